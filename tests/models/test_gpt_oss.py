"""GPT-OSS students are GPT-OSS: megatron-core built from examples/gpt_oss's flags, checked against
transformers' GptOssForCausalLM, with weights in and out through nvidia-modelopt.

1. the 20B and 120B recipes parse with Megatron-LM's own parser and describe the published models
   (transformers' GptOssConfig for each size); a checkpoint that differs from the flags is refused
2. a tiny random GptOssForCausalLM imported through ``model_provider`` (``--kd-student-hf``, the
   path ``megatron-kd train`` runs) gives transformers' logits to ≤1e-4 (fp32), at TP=1, TP=2 and
   EP=2 on gloo; controls show the comparison catches a window one key too wide, windows on the
   wrong layers, YaRN scaling 1.0, a rounded YaRN correction range, zeroed sinks, the clamp
   before the bias (megatron-core's fused path) and no clamp at all
3. one fused-KD training step on the imported model equals the dense reference (loss, all grads)
   and lowers the loss; at TP=1 this runs the expert-bias path megatron-core breaks at EP=1
4. HF -> Megatron -> HF (``export_hf_weights``) gives back identical tensors and config
"""

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.hf_equality import (assert_same_tensors, build_gpt_oss_student, forget_megatron, kd_step,
                                        megatron_logits, reference_logits)
from tests.fixtures.kd_inputs import rel_err
from tests.fixtures.tiny_gpt_oss import SEQ, VOCAB_ROWS, make_tiny_gpt_oss, recipe_flags

TOL = 1e-4


