"""Host memory of Megatron's optimizer CPU offload, per parameter (one GPU, ~2 minutes).

    python -m benchmarks.bench_offload [--out DIR]      # DIR/offload.json and the two training logs

Runs ``megatron-kd train`` twice on the same 0.94B-parameter GPT for 3 iterations: the distributed
optimizer alone, and with the 120B recipe's optimizer flags (precision-aware fp16 master weights and
bf16 moments, ``--optimizer-cpu-offload --optimizer-offload-fraction 1.0``). The difference of the
two processes' peak RSS over the parameter count is the host memory one offloaded parameter costs.
``megatron-kd plan`` uses it (``OFFLOAD_HOST_BYTES_PER_PARAM``); benchmarks/memory_measurements.json
records the result and tests/megatron/test_plan.py holds the plan to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common.offload import MODEL_FLAGS, OFFLOAD_FLAGS, VOCAB

# runs the training as a child and reports the children's peak RSS (the training process's own)
_PEAK_RSS = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
             "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, 'RC', p.returncode)")


def random_dataset(path: Path) -> str:
    from megatron_kd.megatron.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [[*rng.integers(0, VOCAB - 1, size=int(rng.integers(500, 3000))), VOCAB - 1] for _ in range(300)]
    return str(write_indexed_dataset(path / "docs", docs, VOCAB))


def train(flags: list[str], log_path: Path) -> dict:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "megatron_kd.cli", "train", *flags],
                          capture_output=True, text=True, env=env, timeout=600)
    log = proc.stdout + proc.stderr
    log_path.write_text(log)
    rss = re.search(r"MAXRSS_KB (\d+) RC (-?\d+)", log)
    if not rss or rss.group(2) != "0":
        raise SystemExit(f"training failed, see {log_path}:\n{log[-3000:]}")
    allocated = re.findall(r"memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)", log)
    return {"peak_rss_gib": int(rss.group(1)) / 2**20,
            "parameters": int(re.search(r"number of parameters on .*?: (\d+)", log).group(1)),
            "gpu_allocated_gib": float(allocated[-1][0]) / 1024, "gpu_max_allocated_gib": float(allocated[-1][1]) / 1024,
            "iteration_ms": [float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    run = [*MODEL_FLAGS, "--data-path", random_dataset(work), "--split", "98,1,1", "--eval-iters", "0",
           "--eval-interval", "1000", "--log-interval", "1", "--log-memory-interval", "1", "--num-workers", "0",
           "--data-cache-path", str(work / "index-cache")]
    results = {"distributed optimizer": train(run, out / "offload_none.log"),
               "+ CPU offload 1.0": train([*run, *OFFLOAD_FLAGS], out / "offload_full.log")}
    base, offloaded = results.values()
    results["host_bytes_per_offloaded_param"] = ((offloaded["peak_rss_gib"] - base["peak_rss_gib"]) * 2**30
                                                 / offloaded["parameters"])
    (out / "offload.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
