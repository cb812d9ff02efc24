"""Real English text for an offline machine, built from Debian 12 packages (``apt-get download`` reaches
the Debian mirror where the Hugging Face Hub is out of reach).

    python -m benchmarks.common.real_corpora --debs DIR --out DIR [--chat-words 8000]

``--debs`` holds the .deb files (those missing are fetched there with ``apt-get download``); they are
unpacked with ``dpkg -x`` into a temporary folder. Writes, one JSON object per line:

- ``python-docs.jsonl`` (the healing corpus, in domain): the reStructuredText sources of the Python
  3.11 documentation (python3.11-doc, ``html/_sources/**/*.rst.txt``, ~500 files, 12 MB), one document
  per file, sorted by path, as is: ``{"text", "source": path}``. License: the PSF License.
- ``kjv.jsonl`` (out of domain): the King James Bible, decoded by the ``bible`` program (bible-kjv)
  from bible-kjv-text's data; one document per book, a "Book N" line before each chapter, one verse
  per line without its number. Public domain (a 1611 translation; the package's copyright file).
- ``fortunes.jsonl`` (out of domain): the fortune-mod collection (fortunes, fortunes-min), one
  document per file (category), its fortunes separated by a blank line, terminal overstrikes and
  bells removed; ``ascii-art`` (drawings) left out. Offensive fortunes are in another package
  (fortunes-off) and not used. License: the BSD license of the University of California (the
  package's copyright file); the quotations themselves belong to their authors.
- ``wordnet-chat.jsonl`` (conversations for ``megatron-kd data chat``): WordNet 3.0 (wordnet-base).
  For each of the ``--chat-words`` single lowercase words with the most sense-tagged occurrences
  (``cntlist.rev``), the user asks what it means (one of four phrasings, chosen by a hash of the
  word) and the assistant gives up to three senses, most frequent first (by tag count across parts
  of speech, in WordNet's order within one), each with its definition and a quoted example when the
  gloss has one. Sorted by that hash, so a train/valid split mixes frequent and rare words. License:
  the WordNet 3.0 license (permissive, keep its notice).

Why these: the healing text is technical English prose and markup, what the pruned model heals on;
scripture (archaic narrative) and quotations, jokes and poems are English from other sources, for
measuring what healing does out of domain. ``manifest.json`` gives each file's documents, bytes and
SHA-256 and the packages' versions. The same .deb files give byte-identical outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

PACKAGES = ("python3.11-doc", "bible-kjv", "bible-kjv-text", "fortunes", "fortunes-min", "wordnet-base")
SKIP_FORTUNES = {"ascii-art"}  # drawings, not text ("art" holds fortunes about art)
POS = {"n": "noun", "v": "verb", "a": "adjective", "r": "adverb"}  # WordNet's files and order
SS_TYPE = {"1": "n", "2": "v", "3": "a", "4": "r", "5": "a"}  # sense keys' synset type; 5: adjective satellite
QUESTIONS = ('What does the word "{}" mean?', 'What is the meaning of "{}"?', 'Define the word "{}".',
             'Can you explain what "{}" means?')


# --- Python documentation ---------------------------------------------------------------------------

def python_docs(sources: Path) -> list[dict]:
    files = sorted(sources.rglob("*.rst.txt"), key=lambda p: p.relative_to(sources).as_posix())
    return [{"text": f.read_text(encoding="utf-8"), "source": f.relative_to(sources).as_posix()} for f in files]


# --- King James Bible --------------------------------------------------------------------------------

def kjv_books(decoded: str) -> list[dict]:
    """The ``bible`` program's output -> one document per book. It prints a "Book N" heading line after
    a blank line, then each verse as "  N text" wrapped at 80 columns (continuations start at column 0)."""
    books: list[tuple[str, list[str]]] = []
    previous_blank = True
    for line in decoded.splitlines():
        line = line.rstrip()
        if not line:
            previous_blank = True
            continue
        heading = re.fullmatch(r"(\S.*) (\d+)", line) if previous_blank else None
        previous_blank = False
        if heading:
            if not books or books[-1][0] != heading[1]:
                books.append((heading[1], []))
            books[-1][1].append(f"\n{line}" if books[-1][1] else line)
        elif verse := re.fullmatch(r"\s+\d+ (.*)", line):
            books[-1][1].append(verse[1].strip())
        elif books and books[-1][1]:  # a wrapped verse's next line
            books[-1][1][-1] += " " + line.strip()
    return [{"text": "\n".join(lines) + "\n", "source": name} for name, lines in books]


def decode_bible(root: Path) -> str:
    return subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "Gen1:1-Rev22:21"],
                          check=True, capture_output=True, text=True, encoding="utf-8").stdout


# --- fortunes ----------------------------------------------------------------------------------------

def fortunes(text: str) -> list[str]:
    """A fortune file's fortunes (separated by lines holding one ``%``), cleaned: overstrikes ("_\\bX",
    "___\\b\\b\\bfoo": underlining and bold on a terminal) and bells removed, lines right-stripped."""
    out = []
    for fortune in re.split(r"^%\n", text + "\n", flags=re.MULTILINE):
        while (cleaned := re.sub(r"[^\x08\n]\x08", "", fortune)) != fortune:
            fortune = cleaned
        fortune = "\n".join(line.rstrip() for line in re.sub(r"[\x07\x08]", "", fortune).split("\n"))
        if fortune.strip():
            out.append(fortune.strip("\n"))
    return out


def fortune_documents(folder: Path) -> list[dict]:
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix not in (".dat", ".u8")
                   and f.name not in SKIP_FORTUNES)  # folders (Debian's off/) are not read
    return [{"text": "\n\n".join(fortunes(f.read_text(encoding="utf-8"))) + "\n", "source": f.name} for f in files]


# --- WordNet -----------------------------------------------------------------------------------------

def tag_counts(cntlist_rev: str) -> dict[str, dict[tuple[str, int], int]]:
    """``cntlist.rev`` ("lemma%ss_type:... sense_number tag_count") -> lemma -> (pos, sense number) -> count."""
    counts: dict[str, dict[tuple[str, int], int]] = {}
    for line in cntlist_rev.splitlines():
        key, number, count = line.split()
        lemma, ss_type = key.split("%")[0], key.split("%")[1][0]
        senses = counts.setdefault(lemma, {})
        senses[SS_TYPE[ss_type], int(number)] = senses.get((SS_TYPE[ss_type], int(number)), 0) + int(count)
    return counts


def index_offsets(index: str) -> dict[str, list[int]]:
    """An ``index.POS`` file -> lemma -> its synsets' offsets in ``data.POS``, in WordNet's order."""
    out = {}
    for line in index.splitlines():
        if line.startswith(" "):  # the license header
            continue
        fields = line.split()
        n_synsets, n_pointers = int(fields[2]), int(fields[3])
        out[fields[0]] = [int(o) for o in fields[6 + n_pointers:6 + n_pointers + n_synsets]]
    return out


def gloss(data: bytes, offset: int) -> tuple[str, str | None]:
    """(definition, first quoted example or None) of the synset at ``offset`` of a ``data.POS`` file."""
    line = data[offset:data.index(b"\n", offset)].decode("utf-8")
    assert int(line.split(" ", 1)[0]) == offset, line[:40]
    parts = re.split(r";\s*(?=\")", line.split(" | ", 1)[1].strip())
    examples = [m[1] for p in parts[1:] if (m := re.match(r'\s*"([^"]+)"', p))]  # the first quoted span of each
    return parts[0].strip().rstrip(";").strip(), (examples[0] if examples else None)


def answer(word: str, senses: list[tuple[str, str, str | None]], total: int) -> str:
    """senses: (part of speech, definition, example) of the most frequent ones; total: the word's sense count."""
    def sense(definition, example):
        end = "" if definition.endswith((".", "?", "!")) else "."
        return f"{definition}{end}" + (f' For example: "{example}".' if example else "")

    if total == 1:
        pos, definition, example = senses[0]
        return f'"{word}" ({pos}) means {sense(definition, example)}'
    head = {2: "two meanings:", 3: "three meanings:"}.get(total, "several meanings; the most common are:")
    return f'"{word}" has {head}\n' + "\n".join(f"{i}. ({pos}) {sense(definition, example)}"
                                                 for i, (pos, definition, example) in enumerate(senses, 1))


