# GPT-OSS 20B: 24 layers x 32 experts (21B parameters, 3.6B active per token).
# Students are often smaller: later flags win, e.g. `--num-layers 12 --num-experts 16 --moe-router-topk 2`.
GPT_OSS_SIZE=(--num-layers 24 --num-experts 32)
# One 8-GPU node at 32K tokens: the 32 experts spread 4 per GPU (expert parallel 8), attention and
# embeddings replicated with the optimizer state sharded over data parallel 8. Recompute only what
# memory requires: the first 10 layers whole, the experts' activation in the other 14
# (`megatron-kd plan`: 109 GiB per GPU; its model is held to peaks measured at full depth). Full
# recompute of every layer costs ~20% more time (benchmarks/RESULTS.md, bench_node --rank-of 8).
GPT_OSS_LAYOUT=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
  --use-distributed-optimizer --recompute-granularity full --recompute-method block --recompute-num-layers 10
  --recompute-modules moe_act --kd-fused-adam
  --seq-length 32768 --micro-batch-size 1
)
