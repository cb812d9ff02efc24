# GPT-OSS 120B: 36 layers x 128 experts (117B parameters, 5.1B active per token).
# Students are often smaller: later flags win, e.g. `--num-layers 18 --num-experts 64`.
GPT_OSS_SIZE=(--num-layers 36 --num-experts 128)
# One 8-GPU node at 32K tokens: the GPUs hold bf16 weights and fp32 gradients (16 experts per GPU,
# expert parallel 8; ~108 GiB per GPU with the fused loss) and the optimizer runs on the host.
# Megatron's CPU offload keeps fp32 master weights, gradients and moments there, about 20 bytes per
# parameter (measured; it ignores the precision-aware dtypes, but requires the flag): ~2.2 TiB of
# host RAM for all 117B parameters, more than a 2 TB node has. On one such node distill a student of
# this architecture with fewer experts (`--num-experts 64`: 59B parameters, ~67 GiB per GPU and
# ~1.1 TiB of host RAM) or train on two nodes. `megatron-kd plan` gives the numbers.
GPT_OSS_LAYOUT=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
  --use-distributed-optimizer --use-precision-aware-optimizer
  --optimizer-cpu-offload --optimizer-offload-fraction 1.0
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --seq-length 32768 --micro-batch-size 1
)
