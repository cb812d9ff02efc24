"""Llama 3 and Qwen3 students and teachers are what transformers computes: megatron-core built from
the flags ``llama.megatron_flags`` gives for a checkpoint, with weights in and out through
nvidia-modelopt.

1. a tiny random LlamaForCausalLM (RoPE scaled as Llama 3.1) and Qwen3ForCausalLM (QK-norm),
   imported through ``model_provider`` (``--kd-student-hf``, what ``megatron-kd train`` runs), give
   transformers' fp32 logits to ≤1e-4 at TP=1 and TP=2 on gloo; controls show the comparison
   catches RoPE without Llama 3's scaling, a wrong θ and (Qwen3) no QK-norm
2. one fused-KD training step on the imported model equals the dense reference (loss, all grads)
   and lowers the loss
3. HF -> Megatron -> HF (``export_hf_weights`` with ``hf_config_from_args``) gives back identical
   tensors and a config that transformers computes the same logits with
4. a checkpoint that differs from the flags is refused in one line naming the field
"""

import copy
import os
from pathlib import Path

import pytest
import torch

from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.hf_equality import (assert_same_tensors, build_student, forget_megatron, kd_step, megatron_logits,
                                        reference_logits)
from tests.fixtures.kd_inputs import rel_err
from tests.fixtures.tiny_gpt_oss import TOKENIZER_TOKENS, VOCAB_ROWS
from tests.fixtures.tiny_llama import KINDS, SEQ, make_tiny, tiny_config, tiny_flags

TOL = 1e-4  # fp32: both sides round the same 2-layer model's sums differently, ~1e-6 relative


