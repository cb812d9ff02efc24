"""Megatron-Bridge's own pretraining recipes distilled from a teacher cache: each function is a recipe
with the run's data set (``KD_DATA``, ``KD_TOKENIZER``, ``KD_TRAIN_ITERS``); the ``kd`` block comes from
the command line. One cache serves every run over the same windows.

``gpt_oss_20b`` (``gpt_oss_20b_pretrain_config``: the model, its TP 2 / PP 4 / EP 4 layout, optimizer
and schedule); GPT-OSS-120B teaches:

    export KD_DATA=/data/corpus KD_TOKENIZER=/models/gpt-oss-20b KD_TRAIN_ITERS=2000
    # 1. the teacher pass over the recipe's samples: its data flags, the teacher's model flags
    eval "DATA=($(python -m megatron_kd.bridge data-flags examples/bridge/recipes.py:gpt_oss_20b))"
    source examples/gpt_oss/gpt_oss.sh && source examples/gpt_oss/120b.sh
    bash launch/torchrun.sh cache build "${GPT_OSS_ARCH[@]}" "${GPT_OSS_SIZE[@]}" "${GPT_OSS_IMPL[@]}" \
        --expert-model-parallel-size 8 --bf16 "${DATA[@]}" --kd-teacher-hf /models/gpt-oss-120b --kd-cache /data/cache
    # 2. the student: Bridge's pretrain with the KD forward step, on the recipe's 16 GPUs (two 8-GPU nodes;
    #    on one node, set cfg.model's layout below)
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 --master-addr $MASTER_ADDR --master-port 29500 \
        -m megatron_kd.bridge pretrain examples/bridge/recipes.py:gpt_oss_20b --kd-cache /data/cache --kd-ce-weight 0.1

``llama32_3b`` (``llama32_3b_pretrain_config``: one GPU, 8K tokens, its optimizer and schedule);
Llama-3.1-8B teaches:

    export KD_DATA=/data/corpus KD_TOKENIZER=/models/llama-3.2-3b KD_TRAIN_ITERS=2000
    # 1. the teacher pass over the recipe's samples: its data flags, the teacher's model flags
    eval "DATA=($(python -m megatron_kd.bridge data-flags examples/bridge/recipes.py:llama32_3b))"
    source examples/llama/llama3.sh && source examples/llama/8b.sh
    bash launch/torchrun.sh cache build "${LLAMA3_ARCH[@]}" "${LLAMA3_SIZE[@]}" "${LLAMA_IMPL[@]}" --bf16 \
        "${DATA[@]}" --kd-teacher-hf /models/llama-3.1-8b --kd-cache /data/cache
    # 2. the student: Bridge's pretrain with the KD forward step
    torchrun --nproc-per-node 1 -m megatron_kd.bridge pretrain examples/bridge/recipes.py:llama32_3b \
        --kd-cache /data/cache --kd-ce-weight 0.1

``KD_DATA``: the indexed dataset (``megatron-kd data text`` / ``data chat``); ``KD_TOKENIZER``: a Hugging
Face tokenizer directory, the teacher's vocabulary (GPT-OSS's recipe's NullTokenizer reads no text);
``KD_TRAIN_ITERS``: the run's length (the recipes' run about a million iterations of 512 samples). Every
other setting is the recipe's; change it here.
"""

import os

from megatron_kd.errors import UserError


def _env(name: str) -> str:
    if not os.environ.get(name):
        raise UserError(f"{__file__}: set {name} (see the docstring)")
    return os.environ[name]


def _with_run_data(cfg):
    cfg.dataset.data_path = _env("KD_DATA")
    cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model = "HuggingFaceTokenizer", _env("KD_TOKENIZER")
    cfg.train.train_iters = int(os.environ.get("KD_TRAIN_ITERS", "2000"))
    return cfg


def gpt_oss_20b():
    from megatron.bridge.recipes.gpt_oss import gpt_oss_20b_pretrain_config

    return _with_run_data(gpt_oss_20b_pretrain_config())


def llama32_3b():
    from megatron.bridge.recipes.llama import llama32_3b_pretrain_config

    return _with_run_data(llama32_3b_pretrain_config())
