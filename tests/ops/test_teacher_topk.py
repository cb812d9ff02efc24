"""vocab_parallel_topk: the Triton candidate kernel against torch.topk of the full log-softmax.

On CPU the kernel runs in Triton's interpreter (conftest sets it without a GPU), so shapes stay
tiny; on a GPU machine the same tests run it compiled on CUDA tensors.
"""

import pytest
import torch

from megatron_kd.ops.teacher.topk import vocab_parallel_topk
from tests.fixtures.triton_device import DEVICE, TRITON_DEVICE_MARKS

pytestmark = TRITON_DEVICE_MARKS  # compiled on a GPU (`pytest -m cuda`), else Triton's interpreter


def _full_topk(hidden, weight, k, vocab_size=None, temperature=1.0):
    z = (hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().t()) / temperature
    if vocab_size is not None:
        z[:, vocab_size:] = float("-inf")
    return torch.log_softmax(z, -1).topk(k, -1)


@pytest.mark.parametrize("vocab, k, vocab_size, temperature", [
    (4500, 16, None, 1.0),  # two 4096-lane tiles, the last one ragged
    (300, 8, 290, 2.0),  # padded vocabulary rows, tempered
    (40, 64, None, 1.0),  # K larger than the vocabulary shard: all of it
])
def test_triton_topk_equals_full_log_softmax(seed, vocab, k, vocab_size, temperature):
    hidden = torch.randn(2, 3, 16, device=DEVICE)
    weight = torch.randn(vocab, 16, device=DEVICE) * 1.5
    k_eff = min(k, vocab_size or vocab)
    ids, lps = vocab_parallel_topk(hidden, weight, k_eff, vocab_size=vocab_size, temperature=temperature,
                                   chunk_size=5, impl="triton")
    ref = _full_topk(hidden, weight, k_eff, vocab_size, temperature)
    assert ids.shape == (2, 3, k_eff)
    assert torch.equal(ids.reshape(-1, k_eff).cpu(), ref.indices.cpu())
    assert (lps.reshape(-1, k_eff).double() - ref.values).abs().max().item() <= 1e-5


def test_triton_topk_rows_of_ties_fall_back_exactly(seed):
    """A row whose logits are all equal puts every column above the threshold (more than the
    candidate list holds); it is redone with torch.topk and still gets K distinct ids."""
    vocab, k = 1200, 8
    hidden = torch.randn(4, 16, device=DEVICE)
    hidden[1] = 0.0  # all logits 0: log p = -log V everywhere
    weight = torch.randn(vocab, 16, device=DEVICE)
    ids, lps = vocab_parallel_topk(hidden, weight, k, impl="triton")
    ref = _full_topk(hidden, weight, k)
    assert torch.allclose(lps.double().cpu(), ref.values.cpu(), atol=1e-5)
    assert ids[1].unique().numel() == k
    assert torch.equal(ids[[0, 2, 3]].cpu(), ref.indices[[0, 2, 3]].cpu())


def test_triton_topk_lane_holding_three_of_the_top_values(seed):
    """Columns 0, 4096 and 8192 share one kernel lane (4096 lanes); when they are the row's three
    largest, the lane keeps two and flags the row, which is redone exactly."""
    vocab, k = 8300, 4
    hidden = torch.zeros(2, 16, device=DEVICE)
    hidden[:, 0] = 1.0
    weight = torch.randn(vocab, 16, device=DEVICE) * 0.1
    weight[[0, 4096, 8192], 0] = torch.tensor([10.0, 9.0, 8.0], device=DEVICE)
    ids, lps = vocab_parallel_topk(hidden, weight, k, impl="triton")
    ref = _full_topk(hidden, weight, k)
    assert torch.equal(ids.cpu(), ref.indices.cpu())
    assert (lps.double().cpu() - ref.values.cpu()).abs().max().item() <= 1e-5
    assert ids[:, :3].tolist() == [[0, 4096, 8192]] * 2


def test_triton_topk_flat_top_keeps_the_values_above_the_ties(seed):
    """More values tie at the K-th largest than the candidate list holds, below a few distinct
    larger ones (rows found by bisection in the kernel): the larger ones come first, exactly, and
    the rest of the K are distinct columns of the tie."""
    vocab, k = 5000, 8
    logits = torch.randn(2, vocab, dtype=torch.float64) - 10.0
    ties = torch.randperm(vocab)[:1500]  # 1,500 > the kernel's 512 candidates at K = 8
    logits[:, ties] = 0.0
    above = ties[:5]
    logits[:, above] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    hidden = torch.zeros(2, 16, device=DEVICE)
    hidden[:, 0] = 1.0
    weight = torch.zeros(vocab, 16, device=DEVICE)
    weight[:, 0] = logits[0].float().to(DEVICE)
    ids, lps = vocab_parallel_topk(hidden, weight, k, impl="triton")
    ref = _full_topk(hidden, weight, k)
    assert (lps.double().cpu() - ref.values.cpu()).abs().max().item() <= 1e-5
    assert ids[:, :5].cpu().tolist() == [above.tolist()] * 2
    tied = set(ties[5:].tolist())
    for row in ids[:, 5:].cpu().tolist():
        assert len(set(row)) == 3 and set(row) <= tied
