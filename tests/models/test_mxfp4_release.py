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
