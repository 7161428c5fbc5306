#!/usr/bin/env bash
# The lowest lane, in .venv-min on Python 3.12 (lint, types and docs run in
# scripts/test.sh only; arguments go to pytest):
# 1. the suite on the base install alone, as `pip install .` gives it to a new user:
#    the lowest versions of the dependencies (constraints/min.txt) and the test runner
#    (the test-base extra), no optional package. A test of an optional feature skips,
#    naming the package; everything else passes, and an import of an optional package
#    that is not guarded fails here.
# 2. the dask and fast-host extras added at their lowest versions, and the tests of
#    dask's chunks, graphs and clusters and of libdeflate run again.
source "$(dirname "$0")/_env.sh"
setup_venv test-base .venv-min 3.12 -c constraints/min.txt
ensure_nginx
# a venv kept from an earlier run holds step 2's packages: the base install has none
python - <<'PY'
import importlib.metadata
import re
import subprocess
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]


def packages(extra):  # the distributions of an extra, its extras of the project followed
    for requirement in extras[extra]:
        name, inner = re.match(r"([\w.-]+)(?:\[([\w,-]+)\])?", requirement).groups()
        if name == "xarray-gds":
            for other in inner.split(","):
                yield from packages(other)
        else:
            yield name


installed = []
for name in sorted(set(packages("all"))):
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        continue
    installed.append(name)
if installed:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *installed], check=True)
PY
set -x
python -m pip list --disable-pip-version-check 2>/dev/null |
  grep -i -E '^(numpy|xarray|zarr|numcodecs|pandas|pytest) '
python -m pytest -q -p no:cacheprovider "$@"
python -m pip install -q --disable-pip-version-check -e ".[test-base,dask,fast-host]" \
  -c constraints/min.txt
python -m pip list --disable-pip-version-check 2>/dev/null |
  grep -i -E '^(dask|distributed|deflate) '
python -m pytest -q -p no:cacheprovider tests/test_dask.py tests/test_engine.py \
  tests/test_fast_host.py "$@"
