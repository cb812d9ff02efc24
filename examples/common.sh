# Shared by the recipes (sourced by examples/*/<architecture>.sh and distill.sh).
#
# KD_IMPL: without Transformer Engine, megatron-core's local spec with megatron_kd's attention and
# experts (what runs where TE cannot be installed); with TE, Megatron's TE spec (KD_TE is then
# "yes"). Without Apex (NGC's image has it), gradient accumulation fusion off on either spec: its
# extension is Apex's.
_kd_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KD_PY=${PYTHON:-$( [ -x "$_kd_root/.venv/bin/python" ] && echo "$_kd_root/.venv/bin/python" || echo python3 )}
KD_IMPL=()
KD_TE=yes
"$KD_PY" -c 'import transformer_engine' 2>/dev/null || \
  { KD_TE=; KD_IMPL=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm); }
"$KD_PY" -c 'import fused_weight_gradient_mlp_cuda' 2>/dev/null || KD_IMPL+=(--no-gradient-accumulation-fusion)
# KD_DISTILL: distillation defaults of the launchers. --kd-tail renorm (the default) with 10%
# hard-label cross-entropy: the best top-K student in the fidelity benchmark (README, Results)
KD_DISTILL=(
  --bf16 --calculate-per-token-loss --kd-ce-weight 0.1
  --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-fraction 0.01 --clip-grad 1.0 --weight-decay 0.1
  --split 99,1,0 --log-interval 1 --eval-interval 1000 --eval-iters 4
)
