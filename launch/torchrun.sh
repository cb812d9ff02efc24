#!/usr/bin/env bash
# Single-node torchrun launcher for the GPU commands (one process per GPU).
#
#   bash launch/torchrun.sh train       <Megatron-LM flags> --kd-cache PATH [--kd-* ...]
#   bash launch/torchrun.sh cache build <data flags> <teacher flags> --load CKPT --kd-cache PATH
#   bash launch/torchrun.sh --verbose train ...   # every rank's output and third-party notices
#
# GPUS (default: all visible) sets --nproc-per-node; MASTER_PORT (default 29500) the rendezvous port.
# Rank 0 prints; the other ranks print only errors. A mistake in the flags is one line and exit
# status 2 (torchrun's own failure report is kept for anything else).
# Several nodes: launch/multinode.sh (and launch/slurm.sbatch).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "${TORCHRUN[@]}" --standalone --nproc-per-node "$GPUS" --master-port "${MASTER_PORT:-29500}" \
  -m megatron_kd.cli "$@"
