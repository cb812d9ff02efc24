# Llama-3.2-3B(-Instruct): 28 layers, hidden 3072, FFN 8192, 24 query heads, tied embeddings.
LLAMA3_SIZE=(--num-layers 28 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24
             --rope-scaling-factor 32)
LLAMA3_LAYOUT=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --seq-length 8192 --micro-batch-size 1)
