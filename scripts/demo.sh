#!/usr/bin/env bash
# Sets up .venv with the package alone (no test or docs tools) and runs the demo on a
# sample dataset it writes itself. Arguments go to `xarray-gds demo`: `--dir DIR` keeps
# the stores it writes. On a machine with an NVIDIA GPU, add the CUDA extra:
#   CUDA_EXTRA=cuda13 bash scripts/demo.sh
source "$(dirname "$0")/_env.sh"
setup_venv "${CUDA_EXTRA:-}"
xarray-gds demo "$@"
