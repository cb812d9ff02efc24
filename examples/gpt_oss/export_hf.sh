#!/usr/bin/env bash
# Write a distilled GPT-OSS student as a Hugging Face directory (one GPU; any training layout):
#
#   bash examples/gpt_oss/export_hf.sh 20b --load CKPT --out /models/my-student [--num-layers 12 ...]
#
# Pass the same size overrides the student was trained with. The vocabulary rows and tokenizer
# come from the --kd-student-hf directory the student started from (saved in the checkpoint).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
size=${1:?usage: export_hf.sh 20b|120b --load CKPT --out DIR [model flag overrides]}
shift
[ -f "$here/$size.sh" ] || { echo "export_hf.sh: unknown size '$size' (20b or 120b)" >&2; exit 2; }
source "$here/gpt_oss.sh"
source "$here/$size.sh"
GPUS=1 exec bash "$here/../../launch/torchrun.sh" export-hf "${GPT_OSS_ARCH[@]}" "${GPT_OSS_SIZE[@]}" \
  "${GPT_OSS_IMPL[@]}" --seq-length 4096 --micro-batch-size 1 --global-batch-size 1 --train-iters 1 --bf16 "$@"
