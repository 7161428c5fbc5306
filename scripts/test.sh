#!/usr/bin/env bash
# Sets up .venv and runs every check CI runs: lint, types, docs (strict), the workflow
# checks, the pre-commit hooks, the sdist and wheel (scripts/build-check.sh), tests.
# GPU tests are skipped without a GPU; XARRAY_GDS_REQUIRE_GPU=1 makes them fail instead.
source "$(dirname "$0")/_env.sh"
setup_venv "test,docs,dev"
ensure_nginx

set -x
ruff check xarray_gds tests asv_bench
ruff format --check xarray_gds tests asv_bench
mypy
bash scripts/docs-strict.sh
# the GitHub workflows, offline (.github/actionlint.yaml names the self-hosted labels)
actionlint
zizmor --offline .github/workflows
# the pre-commit hooks (local tools only, no network); they need a git checkout
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  pre-commit run --all-files --show-diff-on-failure
fi
bash scripts/build-check.sh
python -m pytest -q -p no:cacheprovider "$@"