def _tokens(seed):
    return torch.randint(0, TOKENIZER_TOKENS, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _controls(kind, args, hf_dir, tokens, want):
    """Each wrong detail moves the logits far beyond the tolerance."""
    from megatron_kd.models.gpt import gpt_model_from_args
    from megatron_kd.models.hf import import_hf_weights

    wrong = {"θ 10,000": {"rotary_base": 10000}}
    if kind == "llama":
        wrong["no Llama 3 RoPE scaling"] = {"use_rope_scaling": False}
    else:
        wrong["no QK-norm"] = {"qk_layernorm": False}
    for name, flags in wrong.items():
        variant = copy.deepcopy(args)
        for key, value in flags.items():
            setattr(variant, key, value)
        m = gpt_model_from_args(variant)
        import_hf_weights(m, hf_dir)
        err = rel_err(megatron_logits(m.eval(), tokens), want)
        assert err > 5 * TOL, f"{name}: relative error {err:.2e}"


def _export_round_trip(args, model, hf_dir, out_dir, tokens, want):
    from transformers import AutoConfig

    from megatron_kd.models.hf import check_hf_dir_config, export_hf_weights, hf_config_from_args

    export_hf_weights(model, out_dir, hf_config_from_args(args, vocab_size=VOCAB_ROWS), dtype=torch.float32,
                      tokenizer_dir=hf_dir)
    assert_same_tensors(hf_dir, out_dir)
    check_hf_dir_config(out_dir, args)
    assert AutoConfig.from_pretrained(out_dir).model_type == AutoConfig.from_pretrained(hf_dir).model_type
    assert (Path(out_dir) / "tokenizer.json").is_file()
    assert rel_err(reference_logits(out_dir, tokens), want) < TOL


def _tp1_worker(rank, world, tmp, seed):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    for kind in KINDS:  # one process for both: each spawn costs ~20 s of imports
        with megatron_cpu_patches():
            hf_dir = make_tiny(kind, Path(tmp) / kind / "hf", seed=seed)
            args, model = build_student(tiny_flags(hf_dir))
            assert args.padded_vocab_size == VOCAB_ROWS  # tokenizer 990 (padded 992) < the checkpoint's 1000 rows
            tokens = _tokens(seed)
            want = reference_logits(hf_dir, tokens)
            assert rel_err(megatron_logits(model.eval(), tokens), want) < TOL, kind
            _controls(kind, args, hf_dir, tokens, want)
            _export_round_trip(args, model, hf_dir, Path(tmp) / kind / "exported", tokens, want)
            kd_step(model.train(), None, seed, SEQ, experts=False)
        forget_megatron()


def test_tiny_llama_and_qwen3_equal_transformers(tmp_path, seed):
    spawn(_tp1_worker, str(tmp_path), seed, world_size=1)


def _tp2_worker(rank, world, tmp, seed):
    from megatron.core import parallel_state

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    for kind in KINDS:
        hf_dir = Path(tmp) / kind / "hf"
        with megatron_cpu_patches():
            if rank == 0:
                make_tiny(kind, hf_dir, seed=seed)
            torch.distributed.barrier()
            args, model = build_student(tiny_flags(hf_dir, "--tensor-model-parallel-size", str(world)))
            tp_group = parallel_state.get_tensor_model_parallel_group()
            tokens = _tokens(seed)
            want = reference_logits(hf_dir, tokens)
            assert rel_err(megatron_logits(model.eval(), tokens, tp_group), want) < TOL, kind
            kd_step(model.train(), tp_group, seed, SEQ, experts=False)
        forget_megatron()


def test_tiny_llama_and_qwen3_tensor_parallel_equal_transformers(tmp_path, seed):
    spawn(_tp2_worker, str(tmp_path), seed, world_size=2)


@pytest.mark.parametrize("kind", KINDS)
def test_flags_describe_the_checkpoint_and_a_different_one_is_refused(kind):
    from megatron_kd.errors import ModelConfigError
    from megatron_kd.megatron.flags import parse_flags
    from megatron_kd.models.llama import check_dense_hf_config, dense_hf_config, megatron_flags

    published = tiny_config(kind)
    args = parse_flags(megatron_flags(published) + ["--seq-length", str(SEQ)], prog="test")
    check_dense_hf_config(published, args, source="ckpt")
    ours = dense_hf_config(args, vocab_size=published.vocab_size)
    assert ours.model_type == kind and ours.rope_parameters == dict(published.rope_parameters)
    changes = [("num_key_value_heads", 4), ("head_dim", 16), ("intermediate_size", 128), ("rms_norm_eps", 1e-6),
               ("tie_word_embeddings", True)]
    if kind == "llama":
        changes.append(("rope_parameters", {**published.rope_parameters, "factor": 32.0}))
        changes.append(("rope_parameters", {**published.rope_parameters, "low_freq_factor": 2.0}))
    for field, value in changes:
        other = tiny_config(kind, **{field: value})
        with pytest.raises(ModelConfigError) as info:
            check_dense_hf_config(other, args, source="ckpt")
        message = str(info.value)
        assert "\n" not in message and message.startswith("ckpt/config.json: ") and field in message, message
    with pytest.raises(ModelConfigError, match="model_type"):
        check_dense_hf_config(tiny_config("qwen3" if kind == "llama" else "llama"), args, source="ckpt")


def _recipe_flags(size: str) -> list[str]:
    import subprocess

    root = Path(__file__).parents[2]
    script = (f'source "{root}/examples/llama/llama3.sh"; source "{root}/examples/llama/{size}.sh"; '
              'printf "%s\\n" "${LLAMA3_ARCH[@]}" "${LLAMA3_SIZE[@]}" "${LLAMA3_LAYOUT[@]}"')
    return subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]


# the published configs' architecture fields (meta-llama/Llama-3.1-8B and Llama-3.2-3B config.json)
_PUBLISHED = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               tie_word_embeddings=False, factor=8.0),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               tie_word_embeddings=True, factor=32.0),
}


@pytest.mark.parametrize("size", ["8b", "3b"])
def test_recipe_is_the_published_llama(size):
    from transformers import LlamaConfig

    from megatron_kd.megatron.flags import parse_flags
    from megatron_kd.models.llama import check_dense_hf_config

    fields = dict(_PUBLISHED[size])
    factor = fields.pop("factor")
    published = LlamaConfig(vocab_size=128256, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                            max_position_embeddings=131072, **fields,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192})
    check_dense_hf_config(published, parse_flags(_recipe_flags(size), prog="test"), source=f"llama-{size}")


def test_hf_flags_prints_flags_that_describe_the_directory(tmp_path, capsys):
    import shlex

    from transformers import AutoConfig

    from megatron_kd.cli import main
    from megatron_kd.megatron.flags import parse_flags
    from megatron_kd.models.llama import check_dense_hf_config

    for kind in KINDS:
        hf_dir = make_tiny(kind, tmp_path / kind)
        assert main(["hf-flags", str(hf_dir)]) == 0
        flags = shlex.split(capsys.readouterr().out)
        check_dense_hf_config(AutoConfig.from_pretrained(hf_dir), parse_flags(flags, prog="test"), source=str(hf_dir))
    assert main(["hf-flags", str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err
