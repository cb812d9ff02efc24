"""Flags only Transformer Engine's layers implement are refused in one line, before any work, in a
run that builds megatron-core's local spec (megatron-core fails on --apply-layernorm-1p and
--moe-permute-fusion with a traceback at model build, and trains in bf16 without a word under
--fp8-format); a run without them passes. A flag of Megatron-LM's own scripts that megatron-core
lacks (--enable-gpt-oss) says what stands for it here. Gradient accumulation fusion, on by default,
is refused in one line where Apex is missing (megatron-core raises at model build on either spec)."""

import importlib.util

import pytest

from megatron_kd.errors import FlagError
from megatron_kd.megatron.flags import check_megatron_flags
from megatron_kd.models.gpt import have_transformer_engine

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
         "--no-gradient-accumulation-fusion",
         "--vocab-size", "100", "--train-iters", "1", "--global-batch-size", "2"]
# the local spec: chosen by the flag wherever Transformer Engine is installed, by its absence elsewhere
LOCAL = ["--transformer-impl", "local"]


@pytest.mark.parametrize("flags, named", [
    (["--fp8-format", "hybrid"], "--fp8-format"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p"),
    (["--moe-permute-fusion", "--num-experts", "4"], "--moe-permute-fusion"),
    (["--fp8-format", "e4m3", "--apply-layernorm-1p"], "--apply-layernorm-1p, --fp8-format need"),
])
def test_transformer_engine_flags_on_the_local_spec_are_one_line(flags, named):
    with pytest.raises(FlagError, match=f"{named}.*local spec \\(--transformer-impl local\\)"):
        check_megatron_flags([*MODEL, *LOCAL, *flags])


@pytest.mark.skipif(have_transformer_engine(), reason="the default spec here is Transformer Engine's")
def test_without_transformer_engine_the_default_spec_refuses_them_too():
    with pytest.raises(FlagError, match="Transformer Engine is not installed"):
        check_megatron_flags([*MODEL, "--fp8-format", "hybrid"])


def test_a_run_without_them_passes():
    check_megatron_flags([*MODEL, *LOCAL])


def test_a_flag_of_megatron_lms_own_scripts_says_what_stands_for_it():
    with pytest.raises(FlagError, match="--enable-gpt-oss is Megatron-LM's post-training flag: here GPT-OSS is"):
        check_megatron_flags([*MODEL, "--enable-gpt-oss"])


@pytest.mark.skipif(importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None, reason="Apex installed")
def test_gradient_accumulation_fusion_without_apex_is_one_line():
    # megatron-core turns the fusion on by default and raises at model build, in every
    # ColumnParallelLinear of either spec, where Apex's extension is missing
    argv = [flag for flag in MODEL if flag != "--no-gradient-accumulation-fusion"]
    with pytest.raises(FlagError, match=r"^gradient accumulation fusion \(on by default\) needs Apex's "
                                        r"fused_weight_gradient_mlp_cuda extension, which is not installed: add "
                                        r"--no-gradient-accumulation-fusion$"):
        check_megatron_flags(argv)
