# GPT-OSS 120B: 36 layers x 128 experts (117B parameters, 5.1B active per token).
# Students are often smaller: later flags win, e.g. `--num-layers 18 --num-experts 64`.
GPT_OSS_SIZE=(--num-layers 36 --num-experts 128)
# One 8-GPU node at 32K tokens with the optimizer on the GPUs: expert parallel 8, so each GPU holds
# 16 of the 128 experts (14.3B expert + 2.1B non-expert parameters). --kd-optimizer bf16-sr-8bit
# keeps bf16 weights updated by stochastic rounding (no fp32 master copy), 8-bit Adam moments and
# bf16 gradients: 2 + 2 + 2.03 bytes per parameter, the non-expert part's state sharded over the 8
# data-parallel ranks (the experts' is not: expert-data parallel is 1). Recompute: the layout
# `megatron-kd plan --search` ranks first for these flags, the first 27 of the 36 layers whole and the
# experts' activation in the other 9, 131.0 GiB per GPU planned (104 with every layer recomputed).
# One rank on one H200 (bench_node --rank-of 8, 2026-12-04, 570c7d6) holds 20.7 GiB more than a real
# rank (the dense state unsharded), so it ran 29 layers whole: 8.69 s per step at 127.3 GiB (28 ran
# NCCL out of memory there). Megatron's default state (fp32 master weights and moments, fp32
# gradients: 18 bytes per parameter) fits no one-node layout, and its CPU offload needs ~2.2 TiB of
# host RAM. The option implies --bf16 --use-distributed-optimizer --use-precision-aware-optimizer
# --main-grads-dtype bf16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 (megatron_kd/optim/megatron.py).
GPT_OSS_LAYOUT=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
  --kd-optimizer bf16-sr-8bit
  --recompute-granularity full --recompute-method block --recompute-num-layers 27 --recompute-modules moe_act
  --seq-length 32768 --micro-batch-size 1
)
