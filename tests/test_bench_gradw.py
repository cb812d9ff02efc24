"""benchmarks/bench_gradw.py's Triton GEMM (main_grad += Gᵀ·h, accumulator started from main_grad) against a
float64 reference: in Triton's interpreter on CPU, compiled on a GPU."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_accumulating_gemm_matches_float64():
    # inherits TRITON_INTERPRET=1 from conftest on machines without a GPU
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_gradw", "--check"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("relative error") == 4, proc.stdout
