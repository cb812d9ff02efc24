"""benchmarks/common/real_corpora.py on tiny fake inputs: the Python docs' sources one document per file in path
order, the Bible decoder's output one book per document, fortune files one category per document, WordNet
conversations that ``data chat`` reads; and the whole script on fake .deb files (dpkg-deb), twice, to
byte-identical outputs."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.common import real_corpora
from megatron_kd.data.conversation import parse_messages

DECODED = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved in the year 12
and so on.

Genesis 2

  1 Thus the heavens and the earth were finished.

1 John 1

  1 That which was from the beginning.
"""

FORTUNES = ("A \"critic\" is a man who creates nothing.   \n\t\t-- Robert Heinlein\n%\n"
            "Calm down, it's *____\b\b\b\bonly* ones and _\bz_\be_\br_\bo_\bs.\n%\n"
            "\n\tTwo paragraphs,\n\n\tthe second indented.\a\n%\n%\n")


def _sources(root: Path) -> Path:
    sources = root / "usr/share/doc/python3.11/html/_sources"
    for path, text in {"library/os.rst.txt": ":mod:`os`\n=========\n", "index.rst.txt": "Python\n******\n",
                       "c-api/abi.rst.txt": ".. _abi:\n\nABI\n", "library/notes.txt": "not reST"}.items():
        (sources / path).parent.mkdir(parents=True, exist_ok=True)
        (sources / path).write_text(text)
    return sources


def _fortunes(root: Path) -> Path:
    folder = root / "usr/share/games/fortunes"
    (folder / "off").mkdir(parents=True)
    (folder / "jokes").write_text(FORTUNES)
    (folder / "art").write_text("Art is long.\n%\nLife is short.\n")
    for name, text in {"jokes.dat": "\0\1", "jokes.u8": "x", "ascii-art": " /\\_/\\\n( o.o )\n%\n",
                       "off/rude": "offensive\n%\n"}.items():
        (folder / name).write_text(text)
    return folder


# WordNet: (pos, lemma, [(gloss, tag count), ...]) in WordNet's sense order
SENSES = [
    ("noun", "bank", [(('sloping land (especially the slope beside a body of water); "they pulled the canoe up on '
                        'the bank"; "he sat on the bank"'), 20), ("a long ridge or pile", 5)]),
    ("verb", "bank", [('tip laterally; "the pilot had to bank the aircraft"', 10)]),
    ("adv", "quickly", [('with rapid movements; "he works quickly"', 3)]),
    ("adj", "good", [("having desirable or positive qualities", 7)]),
    ("noun", "ice_cream", [("frozen dessert", 50)]),
    ("noun", "zebra", [("striped African equine", 0)]),
]


def _wordnet(root: Path) -> Path:
    folder = root / "usr/share/wordnet"
    folder.mkdir(parents=True)
    ss_type = {"noun": ("n", 1), "verb": ("v", 2), "adj": ("a", 3), "adv": ("r", 4)}
    cntlist = []
    for pos, (letter, number) in ss_type.items():
        data, index = "  1 This software and database is being provided to you\n", ["  1 WordNet license header\n"]
        for name, lemma, senses in SENSES:
            if name != pos:
                continue
            offsets = []
            for i, (gloss, count) in enumerate(senses, 1):
                offsets.append(len(data.encode()))
                data += f"{offsets[-1]:08d} 17 {letter} 01 {lemma} {i:x} 000 | {gloss}  \n"
                if count:
                    cntlist.append(f"{lemma}%{number}:17:{i:02d}:: {i} {count}\n")
            index.append(f"{lemma} {letter} {len(senses)} 1 @ {len(senses)} {len(senses)} "
                         + " ".join(f"{o:08d}" for o in offsets) + "  \n")
        (folder / f"data.{pos}").write_text(data)
        (folder / f"index.{pos}").write_text("".join(index))
    (folder / "cntlist.rev").write_text("".join(sorted(cntlist)))
    return folder


def test_python_docs_one_document_per_file_in_path_order(tmp_path):
    docs = real_corpora.python_docs(_sources(tmp_path))
    assert [d["source"] for d in docs] == ["c-api/abi.rst.txt", "index.rst.txt", "library/os.rst.txt"]
    assert docs[2]["text"] == ":mod:`os`\n=========\n"


def test_kjv_books_unwrap_verses_and_group_chapters():
    books = real_corpora.kjv_books(DECODED)
    assert [b["source"] for b in books] == ["Genesis", "1 John"]
    assert books[0]["text"] == (
        "Genesis 1\nIn the beginning God created the heaven and the earth.\n"
        "And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of "
        "God moved in the year 12 and so on.\n\nGenesis 2\nThus the heavens and the earth were finished.\n")
    assert books[1]["text"] == "1 John 1\nThat which was from the beginning.\n"


