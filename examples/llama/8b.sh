# Llama-3.1-8B(-Instruct): 32 layers, hidden 4096, FFN 14336, 32 query heads, untied embeddings.
LLAMA3_SIZE=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
             --rope-scaling-factor 8 --untie-embeddings-and-output-weights)
LLAMA3_LAYOUT=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --seq-length 8192 --micro-batch-size 1)
