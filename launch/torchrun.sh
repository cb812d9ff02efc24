#!/usr/bin/env bash
# Single-node torchrun launcher for the GPU commands (one process per GPU).
#
#   bash launch/torchrun.sh train       <Megatron-LM flags> --kd-cache PATH [--kd-* ...]
#   bash launch/torchrun.sh cache build <data flags> <teacher flags> --load CKPT --kd-cache PATH
#
# GPUS (default: all visible) sets --nproc-per-node; MASTER_PORT (default 29500) the rendezvous port.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
GPUS=${GPUS:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
# Megatron's recommended setting for overlapping TP communication with compute
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" --master-port "${MASTER_PORT:-29500}" \
  -m megatron_kd.cli "$@"
