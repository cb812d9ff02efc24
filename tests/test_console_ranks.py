"""The training log of a multi-rank run reaches the user: Megatron-LM prints it on the last rank
(``print_rank_last``), and the console quiets every rank but 0. Two gloo ranks, each rank's stdout a
file as a terminal would be: the last rank's log lines are in its file, its other prints are not."""

import os
from pathlib import Path

from tests.fixtures.dist_utils import spawn

LOG_LINE = " iteration        1/      10 | lm loss: 2.5E+00 | kd loss: 1.2E+00 | teacher mass: 9.8E-01"


def _worker(rank, world_size, out_dir):
    from megatron.training import training

    from megatron_kd import console

    os.environ["RANK"] = str(rank)  # as torchrun sets it
    out = os.open(Path(out_dir) / f"rank{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)  # this rank's terminal
    os.close(out)
    console.quiet_other_ranks()
    console.show_last_rank_log()
    print("a line every rank prints", flush=True)
    training.print_rank_last(LOG_LINE)  # what training_log calls


def test_the_last_ranks_log_lines_are_printed(tmp_path):
    spawn(_worker, str(tmp_path), world_size=2)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert LOG_LINE in rank1 and "a line every rank prints" not in rank1
    assert "a line every rank prints" in rank0 and LOG_LINE not in rank0
