# Sourced by scripts/test.sh, test-min.sh and demo.sh: makes a virtual environment
# (Python >= 3.12) with the project installed in it, and puts it first on PATH. Set
# PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

_ok() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

_is() {  # _is PYTHON X.Y: the interpreter runs (and, with X.Y, is that version)
  [ -z "${2:-}" ] && { _ok "$1"; return; }
  _ok "$1" && "$1" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$2')" \
    >/dev/null 2>&1
}

find_python() {  # find_python [X.Y]: an interpreter >= 3.12, that version when given
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local want=${1:-} c
  for c in python3.13 python3.12 python3; do
    if _is "$c" "$want"; then echo "$c"; return; fi
  done
  # pyenv shims exist for every installed version but only run the selected one, so
  # take the interpreter's own path (3.12 first: the GPU machine runs 3.12)
  if command -v pyenv >/dev/null 2>&1; then
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.[0-9]+)?$' | sort -V); do
      if _is "$(pyenv root)/versions/$v/bin/python3" "$want"; then
        echo "$(pyenv root)/versions/$v/bin/python3"
        return
      fi
    done
  fi
  echo "error: Python ${want:->= 3.12} not found (zarr >= 3.3 needs >= 3.12); set PYTHON=/path/to/python3.12" >&2
  exit 1
}

setup_venv() {  # setup_venv EXTRAS [VENV [PYTHON_VERSION [PIP_INSTALL_ARGS...]]]
  # EXTRAS: comma-separated extras of pyproject.toml, or "" for the base package only
  local extras=$1 venv=${2:-.venv} want=${3:-} py project=.
  shift $(($# < 3 ? $# : 3))
  py=$(find_python "$want")
  if [ ! -x "$venv/bin/python" ] || ! _is "$venv/bin/python" "$want"; then
    rm -rf "$venv"
    "$py" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  [ -n "$extras" ] && project=".[$extras]"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$project" "$@"
  export PATH="$PWD/$venv/bin:$PATH"
}

ensure_nginx() {  # nginx for the remote tests and benchmarks (Debian's package)
  # the tests start their own nginx on 127.0.0.1 from a configuration they write; the
  # package's own service is kept from starting while it installs (policy-rc.d)
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: nginx is not installed (apt-get install nginx): its tests are skipped" >&2
    return 0
  fi
  local policy=/usr/sbin/policy-rc.d had_policy=0
  [ -e "$policy" ] && had_policy=1
  [ "$had_policy" = 1 ] || printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy" 2>/dev/null || true
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null 2>&1 ||
    echo "note: apt-get install nginx failed: its tests are skipped" >&2
  [ "$had_policy" = 1 ] || rm -f "$policy"
}
