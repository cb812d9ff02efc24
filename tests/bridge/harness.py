"""Bridge's and Megatron-LM's ``pretrain`` on the CPU, and what the Bridge tests compare.

1. ``import_bridge``: megatron-bridge 0.6.2 imports two modules at import time that it does not use on
   this path, and this machine has neither; each gets a stand-in *only for that one importer* (a
   wrapped ``__import__`` that answers the named module's import and no other, never entering
   ``sys.modules``, so megatron-core, nvidia-modelopt and the rest of Bridge still see them absent):
   - Transformer Engine for ``megatron/bridge/peft/lora_layers.py`` (``import transformer_engine.pytorch
     as te``: LoRA's TE-fused adapter, used only by PEFT; its one definition-time use is the return
     annotation ``te.ops.Sequential``);
   - nvidia-resiliency-ext for ``megatron/bridge/training/pretrain.py`` (``from nvidia_resiliency_ext
     .inprocess import CallWrapper``: the annotation of in-process restart's wrapper; restart is off).
     The installable nvidia-resiliency-ext here (0.4.1) has no ``__version__``, which megatron-core's
     checkpointing reads at import, so it cannot be installed beside megatron-core 0.19.
   Bridge's own requirements that its import reads are installed (``launch/setup.sh``, ``--no-deps``).
2. ``cpu_training``: what both frameworks assume of a GPU, redirected for the duration of a run (never in
   the library): ``megatron_cpu.megatron_optimizer_cpu_patches`` (device="cuda" tensors, streams
   waited on, CUDA tensor types, megatron-core's RNG tracker and memory buffer); ``torch.cuda.Stream``
   (DDP's initialization stream) -> an idle stream; ``initialize_megatron`` of both with
   ``allow_no_cuda=True`` (each asserts CUDA first); torch.compile off (megatron-core's fused bias-activation
   and bias-dropout-add kernels are compiled functions, and inductor compiles each for seconds on a CPU;
   both frameworks then run them eagerly); and, for Megatron-LM, megatron-core's model-parallel groups made
   beforehand (its ``_initialize_distributed`` makes them only where it counts a GPU).
3. The tiny models: the recipes' Hugging Face ids (``openai/gpt-oss-20b``, ``meta-llama/Llama-3.2-3B``)
   resolve to directories of those names under the working directory (transformers reads a local
   directory before the hub), holding the tiny configs of ``tests/fixtures``.
4. ``megatron_kd_train_argv``: the ``megatron-kd train`` command line of a Bridge config: its data from
   ``megatron_kd.bridge.megatron_data_flags`` (the product's bridge), the model flags of the same
   architecture (``examples/gpt_oss`` / ``hf-flags``), the recipe's optimizer and schedule as flags.
5. ``write_cache``: a teacher cache of the run's samples, keyed by the tokens of the train split
   megatron-kd builds from those data flags (as ``cache build`` keys it); ``tensorboard_losses``: the
   per-iteration losses each framework writes.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import types
from pathlib import Path

import numpy as np
import torch

SEQ, ITERS, GLOBAL_BATCH, MICRO_BATCH, VOCAB, K = 32, 3, 4, 2, 1000, 8
HUB_IDS = {"gpt-oss": "openai/gpt-oss-20b", "llama": "meta-llama/Llama-3.2-3B"}


# ----------------------------------------------------------------------------- 1. importing Bridge
def _transformer_engine_standin():
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))  # an annotation's target
    return te


def _resiliency_standin():
    inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
    inprocess.CallWrapper = type("CallWrapper", (), {})  # an annotation's target
    return inprocess


# (importing module, top-level package it imports) -> the stand-in it gets
STANDINS = {("megatron.bridge.peft.lora_layers", "transformer_engine"): _transformer_engine_standin,
            ("megatron.bridge.training.pretrain", "nvidia_resiliency_ext"): _resiliency_standin}


def import_bridge() -> None:
    """``import megatron.bridge`` (and its pretrain module) with the stand-ins of the module docstring."""
    original = builtins.__import__

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0:
            make = STANDINS.get(((globals or {}).get("__name__"), name.split(".")[0]))
            if make is not None:
                return make()
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = importer
    try:
        import megatron.bridge.training.pretrain  # noqa: F401
    finally:
        builtins.__import__ = original


# ----------------------------------------------------------------------------- 2. the CPU
@contextlib.contextmanager
def cpu_training():
    """Bridge's and Megatron-LM's ``pretrain`` on CPU tensors over a gloo world (module docstring, 2)."""
    import megatron.training.training as megatron_training

    from tests.fixtures.megatron_cpu import IdleStream, megatron_optimizer_cpu_patches

    patched = [(torch.cuda, "Stream", IdleStream),
               (megatron_training, "initialize_megatron",
                functools.partial(megatron_training.initialize_megatron, allow_no_cuda=True))]
    try:
        import megatron.bridge.training.setup as bridge_setup

        patched.append((bridge_setup, "initialize_megatron",
                        functools.partial(bridge_setup.initialize_megatron, allow_no_cuda=True)))
    except ImportError:  # a Megatron-LM run's process: Bridge not imported
        pass
    from torch._dynamo import config as dynamo_config

    patched.append((dynamo_config, "disable", True))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, value in patched:
        setattr(owner, name, value)
    try:
        with megatron_optimizer_cpu_patches():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


# ----------------------------------------------------------------------------- 3. models and data
def hf_config(kind: str):
    """The tiny Hugging Face config a recipe's model is read from."""
    if kind == "gpt-oss":
        from tests.fixtures.tiny_gpt_oss import tiny_gpt_oss_config

        config = tiny_gpt_oss_config()
        config.architectures = ["GptOssForCausalLM"]
    else:
        from tests.fixtures.tiny_llama import tiny_config

        config = tiny_config("llama")
        config.architectures = ["LlamaForCausalLM"]
    return config


