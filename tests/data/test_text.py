"""``megatron-kd data text``: JSONL documents -> a Megatron indexed dataset that reads back to each
document's token ids plus EOD; several inputs in order; --no-append-eod; bad input as one line naming
FILE:LINE, exit 2, no files left. Offline: the tokenizer is built here (``chat_inputs``)."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from megatron_kd.cli import main as cli_main
from megatron_kd.data.chat import token_dtype
from tests.fixtures.chat_inputs import CHATML_SPECIALS, megatron_tokenizer, save_tokenizer

BOS = "<|im_start|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """Character-level, EOD <|endoftext|>, and a post-processor that adds a BOS (which the dataset must not hold)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    directory = save_tokenizer(tmp_path_factory.mktemp("tok"), CHATML_SPECIALS, eos="<|endoftext|>")
    hf = PreTrainedTokenizerFast.from_pretrained(directory)
    hf._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, hf.convert_tokens_to_ids(BOS))])
    hf.save_pretrained(directory)
    return megatron_tokenizer(directory)


def _flags(tokenizer):
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer.path]


def _jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _expected(tokenizer, text):
    """The text's ids, character by character (the tokenizer's vocabulary; no BOS)."""
    vocab = tokenizer._tokenizer.tokenizer.get_vocab()
    return [vocab[c] for c in text]


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return dataset, [dataset[i].tolist() for i in range(len(dataset))]


def test_documents_read_back_with_eod_in_input_order(tokenizer, tmp_path, capsys):
    assert tokenizer._tokenizer.tokenizer.encode("ab")[0] == tokenizer._tokenizer.tokenizer.convert_tokens_to_ids(BOS)
    first = ["Hello, world.", "Two\nlines\n\nand a paragraph.", "x" * 300]
    second = ["The second file.", "  spaces kept  "]
    a = _jsonl(tmp_path / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(first[:2])] + [""]
               + [{"text": first[2]}])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": t, "source": "b"} for t in second] + [{"text": ""}])
    capsys.readouterr()
    argv = ["data", "text", "--input", str(a), "--input", str(b), "--output", str(tmp_path / "out" / "docs"),
            *_flags(tokenizer)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    eod = tokenizer.eod
    texts = first + second
    dataset, docs = _read(tmp_path / "out" / "docs")
    assert docs == [_expected(tokenizer, t) + [eod] for t in texts]
    assert dataset.index.dtype == np.uint16 and list(dataset.sequence_lengths) == [len(t) + 1 for t in texts]
    sidecar = json.loads((tmp_path / "out" / "docs_text.json").read_text())
    from megatron_kd.megatron.data import tokenizer_fingerprint

    assert sidecar["documents"] == 5 and sidecar["tokens"] == sum(len(t) + 1 for t in texts)
    assert sidecar["inputs"] == [str(a), str(b)] and sidecar["json_key"] == "text" and sidecar["append_eod"]
    assert sidecar["empty_skipped"] == 1 and sidecar["eod"] == eod
    assert sidecar["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert len(out) == 1 and re.search(r"docs: 5 documents, \d+ tokens \([\d,]+ tokens/s", out[0]), out


def test_no_append_eod_and_json_key(tokenizer, tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"content": "abc", "text": 1}, {"content": "de"}])
    argv = ["data", "text", "--input", str(path), "--output", str(tmp_path / "plain"), "--json-key", "content",
            "--no-append-eod", *_flags(tokenizer)]
    assert cli_main(argv) == 0
    _, docs = _read(tmp_path / "plain")
    assert docs == [_expected(tokenizer, "abc"), _expected(tokenizer, "de")]
    assert json.loads((tmp_path / "plain_text.json").read_text())["append_eod"] is False


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(SimpleNamespace(vocab_size=65536)) is np.uint16
    assert token_dtype(SimpleNamespace(vocab_size=65537)) is np.int32


@pytest.mark.parametrize("content, match", [
    ('{"text": "ok"}\n{"text": }\n', r"d\.jsonl:2: not a JSON line"),
    ('{"text": "ok"}\n\n{"body": "no key"}\n', r"d\.jsonl:3: no 'text' key \(the line is an object"),
    ('["a list"]\n', r"d\.jsonl:1: no 'text' key \(the line is a JSON list"),
    ('{"text": ["not", "a", "string"]}\n', r"d\.jsonl:1: 'text' is list, expected a string"),
    ('{"text": null}\n', r"d\.jsonl:1: 'text' is NoneType, expected a string"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
     r"d\.jsonl:2: not UTF-8 \(invalid continuation byte at byte 14 of the line\)"),
    ('{"text": "lone \\ud800 surrogate"}\n', r"d\.jsonl:1: 'text' is not UTF-8 text"),
    ("\n\n", r"--input \S*d\.jsonl: no document in it"),
    ('{"text": ""}\n', r"--input \S*d\.jsonl: no document in it \(1 empty\)"),
    (None, r"--input \S*d\.jsonl: cannot read it \(No such file or directory\)"),
])
def test_bad_input_is_one_line_and_exit_2(tokenizer, tmp_path, capsys, content, match):
    # a good file first (the error names the second), except where no file holds a document
    inputs = [] if "no document" in match else [_jsonl(tmp_path / "good.jsonl", [{"text": "first file, fine"}])]
    path = tmp_path / "d.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    capsys.readouterr()
    argv = ["data", "text", *(f for p in [*inputs, path] for f in ("--input", str(p))),
            "--output", str(tmp_path / "out" / "bad"), *_flags(tokenizer)]
    assert cli_main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("megatron-kd: error:") and re.search(match, err[0]), err
    assert not (tmp_path / "out").exists(), list(tmp_path.glob("out/**/*"))  # nothing written, no temporary file


def test_flags_missing_and_help(tmp_path, capsys):
    path = _jsonl(tmp_path / "e.jsonl", [{"text": "a"}])
    assert cli_main(["data", "text", "--input", str(path), "--output", str(tmp_path / "o")]) == 2
    assert "data text needs --tokenizer-type" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["data", "text", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--input", "--output", "--json-key", "--append-eod", "--no-append-eod", "--tokenizer-type",
                 "--tokenizer-model"):
        assert flag in out, flag
