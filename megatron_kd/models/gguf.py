"""llama.cpp GGUF files as Hugging Face directories (``megatron-kd gguf-to-hf FILE --out DIR``).

Many small pretrained models ship only as GGUF files, and every megatron-kd command takes Hugging
Face directories (``--kd-teacher-hf``, ``--kd-student-hf``, ``hf-flags``). transformers reads a
GGUF file's config, tokenizer (chat template included) and weights, dequantized, but will not save
a model it loaded so; ``hf_from_gguf`` moves the weights into the plain model class and saves
that: float32 safetensors, the tokenizer, the generation config, and ``gguf_source.json`` (the
file's name, size, sha256 and tensor types). The weights are the file's: a Q4_1 file gives its
4-bit values dequantized to float32, not the release it was quantized from.

transformers' GGUF reader leaves out two things that change what the model computes; we add them:

- Llama 3.1+'s RoPE scaling, which llama.cpp stores as per-channel factors (a ``rope_freqs.weight``
  tensor), not as metadata. Factors that follow Llama 3's formula at megatron-core's fixed values
  (low / high frequency factors 1 and 4, original context 8192) become ``rope_type: llama3``;
  other factors, and any ``rope.scaling.type`` (linear, YaRN), are refused.
- ``attention.key_length``: a head size other than hidden / heads (for Qwen3 it reads the class
  default instead).

GGUF stores ``rms_norm_eps`` and the RoPE base as float32; the config gets the shortest decimal
that is the same float32 (1e-05, not 9.999999747378752e-06), as the model's own config.json has it
and as ``hf-flags`` passes it on (``--norm-epsilon``).

The file is checked before transformers reads it: a whole GGUF file, an architecture megatron_kd
trains (Llama, Qwen3: ``models/llama.py``), and exactly that decoder's tensors (transformers drops
a tensor it has no place for, a bias say, without a word).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import uuid
from collections import Counter
from pathlib import Path

from megatron_kd.errors import UserError
from megatron_kd.models.llama import ARCHITECTURES, LLAMA3_ROPE_FIXED

# llama.cpp's tensor names of one decoder layer ("blk.N." + name + ".weight"); Qwen3 adds q/k norms
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down")
_QK_NORMS = ("attn_q_norm", "attn_k_norm")
# tokenizer.ggml.model values transformers builds for these architectures: byte-level BPE, SentencePiece
_TOKENIZERS = ("gpt2", "llama")
SOURCE_FILE = "gguf_source.json"


def _check_packages() -> None:
    for name in ("gguf", "accelerate"):  # transformers reads GGUF with gguf, loads it through accelerate
        try:
            importlib.import_module(name)
        except ImportError:
            raise UserError(f"gguf-to-hf needs the {name} package: pip install 'megatron_kd[gguf]'") from None


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out}: not empty (gguf-to-hf writes a new directory; give a new or empty one)")


def _float32_decimal(value: float) -> float:
    """The shortest decimal that is the same float32: 1e-05 for 9.999999747378752e-06."""
    import numpy as np

    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _llama3_rope_factors(theta: float, head_dim: int, factor: float):
    """The ``rope_freqs`` llama.cpp's convert_hf_to_gguf.py writes for Llama 3's scaling, in its
    float32 arithmetic (megatron-core's fixed low / high frequency factors and original context)."""
    import math

    import torch

    low, high, context = (LLAMA3_ROPE_FIXED[k] for k in
                          ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def _read_header(path: Path) -> dict:
    """What the conversion needs from a GGUF file, each fault in it one ``UserError`` line: the
    architecture, name, tensor counts per type, and the config fields transformers misses."""
    import gguf
    import numpy as np

    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file (expected a GGUF file)")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path}: not a GGUF file (a GGUF file starts with b'GGUF'; "
                        + (f"this one with {magic!r})" if magic else "this one is empty)"))
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 (the reader fails with whatever numpy raises on a short or damaged buffer)
        raise UserError(f"{path}: truncated or damaged GGUF file ({size} bytes; the GGUF reader stops at "
                        f"{type(e).__name__}: {' '.join(str(e).split())}); expected a complete GGUF file") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise UserError(f"{path}: truncated GGUF file: its tensors end at byte {end}, the file has {size} bytes")

    def field(key: str, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    arch = field("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{path}: general.architecture is {arch!r}; megatron-kd converts "
                        f"{' and '.join(ARCHITECTURES)} GGUF files (the dense decoders it trains)")
    parts = field("split.count", 1)
    if parts != 1:  # the first part holds the metadata and only its own share of the tensors
        raise UserError(f"{path}: one part of a GGUF file split in {parts}; merge the parts first "
                        f"(llama.cpp's llama-gguf-split --merge)")
    layers = field(f"{arch}.block_count")
    if not isinstance(layers, int) or layers < 1:
        raise UserError(f"{path}: {arch}.block_count is {layers!r}; expected the number of layers")
    tokenizer = field("tokenizer.ggml.model")
    if tokenizer not in _TOKENIZERS or "tokenizer.ggml.tokens" not in reader.fields:
        raise UserError(f"{path}: tokenizer.ggml.model is {tokenizer!r}; expected a tokenizer in the file, "
                        f"{' or '.join(map(repr, _TOKENIZERS))} with its tokenizer.ggml.tokens")

    per_layer = _LAYER_TENSORS + (_QK_NORMS if arch == "qwen3" else ())
    required = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{name}.weight" for i in range(layers)
                                                              for name in per_layer}
    # no output.weight: the output layer is the embedding (tied); rope_freqs: Llama 3's RoPE scaling
    optional = {"output.weight"} | ({"rope_freqs.weight"} if arch == "llama" else set())
    tensors = {t.name: t for t in reader.tensors}
    missing = sorted(required - tensors.keys())
    if missing:
        raise UserError(f"{path}: no tensor {missing[0]} ({len(missing)} of the {layers}-layer {arch} decoder's "
                        f"tensors missing)")
    extra = sorted(tensors.keys() - required - optional)
    if extra:
        raise UserError(f"{path}: tensor {extra[0]} ({len(extra)} in all) is not part of the {layers}-layer {arch} "
                        f"decoder megatron-kd trains (no biases, no tensors beyond its layers)")
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UserError(f"{path}: {arch}.rope.scaling.type is {scaling!r}; megatron-kd builds plain RoPE and "
                        f"Llama 3's scaling")

    for key in ("embedding_length", "attention.head_count"):
        value = field(f"{arch}.{key}")
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{path}: {arch}.{key} is {value!r}; expected a positive integer")
    key_length = field(f"{arch}.attention.key_length")
    value_length = field(f"{arch}.attention.value_length", key_length)
    if key_length != value_length:
        raise UserError(f"{path}: {arch}.attention.key_length {key_length} and value_length {value_length} differ; "
                        f"Llama and Qwen3 have one head size")
    # llama.cpp's head size where the file gives none: the rotated channels (Llama), hidden / heads
    default = field(f"{arch}.embedding_length") // field(f"{arch}.attention.head_count")
    head_dim = key_length or field(f"{arch}.rope.dimension_count", default)
    rotated = field(f"{arch}.rope.dimension_count", head_dim)
    if rotated != head_dim:
        raise UserError(f"{path}: {arch}.rope.dimension_count is {rotated}, the head size {head_dim}; megatron-kd "
                        f"rotates every channel of a head")
    float32 = {key for key, f in reader.fields.items() if f.types == [gguf.GGUFValueType.FLOAT32]}
    theta = field(f"{arch}.rope.freq_base", 10000.0)
    rope = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
        if not (factors == 1).all():
            factor = float(factors.max())
            expected = _llama3_rope_factors(theta, head_dim, factor)
            if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-6, atol=0):
                raise UserError(f"{path}: rope_freqs.weight holds RoPE factors other than Llama 3's scaling "
                                f"(factor {factor:g}, low / high frequency factors 1 and 4, original context 8192), "
                                f"the one megatron-core computes")
            rope = {"rope_type": "llama3", "rope_theta": theta, "factor": _float32_decimal(factor),
                    **LLAMA3_ROPE_FIXED}
    return {
        "architecture": arch, "name": field("general.name"), "bytes": size,
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors).most_common()),
        "head_dim": head_dim, "rope": rope,
        "float32_eps": f"{arch}.attention.layer_norm_rms_epsilon" in float32,
        "float32_theta": f"{arch}.rope.freq_base" in float32,
    }


