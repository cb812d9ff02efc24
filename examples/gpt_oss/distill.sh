#!/usr/bin/env bash
# Distill a GPT-OSS student on one node with torchrun:
#
#   bash examples/gpt_oss/distill.sh 20b  --data-path DATA --kd-cache CACHE --kd-student-hf /models/gpt-oss-20b \
#       --train-iters 2000 --global-batch-size 64 --lr 1e-5 --save CKPT [more Megatron-LM / --kd-* flags]
#   bash examples/gpt_oss/distill.sh 120b ...
#
# The flags come in this order, later ones winning: architecture (gpt_oss.sh), size and one-node
# layout (20b.sh / 120b.sh), distillation defaults (examples/common.sh), then yours.
# --kd-student-hf initializes the student from a Hugging Face GPT-OSS directory (bf16 or MXFP4) and
# is also its tokenizer unless --tokenizer-model says otherwise. GPUS and MASTER_PORT as in launch/torchrun.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
size=${1:?usage: distill.sh 20b|120b|120b_e64 [Megatron-LM and --kd-* flags]}
shift
[ -f "$here/$size.sh" ] || { echo "distill.sh: unknown size '$size' (20b, 120b or 120b_e64)" >&2; exit 2; }
source "$here/gpt_oss.sh"
source "$here/$size.sh"
exec bash "$here/../../launch/torchrun.sh" train \
  "${GPT_OSS_ARCH[@]}" "${GPT_OSS_SIZE[@]}" "${GPT_OSS_LAYOUT[@]}" "${GPT_OSS_IMPL[@]}" "${KD_DISTILL[@]}" "$@"
