"""What every Hugging Face equality test does with a Megatron student: transformers' logits, the
student's (tensor-parallel shards gathered), the student built as ``megatron-kd train`` builds it,
and one fused-vs-dense KD step on it."""

from __future__ import annotations

import torch

from kd_inputs import rel_err, teacher_topk
from tiny_gpt_oss import TOKENIZER_TOKENS, VOCAB_ROWS


def reference_logits(hf_dir, tokens):
    """transformers' fp32 logits of ``hf_dir``'s model [b, s, V]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def megatron_logits(model, tokens, tp_group=None):
    """Full-vocabulary logits of a megatron GPTModel [b, s, V] (TP shards gathered, padded rows cut)."""
    with torch.no_grad():
        out = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    if tp_group is not None and tp_group.size() > 1:
        parts = [torch.empty_like(out) for _ in range(tp_group.size())]
        torch.distributed.all_gather(parts, out.contiguous(), group=tp_group)
        out = torch.cat(parts, -1)
    return out[..., :VOCAB_ROWS]


def build_student(flags):
    """parse_megatron_args + model_provider: what ``megatron-kd train --kd-student-hf`` runs."""
    from megatron.core import parallel_state

    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.run import model_provider

    args = parse_megatron_args(flags)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                             expert_model_parallel_size=args.expert_model_parallel_size,
                                             expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    return args, model_provider()


def forget_megatron() -> None:
    """Drop Megatron-LM's global arguments and megatron-core's process groups, so that one process
    can build another model from other flags (one spawn per case costs ~20 s of imports)."""
    from megatron.core import parallel_state
    from megatron.training.global_vars import unset_global_variables

    unset_global_variables()
    parallel_state.destroy_model_parallel()


def safetensors_of(path) -> dict:
    """Every tensor of a Hugging Face directory's safetensors files, by name."""
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_same_tensors(a_dir, b_dir) -> None:
    """Two Hugging Face directories hold the same tensor names with bit-identical values."""
    a, b = safetensors_of(a_dir), safetensors_of(b_dir)
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key in a:
        assert torch.equal(a[key], b[key]), key


def kd_step(model, tp_group, seed, seq, *, experts: bool):
    """Fused vs dense KD loss and grads on the model (fp32: the loss to 1e-5, every gradient to 1e-4,
    the fused op's chunked roundings); then one SGD step must lower the fused loss."""
    from megatron_kd.megatron.args import KDConfig
    from megatron_kd.megatron.loss import KDForwardStep

    g = torch.Generator().manual_seed(seed)
    b, k = 2, 8
    tokens = torch.randint(3, TOKENIZER_TOKENS, (b, seq), generator=g)
    torch.manual_seed(seed)
    ids, lps = teacher_topk(b * seq, TOKENIZER_TOKENS, k)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": torch.arange(seq).expand(b, seq),
             "loss_mask": torch.ones(b, seq), "teacher_ids": ids.view(b, seq, k).int(),
             "teacher_logprobs": lps.view(b, seq, k)}
    results = {}
    for impl in ("dense", "fused"):
        model.zero_grad()
        step = KDForwardStep(KDConfig(impl=impl, ce_weight=0.1, tail="ghost", chunk_size=13), tp_group=tp_group,
                             device=torch.device("cpu"))
        output, loss_fn = step(iter([batch]), model)
        loss = loss_fn(output)[0]
        loss.backward()
        results[impl] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (l_dense, g_dense), (l_fused, g_fused) = results["dense"], results["fused"]
    assert rel_err(l_fused, l_dense) < 1e-5
    assert g_fused.keys() == g_dense.keys() and any("local_experts" in n for n in g_fused) == experts
    for name in g_fused:
        assert rel_err(g_fused[name], g_dense[name]) < 1e-4, name
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad
    output, loss_fn = step(iter([batch]), model)
    assert loss_fn(output)[0] < l_fused
