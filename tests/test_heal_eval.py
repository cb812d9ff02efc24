"""benchmarks/common/heal_eval.py, the real-model benchmark's scoring: its CE, KL(teacher || student) and top-1
agreement against torch's own functions on masked windows, the out-of-domain windows as slices of
the tokenized text, and the held-out windows drawn from the validation split's documents only."""

import json

import torch

from benchmarks.common.heal_eval import Windows, megatron_windows, score, text_windows


def _tiny_models(tmp_path, seed):
    from tests.fixtures.tiny_llama import make_tiny
    from transformers import AutoModelForCausalLM

    dirs = [make_tiny("llama", tmp_path / name, seed=seed + i) for i, name in enumerate(("teacher", "student"))]
    return {p.name: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in dirs}


def test_scores_are_the_masked_means_of_torch_functions(tmp_path, seed):
    models = _tiny_models(tmp_path, seed)
    gen = torch.Generator().manual_seed(seed)
    windows = Windows(torch.randint(0, 990, (5, 33), generator=gen), (torch.rand(5, 32, generator=gen) > 0.3).float())
    got = score(models, "teacher", windows, batch_size=2)

    with torch.no_grad():
        log_p = models["teacher"](input_ids=windows.tokens[:, :-1]).logits.log_softmax(-1)
        log_q = models["student"](input_ids=windows.tokens[:, :-1]).logits.log_softmax(-1)
    m = windows.loss_mask
    ce = torch.nn.functional.cross_entropy(log_q.transpose(1, 2), windows.tokens[:, 1:], reduction="none")
    kl = torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    agree = (log_q.argmax(-1) == log_p.argmax(-1)).float()
    student = got["student"]
    assert student.tokens == int(m.sum())
    for value, want in ((student.ce, ce), (student.kl, kl), (student.top1, agree)):
        assert abs(value - float((want * m).sum() / m.sum())) < 1e-5
    assert 0 < student.kl and student.top1 < 1  # two different models
    assert got["teacher"].kl == 0 and got["teacher"].top1 == 1


def test_text_windows_are_slices_of_the_documents_with_eod_between(tmp_path, seed):
    import random

    from tests.fixtures.chat_inputs import CHATML_SPECIALS, save_tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / "tok", CHATML_SPECIALS, eos="<|im_end|>"))
    rng = random.Random(seed)  # text without repeats: each window is found at one place only
    docs = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 ") for _ in range(40 + 7 * i)) for i in range(12)]
    (tmp_path / "ood.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    eod = tok.eos_token_id
    windows = text_windows(tmp_path / "ood.jsonl", tok, seq_length=16, count=5, eod=eod)

    stream = []
    for d in docs:
        stream += tok.encode(d, add_special_tokens=False) + [eod]
    full = (len(stream) - 1) // 16
    assert windows.tokens.shape == (5, 17) and bool(windows.loss_mask.eq(1).all())
    text = torch.tensor(stream)
    found = [next(s for s in range(0, full * 16, 16) if torch.equal(text[s:s + 17], w)) for w in windows.tokens]
    assert found[0] == 0 and found[-1] == (full - 1) * 16 and found == sorted(set(found))


def test_held_out_windows_come_from_the_validation_documents_only(tmp_path):
    from megatron_kd.megatron.data import write_indexed_dataset
    from tests.fixtures.chat_inputs import CHATML_SPECIALS, save_tokenizer

    tok_dir = save_tokenizer(tmp_path / "tok", CHATML_SPECIALS, eos="<|im_end|>")
    # document d holds only the token 10 + d (and its end): a window's tokens name the documents it read
    docs = [[10 + d] * (30 + d) + [2] for d in range(40)]
    prefix = write_indexed_dataset(tmp_path / "data" / "docs", docs, 100)
    flags = ["--data-path", str(prefix), "--split", "80,20,0", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "10", "--eval-iters", "3", "--seed", "5",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir),
             "--data-cache-path", str(tmp_path / "cache")]
    valid = megatron_windows(flags)
    train = megatron_windows(flags, split="train", count=40)
    assert valid.tokens.shape == (12, 17) and valid.loss_mask.shape == (12, 16)
    valid_docs = {int(t) - 10 for t in valid.tokens.unique() if t != 2}
    train_docs = {int(t) - 10 for t in train.tokens.unique() if t != 2}
    assert valid_docs and train_docs and not valid_docs & train_docs
    assert min(valid_docs) > max(train_docs)  # megatron-core splits by document ranges, in order
