"""benchmarks/bench_teacher_topk.py on CPU (its timings need a GPU): the chat loss mask of
--answer-fraction, and the teacher pass of --pass-samples with two lengths, the mask and the
profiled pass on a tiny Megatron teacher (gloo)."""

import contextlib
import re
import types

import torch

from benchmarks.common.teacher_pass import answer_mask, time_teacher_pass
from tests.fixtures.dist_utils import megatron_cpu_patches, spawn


def test_answer_mask_alternates_prompt_and_answer_spans_at_the_fraction():
    gen = torch.Generator().manual_seed(0)
    masks = torch.stack([answer_mask(8192, 0.3, 400, gen) for _ in range(16)])
    assert masks.dtype == torch.int64 and set(masks.unique().tolist()) == {0, 1}
    assert abs(masks.float().mean().item() - 0.3) < 0.05
    assert (masks[:, 0] == 0).all()  # a conversation starts with its prompt
    spans = (masks[:, 1:] != masks[:, :-1]).sum(1).float().mean().item()  # span changes per sample
    assert 8192 / 400 * 2 * 0.6 < spans < 8192 / 400 * 2 * 1.6  # about two spans per 400 tokens


def _pass(rank, world, log):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    from megatron_kd.models.gpt import build_gpt_model

    with megatron_cpu_patches():
        parallel_state.initialize_model_parallel(1)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                                ffn_hidden_size=64, normalization="RMSNorm", attention_dropout=0.0, hidden_dropout=0.0,
                                add_bias_linear=False, persist_layer_norm=False)
        model = build_gpt_model(cfg, vocab_size=1000, max_sequence_length=64, use_te=False).eval()
        args = types.SimpleNamespace(seq_length=64, topk=8, codecs="topk-v2", workers="1", switch_intervals=None,
                                     no_inline=True, pass_samples=[2, 4], answer_fraction=0.5, span_tokens=16,
                                     profile_pass=True)
        with open(log, "w") as out, contextlib.redirect_stdout(out):
            time_teacher_pass(model, args, 1000, logits_forward_ms=5.0)
        parallel_state.destroy_model_parallel()


def test_teacher_pass_reports_each_length_the_marginal_cost_and_the_answer_only_pass(tmp_path):
    spawn(_pass, str(tmp_path / "log"), world_size=1)
    out = (tmp_path / "log").read_text()
    full = [float(b) for b in re.findall(r"1 workers +\d samples .* ([\d.]+) bytes/token", out)]
    answers = [float(b) for b in re.findall(r"answer tokens only +\d samples .* ([\d.]+) bytes/token", out)]
    assert len(full) == len(answers) == 2 and all(a < f for a, f in zip(answers, full))
    assert len(re.findall(r"marginal 2->4: .* per sample", out)) == 2
    assert re.search(r"chat loss mask: 0\.\d+ of the tokens kept", out)
    assert re.search(r"profiled pass, 2 samples: wall [\d.]+ s, GPU busy 0\.00 s", out)  # no GPU here
    assert "kernels beyond the logits forwards, ms per sample" in out
