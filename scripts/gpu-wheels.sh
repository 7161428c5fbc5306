#!/usr/bin/env bash
# Prepares the wheels a GPU machine without network access needs to run the GPU tests
# and benchmarks (scripts/gpu-run.sh): the runtime and test packages for CPython 3.12 on
# manylinux x86_64, downloaded here, and a wheel of this working tree. Copy the
# directory to the GPU machine beside the checkout; gpu-run.sh installs from it.
#
#   bash scripts/gpu-wheels.sh                      # into .whl/
#   bash scripts/gpu-wheels.sh cftime==1.6.6.1      # and these requirements too
#   bash scripts/gpu-wheels.sh --dir .whl2 "moto[server,s3]" s3fs   # a second directory
#
# Options:
#   --dir DIR          where the wheels go (default .whl; emptied of wheels first)
#   --python-version V the target interpreter (default 3.12)
#   --deps             let pip resolve and download dependencies too (large: CuPy and
#                      the CUDA libraries come with them); the default takes the named
#                      packages only, for a machine whose image already has Python,
#                      CUDA, CuPy, numpy, pandas, xarray, pytest and their dependencies
#   --no-default       only the requirements given as arguments, not the default list
#   --no-project       no wheel of the working tree
#   --dry-run          print the commands instead of running them
#   --list             print the default requirements and exit
#   -h, --help         this text
#
# A machine with network access needs none of this: `pip install ".[cuda13,test]"`.
self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
source "$(dirname "$self")/_env.sh"  # find_python; from here on in the repository root

# the cuda13 extra of pyproject.toml, the test packages the GPU suite uses, and what
# they need beyond the packages of a CUDA Python image (named one by one: the default
# download takes no dependencies)
DEFAULT=(
  kvikio-cu13 libkvikio-cu13 nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 cupy-xarray
  zarr numcodecs donfig google-crc32c
  dask distributed dask-cuda rapids-dask-dependency cuda-core nvidia-ml-py
  cloudpickle toolz partd locket fsspec zict tblib sortedcontainers msgpack psutil tornado
  pytest-asyncio pytest-xdist execnet pytest-timeout hypothesis cftime
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
  manylinux_2_17_x86_64 manylinux2014_x86_64 any)

usage() { sed -n '2,/^self=/p' "$self" | sed '$d' | sed 's/^# \{0,1\}//'; }

dir=.whl pyver=3.12 deps=0 defaults=1 project=1 dry=0 extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=${2:?--dir needs a directory}; shift 2 ;;
    --python-version) pyver=${2:?--python-version needs a version}; shift 2 ;;
    --deps) deps=1; shift ;;
    --no-default) defaults=0; shift ;;
    --no-project) project=0; shift ;;
    --dry-run) dry=1; shift ;;
    --list) printf '%s\n' "${DEFAULT[@]}"; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu-wheels.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done

name() {  # the normalized project name of a requirement: "Foo_Bar[x]>=1" -> foo-bar
  local n=${1%%[<>=!~\[;@ ]*}
  n=${n//_/-}
  echo "${n,,}"
}

want=()
if [ "$defaults" = 1 ]; then
  # a default the arguments name again (pinned, say) is left to the arguments
  given=" "
  for r in ${extra[@]+"${extra[@]}"}; do given+="$(name "$r") "; done
  for r in "${DEFAULT[@]}"; do
    [[ $given == *" $(name "$r") "* ]] || want+=("$r")
  done
fi
want+=(${extra[@]+"${extra[@]}"})

run() {  # the command, printed; run unless --dry-run
  echo "+ $*"
  [ "$dry" = 1 ] || "$@"
}

# the project needs Python >= 3.12 to build: the .venv of scripts/test.sh, or the
# interpreter _env.sh finds (PYTHON chooses one)
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=$(find_python); fi

if [ "$dry" = 0 ]; then
  mkdir -p "$dir"
  rm -f "$dir"/*.whl
fi
if [ ${#want[@]} -gt 0 ]; then
  args=(-m pip download --disable-pip-version-check --only-binary=:all:
    --python-version "$pyver" --implementation cp -d "$dir")
  for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
  # pip downloads for another platform only without dependencies, or with
  # --only-binary=:all: as here, which it then resolves for that platform
  [ "$deps" = 0 ] && args+=(--no-deps)
  run "$python" "${args[@]}" "${want[@]}"
fi
if [ "$project" = 1 ]; then
  run "$python" -m pip wheel --disable-pip-version-check --no-deps -w "$dir" .
  # the commit the wheel was built at, for the benchmark's results (gpu-run.sh)
  if commit=$(git rev-parse --short HEAD 2>/dev/null); then
    [ -n "$(git status --porcelain --untracked-files=no -- xarray_gds)" ] && commit+="+"
    if [ "$dry" = 1 ]; then echo "+ echo $commit > $dir/COMMIT"; else echo "$commit" > "$dir/COMMIT"; fi
  fi
fi
[ "$dry" = 1 ] || ls -1 "$dir"