@pytest.mark.parametrize("size, layers, experts", [("20b", 24, 32), ("120b", 36, 128)])
def test_recipe_is_the_published_architecture(size, layers, experts):
    from megatron.training.arguments import parse_args
    from transformers import GptOssConfig

    from megatron_kd.errors import ModelConfigError
    from megatron_kd.megatron.args import add_kd_args
    from megatron_kd.models.gpt_oss import check_hf_config, gpt_oss_hf_config

    argv, sys.argv = sys.argv, ["megatron-kd", *recipe_flags(size)]
    try:
        args = parse_args(add_kd_args)
    finally:
        sys.argv = argv
    published = GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)  # transformers' GPT-OSS facts
    check_hf_config(published, args, source=f"gpt-oss-{size}")
    ours = gpt_oss_hf_config(args, vocab_size=201_088)
    assert ours.layer_types == published.layer_types and ours.layer_types[0] == "sliding_attention"
    assert ours.sliding_window == 128 and ours.rope_parameters["factor"] == 32
    assert args.expert_model_parallel_size == 8 and args.seq_length == 32768
    for field, value in [("sliding_window", 129), ("num_local_experts", experts // 2), ("swiglu_limit", 5.0)]:
        with pytest.raises(ModelConfigError, match=field):
            check_hf_config(GptOssConfig(**{**published.to_dict(), field: value}), args, source="x")


def _controls(args, model, hf_dir, tokens, want):
    """Each wrong GPT-OSS detail moves the logits far beyond the tolerance; the right ones do not."""
    from megatron_kd.models.gpt import gpt_model_from_args
    from megatron_kd.models.hf import import_hf_weights

    def zero_sinks(m):
        for layer in m.decoder.layers:
            layer.self_attention.core_attention.softmax_offset.data.zero_()

    def fused_clamp(m):  # megatron-core's fused bias + quick-GeGLU clamps before adding the bias
        m.config.bias_activation_fusion = True

    def no_clamp(m):
        m.config.activation_func_clamp_value = None

    wrong = {
        "window of 129 keys": ({"window_size": (8, 0)}, None),
        "windows on odd layers": ({"window_attn_skip_freq": [0, 1]}, None),
        "YaRN scaling 1.0": ({"mscale_all_dim": 1.0}, None),
        "rounded YaRN range": ({"yarn_correction_range_round_to_int": True}, None),
        "no sinks": ({}, zero_sinks),
        "clamp before bias": ({}, fused_clamp),
        "no clamp": ({}, no_clamp),
    }
    right = {"fused bias-activation requested": ({"bias_gelu_fusion": True}, None)}  # correct_config undoes it
    for name, (flags, edit) in {**wrong, **right}.items():
        variant = copy.deepcopy(args)
        for key, value in flags.items():
            setattr(variant, key, value)
        m = gpt_model_from_args(variant)
        import_hf_weights(m, hf_dir)
        if edit is not None:
            edit(m)
        err = rel_err(megatron_logits(m, tokens), want)
        assert (err > 5 * TOL) if name in wrong else (err < TOL), f"{name}: relative error {err:.2e}"


def _export_round_trip(args, model, hf_dir, out_dir, tokens, want):
    from transformers import AutoConfig

    from megatron_kd.models.gpt_oss import check_hf_config, gpt_oss_hf_config
    from megatron_kd.models.hf import export_hf_weights

    export_hf_weights(model, out_dir, gpt_oss_hf_config(args, vocab_size=VOCAB_ROWS), dtype=torch.float32,
                      tokenizer_dir=hf_dir)
    assert_same_tensors(hf_dir, out_dir)
    check_hf_config(AutoConfig.from_pretrained(out_dir), args, source=str(out_dir))
    assert (Path(out_dir) / "tokenizer.json").is_file()
    assert rel_err(reference_logits(out_dir, tokens), want) < TOL


def _tp1_worker(rank, world, tmp, seed):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_cpu_patches():
        hf_dir = make_tiny_gpt_oss(Path(tmp) / "hf", seed=seed)
        args, model = build_gpt_oss_student(hf_dir)
        assert args.padded_vocab_size == VOCAB_ROWS  # tokenizer 990 (padded 992) < the checkpoint's 1000 rows
        tokens = torch.randint(0, 990, (2, SEQ), generator=torch.Generator().manual_seed(seed))
        want = reference_logits(hf_dir, tokens)
        assert rel_err(megatron_logits(model, tokens), want) < TOL
        _controls(args, model, hf_dir, tokens, want)
        _export_round_trip(args, model, hf_dir, Path(tmp) / "exported", tokens, want)
        kd_step(model, None, seed, SEQ, experts=True)


def test_tiny_gpt_oss_equals_transformers(tmp_path, seed):
    spawn(_tp1_worker, str(tmp_path), seed, world_size=1)


def _parallel_worker(rank, world, tmp, seed):
    from megatron.core import parallel_state

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    hf_dir = Path(tmp) / "hf"
    # TP 2, then EP 2, in one process (each spawn costs ~20 s of imports)
    for parallel_flag in ("--tensor-model-parallel-size", "--expert-model-parallel-size"):
        with megatron_cpu_patches():
            if rank == 0 and not hf_dir.exists():
                make_tiny_gpt_oss(hf_dir, seed=seed)
            torch.distributed.barrier()
            args, model = build_gpt_oss_student(hf_dir, parallel_flag, str(world))
            tokens = torch.randint(0, 990, (2, SEQ), generator=torch.Generator().manual_seed(seed))
            want = reference_logits(hf_dir, tokens)
            tp_group = parallel_state.get_tensor_model_parallel_group()
            # megatron-core refuses MoE in training mode under TP without sequence parallelism, which its
            # local spec lacks (no TE norm); with dropout 0, eval mode computes the same loss and gradients
            model.train(tp_group.size() == 1)
            assert rel_err(megatron_logits(model, tokens, tp_group), want) < TOL, parallel_flag
            kd_step(model, tp_group, seed, SEQ, experts=True)
        forget_megatron()


def test_tiny_gpt_oss_tp2_and_ep2_equal_transformers(tmp_path, seed):
    spawn(_parallel_worker, str(tmp_path), seed, world_size=2)
