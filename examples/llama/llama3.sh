# Llama 3.x architecture as Megatron-LM flags (megatron_kd/models/llama.py maps them to
# transformers' LlamaConfig and checks a checkpoint against them; `megatron_flags(config)` gives
# them for any Llama / Qwen3 config.json). Sourced by distill.sh with a size file (8b.sh, 3b.sh).
LLAMA3_ARCH=(
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
  --group-query-attention --num-query-groups 8 --kv-channels 128
  # RoPE at theta 500,000 with Llama 3's scaling (low / high frequency factors 1 and 4 over an
  # original 8,192 positions: megatron-core's fixed values); the factor is per size
  --position-embedding-type rope --rotary-base 500000 --use-rope-scaling
  --max-position-embeddings 131072
  --attention-dropout 0.0 --hidden-dropout 0.0
  # vocabulary (128,256) and tokenizer from the Hugging Face directory
  --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 128
)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
LLAMA_IMPL=("${KD_IMPL[@]}")  # the local spec without Transformer Engine (common.sh)
