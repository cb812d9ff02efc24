"""The distillation-fidelity benchmark at CPU size, end to end (``python -m benchmarks.bench_fidelity --size cpu``:
``benchmarks.common.fidelity.run``).

A byte-level BPE trained on real text (the installed Python's and packages' files), a megatron-core
teacher, its top-32 cache, and one student architecture trained three ways for the same steps from
the same start: cross-entropy only, online full-vocabulary KD (teacher in memory) and offline fused
top-32 KD (ghost tail). The claim checked is the product's: on the held-out split, which neither
the tokenizer nor any model trained on, every distilled student has lower cross-entropy than the
CE-only one. Seeds are fixed, so the numbers repeat run to run. The run is stopped after its
second student and finished with ``resume=True``, which must keep the teacher, the cache and the
finished students and train only the last one.
"""

import math

import pytest

from benchmarks.common import fidelity
from tests.fixtures.tiny_fidelity import TINY

KD_VARIANTS = ("online", "top32-ghost")


class Stop(Exception):
    pass


def test_distilled_students_beat_cross_entropy_on_held_out_text(tmp_path):
    def stop_after_online(msg):
        if "online: held-out" in msg:
            raise Stop

    variants = ["ce", *KD_VARIANTS]
    try:
        fidelity.run("cpu", tmp_path, variants, log=stop_after_online)
        raise AssertionError("the run was to be stopped after the online student")
    except Stop:
        pass
    logs = []
    results = fidelity.run("cpu", tmp_path, variants, log=logs.append, resume=True)
    log = "\n".join(logs)
    assert "resuming" in log and "teacher: loaded" in log, log
    assert "ce: held-out" not in log and "online: held-out" not in log and "top32-ghost: held-out" in log, log
    assert "cache top32" not in log, log  # reused, not rebuilt
    heldout = {name: r["heldout_ce"] for name, r in results["variants"].items()}
    print(f"teacher {results['teacher']['heldout_ce']:.4f}, "
          + ", ".join(f"{name} {ce:.4f}" for name, ce in heldout.items()), "(held-out nats/token)")
    for name in KD_VARIANTS:
        assert heldout[name] < heldout["ce"], heldout


def test_document_windows_score_every_prediction_once_from_its_own_document():
    docs = [list(range(10, 10 + n)) for n in (2, 9, 10, 11, 30)]  # predictions: n - 1 each
    rows = fidelity.document_windows(docs, length=8, stride=3, pad=0)
    scored = [(int(t), int(l)) for r in rows for t, l, m in zip(r["tokens"], r["labels"], r["loss_mask"]) if m]
    # each (input, label) pair of each document exactly once: ids are consecutive within a document
    expected = [(doc[i], doc[i + 1]) for doc in docs for i in range(len(doc) - 1)]
    assert sorted(scored) == sorted(expected)
    for r in rows:
        tokens = [int(t) for t in r["tokens"] if t]
        # one document per row, consecutive ids from position 0 on; a scored token sees >= 8 - 3 + 1 of it
        assert tokens == list(range(tokens[0], tokens[0] + len(tokens)))
        first = int(r["loss_mask"].nonzero()[0])
        assert first == 0 or first >= 8 - 3, r


def test_packing_ablation_reports_both_settings_on_whole_documents(tmp_path):
    logs = []
    results = fidelity.run("cpu", tmp_path, ["ce", "online", "top8-renorm"], log=logs.append,
                           packing_ablation=True, **TINY)
    settings = results["settings"]
    assert list(settings) == ["none", "documents+positions"] == results["packing_ablation"]
    apart, across = settings["documents+positions"], settings["none"]
    # the same data and the same whole-document set in both
    assert apart["corpus"] == across["corpus"]
    assert apart["corpus"]["heldout_document_eval"]["documents"] >= 2
    assert apart["packing"] == "documents+positions" and "packing" not in across
    assert apart["caches"]["top8"]["packing"] == "documents+positions" and "packing" not in across["caches"]["top8"]
    for run in settings.values():
        assert math.isfinite(run["teacher"]["heldout_doc_ce"])
        for name in ("ce", "online", "top8-renorm"):
            r = run["variants"][name]
            assert math.isfinite(r["heldout_doc_ce"]) and math.isfinite(r["heldout_doc_kl"]) and r["heldout_doc_kl"] >= 0
    # packing reached the teacher: kept apart, it is another model (the same start, the same batches)
    assert apart["teacher"]["heldout_doc_ce"] != across["teacher"]["heldout_doc_ce"]
    md = (tmp_path / "results.md").read_text()
    assert "| top8-renorm | documents+positions |" in md and "| top8-renorm | none |" in md, md
    assert not (tmp_path / "work").exists()


def test_sampled_variants_take_the_renorm_or_the_ghost_tail():
    from benchmarks.common.fidelity import parse_variant

    assert (parse_variant("sampled64").tail, parse_variant("sampled64").k) == ("renorm", 64)
    ghost = parse_variant("sampled64-ghost-reverse")
    assert (ghost.kind, ghost.k, ghost.tail, ghost.divergence, ghost.cache) == ("sampled", 64, "ghost", "reverse",
                                                                               "sampled64")
    assert parse_variant("sampled-ghost-jsd0.3").jsd_beta == 0.3
    assert (parse_variant("sampled64-reverse-ce0.1").ce_weight, parse_variant("sampled64").ce_weight) == (0.1, 0.0)
    with pytest.raises(ValueError, match="unknown variant"):
        parse_variant("sampled64-none")
