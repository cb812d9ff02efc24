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
  stay (every query group keeps heads);
- experts' FFN channels (GPT-OSS): per expert its channels' gate and up columns of
  ``mlp.experts.gate_up_proj`` (interleaved: channel c is columns 2c and 2c + 1) and its bias, its
  rows of ``mlp.experts.down_proj``;
- hidden channels (the same everywhere): columns of ``model.embed_tokens``, ``lm_head``,
  q / k / v, gate / up, the router and the experts' ``gate_up_proj`` inputs; rows (and bias) of
  o_proj, down_proj and the experts' ``down_proj`` outputs; every norm's weight.

MXFP4 experts are blocked along their inputs (32 per scale), which both width cuts select: there the
student's experts are written dequantized (bf16, the dense layout ``save_pretrained`` writes; a
block and its scales may lie in different files, the first waits for the other) and config.json
loses ``quantization_config``; ``prune.json`` says so (``mxfp4_dequantized``).

config.json gets the student's ``num_hidden_layers``, ``layer_types``, ``num_local_experts``,
``intermediate_size`` (dense or experts' width), ``num_attention_heads``, ``hidden_size`` and
``head_dim`` (explicit where heads or hidden are cut: the heads keep their width); the tokenizer
and generation files are copied; ``prune.json`` records the kept layers, experts and heads, and
``prune_scores.npz`` the kept channels and every score.

The student is written into a new directory beside the one asked for (``.NAME.partial-*``) and
renamed into place once whole, so a killed prune never leaves half a student there. The directory
asked for is new or empty, and never the teacher's (``check_student_dir``: one line each, which
``megatron-kd prune`` runs before any work, with a probe that its parent can be written).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from megatron_kd.ops.quant import mxfp4_decode
from megatron_kd.prune.cuts import KeptParts, LayerCut, PruneError

PRUNE_ARRAYS = "prune_scores.npz"

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# files of a Hugging Face directory that are not weights and describe the same model after the cuts
_COPIED = ("tokenizer", "special_tokens", "chat_template", "generation_config", "vocab", "merges")
# FP4 E2M1 values by code (transformers' FP4_VALUES): codes 8-15 are the negatives of 0-7


def head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    """The rows (of q_proj; columns of o_proj) of ``heads``, head-major as Hugging Face lays them."""
    return (torch.tensor(heads).view(-1, 1) * head_dim + torch.arange(head_dim)).flatten()


def keep_along(t: torch.Tensor, dim: int, index) -> torch.Tensor:
    """The entries ``index`` of ``t`` along ``dim``, as a tensor of its own (what a cut writes)."""
    return t.index_select(dim, torch.as_tensor(index, device=t.device)).contiguous()


def _per_expert(t: torch.Tensor, dim: int, channels: list[list[int]], interleaved: bool = False) -> torch.Tensor:
    """Each expert's ``channels`` along ``dim`` of its slice t[e] (``interleaved``: channel c is
    gate / up entries 2c and 2c + 1, as GPT-OSS's ``gate_up_proj`` lays them)."""
    def index(ch):
        ch = torch.tensor(ch)
        return torch.stack([2 * ch, 2 * ch + 1], 1).flatten() if interleaved else ch
    return torch.stack([t[e].index_select(dim, index(ch)) for e, ch in enumerate(channels)]).contiguous()


# where a layer's tensor holds the hidden channels (name after ``model.layers.{i}.``: dim)
_HIDDEN_DIM = {"self_attn.q_proj.weight": 1, "self_attn.k_proj.weight": 1, "self_attn.v_proj.weight": 1,
               "self_attn.o_proj.weight": 0, "self_attn.o_proj.bias": 0, "mlp.gate_proj.weight": 1,
               "mlp.up_proj.weight": 1, "mlp.down_proj.weight": 0, "mlp.down_proj.bias": 0, "mlp.router.weight": 1,
               "mlp.experts.gate_up_proj": 1, "mlp.experts.down_proj": 2, "mlp.experts.down_proj_bias": 1,
               "input_layernorm.weight": 0, "post_attention_layernorm.weight": 0}
_OUTER_HIDDEN_DIM = {"model.embed_tokens.weight": 1, "lm_head.weight": 1, "model.norm.weight": 0}


