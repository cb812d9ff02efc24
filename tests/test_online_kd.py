"""benchmarks/common/online_kd.py on CPU (bench_node's ``--losses online``): the teacher built from its own
flags over the student's arguments, frozen, and the step's loss KL(teacher || student) over the full
vocabulary plus the weighted cross-entropy, with gradients into the student only."""

import torch

from tests.fixtures.dist_utils import megatron_cpu_patches, spawn

# the Llama recipes shrunk: a 2-layer student of width 64 (3b.sh's tied embeddings) and a 3-layer
# teacher of width 96 (8b.sh's untied ones); later flags win, as over the recipes
STUDENT_SIZE = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "4",
                "--num-query-groups", "2", "--kv-channels", "16"]
TEACHER_SIZE = ["--num-layers", "3", "--hidden-size", "96", "--ffn-hidden-size", "160", "--num-attention-heads", "6",
                "--num-query-groups", "2", "--kv-channels", "16"]
# megatron-core's fused bias-dropout-add and SwiGLU are torch.compile'd: on the CPU, seconds of C++ builds
NO_JIT = ["--no-bias-dropout-fusion", "--no-bias-swiglu-fusion"]


def _worker(rank, world_size, seed):
    from megatron.core import parallel_state

    from benchmarks.common.node import SIZES
    from benchmarks.common.online_kd import OnlineKDForwardStep, build_teacher, teacher_args
    from megatron_kd.megatron.args import KDConfig
    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.run import model_provider
    from tests.fixtures.tiny_gpt_oss import CPU_FLAGS, LOCAL_IMPL

    size = SIZES["llama3-3b"]
    with megatron_cpu_patches():
        args = parse_megatron_args([*size.recipe.flags(), *STUDENT_SIZE, *LOCAL_IMPL, *CPU_FLAGS, *NO_JIT,
                                    "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer"])
        parallel_state.initialize_model_parallel()
        torch.manual_seed(seed)
        student = model_provider()
        teacher = build_teacher(teacher_args(args, [*size.online_teacher.flags(layout=False), *TEACHER_SIZE]))
        config = teacher.config
        assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (3, 96, 160)
        assert not teacher.share_embeddings_and_output_weights and student.share_embeddings_and_output_weights
        assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())

        gen = torch.Generator().manual_seed(seed)
        b, s = 2, 32
        tokens = torch.randint(0, 999, (b, s), generator=gen)
        mask = (torch.rand(b, s, generator=gen) > 0.25).float()
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": mask,
                 "position_ids": torch.arange(s).expand(b, s)}
        step = OnlineKDForwardStep(teacher, KDConfig(weight=1.0, ce_weight=0.5), device=torch.device("cpu"))
        output, loss_fn = step(iter([batch]), student)
        loss, tokens_counted, report = loss_fn(output)

        with torch.no_grad():  # by hand: the two models' logits, torch's KL and cross-entropy
            log_p = teacher(tokens, batch["position_ids"], None).log_softmax(-1)
            log_q = student(tokens, batch["position_ids"], None).log_softmax(-1)
        kl = torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
        ce = torch.nn.functional.nll_loss(log_q.transpose(1, 2), batch["labels"], reduction="none")
        assert torch.allclose(loss, ((kl + 0.5 * ce) * mask).sum(), rtol=1e-5)
        assert int(tokens_counted) == int(mask.sum()) and float(report["teacher mass"][0]) == float(mask.sum())
        loss.backward()
        assert all(p.grad is None for p in teacher.parameters())
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())

        # control: with no flags the teacher is the student's architecture; with its weights, KL is 0
        twin = build_teacher(teacher_args(args, []))
        twin.load_state_dict(student.state_dict())
        output, loss_fn = OnlineKDForwardStep(twin, KDConfig(weight=1.0, ce_weight=0.0))(iter([batch]), student)
        assert abs(float(loss_fn(output)[0].detach())) < 1e-4


def test_online_kd_step_is_full_vocabulary_kl_against_a_frozen_teacher(seed):
    spawn(_worker, seed, world_size=1)


def _hf_teacher_worker(rank, world_size, seed, hf_dir):
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from benchmarks.common.online_kd import build_teacher, teacher_args
    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.models.llama import megatron_flags
    from tests.fixtures.hf_equality import megatron_logits, reference_logits
    from tests.fixtures.kd_inputs import rel_err
    from tests.fixtures.tiny_llama import SEQ, tiny_flags

    with megatron_cpu_patches():
        args = parse_megatron_args(tiny_flags(hf_dir))  # the student starts from the same directory
        parallel_state.initialize_model_parallel()
        tokens = torch.randint(0, 990, (2, SEQ), generator=torch.Generator().manual_seed(seed))
        want = reference_logits(hf_dir, tokens)
        # the teacher's flags as a user writes them: hf-flags' output and the directory
        flags = [*megatron_flags(AutoConfig.from_pretrained(hf_dir)), "--kd-teacher-hf", str(hf_dir)]
        teacher = build_teacher(teacher_args(args, flags))
        assert rel_err(megatron_logits(teacher, tokens), want) < 1e-4
        # control: without the directory the teacher keeps its random weights
        random_teacher = build_teacher(teacher_args(args, flags[:-2]))
        assert rel_err(megatron_logits(random_teacher, tokens), want) > 0.5


def test_online_teacher_from_a_hugging_face_directory_computes_its_logits(tmp_path, seed):
    from tests.fixtures.tiny_llama import make_tiny

    hf_dir = make_tiny("llama", tmp_path / "teacher", seed=seed)
    spawn(_hf_teacher_worker, seed, str(hf_dir), world_size=1)
