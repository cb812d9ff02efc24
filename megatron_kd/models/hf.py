"""Hugging Face weights into and out of megatron-core GPT models, through nvidia-modelopt.

ModelOpt's ``GPTModelImporter`` / ``GPTModelExporter`` hold the name and layout rules for every
architecture they know (GPT-OSS: q/k/v merged per group, sinks -> ``softmax_offset``, packed
experts de-interleaved); each rank reads or writes its own tensor- and expert-parallel shard.
We add only what they lack for our students:

- experts in the dense layout ``transformers.save_pretrained`` writes (``gate_up_proj`` [E, in, 2I]
  with gate/linear interleaved on the last dim, ``down_proj`` [E, I, out], ``*_bias``) beside the
  MXFP4 layout of the published release, which ModelOpt's own rule reads: ``*_blocks`` uint8
  [E, out, in/32, 16] and ``*_scales`` uint8 [E, out, in/32] (one E8M0 scale per 32 inputs), already
  Megatron's [out, in] once dequantized, gate/linear rows interleaved as in the dense layout;
- vocabulary rows Megatron pads for tensor parallelism (``--make-vocab-size-divisible-by`` × TP):
  zero rows on import (no token ever has a padded id), dropped again on export.

Export writes this rank's shards, so run it with tensor-parallel size 1 (expert parallelism is
gathered by ModelOpt); ``megatron-kd export-hf`` does.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from megatron_kd.errors import ModelConfigError


def _safetensors_keys(path: Path) -> set[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _vocab_prefixes(mapping: dict) -> tuple[str, ...]:
    """HF name prefixes of the embedding and output layer (the tensors with vocabulary rows), from
    one architecture's ModelOpt mapping."""
    return tuple(mapping[key].target_name_or_prefix for key in ("word_embeddings", "output_layer") if key in mapping)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """HF's gate/linear interleaving [g0, l0, g1, l1, ...] -> Megatron's [g0, g1, ..., l0, l1, ...]."""
    t = t.movedim(dim, 0)
    return torch.cat([t[0::2], t[1::2]]).movedim(0, dim)


