"""A GPT-OSS directory's experts rewritten in the MXFP4 layout of the published release.

``export-hf`` of a student distilled with ``--kd-quant mxfp4`` writes its experts as GPT-OSS's
release stores them, so that vLLM, SGLang and transformers serve it in its release format:

    model.layers.N.mlp.experts.gate_up_proj_blocks   uint8 [E, 2I, hidden/32, 16]
    model.layers.N.mlp.experts.gate_up_proj_scales   uint8 [E, 2I, hidden/32]
    model.layers.N.mlp.experts.down_proj_blocks      uint8 [E, hidden, I/32, 16]
    model.layers.N.mlp.experts.down_proj_scales      uint8 [E, hidden, I/32]

(``ops.quant.mxfp4_encode``'s layout: a weight stored [outputs, inputs], 32 inputs per block with one
E8M0 scale, two E2M1 codes per byte); the biases stay dense, and config.json gets the release's
``quantization_config``. ``save_pretrained``'s dense experts are [E, inputs, outputs] and are
transposed first. The weights must be MXFP4 values already (a QAD student's experts, baked): a
tensor that the layout would round is refused, never rounded without a word.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_kd.errors import ModelConfigError
from megatron_kd.ops.quant import mxfp4_decode, mxfp4_encode

# what GPT-OSS's release leaves unquantized (its config.json)
RELEASE_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def write_mxfp4_experts(path: str | Path) -> int:
    """Rewrite the dense expert weights of the GPT-OSS directory ``path`` (one or several safetensors
    files, with their index) in the release's MXFP4 layout; returns how many tensors were rewritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    rewritten = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        out, changed = {}, 0
        for key, tensor in tensors.items():
            if not key.endswith(EXPERT_WEIGHTS):
                out[key] = tensor
                continue
            stored = tensor.transpose(1, 2).contiguous()  # [E, in, out] -> the release's [E, out, in]
            blocks, scales = mxfp4_encode(stored)
            if not torch.equal(mxfp4_decode(blocks, scales, torch.float32), stored.float()):
                raise ModelConfigError(f"{file}: {key} holds values that are not MXFP4 (a student distilled without "
                                       f"--kd-quant mxfp4?); the release layout would round them")
            out[key + "_blocks"], out[key + "_scales"] = blocks, scales
            if index is not None:
                where = index["weight_map"].pop(key)
                index["weight_map"][key + "_blocks"] = index["weight_map"][key + "_scales"] = where
            changed += 1
        if changed:
            tmp = file.with_name(file.name + ".partial")
            save_file(out, str(tmp), metadata={"format": "pt"})
            tmp.replace(file)
        rewritten += changed
    if not rewritten:
        raise ModelConfigError(f"{path}: no GPT-OSS expert weights ({', '.join(EXPERT_WEIGHTS)}) to write as MXFP4")
    if index is not None:
        index_file.write_text(json.dumps(index, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = RELEASE_QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return rewritten
