#!/usr/bin/env bash
# Sets up .venv and runs every check CI runs: lint, types, docs (strict), the sdist and
# wheel (scripts/build-check.sh), tests.
# GPU tests are skipped without a GPU; XARRAY_GDS_REQUIRE_GPU=1 makes them fail instead.
source "$(dirname "$0")/_env.sh"
setup_venv "test,docs,virtual"
ensure_nginx

docs_strict() {
  # --strict fails on the warnings mkdocs counts (never add --quiet: it hides them from
  # the count); any other WARNING or ERROR line in the log fails the check too.
  local log
  log=$(mktemp)
  NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$(mktemp -d)" 2>&1 | tee "$log"
  if grep -E '^(WARNING|ERROR)' "$log" >/dev/null; then
    echo "error: the docs build logged warnings (above)" >&2
    return 1
  fi
}

set -x
ruff check xarray_gds tests asv_bench
ruff format --check xarray_gds tests asv_bench
mypy
docs_strict
bash scripts/build-check.sh
python -m pytest -q -p no:cacheprovider "$@"
