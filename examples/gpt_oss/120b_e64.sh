# A GPT-OSS-120B student with half the experts: 36 layers x 64 experts (~60B parameters), cut from
# the 120B teacher by `megatron-kd prune --prune-num-experts 64` (README, "Heal a pruned student")
# and healed by distillation from the teacher's cache: `distill.sh 120b_e64 --kd-student-hf DIR`.
GPT_OSS_SIZE=(--num-layers 36 --num-experts 64)
# One 8-GPU node at 32K tokens, the layout `megatron-kd plan --search` ranks first for these flags:
# expert parallel 8 (8 of the 64 experts per GPU), --kd-optimizer bf16-sr-8bit, 18 of the 36
# layers recomputed whole (block), the experts' activation in the others, 121 GiB per GPU planned,
# no host memory. One rank on one H200 (bench_node --size 120b_e64 --rank-of 8, 2026-12-04, 570c7d6;
# the dense state unsharded): 7.79 s per step, 381 model TFLOP/s, 125.3 GiB (123.5 planned).
GPT_OSS_LAYOUT=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
  --kd-optimizer bf16-sr-8bit
  --recompute-granularity full --recompute-method block --recompute-num-layers 18 --recompute-modules moe_act
  --seq-length 32768 --micro-batch-size 1
)
