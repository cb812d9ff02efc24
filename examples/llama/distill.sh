#!/usr/bin/env bash
# Distill a Llama 3 student with torchrun:
#
#   bash examples/llama/distill.sh 3b --data-path DATA --kd-cache CACHE --kd-student-hf /models/llama-3.2-3b \
#       --train-iters 2000 --global-batch-size 64 --save CKPT [more Megatron-LM / --kd-* flags]
#
# The flags come in this order, later ones winning: architecture (llama3.sh), size and layout
# (8b.sh / 3b.sh; 3b_128k.sh: 3b.sh's size at 128K tokens on one GPU), the distillation defaults
# (examples/common.sh), then yours. The cache comes from `cache build` with the teacher's flags
# (e.g. 8b.sh's and --kd-teacher-hf) over the same data flags. GPUS and MASTER_PORT as in launch/torchrun.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
size=${1:?usage: distill.sh 8b|3b|3b_128k [Megatron-LM and --kd-* flags]}
shift
[ -f "$here/$size.sh" ] || { echo "distill.sh: unknown size '$size' (8b, 3b or 3b_128k)" >&2; exit 2; }
source "$here/llama3.sh"
source "$here/$size.sh"
exec bash "$here/../../launch/torchrun.sh" train \
  "${LLAMA3_ARCH[@]}" "${LLAMA3_SIZE[@]}" "${LLAMA3_LAYOUT[@]}" "${LLAMA_IMPL[@]}" "${KD_DISTILL[@]}" "$@"
