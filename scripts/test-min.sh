#!/usr/bin/env bash
# Runs the test suite against the lowest versions the project claims
# (constraints/min.txt) on Python 3.12, in .venv-min. Lint, types and docs run in
# scripts/test.sh only. Arguments go to pytest.
source "$(dirname "$0")/_env.sh"
setup_venv test .venv-min 3.12 -c constraints/min.txt
ensure_nginx
set -x
python -m pip list --disable-pip-version-check 2>/dev/null |
  grep -i -E '^(numpy|xarray|zarr|numcodecs|dask|distributed|pandas) '
python -m pytest -q -p no:cacheprovider "$@"
