#!/usr/bin/env bash
# Builds the sdist, then the wheel from the sdist (python -m build), into a temporary
# directory (or into DIR, kept, with `build-check.sh DIR`: the release workflow
# publishes what it checked); checks both with `twine check --strict` and their contents
# with scripts/check_dist.py. Run by scripts/test.sh, in a venv with the test extra
# (build, twine); `python -m build` fetches hatchling into an isolated environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -n "${1:-}" ]; then
  dist=$1
  mkdir -p "$dist"
else
  dist=$(mktemp -d)
  trap 'rm -rf "$dist"' EXIT
fi
python -m build --outdir "$dist" .
twine check --strict "$dist"/*
python scripts/check_dist.py "$dist"