def import_hf_weights(model, hf_dir: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Load a Hugging Face checkpoint directory into this rank's shard of a megatron-core GPTModel.

    ``model`` is the bare GPTModel (not DDP- or Float16-wrapped); process groups (TP, EP) are
    megatron-core's ``parallel_state``. Tensors are cast to ``dtype`` (default: the model's).
    """
    from modelopt.torch.export.plugins.mcore_common import all_mcore_hf_import_mapping
    from modelopt.torch.export.plugins.megatron_importer import GPTModelImporter

    from megatron.core import parallel_state

    class Importer(GPTModelImporter):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.hf_keys = _safetensors_keys(Path(self.pretrained_model_path))
            self.vocab_keys = {p + "weight" for p in _vocab_prefixes(all_mcore_hf_import_mapping[self.arch])}

        def _get_safetensor(self, key, parallel_config=None):
            if key not in self.vocab_keys:
                return super()._get_safetensor(key, parallel_config)
            full = super()._get_safetensor(key, None)
            rows = model.vocab_size
            if full.shape[0] > rows:
                raise ValueError(f"{hf_dir}: {key} has {full.shape[0]} vocabulary rows, the model {rows} "
                                 f"(--vocab-size / tokenizer do not match the checkpoint)")
            padded = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
            if parallel_config is None:
                return padded
            tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
            return padded.chunk(tp)[rank].contiguous()

        def _unpack_name_remapping_gpt_oss(self, module, prefix, layer_type, parallel_config=None, is_mtp=False):
            if prefix + "_blocks" in self.hf_keys:  # MXFP4 release layout: ModelOpt's own rule
                return super()._unpack_name_remapping_gpt_oss(module, prefix, layer_type, parallel_config, is_mtp)
            # dense layout: [E_local, in, out] -> Megatron's [out, in] per expert; this rank's experts
            weight = self._get_safetensor(prefix, parallel_config).transpose(1, 2)
            bias = self._get_safetensor(prefix + "_bias", parallel_config)
            if layer_type == "linear_fc1":
                weight, bias = _deinterleave(weight, 1), _deinterleave(bias, 1)
            experts = list(module.children())
            if len(experts) != weight.shape[0]:
                raise ValueError(f"{hf_dir}: {prefix} holds {weight.shape[0]} experts for this rank, the model "
                                 f"{len(experts)}")
            with torch.no_grad():
                for expert, w, b in zip(experts, weight, bias):
                    linear = getattr(expert, layer_type)
                    linear.weight.copy_(w)
                    linear.bias.copy_(b)

    dtype = dtype or model.config.params_dtype
    Importer(model, str(hf_dir), dtype=dtype)._import_state_dict()


def hf_vocab_rows(hf_dir: str | Path) -> int:
    """Rows of the embedding in a Hugging Face directory (``config.json``'s vocab_size)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def hf_config_from_args(args, *, vocab_size: int):
    """The ``transformers`` config computing what the model built from Megatron-LM flags ``args``
    computes: GPT-OSS (``gpt_oss.py``), Llama or Qwen3 (``llama.py``). ``vocab_size`` is the
    tokenizer's (unpadded) vocabulary."""
    from megatron_kd.models.gpt_oss import gpt_oss_hf_config, is_gpt_oss
    from megatron_kd.models.llama import dense_hf_config, is_dense_decoder

    if is_gpt_oss(args):
        return gpt_oss_hf_config(args, vocab_size=vocab_size)
    if is_dense_decoder(args):
        return dense_hf_config(args, vocab_size=vocab_size)
    raise ModelConfigError("the model flags are neither GPT-OSS (examples/gpt_oss) nor a Llama / Qwen3 decoder "
                           "(examples/llama): no Hugging Face architecture computes them")


def check_hf_dir_config(hf_dir: str | Path, args) -> None:
    """Refuse a Hugging Face directory whose config.json describes another model than the flags."""
    import transformers

    from megatron_kd.models.gpt_oss import check_hf_config
    from megatron_kd.models.llama import ARCHITECTURES, check_dense_hf_config

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt_oss":
        check_hf_config(hf_config, args, source=str(hf_dir))
    elif kind in ARCHITECTURES:
        check_dense_hf_config(hf_config, args, source=str(hf_dir))
    else:
        raise ModelConfigError(f"{hf_dir}/config.json: model_type {kind!r}; megatron_kd imports gpt_oss, "
                               f"{', '.join(ARCHITECTURES)}")


def init_from_hf(model, hf_dir: str | Path, args) -> None:
    """Initialize the model Megatron-LM flags ``args`` built from a Hugging Face directory, after
    checking that the directory's architecture is the one the flags describe."""
    check_hf_dir_config(hf_dir, args)
    import_hf_weights(model, hf_dir)


def export_hf_weights(model, out_dir: str | Path, hf_config, *, dtype: torch.dtype = torch.bfloat16,
                      tokenizer_dir: str | Path | None = None) -> None:
    """Write a Hugging Face checkpoint directory (safetensors + ``hf_config`` + tokenizer files).

    Collective over all ranks (ModelOpt gathers expert-parallel shards); tensor-parallel size 1.
    ``hf_config`` is the transformers config the model computes (``hf_config_from_args``);
    its ``vocab_size`` is the unpadded vocabulary.
    """
    from modelopt.torch.export.plugins.mcore_common import all_mcore_hf_export_mapping
    from modelopt.torch.export.unified_export_megatron import GPTModelExporter

    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise ValueError("export to Hugging Face runs with --tensor-model-parallel-size 1 (checkpoints reshard on load)")
    vocab = hf_config.vocab_size

    class Exporter(GPTModelExporter):
        def _name_remapping(self, module, prefix, *args, **kwargs):
            super()._name_remapping(module, prefix, *args, **kwargs)
            if prefix in _vocab_prefixes(all_mcore_hf_export_mapping[self.arch]):
                self._state_dict[prefix + "weight"] = self._state_dict[prefix + "weight"][:vocab].contiguous()

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as template:
        # ModelOpt reads the config from, and copies every non-weight file of, a "pretrained" directory
        hf_config.save_pretrained(template)
        if tokenizer_dir is not None:
            for f in Path(tokenizer_dir).iterdir():
                if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens", "chat_template"))
                                    or f.suffix in (".tiktoken", ".model")):
                    shutil.copy(f, template)
        out_dir.mkdir(parents=True, exist_ok=True)
        Exporter(model, template, dtype=dtype).save_pretrained(str(out_dir), template)
