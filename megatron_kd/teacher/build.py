"""The teacher pass on GPUs (``megatron-kd cache build``, ``commands/cache_build.py``): a teacher
run once over the student run's training data, its top-K (or sampled) entries written to the cache.

    torchrun --nproc-per-node 8 -m megatron_kd.cli cache build \\
        <the student run's data flags: --data-path --split --seq-length --seed --train-iters
         --global-batch-size --micro-batch-size --tokenizer-*> \\
        <the teacher's model flags + --load CKPT, with its own --tensor-model-parallel-size ...> \\
        --kd-cache PATH [--kd-draws N | --kd-cache-mode topk --kd-topk K] [--kd-teacher-hf DIR]

The datasets are built by the same code and arguments as ``megatron-kd train`` (so sample i is
the same token window), the teacher is a Megatron GPTModel loaded from ``--load`` (TP, EP; PP=1)
or a Hugging Face causal LM from ``--kd-teacher-hf``. Each data-parallel rank writes its own
partition; re-running the same command resumes a killed pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kd.cache import CacheError, CacheWriter
from megatron_kd.cache.inspect import store_bytes
from megatron_kd.megatron.args import TeacherPassConfig
from megatron_kd.megatron.loss_mask import loss_mask_field
from megatron_kd.megatron.data import dataset_fingerprint, tokenizer_fingerprint, vocabulary
from megatron_kd.megatron.packing import DocumentPacking
from megatron_kd.teacher.capture import CaptureConfig, capture_teacher
from megatron_kd.models.gpt_oss import is_gpt_oss
from megatron_kd.teacher.fingerprint import hf_fingerprint, megatron_fingerprint
from megatron_kd.teacher.sources import HFTeacher, MegatronTeacher


def check_teacher_vocab(teacher_vocab: int, tokenizer, *, source: str) -> None:
    if teacher_vocab < tokenizer.vocab_size:
        raise CacheError(f"teacher {source} has a vocabulary of {teacher_vocab} tokens, the dataset's tokenizer "
                         f"{tokenizer.vocab_size}: they are not the same tokenizer")


def check_teacher_tokenizer(path: str, tokenizer) -> None:
    """The Hugging Face teacher's own tokenizer (where ``path`` has one) maps every token to the id
    the dataset's tokenizer does: a tokenizer of the same size but other tokens is refused, naming
    the first id that differs."""
    import transformers

    try:
        hf_vocab = transformers.AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError):
        return  # no tokenizer files next to the weights: only the size was checked
    ours = vocabulary(tokenizer)  # None: a tokenizer without a vocabulary table (NullTokenizer): only the size
    if not ours:
        return
    differ = sorted(set(hf_vocab.items()) ^ set(ours.items()), key=lambda item: item[1])
    if differ:
        token, i = differ[0]
        raise CacheError(f"teacher {path}: its tokenizer's vocabulary differs from the dataset's tokenizer "
                         f"(first at id {i}: {token!r} in one of them only)")


def _print_rank_0(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def _hf_teacher(path: str, tokenizer, device, packing: DocumentPacking | None = None) -> HFTeacher:
    import transformers

    fingerprint = hf_fingerprint(path, log=_print_rank_0)  # first: a directory without weights stops here
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).to(device)
    teacher = HFTeacher(model, fingerprint=fingerprint, packing=packing)
    check_teacher_vocab(teacher.vocab_size, tokenizer, source=path)
    check_teacher_tokenizer(path, tokenizer)
    teacher.vocab_size = tokenizer.vocab_size
    return teacher


def _megatron_teacher(args, teacher_hf: str | None, tokenizer, packing: DocumentPacking | None = None) -> MegatronTeacher:
    """The teacher the model flags describe, from --load or (GPT-OSS) a Hugging Face directory."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import get_model

    from megatron_kd.megatron.run import model_provider
    from megatron_kd.models.hf import init_from_hf

    if args.pipeline_model_parallel_size > 1:
        raise CacheError("the teacher pass runs Megatron teachers with --pipeline-model-parallel-size 1 "
                         "(use tensor / expert parallelism to fit the teacher)")
    if args.load is None and teacher_hf is None:
        raise CacheError("the teacher pass needs the teacher checkpoint: --load CKPT_DIR (or --kd-teacher-hf DIR)")
    # the weights' digest, before loading: a missing checkpoint stops here instead of a random teacher
    if args.load is not None:
        fingerprint = megatron_fingerprint(args.load, ckpt_step=getattr(args, "ckpt_step", None),
                                           log=_print_rank_0)
    else:
        fingerprint = hf_fingerprint(teacher_hf, log=_print_rank_0)
    model = get_model(model_provider, wrap_with_ddp=False)
    if args.load is not None:
        load_checkpoint(model, None, None, strict=True)
    else:
        init_from_hf(unwrap_model(model[0]), teacher_hf, args)
    check_teacher_vocab(args.padded_vocab_size, tokenizer, source=args.load or teacher_hf)
    return MegatronTeacher(model[0].eval(), tp_group=parallel_state.get_tensor_model_parallel_group(),
                           sequence_parallel=args.sequence_parallel, vocab_size=tokenizer.vocab_size,
                           fingerprint=fingerprint, packing=packing)


