#!/usr/bin/env bash
# Sets up .venv and runs every check CI runs: lint, types, docs (strict), tests.
# GPU tests are skipped without a GPU; XARRAY_GDS_REQUIRE_GPU=1 makes them fail instead.
source "$(dirname "$0")/_env.sh"
setup_venv "test,docs"
set -x
ruff check xarray_gds tests asv_bench
ruff format --check xarray_gds tests asv_bench
mypy
mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
python -m pytest -q -p no:cacheprovider "$@"
