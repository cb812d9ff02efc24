"""benchmarks/bench_smollm2.py on CPU: its data stage for real (``data text``, ``data chat
--renderer template``) on a tiny teacher with a ChatML tokenizer, and every GPU command it then
launches (cache builds, prunes, trains, online KD, exports) checked by the product's own flag checks,
which on a machine without CUDA end in the one "needs CUDA GPUs" line: a flag the commands refuse
would stop the benchmark on the GPU instead."""

import argparse
import contextlib
import io
import json
import shutil
from pathlib import Path

NO_CUDA = "needs CUDA GPUs and this machine has none"


def _corpora(path: Path) -> Path:
    path.mkdir()
    words = "the quick brown fox jumps over a lazy dog while python reads every line of text".split()
    for name, n in (("python-docs", 60), ("kjv", 8), ("fortunes", 8)):
        docs = [" ".join(words[(i + j) % len(words)] for j in range(40 + 3 * i)) for i in range(n)]
        (path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    chats = [{"messages": [{"role": "user", "content": f"What does the word \"{w}\" mean?"},
                           {"role": "assistant", "content": f"\"{w}\" means {' '.join(words[:5 + i % 7])}."}]}
             for i, w in enumerate(words * 6)]
    (path / "wordnet-chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return path


def _megatron_line(argv: list[str]) -> str:
    """The last stderr line of one benchmark command run in this process (torchrun left out)."""
    from megatron.training import global_vars

    from benchmarks.common import online_kd
    from megatron_kd.cli import main
    from megatron_kd.errors import UserError

    err = io.StringIO()
    # export-hf and online KD set Megatron's global arguments, which a later in-process command (here, or
    # another test of this worker) would find set: none before, none left after
    global_vars.unset_global_variables()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if "megatron_kd.cli" in argv:
                assert main(argv[argv.index("megatron_kd.cli") + 1:]) == 2
            else:
                module = argv.index("benchmarks.common.online_kd")
                try:
                    online_kd.main(argv[module + 1:])
                except UserError as e:
                    return str(e)
    finally:
        global_vars.unset_global_variables()
    return err.getvalue().strip().splitlines()[-1]


def test_every_command_of_the_benchmark_passes_the_product_checks(tmp_path):
    from benchmarks.common import smollm2
    from tests.fixtures.chat_inputs import CHATML_SPECIALS, CHATML_TEMPLATE, save_tokenizer
    from tests.fixtures.tiny_llama import make_tiny

    work = tmp_path / "work"
    teacher = make_tiny("llama", work / "teacher", vocab_size=128, tie_word_embeddings=True, eos_token_id=2,
                        pad_token_id=0, bos_token_id=None)
    for f in teacher.glob("tokenizer*"):
        f.unlink()
    save_tokenizer(teacher, CHATML_SPECIALS, eos="<|im_end|>", chat_template=CHATML_TEMPLATE)
    opts = argparse.Namespace(gguf="unused.gguf", corpora=str(_corpora(tmp_path / "corpora")), work=str(work),
                              preset="gpu", seeds="1234", jobs=2, dry_run=False)
    bench = smollm2.Bench(opts)
    (work / "done").mkdir(parents=True)
    (work / "done" / "gguf-to-hf").write_text("0\n")  # the teacher is there already: gguf-to-hf is skipped
    bench.prepare()  # data text and data chat run
    assert (work / "data" / "python-docs.idx").is_file() and (work / "data" / "chat_loss_mask.idx").is_file()
    assert "--num-layers" in bench.teacher_flags

    jobs = []
    bench.run_jobs = lambda stage, batch: jobs.extend(batch)
    bench.teacher_pass()
    # prune refuses an --out that holds a model: its commands are checked before their students exist
    before_prune = {job.name: _megatron_line(job.argv) for job in jobs if job.name.startswith("prune")}
    for cut in smollm2.CUTS:  # what prune writes, for the students' flags
        shutil.copytree(teacher, bench.pruned(cut))
    for name in ("sampled64-1234", "top100-1234", "chat-sampled64-1234"):
        bench.cache(*name.rsplit("-", 1)).mkdir(parents=True)  # train checks that its --kd-cache exists
    bench.train()
    bench.export()
    assert len(jobs) == 3 + 2 + 2 * 10  # caches, prunes, trains and exports of one seed
    # each kind of command once (the width cut's differ from the deep cut's only by the directory)
    checked = [j for j in jobs if not j.name.startswith(("train-width", "export-width", "export-deep-s", "export-deep-t",
                                                         "export-deep-o", "export-chat-ce"))]
    assert len(checked) == 13
    for job in checked:
        line = before_prune.get(job.name) or _megatron_line(job.argv)
        assert NO_CUDA in line, (job.name, line)
