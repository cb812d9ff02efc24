# GPT-OSS: the architecture shared by 20B and 120B, as Megatron-LM flags (megatron-core 0.19).
# Sourced by distill.sh after the size file (20b.sh / 120b.sh). Facts from the public Hugging Face
# configs and OpenAI's reference code; each non-obvious mapping is the one `megatron_kd.models.gpt_oss`
# documents and `tests/models/test_gpt_oss.py` checks against transformers' GptOssForCausalLM.
GPT_OSS_ARCH=(
  # width: hidden 2880; 64 query heads and 8 key/value groups of dimension 64
  --hidden-size 2880
  --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 64
  --normalization RMSNorm --norm-epsilon 1e-5
  --untie-embeddings-and-output-weights
  # biases on q/k/v/o, router and experts: Megatron's default --add-bias-linear stays on
  # attention: a 128-key sliding window (current token included) on even 0-based layers, full
  # causal attention on odd ones; Megatron's window (w, 0) spans w + 1 keys, and skip-freq 2
  # windows its 1-based odd layers
  --window-size 127,0 --window-attn-skip-freq 2
  # one learnable sink logit per head (core_attention.softmax_offset)
  --softmax-type learnable
  --attention-dropout 0.0 --hidden-dropout 0.0
  # YaRN: theta 150,000, factor 32 over an original 4,096 positions, beta 32 / 1, no rounding of the
  # correction range; --mscale 1 --mscale-all-dim 0 give the attention scaling 0.1 ln 32 + 1 = 1.347
  --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32
  --yarn-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1
  --no-yarn-correction-range-round-to-int --mscale 1.0 --mscale-all-dim 0.0
  --max-position-embeddings 131072
  # experts: SwiGLU with the gate clamped <= 7 and the linear half to [-7, 7] after the bias,
  # out = gate * sigmoid(1.702 gate) * (linear + 1); the unfused bias path is the exact one
  --moe-ffn-hidden-size 2880 --ffn-hidden-size 2880
  --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --no-bias-gelu-fusion
  # router: top-4, softmax over the 4 chosen logits, no load-balancing loss
  --moe-router-topk 4 --moe-router-load-balancing-type none --moe-token-dispatcher-type alltoall
  # experts are never split by tensor parallelism (megatron-core supports expert biases only with
  # expert-TP 1); --tensor-model-parallel-size shards attention and the vocabulary, EP the experts
  --expert-tensor-parallel-size 1
  # vocabulary (201,088 rows) and tokenizer (o200k_harmony) from the Hugging Face directory
  --tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 128
)

source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
GPT_OSS_IMPL=("${KD_IMPL[@]}")  # the local spec without Transformer Engine (common.sh)
# TE's grouped experts refuse bias-dropout fusion with biased experts (megatron-core asserts)
if [ -n "$KD_TE" ]; then GPT_OSS_IMPL+=(--no-bias-dropout-fusion); fi