def prepare(work: Path) -> None:
    """The recipes' model directories and an indexed dataset of random documents under ``work``."""
    from megatron_kd.megatron.data import write_indexed_dataset

    for kind, hub_id in HUB_IDS.items():
        hf_config(kind).save_pretrained(work / hub_id)
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, VOCAB - 1, size=int(n)) for n in rng.integers(20, 200, size=200)]
    write_indexed_dataset(work / "corpus", documents, VOCAB)


def megatron_kd_train_argv(kind: str, cfg, kd_flags: list[str], tensorboard: Path) -> list[str]:
    """``megatron-kd train``'s flags for the run ``cfg`` (a recipe's ConfigContainer) describes, distilling
    with ``kd_flags`` (the ``--kd-*`` flags the Bridge run was given)."""
    from megatron_kd.bridge.flags import megatron_data_flags

    if kind == "gpt-oss":
        from tests.fixtures.tiny_gpt_oss import TINY_ARCH, recipe_flags

        # examples/gpt_oss's architecture at the tiny size; Bridge's GPT-OSS provider unfuses bias-dropout-add
        # and keeps an aux-loss coefficient (unused: no load balancing)
        model = [*recipe_flags("20b", layout=False), *TINY_ARCH, "--no-bias-dropout-fusion",
                 "--moe-aux-loss-coeff", str(cfg.model.moe_aux_loss_coeff), "--moe-token-dispatcher-type", "allgather"]
    else:
        from megatron_kd.models.llama import megatron_flags
        from tests.fixtures.tiny_gpt_oss import LOCAL_IMPL

        model = [*megatron_flags(hf_config(kind)), *[f for f in LOCAL_IMPL if f != "--calculate-per-token-loss"],
                 "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--no-bias-dropout-fusion"]
        if cfg.model.calculate_per_token_loss:
            model.append("--calculate-per-token-loss")
    opt, sched = cfg.optimizer, cfg.scheduler
    optimizer = ["--init-method-std", str(cfg.model.init_method_std), "--use-cpu-initialization",
                 "--lr", str(opt.lr), "--min-lr", str(opt.min_lr), "--lr-decay-style", sched.lr_decay_style,
                 "--lr-warmup-iters", str(sched.lr_warmup_iters), "--weight-decay", str(sched.start_weight_decay),
                 "--adam-beta1", str(opt.adam_beta1), "--adam-beta2", str(opt.adam_beta2), "--adam-eps",
                 str(opt.adam_eps), "--clip-grad", str(opt.clip_grad), "--use-distributed-optimizer"]
    return [*model, *optimizer, *megatron_data_flags(cfg), "--num-workers", "0", "--log-interval", "1",
            "--tensorboard-dir", str(tensorboard), "--rerun-mode", "disabled", *kd_flags]


def run_megatron_kd_train(argv: list[str]) -> None:
    """``megatron-kd train``'s run (``commands/train.run``) of ``argv`` on the CPU, in this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_kd.megatron import run
    from megatron_kd.megatron.flags import parse_megatron_args

    # Megatron-LM's validation reads the world from torchrun's environment
    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(dist.get_rank()))
    with cpu_training():
        args = parse_megatron_args(argv)  # megatron-kd train's check, less its refusal of a machine without CUDA
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size)
        run.pretrain(args)


def write_cache(data_flags: list[str], path: Path) -> int:
    """A top-K cache of the train split ``data_flags`` describe (random teacher rows, bound to each sample's
    tokens), as ``cache build`` keys it; returns its samples."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from megatron_kd.cache import CacheWriter
    from megatron_kd.megatron.data import build_gpt_datasets, dataset_fingerprint, tokenizer_fingerprint
    from megatron_kd.megatron.flags import megatron_parser
    from tests.fixtures.kd_inputs import teacher_topk

    args = megatron_parser().parse_args([*data_flags, "--num-layers", "1", "--hidden-size", "8",
                                         "--num-attention-heads", "1"])
    args.rank, args.tensor_model_parallel_size = 0, 1
    tokenizer = build_tokenizer(args)
    samples = args.train_iters * args.global_batch_size
    train, _, _ = build_gpt_datasets(args.data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
                                     tokenizer=tokenizer, num_samples=(samples, 0, 0), cache_dir=args.data_cache_path)
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "dataset_fingerprint": dataset_fingerprint(train)}
    generator = torch.Generator().manual_seed(0)
    with CacheWriter(path, vocab_size=tokenizer.vocab_size, topk=K, seq_length=args.seq_length, num_samples=samples,
                     metadata=meta) as writer:
        for sample in writer.pending_samples():
            ids, logprobs = teacher_topk(args.seq_length, tokenizer.vocab_size, K, generator=generator)
            writer.write(int(sample), ids, logprobs, tokens=train[int(sample)]["tokens"])
    return samples


def tensorboard_losses(directory: Path) -> dict[str, list[float]]:
    """Each loss a run wrote per iteration (lm loss, kd loss, ce loss, teacher mass), in iteration order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]
            for tag in ("lm loss", "kd loss", "ce loss", "teacher mass")}


@contextlib.contextmanager
def working_directory(path: Path):
    saved = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(saved)
