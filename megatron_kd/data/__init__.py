"""Chat data: conversations rendered to Megatron indexed datasets with a per-token loss mask
(``megatron-kd data chat``); ``megatron_kd.megatron.loss_mask`` joins that mask to the GPT datasets of training
and the teacher pass."""
