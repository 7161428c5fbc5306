#!/usr/bin/env bash
# Builds the docs in strict mode into a temporary directory. --strict fails on the
# warnings mkdocs counts (never add --quiet: it hides them from the count); any other
# WARNING or ERROR line in the log fails the check too. Run by scripts/test.sh and by
# the pre-commit hook "docs", with the docs extra's mkdocs on PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log=$(mktemp)
site=$(mktemp -d)
trap 'rm -rf "$log" "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site" 2>&1 | tee "$log"
if grep -E '^(WARNING|ERROR)' "$log" >/dev/null; then
  echo "error: the docs build logged warnings (above)" >&2
  exit 1
fi