def wordnet_chat(wordnet: Path, n_words: int) -> list[dict]:
    counts = tag_counts((wordnet / "cntlist.rev").read_text(encoding="utf-8"))
    index = {pos: index_offsets((wordnet / f"index.{name}").read_text(encoding="utf-8"))
             for pos, name in zip(POS, ("noun", "verb", "adj", "adv"))}
    data = {pos: (wordnet / f"data.{name}").read_bytes() for pos, name in zip(POS, ("noun", "verb", "adj", "adv"))}
    known = [w for w in counts if re.fullmatch(r"[a-z]+", w) and any(w in index[p] for p in POS)]
    words = sorted(known, key=lambda w: (-sum(counts[w].values()), w))[:n_words]
    out = []
    for word in words:
        queues = {p: [(counts[word].get((p, i), 0), o) for i, o in enumerate(index[p].get(word, []), 1)] for p in POS}
        chosen = []
        while len(chosen) < 3 and any(queues.values()):  # the most tagged next sense; ties: noun, verb, adj, adv
            pos = max((p for p in POS if queues[p]), key=lambda p: (queues[p][0][0], -list(POS).index(p)))
            chosen.append((POS[pos], *gloss(data[pos], queues[pos].pop(0)[1])))
        h = hashlib.sha256(word.encode()).hexdigest()
        question = QUESTIONS[int(h[:8], 16) % len(QUESTIONS)].format(word)
        total = sum(len(index[p].get(word, [])) for p in POS)
        out.append((h, {"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer(word, chosen, total)}]}))
    return [conversation for _, conversation in sorted(out, key=lambda x: x[0])]


# --- files -------------------------------------------------------------------------------------------

def write_jsonl(path: Path, records: list[dict]) -> dict:
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    path.write_bytes(body)
    return {"documents": len(records), "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def debian_packages(debs: Path) -> dict[str, Path]:
    """package -> its .deb in ``debs``, fetching the missing ones with ``apt-get download``."""
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in PACKAGES if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        print(f"apt-get download {' '.join(missing)} (into {debs})")
        subprocess.run(["apt-get", "download", *missing], cwd=debs, check=True)
    found = {p: sorted(debs.glob(f"{p}_*.deb")) for p in PACKAGES}
    several = {p: [f.name for f in fs] for p, fs in found.items() if len(fs) != 1}
    if several:
        raise SystemExit(f"expected one .deb per package in {debs}, found {several}")
    return {p: fs[0] for p, fs in found.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--debs", type=Path, required=True, help="Folder of the .deb files (missing ones are "
                                                                 "downloaded there with apt-get download).")
    parser.add_argument("--out", type=Path, required=True, help="Where to write the JSONL files and manifest.json.")
    parser.add_argument("--chat-words", type=int, default=8000, help="Words (conversations) of wordnet-chat.jsonl.")
    args = parser.parse_args(argv)
    packages = debian_packages(args.debs)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for deb in packages.values():
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        corpora = {
            "python-docs.jsonl": python_docs(root / "usr/share/doc/python3.11/html/_sources"),
            "kjv.jsonl": kjv_books(decode_bible(root)),
            "fortunes.jsonl": fortune_documents(root / "usr/share/games/fortunes"),
            "wordnet-chat.jsonl": wordnet_chat(root / "usr/share/wordnet", args.chat_words),
        }
    files = {}
    for name, records in corpora.items():
        files[name] = write_jsonl(args.out / name, records)
        print(f"{args.out / name}: {files[name]['documents']:,} documents, {files[name]['bytes']:,} bytes")
    versions = {p: subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True,
                                  text=True).stdout.strip() for p, deb in packages.items()}
    manifest = {"files": files, "packages": versions, "chat_words": args.chat_words}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


if __name__ == "__main__":
    main()
