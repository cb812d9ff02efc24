"""``write_mxfp4_experts``: a GPT-OSS directory's experts in the MXFP4 layout of the published release.

1. a dense tiny GPT-OSS whose experts are MXFP4 values, rewritten, is the directory the test
   fixture writes in the release layout (``write_mxfp4_layout``, checked against transformers' reader
   by the import tests): the same scales, the same codes but for the sign bit of zeros (ModelOpt's
   rule sets it), the same other tensors and the release's ``quantization_config``; a directory of
   several safetensors files keeps its index right
2. transformers loads the rewritten directory and computes the dense one's logits
3. experts that are not MXFP4 values are refused in one line naming the tensor (never rounded)
"""

import json
import shutil

import pytest
import torch

from megatron_kd.errors import ModelConfigError
from megatron_kd.models.mxfp4_release import write_mxfp4_experts
from megatron_kd.ops.quant import mxfp4_decode
from tests.fixtures.hf_equality import safetensors_of
from tests.fixtures.tiny_gpt_oss import TOKENIZER_TOKENS, make_tiny_gpt_oss


def test_the_release_layout_is_the_fixtures(tmp_path, seed):
    dense = make_tiny_gpt_oss(tmp_path / "dense", seed=seed)
    release = make_tiny_gpt_oss(tmp_path / "release", seed=seed, layout="mxfp4")
    ours = shutil.copytree(dense, tmp_path / "ours")
    assert write_mxfp4_experts(ours) == 2 * json.loads((dense / "config.json").read_text())["num_hidden_layers"]
    want, got = safetensors_of(release), safetensors_of(ours)
    assert want.keys() == got.keys()
    for key in want:
        if key.endswith("_blocks"):  # ModelOpt's codes give a zero the sign bit (-0), the fixture's +0
            prefix = key[:-len("_blocks")]
            assert torch.equal(mxfp4_decode(got[key], got[prefix + "_scales"], torch.float32),
                               mxfp4_decode(want[key], want[prefix + "_scales"], torch.float32)), key
            assert torch.equal(got[key] & 0x77, want[key] & 0x77), key  # the magnitudes: every code but zero's sign
        else:
            assert torch.equal(want[key], got[key]), key
    config = json.loads((ours / "config.json").read_text())
    assert config["quantization_config"] == json.loads((release / "config.json").read_text())["quantization_config"]

    import transformers

    tokens = torch.randint(3, TOKENIZER_TOKENS, (1, 24), generator=torch.Generator().manual_seed(seed))
    logits = {}
    for name, d in (("dense", dense), ("ours", ours)):
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits[name] = model(input_ids=tokens).logits
    assert torch.allclose(logits["ours"], logits["dense"], rtol=0, atol=1e-5)


def test_several_files_keep_their_index(tmp_path, seed):
    from safetensors.torch import load_file, save_file

    d = make_tiny_gpt_oss(tmp_path / "dense", seed=seed)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(d / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in halves.items() for k in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    write_mxfp4_experts(d)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    on_disk = {k: name for name in halves for k in load_file(str(d / name))}
    assert weight_map == on_disk
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in weight_map)


def test_values_that_are_not_mxfp4_are_refused(tmp_path, seed):
    from safetensors.torch import load_file, save_file

    d = make_tiny_gpt_oss(tmp_path / "dense", seed=seed)
    tensors = load_file(str(d / "model.safetensors"))
    key = "model.layers.0.mlp.experts.down_proj"
    tensors[key] = tensors[key] * 1.01  # off the FP4 grid
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=rf"{key} holds values that are not MXFP4"):
        write_mxfp4_experts(d)


def _qad_export_worker(rank, world, tmp, seed):
    import os
    from pathlib import Path

    from megatron.core.transformer.module import Float16Module

    from megatron_kd.models.experts import bake_quantized_experts
    from megatron_kd.models.hf import export_hf_weights, hf_config_from_args
    from tests.fixtures.dist_utils import megatron_cpu_patches
    from tests.fixtures.hf_equality import build_gpt_oss_student
    from tests.fixtures.kd_inputs import rel_err
    from tests.fixtures.tiny_gpt_oss import VOCAB_ROWS

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_cpu_patches():
        hf_dir = make_tiny_gpt_oss(Path(tmp) / "hf", seed=seed)
        args, model = build_gpt_oss_student(hf_dir, "--kd-quant", "mxfp4", "--bf16")
        with torch.no_grad():  # a trained student: its experts' weights off the FP4 grid
            g = torch.Generator().manual_seed(seed)
            for name, p in model.named_parameters():
                if "local_experts" in name and name.endswith("weight"):
                    p.mul_(1 + 0.3 * torch.rand(p.shape, generator=g).to(p.dtype))
        tokens = torch.randint(3, TOKENIZER_TOKENS, (1, 32), generator=g)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        wrapped = Float16Module(model.config, model).eval()
        with torch.no_grad():
            ours = wrapped(tokens, positions, None)[..., :VOCAB_ROWS].float()  # the training forward: quantized
            model.decoder.layers[0].mlp.experts.weight_quant = None
            unquantized = wrapped(tokens, positions, None)[..., :VOCAB_ROWS].float()
            model.decoder.layers[0].mlp.experts.weight_quant = "mxfp4"
        bake_quantized_experts(model)
        out = Path(tmp) / "export"
        export_hf_weights(model, out, hf_config_from_args(args, vocab_size=VOCAB_ROWS), dtype=torch.bfloat16,
                          tokenizer_dir=hf_dir)
        write_mxfp4_experts(out)

    import transformers

    # the file holds exactly the weights the training forward computed with
    stored = safetensors_of(out)
    for i, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts.local_experts
        for hf_name, linear in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
            key = f"model.layers.{i}.mlp.experts.{hf_name}"
            weights = mxfp4_decode(stored[key + "_blocks"], stored[key + "_scales"], torch.float32)
            baked = torch.stack([getattr(e, linear).weight.float() for e in experts])
            if hf_name == "gate_up_proj":  # Megatron's [gate rows; linear rows] -> the release's interleaved rows
                gate, lin = baked.chunk(2, dim=1)
                baked = torch.stack([gate, lin], 2).flatten(1, 2)
            assert torch.equal(weights, baked), key

    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
        with torch.no_grad():
            logits[dtype] = exported(input_ids=tokens).logits.float()
    # the yardstick of test_gpt_oss_cuda_equality.py: what computing this model in bf16 costs transformers
    err, yardstick = rel_err(ours, logits[torch.float32]), rel_err(logits[torch.bfloat16], logits[torch.float32])
    control = rel_err(unquantized, logits[torch.float32])
    print(f"exported MXFP4 student (transformers fp32) vs the training forward (bf16): {err:.2e}; transformers "
          f"bf16: {yardstick:.2e}; layer 0 unquantized: {control:.2e}")
    assert err <= 3 * yardstick + 2.0 ** -8, (err, yardstick)
    assert control > 2 * err, (control, err)  # the comparison sees the quantization of one layer


def test_a_qad_student_exports_in_the_release_layout_and_computes_its_training_forward(tmp_path, seed):
    """A student with --kd-quant mxfp4 (bf16 on CPU: the grouped experts), its experts' weights moved
    off the FP4 grid as training moves them: baked, exported and written in the release layout,
    transformers computes the logits of its fake-quantized training forward within bf16 error."""
    from tests.fixtures.dist_utils import spawn

    spawn(_qad_export_worker, str(tmp_path), seed, world_size=1)
