"""A pruned student written as a Hugging Face directory: the teacher's tensors, cut.

The cuts are row and column selections on the teacher's own tensors, read and written one
safetensors file at a time (a 120B teacher never sits in memory whole), so every kept weight is the
teacher's bit for bit, in whatever layout the teacher has (GPT-OSS's MXFP4 experts stay MXFP4:
experts are cut along their leading dimension only). The student then starts a run through
``--kd-student-hf`` like any checkpoint.

- layers: ``model.layers.{i}.*`` renumbered, config.json's ``layer_types`` cut;
- experts (GPT-OSS): ``mlp.router.{weight,bias}`` rows and every ``mlp.experts.*`` tensor along
  its leading (expert) dimension;
- FFN channels (Llama, Qwen3): rows of ``mlp.gate_proj`` and ``mlp.up_proj``, columns of
  ``mlp.down_proj``;
- attention heads: each kept head's ``head_dim`` rows of ``self_attn.q_proj`` (weight and bias),
  its columns of ``self_attn.o_proj`` and its ``self_attn.sinks`` entry (GPT-OSS); keys and values
  stay (every query group keeps heads).

config.json gets the student's ``num_hidden_layers``, ``layer_types``, ``num_local_experts``,
``intermediate_size``, ``num_attention_heads`` and ``head_dim`` (explicit: fewer heads of the same
width); the tokenizer and generation files are copied; ``prune.json`` records the
scores and the kept indices.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from megatron_kd.prune.cuts import KeptParts, PruneError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# files of a Hugging Face directory that are not weights and describe the same model after the cuts
_COPIED = ("tokenizer", "special_tokens", "chat_template", "generation_config", "vocab", "merges")


def head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    """The rows (of q_proj; columns of o_proj) of ``heads``, head-major as Hugging Face lays them."""
    return (torch.tensor(heads).view(-1, 1) * head_dim + torch.arange(head_dim)).flatten()


def _cut(name: str, t: torch.Tensor, experts: list[int] | None, ffn: list[int] | None,
         heads: list[int] | None = None, head_dim: int | None = None) -> torch.Tensor:
    """The part of one layer's tensor (``name`` after ``model.layers.{i}.``) the student keeps."""
    if heads is not None:
        if name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            return t.index_select(0, head_rows(heads, head_dim)).contiguous()
        if name == "self_attn.o_proj.weight":
            return t.index_select(1, head_rows(heads, head_dim)).contiguous()
        if name == "self_attn.sinks":
            return t.index_select(0, torch.tensor(heads)).contiguous()
    if experts is not None and (name.startswith("mlp.experts.") or name.startswith("mlp.router.")):
        return t.index_select(0, torch.tensor(experts)).contiguous()
    if ffn is not None:
        if name.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            return t.index_select(0, torch.tensor(ffn)).contiguous()
        if name == "mlp.down_proj.weight":
            return t.index_select(1, torch.tensor(ffn)).contiguous()
        if name.startswith("mlp.experts."):
            raise PruneError("expert FFN widths are not pruned yet: prune experts and layers of MoE teachers")
    return t


def pruned_state(tensors: dict[str, torch.Tensor], kept: KeptParts, head_dim: int | None = None) -> dict:
    """The student's tensors from (part of) the teacher's, by Hugging Face name; ``head_dim``: the
    attention's, needed when heads are cut."""
    out = {}
    for i, rest, t, (experts, ffn, heads) in kept.entries(tensors, _LAYER):
        if i is None:
            out[rest] = t
        else:
            out[f"model.layers.{i}.{rest}"] = _cut(rest, t, experts, ffn, heads, head_dim)
    return out


def pruned_config(config: dict, kept: KeptParts) -> dict:
    """The student's config.json from the teacher's."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    if max(kept.layers) >= text["num_hidden_layers"]:
        raise PruneError(f"kept layer {max(kept.layers)} is beyond the teacher's {text['num_hidden_layers']}")
    text["num_hidden_layers"] = len(kept.layers)
    if text.get("layer_types"):
        text["layer_types"] = [text["layer_types"][i] for i in kept.layers]
    if kept.experts is not None:
        sizes = {len(e) for e in kept.experts}
        if len(sizes) != 1:
            raise PruneError(f"every layer keeps the same number of experts, got {sorted(sizes)}")
        text["num_local_experts"] = sizes.pop()
    if kept.ffn is not None:
        sizes = {len(f) for f in kept.ffn}
        if len(sizes) != 1:
            raise PruneError(f"every layer keeps the same FFN width, got {sorted(sizes)}")
        text["intermediate_size"] = sizes.pop()
    if kept.heads is not None:
        sizes = {len(h) for h in kept.heads}
        if len(sizes) != 1:
            raise PruneError(f"every layer keeps the same number of attention heads, got {sorted(sizes)}")
        text["head_dim"] = head_dim_of(text)
        text["num_attention_heads"] = sizes.pop()
    return config


def head_dim_of(config: dict) -> int:
    """The attention's head width of a Hugging Face (text) config: ``head_dim``, else hidden / heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def write_pruned_hf(teacher_dir: str | Path, out_dir: str | Path, kept: KeptParts) -> Path:
    """Write the student (``kept`` parts of ``teacher_dir``'s model) into ``out_dir``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    teacher_dir, out_dir = Path(teacher_dir), Path(out_dir)
    files = sorted(teacher_dir.glob("*.safetensors"))
    if not files:
        raise PruneError(f"{teacher_dir}: no *.safetensors files (the teacher's Hugging Face weights)")
    out_dir.mkdir(parents=True, exist_ok=True)
    teacher_config = json.loads((teacher_dir / "config.json").read_text())
    head_dim = head_dim_of(teacher_config.get("text_config", teacher_config))
    weight_map, total = {}, 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            metadata = st.metadata() or {"format": "pt"}
            part = pruned_state({k: st.get_tensor(k) for k in st.keys()}, kept, head_dim)
        if part:
            save_file(part, str(out_dir / f.name), metadata=metadata)
            weight_map.update({k: f.name for k in part})
            total += sum(t.numel() * t.element_size() for t in part.values())
    if (teacher_dir / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = pruned_config(teacher_config, kept)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in teacher_dir.iterdir():
        if f.is_file() and f.name.startswith(_COPIED):
            shutil.copy(f, out_dir / f.name)
    (out_dir / "prune.json").write_text(json.dumps({"teacher": str(teacher_dir), **kept.to_dict()}, indent=1))
    return out_dir
