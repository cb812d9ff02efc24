"""What hf-flags, export-hf, plan and the demo's checkpoints promise, on CPU.

1. ``hf-flags``: a Llama config.json without its sizes is refused naming the missing fields (never
   transformers' defaults printed as flags); an unknown model_type, one that needs remote code
   (``auto_map``) and YaRN RoPE are one line each, with nothing else on stderr; a good directory
   prints its flags and nothing on stderr (transformers' notices on its RoPE parameters kept quiet)
2. ``export-hf`` without ``--out``: one line
3. ``plan``: astronomical sizes are one line naming the flag (never an overflow's traceback); the
   code-path line names the spec it sizes and, without Transformer Engine, the one this machine builds
4. the demo's checkpoints load with ``torch.load(weights_only=True)``: a planted pickle runs nothing
   (it is refused, said in one line, and the stage starts over); a real one resumes
"""

import json
import shutil

import pytest
import torch

from megatron_kd.cli import main
from tests.fixtures.tiny_gpt_oss import recipe_flags
from tests.fixtures.tiny_llama import make_tiny


def _one_line(capfd) -> str:
    out, err = capfd.readouterr()
    err = err.strip()
    assert err.startswith("megatron-kd: error: ") and "\n" not in err, err
    return err


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


def _edited(llama_dir, tmp_path, name, edit):
    root = tmp_path / name
    shutil.copytree(llama_dir, root)
    config = json.loads((root / "config.json").read_text())
    edit(config)
    (root / "config.json").write_text(json.dumps(config))
    return root


# ------------------------------------------------------------------------------------- 1. hf-flags
def test_hf_flags_refuses_what_it_cannot_describe_in_one_line(llama_dir, tmp_path, capfd):
    capfd.readouterr()

    def drop(*names):
        return lambda c: [c.pop(n) for n in names]

    yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 2048}
    cases = [
        ("sizes", drop("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size"),
         "config.json: no num_hidden_layers, hidden_size, num_attention_heads, intermediate_size"),
        ("layers", drop("num_hidden_layers"), "config.json: no num_hidden_layers (each a positive integer"),
        ("text", lambda c: c.update(hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
        ("unknown", lambda c: c.update(model_type="frobnicator"), "model_type 'frobnicator': megatron_kd builds llama"),
        ("remote", lambda c: c.update(model_type="mine", auto_map={"AutoConfig": "configuration_mine.MineConfig"}),
         "auto_map names the model's own code (AutoConfig, run only with trust_remote_code)"),
        ("remote-llama", lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_mine.Mine"}), "auto_map"),
        # max_position_embeddings / original != factor: transformers warns about it as it reads the file
        ("yarn", lambda c: (c.pop("rope_parameters"), c.update(rope_scaling=yarn)),
         "rope_type 'yarn'; megatron_kd builds default and llama3 RoPE"),
        ("yarn5", lambda c: c.update(rope_parameters=yarn), "rope_type 'yarn'"),
    ]
    for name, edit, message in cases:
        root = _edited(llama_dir, tmp_path, name, edit)
        assert main(["hf-flags", str(root)]) == 2
        err = _one_line(capfd)
        assert f"hf-flags: {root / 'config.json'}: " in err and message in err, err


def test_hf_flags_prints_its_flags_and_nothing_else(llama_dir, tmp_path):
    """A process of its own (transformers says some notices once per process): the tiny Llama's
    original context (8,192) exceeds its max_position_embeddings (4,096), and a YaRN config whose
    factor is not max / original context length; transformers warns on reading either, and those
    notices are not hf-flags' to print: the flags alone, or the one line."""
    import subprocess
    import sys

    yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 2048}
    yarn_dir = _edited(llama_dir, tmp_path, "yarn", lambda c: (c.pop("rope_parameters"), c.update(rope_scaling=yarn)))
    for root, rc, stdout, stderr in [
        (llama_dir, 0, "--num-layers 2 --hidden-size 64 --ffn-hidden-size 96", ""),
        (yarn_dir, 2, "", f"megatron-kd: error: hf-flags: {yarn_dir / 'config.json'}: rope_type 'yarn'"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "megatron_kd.cli", "hf-flags", str(root)], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == rc and proc.stdout.startswith(stdout), proc
        assert proc.stderr.startswith(stderr) and proc.stderr.count("\n") == (1 if stderr else 0), proc.stderr


# ------------------------------------------------------------------------------------ 2. export-hf
def test_export_hf_without_out_is_one_line(capfd):
    for argv in (["export-hf"], ["export-hf", "--load", "/tmp", "--num-layers", "2"]):
        assert main(argv) == 2
        assert "the following arguments are required: --out" in _one_line(capfd)


# ----------------------------------------------------------------------------------------- 3. plan
PLAN = [*recipe_flags("20b"), "--vocab-size", "201088", "--bf16", "--global-batch-size", "64"]


def _with(flags, flag, value):
    flags = list(flags)
    flags[flags.index(flag) + 1] = value
    return flags


@pytest.mark.parametrize("flag", ["--seq-length", "--hidden-size", "--num-layers", "--micro-batch-size"])
@pytest.mark.parametrize("value", [10**30, 10**400])
def test_plan_with_astronomical_sizes_is_one_line(flag, value, capfd):
    flags = _with(PLAN, flag, str(value)) if flag in PLAN else [*PLAN, flag, str(value)]
    assert main(["plan", *flags]) == 2
    err = _one_line(capfd)
    assert f"{flag} {value}" in err and "plan sizes runs up to" in err, err


def test_plan_names_the_spec_it_sizes_and_the_one_this_machine_builds(capfd):
    from megatron_kd.models.gpt import have_transformer_engine

    assert main(["plan", *PLAN]) == 0
    _, err = capfd.readouterr()
    if have_transformer_engine():
        assert err.strip() == "megatron_kd: Transformer Engine spec", err
    else:
        assert "plan sizes the Transformer Engine spec" in err and "this one has none" in err, err
    assert main(["plan", *PLAN, "--transformer-impl", "local"]) == 0
    assert "--transformer-impl local: megatron-core local spec" in capfd.readouterr().err


# ------------------------------------------------------------------------------ 4. demo checkpoints
class _Planted:
    """What a planted checkpoint runs when unpickled without weights_only."""

    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['PLANTED']).write_text('ran')",))


def test_demo_checkpoints_never_run_a_planted_pickle(tmp_path, monkeypatch):
    from megatron_kd.demo import DemoConfig, train_loop

    marker = tmp_path / "ran"
    monkeypatch.setenv("PLANTED", str(marker))
    checkpoint = tmp_path / "student.pt"
    torch.save({"model": _Planted(), "steps": 2}, checkpoint)

    cfg = DemoConfig(workdir=str(tmp_path / "demo"), log_interval=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

    def step(model, step):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        return (model(x) ** 2).sum(), torch.tensor(8.0), {}

    lines = []
    curve = train_loop("student", model, 2, step, cfg, _Writer(), lines.append, checkpoint=checkpoint)
    assert not marker.exists()
    assert [s for s, _ in curve] == [1, 2]
    assert any("cannot be resumed" in ln and str(checkpoint) in ln for ln in lines), lines
    # the checkpoint it wrote in its place loads with weights_only and resumes where it stopped
    state = torch.load(checkpoint, weights_only=True)
    assert state["step"] == 2
    lines.clear()
    again = train_loop("student", torch.nn.Linear(4, 1), 2, step, cfg, _Writer(), lines.append, checkpoint=checkpoint)
    assert again == curve and any("resumed after step 2" in ln for ln in lines), lines


class _Writer:
    def add_scalar(self, *args, **kwargs):
        pass
