"""The chat benchmark end to end at a toy size (``benchmarks/bench_chat.py``; its numbers are for the
CPU preset): conversations from the standard library's docstrings -> ``data chat`` (harmony, a BPE
with harmony's special tokens) -> a teacher on every token -> a cache under the chat mask and one
over every token -> an answer-only and a full-sequence student from the same start.

The masked cache holds entries at the answer tokens alone, so its bytes are about the answer
fraction of the full cache's; both students learn the answers (held-out answer CE below the
untrained start's); results.json holds every number the report shows.
"""

import json

from benchmarks.common import chat
from tests.fixtures.tiny_fidelity import TINY

# the toy preset over whole modules (TINY skips files over 1.5 kB); no held-out pass during the teacher's steps
CHAT_TINY = {**TINY, "corpus_bytes": 40_000, "bpe_bytes": 40_000, "max_file_bytes": 250_000, "heldout_percent": 20,
             "teacher_eval_interval": TINY["teacher_steps"], "student_steps": 8}
CACHE_FIELDS = {"mode", "k", "samples", "tokens", "tokens_with_entries", "bytes", "bytes_per_token",
                "bytes_per_answer_token", "mean_teacher_mass", "seconds", "entry_bytes"}
METRICS = {"heldout_ce", "heldout_kl", "heldout_sequence_ce", "heldout_sequence_kl"}


def test_conversations_hold_out_whole_modules_and_reason_in_the_last_turn():
    train, heldout, counts = chat.chat_corpus(20_000, 30, 250_000, seed=1)
    answers = {split: {m["content"] for c in convs for m in c["messages"] if m["role"] == "assistant"}
               for split, convs in (("train", train), ("heldout", heldout))}
    assert answers["train"] and answers["heldout"] and not answers["train"] & answers["heldout"]
    for c in train + heldout:
        roles = [m["role"] for m in c["messages"]]
        turns = (len(roles) - 1) // 2
        assert roles == ["system"] + ["user", "assistant"] * turns and 1 <= turns <= chat.MAX_TURNS, roles
        assert all("reasoning" not in m for m in c["messages"][:-1])  # harmony keeps the last turn's alone
    assert 0.2 < counts["train_analysis"] / counts["train_conversations"] < 0.5, counts
    assert counts["train_bytes"] >= 20_000 and counts["heldout_modules"] >= 1
    # the same modules, the same draws: the corpus repeats run to run
    assert chat.chat_corpus(20_000, 30, 250_000, seed=1)[0] == train


def test_answer_only_and_full_sequence_students(tmp_path):
    results = chat.run("cpu", tmp_path, "top8-renorm", log=lambda msg: None, **CHAT_TINY)
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(results))
    assert {"corpus", "teacher", "start", "caches", "variants", "answer_fraction", "masked_bytes_ratio",
            "masked_entry_bytes_ratio", "stages",
            "seconds", "variant"} <= set(results)
    answers, full = results["caches"]["top8-answers"], results["caches"]["top8-full"]
    assert CACHE_FIELDS <= set(answers) and CACHE_FIELDS <= set(full)
    assert answers["loss_mask"] == results["corpus"]["mask"] and "loss_mask" not in full
    # entries at the answer tokens only; bytes in proportion
    assert full["tokens_with_entries"] == full["tokens"] == answers["tokens"]
    fraction = results["answer_fraction"]
    assert 0.2 < fraction < 0.8 and answers["tokens_with_entries"] == round(fraction * answers["tokens"])
    ratio = results["masked_entry_bytes_ratio"]
    assert 0.8 < ratio / fraction < 1.25 and ratio < results["masked_bytes_ratio"], (ratio, fraction)
    assert answers["bytes_per_answer_token"] < full["bytes_per_answer_token"]
    corpus = results["corpus"]  # held out: every window of the split once
    assert corpus["heldout_samples"] == (corpus["heldout_tokens"] - 1) // results["preset"]["seq_length"]
    start = results["start"]
    assert METRICS <= set(start) and {"heldout_ce", "heldout_sequence_ce"} <= set(results["teacher"])
    students = results["variants"]
    assert set(students) == {"answer-only", "full-sequence"}
    for name, r in students.items():
        assert METRICS | {"seconds_per_step", "bytes_per_token", "cache"} <= set(r), name
        assert r["heldout_ce"] < start["heldout_ce"], (name, r["heldout_ce"], start["heldout_ce"])
    assert students["answer-only"]["cache"] == "top8-answers" and students["answer-only"]["answers_only"]
    md = (tmp_path / "results.md").read_text()
    assert "| answer-only | answer tokens |" in md and "| full-sequence |" in md and "| untrained start |" in md, md
    assert not (tmp_path / "work").exists()
