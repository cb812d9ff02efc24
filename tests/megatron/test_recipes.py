"""Three Megatron-LM recipes, shrunk, through the product's flag check and Megatron-LM's validation.

The recipes (Megatron-LM main, examples/): ``gpt3/train_gpt3_175b_distributed.sh`` at TP 2,
``llama/train_llama3_8b_h100_fp8.sh`` at DP 2 with the distributed optimizer (its quoted
``--split '99,1,0'``, its ``--train-samples``), ``gptoss/02_train.sh`` at PP 2 and EP 2. Each flag
list is the recipe's own, its sizes shrunk and its paths put under the test's folder, plus
``--kd-cache``: what a user adapting the recipe to distill passes.

1. On a machine without Transformer Engine (megatron-core's local spec), each recipe's flags that
   only Transformer Engine implements, Megatron-LM main's ``--enable-gpt-oss`` and
   ``--export-force-local-attention``, and (without Apex) gradient accumulation fusion, which
   megatron-core turns on by default, are one line before any work, naming them.
2. Adapted as that line says (those flags dropped), each recipe passes the product's flag check and
   Megatron-LM's validation at its world size (CUDA's device queries answered as on a GPU machine),
   and the validated arguments keep the recipe's layout and sizes.
3. On a GPU machine, the Llama recipe's teacher -> ``cache build`` -> student loop runs end to end
   (two ranks where two GPUs are, else one): the student's log reports its kd loss and finds every
   sample in the cache.
"""

import importlib.util

import pytest
import torch

from megatron_kd.errors import FlagError
from megatron_kd.megatron.flags import check_megatron_run
from megatron_kd.models.gpt import have_transformer_engine
from tests.fixtures.cli_utils import run_cli
from tests.fixtures.dist_utils import megatron_cpu_patches

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128"]


def gpt3(tmp) -> list[str]:
    vocab, merges = tmp / "gpt2-vocab.json", tmp / "gpt2-merges.txt"
    vocab.write_text("{}")
    merges.write_text("#version: 0.2\n")
    return [*SMALL, "--attention-backend", "auto",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "4", "4", "16",
            "--train-iters", "30", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style",
            "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "25",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
            "--data-path", str(tmp / "corpus_text_document"), "--vocab-file", str(vocab), "--merge-file", str(merges),
            # the recipe leaves the tokenizer to an old Megatron-LM default; megatron-core 0.19 has none
            # (the check then says "missing required flags: --tokenizer-type")
            "--tokenizer-type", "GPT2BPETokenizer",
            "--split", "949,50,1",
            "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
            "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--eval-iters", "10",
            "--tensorboard-dir", str(tmp / "tb")]


LLAMA_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
             "--fp8-param-gather"]


def llama(tmp) -> list[str]:
    return [*SMALL, "--ffn-hidden-size", "224", "--group-query-attention", "--num-query-groups", "2",
            "--kv-channels", "16", "--position-embedding-type", "rope", "--rotary-base", "1000000",
            "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
            "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "240",
            "--lr-decay-samples", "200", "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
            "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
            "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
            "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
            "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
            *LLAMA_FP8,
            "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--data-cache-path", str(tmp / "data-cache"), "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
            "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100", "--save-interval", "1000",
            "--log-throughput", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
            "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--tensorboard-dir", str(tmp / "tb")]


def gpt_oss(tmp) -> list[str]:
    return ["--no-masked-softmax-fusion", "--transformer-impl", "transformer_engine", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--no-rope-fusion", "--normalization", "RMSNorm",
            "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "8",
            "--group-query-attention", "--num-query-groups", "2", "--seq-length", "128",
            "--max-position-embeddings", "128", "--use-mcore-models", "--rotary-percent", "1.0", "--rope-type",
            "rope", "--position-embedding-type", "rope", "--rotary-base", "10000", "--no-bias-gelu-fusion",
            "--export-force-local-attention", "--no-bias-dropout-fusion", "--quick-geglu", "--glu-linear-offset",
            "1.0", "--softmax-type", "learnable", "--window-attn-skip-freq", "2",
            "--activation-func-clamp-value", "7.0", "--window-size", "128,0", "--enable-gpt-oss",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", "1e-3", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
            "--overlap-param-gather", "--overlap-grad-reduce", "--moe-ffn-hidden-size", "128",
            "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3", "--moe-permute-fusion",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--data-cache-path", str(tmp / "data-cache"), "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1.0e-5", "--train-samples", "240",
            "--lr-decay-samples", "200", "--lr-decay-style", "cosine", "--min-lr", "1.0e-6", "--weight-decay",
            "0.1", "--lr-warmup-fraction", "0.05", "--clip-grad", "1.0", "--bf16", "--use-flash-attn",
            "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
            "--disable-bf16-reduced-precision-matmul", "--recompute-activations",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
            "--expert-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "1",
            "--use-distributed-optimizer", "--fp8-format", "hybrid", "--fp8-param-gather",
            "--fp8-amax-compute-algo", "max", "--fp8-amax-history-len", "1024",
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "50000000", "--eval-iters", "0",
            "--save", str(tmp / "ckpt"), "--tensorboard-dir", str(tmp / "ckpt" / "tensorboard"),
            "--moe-per-layer-logging", "--no-load-optim", "--no-load-rng", "--log-throughput"]


