# GPT-OSS 120B: 36 layers x 128 experts (117B parameters, 5.1B active per token).
# Students are often smaller: later flags win, e.g. `--num-layers 18 --num-experts 64`.
GPT_OSS_SIZE=(--num-layers 36 --num-experts 128)
# One 8-GPU node at 32K tokens. Full fine-tuning at 16 bytes per parameter (1.9 TB) cannot fit
# 8 x 141 GB; this layout keeps bf16 weights and fp32 gradients on the GPUs (16 experts per GPU,
# expert parallel 8) and moves the optimizer (fp16 master weights, bf16 moments) to host memory:
# about 0.7 TB of host RAM. `megatron-kd plan` gives the numbers and the alternatives.
GPT_OSS_LAYOUT=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
  --use-distributed-optimizer --use-precision-aware-optimizer --main-params-dtype fp16
  --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --optimizer-cpu-offload --optimizer-offload-fraction 1.0
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --seq-length 32768 --micro-batch-size 1
)