def build_cache(args, config: TeacherPassConfig) -> dict:
    """The teacher pass ``config`` describes (its ``cache`` given) over the data and the teacher of
    Megatron-LM's global arguments ``args``: starts Megatron, writes this rank's partition of the cache and returns, the same on every rank, what the
    pass did: ``total`` samples the cache holds, ``samples`` / ``tokens`` computed by this pass,
    their ``mass`` (the teacher's mean top-K mass), the cache's ``mode``, ``k``, ``loss_mask`` (its
    field, or None) and ``bytes_per_token``."""
    from megatron.core import parallel_state
    from megatron.training.initialize import initialize_megatron

    from megatron_kd.megatron.run import build_datasets, consumed_train_samples, run_sizes

    initialize_megatron()
    device = torch.device("cuda", torch.cuda.current_device())
    # the student's splits; every rank of a model replica reads the samples it feeds the teacher
    sizes = run_sizes(args)
    (train, _, _), tokenizer = build_datasets(sizes, is_built_on_rank=lambda *a, **k: True)
    # the student's --reset-attention-mask / --reset-position-ids: the teacher sees the documents alike
    packing = DocumentPacking.from_args(args, eod=tokenizer.eod)
    # GPT-OSS teachers run as Megatron models (sharded by TP / EP), other HF teachers through transformers
    teacher = _hf_teacher(config.teacher_hf, tokenizer, device, packing) \
        if config.teacher_hf and not is_gpt_oss(args) else _megatron_teacher(args, config.teacher_hf, tokenizer, packing)

    # chat data with a loss mask: rows only where the student's loss is taken
    loss_mask = loss_mask_field(train)
    mode, k = config.cache_mode, config.entries
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    writer = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        writer = CacheWriter(
            config.cache, vocab_size=tokenizer.vocab_size, topk=k, seq_length=args.seq_length,
            num_samples=consumed_train_samples(args), dp_rank=dp_rank, dp_size=dp_size,
            micro_batch_size=args.micro_batch_size, codec=config.codec,
            metadata={"temperature": config.capture_temperature, "mode": mode,
                      "sampled_draws": k if mode == "sampled" else 0, "packing": packing.mode,
                      "loss_mask": loss_mask,
                      "teacher_fingerprint": teacher.fingerprint, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                      "dataset_fingerprint": dataset_fingerprint(train)},
        )
        for reason in writer.repairs:  # rows_done claimed rows whose shard is not on disk as recorded
            print(f"teacher cache {config.cache}: {reason}; computing those samples again", flush=True)
    capture = CaptureConfig(mode=mode, topk=k, draws=k, temperature=config.capture_temperature,
                            micro_batch_size=args.micro_batch_size, seed=args.seed, chunk_size=config.chunk_size,
                            masked=bool(loss_mask), store_workers=config.cache_workers)
    summary = capture_teacher(teacher, train, writer, capture, device=device)
    if writer is not None:
        writer.close()
    totals = torch.tensor([summary["samples"], summary["tokens"], summary["mean_teacher_mass"] * summary["tokens"]],
                          dtype=torch.float64, device=device)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        totals.zero_()  # one count per model replica
    dist.all_reduce(totals)
    dist.barrier()
    samples, tokens, mass = (float(x) for x in totals)
    total = consumed_train_samples(args)
    return {"total": total, "samples": int(samples), "tokens": int(tokens), "mass": mass / tokens if tokens else None,
            "mode": mode, "k": k, "loss_mask": loss_mask,
            "bytes_per_token": store_bytes(config.cache) / (total * args.seq_length)}