# recipe -> (flag list, world size, what validation must keep)
RECIPES = {
    "gpt3-175b": (gpt3, 2, {"tensor_model_parallel_size": 2, "data_parallel_size": 1, "fp16": True,
                            "train_iters": 30, "split": "949,50,1"}),
    "llama3-8b-fp8": (llama, 2, {"data_parallel_size": 2, "use_distributed_optimizer": True,
                                 "train_samples": 240, "split": "'99,1,0'", "group_query_attention": True}),
    "gpt-oss": (gpt_oss, 4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
                             "data_parallel_size": 2, "num_experts": 4, "softmax_type": "learnable"}),
}
# what only Transformer Engine implements, and Megatron-LM main's post-training and export flags:
# refused in one line (with what stands for them here), dropped by a user adapting the recipe
# (flag -> the values it takes)
DROPPED = {"--apply-layernorm-1p": 0, "--moe-permute-fusion": 0, "--enable-gpt-oss": 0,
           "--export-force-local-attention": 0,
                         **{flag: 1 for flag in ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo")},
                         "--fp8-param-gather": 0}


HAVE_APEX = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None  # gradient accumulation fusion


def adapted(argv: list[str]) -> list[str]:
    """The recipe as the product's one-line refusals say to adapt it on the local spec."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in DROPPED:
            i += 1 + DROPPED[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    if "--transformer-impl" in out:
        out[out.index("--transformer-impl") + 1] = "local"
    if not HAVE_APEX:
        out.append("--no-gradient-accumulation-fusion")
    return out


def _check(argv, world_size, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # every recipe exports it, as launch/env.sh does
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # --moe-grouped-gemm asks
    with megatron_cpu_patches():
        return check_megatron_run(argv, "train")


@pytest.mark.skipif(have_transformer_engine(), reason="the local spec's refusals: a machine without Transformer Engine")
@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_as_written_is_one_line_naming_what_this_machine_lacks(name, tmp_path, monkeypatch):
    recipe, world, _ = RECIPES[name]
    argv = [*recipe(tmp_path), "--kd-cache", str(tmp_path / "cache")]
    named = [flag for flag in DROPPED if flag in argv] + ([] if HAVE_APEX else ["--no-gradient-accumulation-fusion"])
    if name == "gpt3-175b":  # the recipe leaves the tokenizer to a default megatron-core 0.19 lacks
        i = argv.index("--tokenizer-type")
        with pytest.raises(FlagError, match="^missing required flags: --tokenizer-type$"):
            _check(argv[:i] + argv[i + 2:], world, monkeypatch)
    if not named:
        assert adapted(argv) == argv
        return
    with pytest.raises(FlagError) as info:
        _check(argv, world, monkeypatch)
    message = str(info.value)
    assert "\n" not in message
    assert any(flag in message for flag in named), message


@pytest.mark.parametrize("name", RECIPES)
def test_an_adapted_recipe_passes_the_check_and_megatron_validation(name, tmp_path, monkeypatch):
    recipe, world, keeps = RECIPES[name]
    run = _check([*adapted(recipe(tmp_path)), "--kd-cache", str(tmp_path / "cache")], world, monkeypatch)
    args = run.args
    assert args.world_size == world and args.kd_cache == str(tmp_path / "cache")
    for field, want in keeps.items():
        assert getattr(args, field) == want, (field, getattr(args, field), want)


# ---------------------------------------------------------------- 3. the loop on a GPU machine
def _set(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with ``flag``'s value replaced (``None``: the flag and its value dropped)."""
    i = argv.index(flag)
    return argv[:i] + ([flag, value] if value is not None else []) + argv[i + 2:]


@pytest.mark.cuda
def test_the_llama_recipe_distills_end_to_end(tmp_path):
    from tests.megatron.test_train_cli_cuda import _data

    ranks = 2 if torch.cuda.device_count() >= 2 else 1
    # the recipe on a real dataset of 256 symbols (NullTokenizer: end-of-document 255) in place of
    # --mock-data, for 8 iterations of its global batch, on the local spec; checkpoints per stage
    common = [a for a in adapted(llama(tmp_path)) if a != "--mock-data"]
    for flag, value in (("--vocab-size", "256"), ("--train-samples", "64"), ("--lr-decay-samples", "48"),
                        ("--exit-duration-in-mins", None), ("--save", None), ("--load", None)):
        common = _set(common, flag, value)
    common += ["--data-path", _data(tmp_path), "--transformer-impl", "local", "--no-rope-fusion",
               "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]
    teacher = tmp_path / "teacher"
    run_cli(["train", *common, "--save", str(teacher), "--save-interval", "8"], tmp_path, "teacher", ranks)
    cache = tmp_path / "cache"
    log = run_cli(["cache", "build", *common, "--load", str(teacher), "--kd-cache", str(cache)], tmp_path, "build",
                  ranks)
    assert "64 samples" in log, log[-3000:]
    log = run_cli(["train", *common, "--kd-cache", str(cache)], tmp_path, "student", ranks)
    assert "kd loss" in log and "the run's 64 found by their tokens" in log, log[-3000:]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
