# SmolLM2-135M-Instruct healed after a cut, on one GPU (sourced by heal.sh and benchmarks/common/smollm2.py).
#
# SMOL_RUN: the run's data and shape, the same for cache build, prune, train and export-hf (the cache is
# keyed by the samples these flags give, so one cache serves every cut): 200 steps of 32 x 1,024
# tokens, 5% of the documents held out, no dropout (the teacher was trained without).
SMOL_RUN=(
  --split 95,5,0 --seq-length 1024 --micro-batch-size 4 --global-batch-size 32 --train-iters 200
  --eval-iters 4 --bf16 --attention-dropout 0.0 --hidden-dropout 0.0
)
# SMOL_OPTIM: healing: lr 2e-4, cosine to 2e-5 after 10 warm-up steps, no weight decay
SMOL_OPTIM=(
  --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 10 --clip-grad 1.0 --weight-decay 0.0
  --calculate-per-token-loss --log-interval 10
)
