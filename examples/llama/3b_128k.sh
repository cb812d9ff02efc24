# Llama-3.2-3B (3b.sh's size) at 128K tokens per sample on one H200: the layout `megatron-kd plan
# --gpus 1 --search` ranks first for the fused KD path (141GB, 2026-12-03). --kd-optimizer
# bf16-sr-8bit: bf16 weights updated by stochastic rounding, 8-bit Adam moments, bf16 gradients
# (6 bytes per parameter, 18.1 GiB for the 3.2B; Megatron's default state is 18, 53.9 GiB). Recompute:
# the first 21 of the 28 layers whole, the other 7 keep their activations: 123.0 GiB planned; every
# layer recomputed: 53.3 GiB, planned 6% slower (7 more layers' forward run twice). With Megatron's
# optimizer state only full recompute fits (89.1 GiB), and Megatron's cross-entropy fits no layout
# at 128K (its [128K x 128,256] logits and their fp32 copy: 94 GiB).
# The plan's choice at shorter lengths, for `--seq-length` overrides: 32K no recompute (107.5 GiB),
# 64K the first 14 layers (112.6 GiB), both with bf16-sr-8bit. This H200 layout is planned, not yet
# measured. On an 80 GB card the plan (--gpu-memory 80GB) recomputes every layer at 128K: measured on
# one H100 (2026-12-05) at 56.7 GiB peak (planned 53.4), 30.0 s per step, 4,363 tokens/s;
# `python -m benchmarks.bench_node --size llama3-3b --seq 131072 --recompute plan [--gpu-memory 80GB]`
# measures either.
source "$(dirname "${BASH_SOURCE[0]}")/3b.sh"
LLAMA3_LAYOUT=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --kd-optimizer bf16-sr-8bit
  --recompute-granularity full --recompute-method block --recompute-num-layers 21
  --seq-length 131072 --micro-batch-size 1
)
