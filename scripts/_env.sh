# Sourced by scripts/test.sh and scripts/demo.sh: makes .venv (Python >= 3.12) with the
# project installed in it, and puts it first on PATH. Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

_ok() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for c in python3.13 python3.12 python3; do
    if _ok "$c"; then echo "$c"; return; fi
  done
  # pyenv shims exist for every installed version but only run the selected one, so
  # take the interpreter's own path (3.12 first: the GPU machine runs 3.12)
  if command -v pyenv >/dev/null 2>&1; then
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V); do
      if _ok "$(pyenv root)/versions/$v/bin/python3"; then
        echo "$(pyenv root)/versions/$v/bin/python3"
        return
      fi
    done
  fi
  echo "error: Python >= 3.12 not found (zarr >= 3.2 needs it); set PYTHON=/path/to/python3.12" >&2
  exit 1
}

setup_venv() {  # setup_venv EXTRAS
  local py
  py=$(find_python)
  if [ ! -x .venv/bin/python ] || ! _ok .venv/bin/python; then
    rm -rf .venv
    "$py" -m venv .venv
  fi
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$1]"
  export PATH="$PWD/.venv/bin:$PATH"
}
