#!/usr/bin/env bash
# Sets up .venv and runs the demo on a sample dataset it writes itself.
# On a machine with an NVIDIA GPU, pass the CUDA extra: CUDA_EXTRA=cuda13 bash scripts/demo.sh
source "$(dirname "$0")/_env.sh"
setup_venv "${CUDA_EXTRA:-test}"
xarray-gds demo "$@"
