"""benchmarks/bench_layer.py runs end to end on CPU at a toy shape (its numbers are for the GPU), here
with the experts' activation recomputed (``--recompute-modules moe_act``, as the 20B layouts under
test use) and megatron-core's own RoPE and token permutation (``--megatron-ops``). Megatron-LM's
validation asks the GPU's compute capability for ``--moe-grouped-gemm``: the test answers Hopper's,
as the test harness does for its other GPU queries."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
MOE_ACT = "--recompute-granularity selective --recompute-modules moe_act --moe-grouped-gemm"
# ``python -m benchmarks.bench_layer`` from the repository root, with the GPU query answered
RUN_ON_CPU = ("import runpy, sys, torch; torch.cuda.get_device_capability = lambda *a: (9, 0); "
              "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def test_bench_layer_tiny(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUN_ON_CPU, "benchmarks.bench_layer", "--tiny",
                           "--out", str(tmp_path), "--extra", MOE_ACT,
                           "--megatron-ops", "rope,permutation"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "layer_profile.json").read_text())
    assert r["moe_act_recompute"] and r["recompute_granularity"] == "selective"
    assert r["megatron_ops"] == "rope,permutation"
    # times only exist, nothing is compared: on two busy CPU cores a step may beat a forward
    assert r["step_ms"] > 0 and r["forward_ms"] > 0
    modules = r["modules_forward_ms"]
    for layer in ("layer 0 (window)", "layer 1 (full)"):
        for part in ("self_attention / core_attention", "self_attention / rest (RoPE, reshapes)", "mlp / experts",
                     "mlp / rest (token dispatch: permute, combine)", "input_layernorm"):
            assert f"{layer} / {part}" in modules, (layer, part)
        assert modules[f"{layer} / mlp"] > 0 and modules[f"{layer} / mlp / experts"] > 0
        assert r["saved_gib"][f"{layer} / mlp / experts"] > 0
    assert r["top_ops_step"] and r["top_ops_forward"] and (tmp_path / "profile_step.txt").read_text().strip()