def _cut(name: str, t: torch.Tensor, cut: LayerCut, head_dim: int | None = None) -> torch.Tensor:
    """The part of one layer's tensor (``name`` after ``model.layers.{i}.``) the student keeps."""
    if cut.heads is not None:
        if name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            t = keep_along(t, 0, head_rows(cut.heads, head_dim))
        elif name == "self_attn.o_proj.weight":
            t = keep_along(t, 1, head_rows(cut.heads, head_dim))
        elif name == "self_attn.sinks":
            t = keep_along(t, 0, cut.heads)
    if cut.experts is not None and name.startswith(("mlp.experts.", "mlp.router.")):
        t = keep_along(t, 0, cut.experts)
    if cut.ffn is not None:
        if name.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            t = keep_along(t, 0, cut.ffn)
        elif name == "mlp.down_proj.weight":
            t = keep_along(t, 1, cut.ffn)
        elif name.startswith("mlp.experts."):
            raise PruneError("an FFN width of the experts is --prune-moe-ffn-hidden-size (expert_ffn), not ffn")
    if cut.expert_ffn is not None:
        if name in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
            t = _per_expert(t, t.dim() - 2, cut.expert_ffn, interleaved=True)
        elif name == "mlp.experts.down_proj":
            t = _per_expert(t, 0, cut.expert_ffn)
        elif name.endswith(("_blocks", "_scales")):
            raise PruneError(f"{name}: MXFP4 experts are cut in width only dequantized (dense_experts)")
    if cut.hidden is not None:
        if name in _HIDDEN_DIM:
            t = keep_along(t, _HIDDEN_DIM[name], cut.hidden)
        elif name.endswith(("_blocks", "_scales")):
            raise PruneError(f"{name}: MXFP4 experts are cut in width only dequantized (dense_experts)")
    return t


def pruned_state(tensors: dict[str, torch.Tensor], kept: KeptParts, head_dim: int | None = None) -> dict:
    """The student's tensors from (part of) the teacher's, by Hugging Face name (MXFP4 experts
    already dense where a width is cut: ``dense_experts``); ``head_dim``: the attention's, needed
    when heads are cut."""
    out = {}
    for i, rest, t, cut in kept.entries(tensors, _LAYER):
        if i is None:
            out[rest] = keep_along(t, _OUTER_HIDDEN_DIM[rest], cut.hidden) if (
                cut.hidden is not None and rest in _OUTER_HIDDEN_DIM) else t
        else:
            out[f"model.layers.{i}.{rest}"] = _cut(rest, t, cut, head_dim)
    return out


def cuts_mxfp4_blocks(kept: KeptParts) -> bool:
    """Whether the student selects along the inputs of MXFP4-blocked expert weights (either width)."""
    return kept.expert_ffn is not None or kept.hidden is not None


