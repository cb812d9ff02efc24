"""The Triton kernels compile for sm_90 on any machine (the CPU tests otherwise only interpret them)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.fixtures.triton_sm90_compile"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = [line.split(":")[0] for line in proc.stdout.splitlines()]
    assert compiled == ["topk_candidates_kernel", "tile_stats_kernel", "row_mass_kernel", "tile_sample_kernel", *["exp_stats_kernel"] * 2, *["grad_fixup_kernel"] * 4,
                        *["row_terms_kernel"] * 4, "scale_rows_kernel", *["bf16_adam_kernel"] * 2,
                        *["_rope_kernel"] * 2, "_gather_sum_kernel"], proc.stdout
