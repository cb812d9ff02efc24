"""The teacher pass on a GPU (skipped without CUDA): its loop never waits for the device, and what
it stores is what the host-side path stores.

A pass that synchronized per micro-batch (pageable host-to-device copies, the entries' checks read
back, the encoded rows copied to the host) let the GPU's queue drain between forwards, and the
next forward's launches then waited on the store threads. The loop's own work runs under torch's
sync debug mode: only the teacher's forward (a transformers model, whose own masks may synchronize)
is exempt, and one synchronization is allowed after the loop (the summary's mean teacher mass).
"""

import warnings

import pytest
import torch

from megatron_kd.cache import CacheReader, CacheWriter
from megatron_kd.megatron.data import ByteTokenizer
from megatron_kd.teacher import CaptureConfig, HFTeacher, capture_teacher
from tests.fixtures.tiny_teacher import K, SEQ, make_dataset

pytestmark = pytest.mark.cuda
VOCAB = ByteTokenizer().vocab_size


class _ForwardExempt:
    """The teacher, its forward run with the sync debug mode off."""

    def __init__(self, teacher):
        self.teacher, self.model, self.tp_group, self.vocab_size = teacher, teacher.model, None, teacher.vocab_size

    def __call__(self, tokens, position_ids):
        if not tokens.is_cuda:
            return self.teacher(tokens, position_ids)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return self.teacher(tokens, position_ids)
        finally:
            torch.cuda.set_sync_debug_mode(mode)


def _store(teacher, dataset, path, cfg: CaptureConfig, device: str) -> list[str]:
    """One pass into a new cache at ``path``; the synchronizations the loop's own work made (CUDA)."""
    metadata = {"teacher_fingerprint": teacher.fingerprint}
    if cfg.mode == "sampled":
        metadata.update(mode="sampled", sampled_draws=cfg.topk)
    with CacheWriter(path, vocab_size=VOCAB, topk=K, seq_length=SEQ, num_samples=len(dataset),
                     metadata=metadata) as writer:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                capture_teacher(_ForwardExempt(teacher), dataset, writer, cfg, device=device, progress=False)
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
    # (torch's first switch into the mode also warns that it is a prototype: not a synchronization)
    return [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_the_pass_loop_does_not_wait_for_the_gpu(tmp_path, mode):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    dataset = make_dataset(tmp_path, num_samples=12)
    cfg = CaptureConfig(topk=K, draws=K, micro_batch_size=2, mode=mode, store_workers=2)
    _store(HFTeacher(model), dataset, tmp_path / "cpu", cfg, "cpu")
    teacher = HFTeacher(model.cuda())
    teacher(torch.stack([torch.as_tensor(dataset[0]["tokens"])]).cuda())  # its one-time logits check
    syncs = _store(teacher, dataset, tmp_path / "cuda", cfg, "cuda")
    assert len(syncs) <= 1, syncs  # the summary's teacher mass, after the loop
    (ids_gpu, _), (ids_cpu, _) = (CacheReader(tmp_path / d).read(range(len(dataset))) for d in ("cuda", "cpu"))
    # the same fp32 teacher on either device: the same entries but where a near-tie or a draw's
    # uniform on a CDF boundary falls the other way
    agree = (ids_gpu.sort(-1).values == ids_cpu.sort(-1).values).all(-1).double().mean()
    assert agree > 0.95, float(agree)
