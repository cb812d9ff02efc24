#!/usr/bin/env bash
# Multi-node torchrun launcher: run it once on every node with the same arguments.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/multinode.sh train <Megatron-LM flags> ...   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/multinode.sh train <Megatron-LM flags> ...   # on node1
#
# NNODES, NODE_RANK and MASTER_ADDR are required; MASTER_PORT (29500), GPUS (per node: all visible)
# and RDZV_ID (the job's id for the c10d rendezvous; SLURM_JOB_ID under SLURM) are optional.
# launch/slurm.sbatch sets them from SLURM's variables.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
: "${NNODES:?set NNODES (number of nodes)}" "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}" \
  "${MASTER_ADDR:?set MASTER_ADDR (the host of node rank 0)}"
exec "${TORCHRUN[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-megatron-kd}}" \
  -m megatron_kd.cli "$@"
