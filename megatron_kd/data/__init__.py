"""Chat data: conversations rendered to Megatron indexed datasets with a per-token loss mask
(``megatron-kd data chat``), and that mask joined to the GPT datasets of training and the teacher pass."""
