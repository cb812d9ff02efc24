"""Bridge's GPT-OSS-20B and Llama-3.2-3B pretraining recipes, as the Bridge tests run them: the recipe
itself (``gpt_oss_20b_pretrain_config``, ``llama32_3b_pretrain_config``), read from the tiny model
directories the working directory holds under the recipes' Hugging Face ids (``harness.prepare``), on
one CPU rank at a test's size. What ``shrink`` changes, and only that:

- sizes: 32-token samples, 3 iterations of 4 samples (micro-batches of 2), one warm-up iteration (the
  recipes warm up over 2,000), one evaluation iteration at the end;
- layout: one rank (no tensor, pipeline, expert or sequence parallelism);
- precision: fp32 (the recipes train in bf16, which the CPU runs slowly);
- what only a GPU runs: Transformer Engine's grouped GEMM and fusions (permutation, cross-entropy, RoPE,
  layer norm, softmax, gradient accumulation), the all-to-all and flex token dispatchers (CUDA streams;
  allgather computes the same), overlapped gradient reduction; weights initialized on the CPU;
- the data: ``corpus`` (an indexed dataset; the recipes default to mock data), no DataLoader workers,
  the NullTokenizer the recipes use at the tiny models' vocabulary;
- outputs: TensorBoard under the working directory, no checkpoints; gloo.

The layer spec is the ``--local-spec`` flag's business (Transformer Engine is absent here).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.bridge.harness import GLOBAL_BATCH, ITERS, MICRO_BATCH, SEQ, VOCAB


def shrink(cfg, name: str):
    model = cfg.model
    model.tensor_model_parallel_size = model.pipeline_model_parallel_size = 1
    model.expert_model_parallel_size = model.context_parallel_size = 1
    model.sequence_parallel, model.pipeline_dtype = False, None
    model.seq_length = SEQ
    model.bf16, model.params_dtype, model.autocast_dtype = False, torch.float32, torch.float32
    model.moe_grouped_gemm = model.moe_permute_fusion = model.cross_entropy_loss_fusion = False
    model.apply_rope_fusion = model.persist_layer_norm = model.masked_softmax_fusion = False
    model.gradient_accumulation_fusion = False
    model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend = "allgather", None
    model.use_cpu_initialization = True
    cfg.mixed_precision = None
    cfg.optimizer.bf16 = False
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = ITERS, GLOBAL_BATCH, MICRO_BATCH
    cfg.scheduler.lr_warmup_iters = 1
    cfg.validation.eval_interval, cfg.validation.eval_iters = 1000, 1
    work = Path.cwd()
    data = cfg.dataset
    data.data_path, data.blend, data.split, data.seq_length = str(work / "corpus"), None, "90,5,5", SEQ
    data.num_workers, data.pin_memory, data.path_to_cache = 0, False, str(work / "index-cache")
    cfg.tokenizer.vocab_size = VOCAB
    cfg.logger.log_interval, cfg.logger.tensorboard_dir = 1, str(work / f"tb-bridge-{name}")
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False
    cfg.dist.distributed_backend = "gloo"
    return cfg


def gpt_oss():
    from megatron.bridge.recipes.gpt_oss import gpt_oss_20b_pretrain_config

    return shrink(gpt_oss_20b_pretrain_config(), "gpt-oss")


def llama():
    from megatron.bridge.recipes.llama import llama32_3b_pretrain_config

    return shrink(llama32_3b_pretrain_config(), "llama")


def gpt_oss_other_seed():
    """The GPT-OSS run on other windows of the same data: the dataset shuffled with another seed."""
    cfg = gpt_oss()
    cfg.dataset.random_seed += 1
    return cfg