def mxfp4_to_dense(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The release's MXFP4 [E, out, in/32, 16] codes and [E, out, in/32] E8M0 scales as the dense
    layout ``save_pretrained`` writes, [E, in, out] in ``dtype`` (exact in bf16: an FP4 E2M1 value
    has two significant bits, the scale is a power of two); decoded by ``ops.quant.mxfp4_decode``."""
    return mxfp4_decode(blocks, scales, dtype).transpose(-1, -2).contiguous()


def dense_experts(tensors: dict[str, torch.Tensor], waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each MXFP4 pair (``{prefix}_blocks``, ``{prefix}_scales``) as the dense
    ``{prefix}``; a pair's first half waits in ``waiting`` until the file that holds the other."""
    out = {}
    for name, t in tensors.items():
        if not name.endswith(("_blocks", "_scales")):
            out[name] = t
            continue
        waiting[name] = t
        prefix = name.rsplit("_", 1)[0]
        if prefix + "_blocks" in waiting and prefix + "_scales" in waiting:
            try:
                out[prefix] = mxfp4_to_dense(waiting.pop(prefix + "_blocks"), waiting.pop(prefix + "_scales"))
            except ValueError as e:  # a scale byte of 255 (E8M0's NaN), or blocks and scales that disagree
                raise PruneError(f"{prefix}: {e}") from None
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
    if kept.expert_ffn is not None:
        sizes = {len(c) for layer in kept.expert_ffn for c in layer}
        if len(sizes) != 1:
            raise PruneError(f"every expert keeps the same FFN width, got {sorted(sizes)}")
        text["intermediate_size"] = sizes.pop()
    if kept.hidden is not None:
        text["head_dim"] = head_dim_of(text)
        text["hidden_size"] = len(kept.hidden)
    if cuts_mxfp4_blocks(kept):
        config.pop("quantization_config", None)  # the experts are written dense
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


def _same_place(a: Path, b: Path) -> bool:
    """Whether two paths name one directory (by its resolved path, or the same inode: a link, a bind mount)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (absolute)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_student_dir(out_dir: str | Path, teacher_dir: str | Path, *, flag: str = "--out",
                      probe: bool = True) -> None:
    """One ``PruneError`` line unless ``out_dir`` can take a new student: not the teacher's directory
    (by any path), not a file, absent or empty; with ``probe``, a directory is made (and removed) in
    its parent (or the parent's nearest existing ancestor): where the student is written first."""
    out, teacher = Path(out_dir), Path(teacher_dir)
    if _same_place(out, teacher):
        raise PruneError(f"{flag} {out_dir} is the teacher's directory (--kd-teacher-hf {teacher_dir}): the student "
                         f"would overwrite its config.json and weights; give a new or empty directory")
    if out.exists() and not out.is_dir():
        raise PruneError(f"{flag} {out_dir}: a file, not a directory (the student is a new or empty directory)")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise PruneError(f"{flag} {out_dir}: not empty (holds {shown}); prune writes the student into an empty "
                             f"or absent directory: remove it or give another")
    if not probe:
        return
    parent = _existing_ancestor(Path(os.path.abspath(out)).parent)
    if not parent.is_dir():
        raise PruneError(f"{flag} {out_dir}: {parent} is a file, not a directory")
    trial = parent / f".megatron-kd-probe-{uuid.uuid4().hex[:12]}"
    try:
        trial.mkdir()
        trial.rmdir()
    except OSError as e:
        raise PruneError(f"{flag} {out_dir}: cannot write in {parent} ({e.strerror or e})") from None


def write_pruned_hf(teacher_dir: str | Path, out_dir: str | Path, kept: KeptParts) -> Path:
    """Write the student (``kept`` parts of ``teacher_dir``'s model) into ``out_dir`` (new or empty):
    first into a directory beside it, renamed into place once whole."""
    teacher_dir, out_dir = Path(teacher_dir), Path(out_dir)
    check_student_dir(out_dir, teacher_dir, probe=False)
    files = sorted(teacher_dir.glob("*.safetensors"))
    if not files:
        raise PruneError(f"{teacher_dir}: no *.safetensors files (the teacher's Hugging Face weights)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        _write_student(teacher_dir, files, partial, kept)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        if out_dir.is_dir():
            out_dir.rmdir()  # empty, as checked: the student takes its place
        os.rename(partial, out_dir)
    except OSError as e:
        raise PruneError(f"{out_dir}: cannot put the student there ({e.strerror or e}: written there meanwhile?); "
                         f"it is whole in {partial}") from None
    return out_dir


def _write_student(teacher_dir: Path, files: list[Path], out_dir: Path, kept: KeptParts) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    teacher_config = json.loads((teacher_dir / "config.json").read_text())
    head_dim = head_dim_of(teacher_config.get("text_config", teacher_config))
    weight_map, total, waiting, dequantized = {}, 0, {}, False
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            metadata = st.metadata() or {"format": "pt"}
            tensors = {k: st.get_tensor(k) for k in st.keys()}
        if cuts_mxfp4_blocks(kept):
            dense = dense_experts(tensors, waiting)
            dequantized |= dense.keys() != tensors.keys()
            tensors = dense
        part = pruned_state(tensors, kept, head_dim)
        if part:
            save_file(part, str(out_dir / f.name), metadata=metadata)
            weight_map.update({k: f.name for k in part})
            total += sum(t.numel() * t.element_size() for t in part.values())
    if waiting:
        raise PruneError(f"{teacher_dir}: MXFP4 {sorted(waiting)[0]} has no partner (_blocks with _scales)")
    if (teacher_dir / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = pruned_config(teacher_config, kept)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for f in teacher_dir.iterdir():
        if f.is_file() and f.name.startswith(_COPIED):
            shutil.copy(f, out_dir / f.name)
    record = {"teacher": str(teacher_dir), **kept.record(), "arrays": PRUNE_ARRAYS}
    if dequantized:  # the widths cut MXFP4's blocks of 32 inputs: these experts are no longer the release's bytes
        record["mxfp4_dequantized"] = "experts written dense in bf16 (MXFP4 blocks run along the cut inputs)"
    (out_dir / "prune.json").write_text(json.dumps(record, indent=1))
    # numpy's archive, not *.safetensors: nothing that globs a directory's weight files picks it up
    np.savez_compressed(out_dir / PRUNE_ARRAYS, **{k: t.numpy() for k, t in kept.arrays().items()})
