"""The offload benchmark's model and optimizer flags (``python -m benchmarks.bench_offload``): a
0.94B-parameter GPT, and the 120B recipe's optimizer offload. tests/megatron/test_plan.py plans the
same flags against what the benchmark measured (benchmarks/memory_measurements.json).
"""

VOCAB = 32768

# the model and run (no data flags): tests/megatron/test_plan.py plans the same flags
MODEL_FLAGS = [
    "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "8192",
    "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--train-iters", "3", "--lr", "1e-4",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--bf16", "--seed", "1",
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--no-masked-softmax-fusion", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--no-rope-fusion", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--calculate-per-token-loss", "--use-distributed-optimizer",
]
OFFLOAD_FLAGS = [
    "--use-precision-aware-optimizer", "--main-params-dtype", "fp16", "--exp-avg-dtype", "bf16",
    "--exp-avg-sq-dtype", "bf16", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
]
