"""GPT-OSS checkpoints in the release's MXFP4 layout (experts as ``*_blocks`` / ``*_scales``, as
openai/gpt-oss-20b and -120b are published) import as students and as teachers.

The tiny random GPT-OSS of tiny_gpt_oss.py, its experts MXFP4-representable, saved in both layouts:
1. the MXFP4 directory has the release's format (names, shapes, dtypes, quantization_config);
   transformers' own MXFP4 decoder gives back the dense tensors exactly, and transformers loads
   both directories to the same logits
2. ``model_provider`` with ``--kd-student-hf MXFP4_DIR`` (``megatron-kd train``'s path; ModelOpt's
   MXFP4 rule) holds exactly the weights of the dense directory's import and gives transformers'
   logits (≤1e-4, fp32), at EP=2 (each rank reads its experts' blocks)
3. ``init_from_hf`` (what ``cache build`` runs for a GPT-OSS teacher) sets the same weights from the
   MXFP4 directory as from the dense one
"""

import json
import os
from pathlib import Path

import torch

from tests.fixtures.dist_utils import megatron_cpu_patches, spawn
from tests.fixtures.kd_inputs import rel_err
from tests.fixtures.tiny_gpt_oss import (
    MXFP4_BLOCK, RELEASE_QUANTIZATION_CONFIG, SEQ, TINY, TOKENIZER_TOKENS, VOCAB_ROWS, make_tiny_gpt_oss, tiny_flags,
)

TOL = 1e-4


def _tensors(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    # the documented way to load the release for training: experts dequantized on load
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_mxfp4_directory_is_the_release_format(tmp_path, seed):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense = make_tiny_gpt_oss(tmp_path / "dense", seed=seed)
    mxfp4 = make_tiny_gpt_oss(tmp_path / "mxfp4", seed=seed, layout="mxfp4")
    config = json.loads((mxfp4 / "config.json").read_text())
    assert config["quantization_config"] == RELEASE_QUANTIZATION_CONFIG
    d, q = _tensors(dense), _tensors(mxfp4)
    e, h, i = TINY.experts, TINY.hidden, TINY.intermediate
    release_shapes = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}  # [rows = outputs, cols = inputs]
    for layer in range(TINY.layers):
        for proj, (rows, cols) in release_shapes.items():
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = q[key + "_blocks"], q[key + "_scales"]
            assert key not in q and key + "_bias" in q
            assert blocks.dtype == scales.dtype == torch.uint8
            assert blocks.shape == (e, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2)
            assert scales.shape == (e, rows, cols // MXFP4_BLOCK)
            # transformers' decoder (the release's reader) returns save_pretrained's [E, in, out] layout
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), d[key]), key
            assert len(scales.unique()) > 1  # the blocks' scales differ: a wrong scale would show
    assert d.keys() - {k for k in d if k.endswith(("gate_up_proj", "down_proj"))} == \
        q.keys() - {k for k in q if k.endswith(("_blocks", "_scales"))}
    tokens = torch.randint(0, TOKENIZER_TOKENS, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(_hf_logits(mxfp4, tokens), _hf_logits(dense, tokens))


def _weights(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :VOCAB_ROWS]


def _worker(rank, world, tmp, seed):
    from megatron.core import parallel_state

    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.run import model_provider
    from megatron_kd.models.gpt import gpt_model_from_args
    from megatron_kd.models.hf import init_from_hf

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dense, mxfp4 = Path(tmp) / "dense", Path(tmp) / "mxfp4"
    with megatron_cpu_patches():
        if rank == 0:
            make_tiny_gpt_oss(dense, seed=seed)
            make_tiny_gpt_oss(mxfp4, seed=seed, layout="mxfp4")
        torch.distributed.barrier()
        args = parse_megatron_args(tiny_flags(mxfp4, "--expert-model-parallel-size", str(world)))
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
        student = model_provider()  # --kd-student-hf MXFP4_DIR
        from_dense = gpt_model_from_args(args)
        init_from_hf(from_dense, dense, args)
        teacher = gpt_model_from_args(args)  # the teacher pass's import of a GPT-OSS directory
        init_from_hf(teacher, mxfp4, args)
        want = _weights(from_dense)
        assert any(".local_experts." in k for k in want)
        for name, model in (("student", student), ("teacher", teacher)):
            got = _weights(model)
            assert got.keys() == want.keys()
            for key in want:
                assert torch.equal(got[key], want[key]), f"{name}: {key}"
        tokens = torch.randint(0, TOKENIZER_TOKENS, (2, SEQ), generator=torch.Generator().manual_seed(seed))
        err = rel_err(_logits(student, tokens), _hf_logits(mxfp4, tokens))
        assert err < TOL, f"student from MXFP4 vs transformers: relative error {err:.2e}"


def test_mxfp4_import_equals_dense_and_transformers(tmp_path, seed):
    # at EP=2 each rank reads its own experts' blocks and scales; EP=1 is the same rule unsliced
    spawn(_worker, str(tmp_path), seed, world_size=2)