def test_fortunes_cleaned_one_document_per_category(tmp_path):
    assert real_corpora.fortunes(FORTUNES) == [
        "A \"critic\" is a man who creates nothing.\n\t\t-- Robert Heinlein",
        "Calm down, it's *only* ones and zeros.",
        "\tTwo paragraphs,\n\n\tthe second indented."]
    docs = real_corpora.fortune_documents(_fortunes(tmp_path))
    assert [d["source"] for d in docs] == ["art", "jokes"]  # no .dat/.u8, no drawings, nothing from off/
    assert docs[0]["text"] == "Art is long.\n\nLife is short.\n"


def test_wordnet_conversations(tmp_path):
    conversations = real_corpora.wordnet_chat(_wordnet(tmp_path), 8000)
    answers = {parse_messages(c)[0].content.split('"')[1]: parse_messages(c)[1].content for c in conversations}
    assert set(answers) == {"bank", "good", "quickly"}  # no underscores, no untagged word
    # most tagged first across parts of speech, WordNet's order within one; the first quoted example
    assert answers["bank"] == (
        '"bank" has three meanings:\n'
        '1. (noun) sloping land (especially the slope beside a body of water). For example: "they pulled the canoe '
        'up on the bank".\n'
        '2. (verb) tip laterally. For example: "the pilot had to bank the aircraft".\n'
        '3. (noun) a long ridge or pile.')
    assert answers["quickly"] == '"quickly" (adverb) means with rapid movements. For example: "he works quickly".'
    assert answers["good"] == '"good" (adjective) means having desirable or positive qualities.'
    for c in conversations:
        assert list(c) == ["messages"] and [m["role"] for m in c["messages"]] == ["user", "assistant"]
        assert c["messages"][0]["content"] in {q.format(c["messages"][0]["content"].split('"')[1])
                                               for q in real_corpora.QUESTIONS}
    assert conversations == real_corpora.wordnet_chat(tmp_path / "usr/share/wordnet", 8000)  # a fixed order
    only = real_corpora.wordnet_chat(tmp_path / "usr/share/wordnet", 1)  # the most tagged word
    assert len(only) == 1 and '"bank"' in only[0]["messages"][0]["content"]


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb (Debian / Ubuntu)")
def test_script_on_fake_debs_is_deterministic(tmp_path):
    root = tmp_path / "tree"
    _sources(root), _fortunes(root), _wordnet(root)
    bible = root / "usr/bin/bible"  # a stand-in for the decoder: prints DECODED whatever it is asked
    bible.parent.mkdir(parents=True)
    (root / "usr/lib").mkdir()
    (root / "usr/lib/decoded.txt").write_text(DECODED)
    bible.write_text('#!/bin/sh\ncat "$2/decoded.txt"\n')
    bible.chmod(0o755)
    parts = {"python3.11-doc": "usr/share/doc", "bible-kjv": "usr/bin", "bible-kjv-text": "usr/lib",
             "fortunes": "usr/share/games", "fortunes-min": None, "wordnet-base": "usr/share/wordnet"}
    debs = tmp_path / "debs"
    debs.mkdir()
    for package, part in parts.items():
        tree = tmp_path / "pkg" / package
        (tree / "DEBIAN").mkdir(parents=True)
        (tree / "DEBIAN/control").write_text(f"Package: {package}\nVersion: 1:2.3-4\nArchitecture: all\n"
                                             f"Maintainer: test <t@example.com>\nDescription: fake\n")
        if part:
            shutil.copytree(root / part, tree / part)
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree),
                        str(debs / f"{package}_2.3-4_all.deb")], check=True, capture_output=True)
    manifest = real_corpora.main(["--debs", str(debs), "--out", str(tmp_path / "a")])
    real_corpora.main(["--debs", str(debs), "--out", str(tmp_path / "b")])
    names = ["python-docs.jsonl", "kjv.jsonl", "fortunes.jsonl", "wordnet-chat.jsonl", "manifest.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert manifest["packages"] == {p: "1:2.3-4" for p in parts}
    assert {n: f["documents"] for n, f in manifest["files"].items()} == {
        "python-docs.jsonl": 3, "kjv.jsonl": 2, "fortunes.jsonl": 2, "wordnet-chat.jsonl": 3}
    kjv = [json.loads(ln) for ln in (tmp_path / "a/kjv.jsonl").read_text().splitlines()]
    assert kjv == real_corpora.kjv_books(DECODED)