def _fix_config(config, header: dict) -> None:
    """What transformers' GGUF config misses or spells as float32 (the module docstring)."""
    config.head_dim = header["head_dim"]
    rope = dict(header["rope"] or config.rope_parameters)
    if header["float32_theta"]:
        rope["rope_theta"] = _float32_decimal(rope["rope_theta"])
    config.rope_parameters = rope
    if header["float32_eps"]:
        config.rms_norm_eps = _float32_decimal(config.rms_norm_eps)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hf_from_gguf(gguf_path: str | Path, out_dir: str | Path) -> dict:
    """Write the Llama / Qwen3 model of a GGUF file as a new Hugging Face directory ``out_dir``;
    returns a summary (architecture, layers, hidden size, vocabulary, tensor counts per type)."""
    _check_packages()
    path, out = Path(gguf_path), Path(out_dir)
    _check_out(out)
    header = _read_header(path)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:  # transformers with GgufConfig keeps GGUF blocks packed wherever it finds a matmul kernel, unless told
        from transformers import GgufConfig

        dequantize = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # before it, transformers always dequantized
        dequantize = {}
    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type != header["architecture"]:  # transformers reads a llama file named "mistral" as Mistral
        raise UserError(f"{path}: transformers reads it as a {config.model_type!r} model, not "
                        f"{header['architecture']!r} (general.name {header['name']!r})")
    _fix_config(config, header)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32,
                                                        output_loading_info=True, **dequantize)
    if info["missing_keys"] or info["mismatched_keys"]:
        keys = sorted(info["missing_keys"]) or sorted(map(str, info["mismatched_keys"]))
        raise UserError(f"{path}: transformers found no matching tensor for {keys[0]} ({len(keys)} in all)")
    state = loaded.state_dict()
    packed = [key for key, value in state.items() if value.dtype != torch.float32]
    if packed:  # a transformers change: the plain model below cannot take GGUF blocks
        raise RuntimeError(f"{path}: transformers loaded {packed[0]} as {state[packed[0]].dtype}, not dequantized")

    # save_pretrained refuses a model loaded as GGUF-quantized; the plain class holds the same tensors
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.__dict__.pop("_model_name_or_path", None)  # general.name, kept in gguf_source.json
    model = type(loaded)(config).float()
    model.load_state_dict(state, strict=True)
    if loaded.generation_config is not None:
        model.generation_config = loaded.generation_config
    del loaded, state

    source = {"file": path.name, "bytes": header["bytes"], "sha256": _sha256(path),
              "general.architecture": header["architecture"],
              **({"general.name": header["name"]} if header["name"] is not None else {}),
              "tensor_types": header["tensor_types"],
              "note": "The weights are this GGUF file's values dequantized to float32 (a quantized file gives the "
                      "quantized model, e.g. 4-bit Q4_1, not the release it was made from)."}
    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside --out and renamed into place: a failed conversion leaves no half directory behind
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()  # empty: _check_out
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"architecture": header["architecture"], "name": header["name"], "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "rope": config.rope_parameters,
            "tensor_types": header["tensor_types"], "out": str(out)}
