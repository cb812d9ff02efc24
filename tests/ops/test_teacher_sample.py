"""vocab_parallel_sample: the Triton kernels (sample_triton.py) against the torch path and the
teacher's own distribution.

1. draw j of a row is the inverse CDF of softmax(z) at u_j = draw_uniforms(row key)[j], as
   documented: exactly for fp64 logits (torch), on nearly every row for fp32 (Triton)
2. Triton and torch draw the same tokens (both do the same three-level inverse CDF; only the
   summation order inside a tile differs, which can move a draw whose uniform lies within ~1e-7 of
   a boundary: the rows are compared, not required equal to the last one)
3. the draws follow softmax(z) over several tiles (chi-square over cells of >= 40 expected)
4. padding rows past ``vocab_size`` and columns of no mass are never drawn, whatever the weights
5. TP = 2 (gloo), one rank's shard all padding, draws the tokens TP = 1 draws

On CPU the kernels run in Triton's interpreter (conftest sets it without a GPU), so shapes stay
small; on a GPU machine the same tests run them compiled on CUDA tensors.
"""

import pytest
import torch

from megatron_kd.ops.teacher.sample import SAMPLE_TILE, draw_uniforms, sample_row_keys, vocab_parallel_sample
from tests.fixtures.dist_utils import spawn
from tests.fixtures.triton_device import DEVICE, TRITON_DEVICE_MARKS

pytestmark = TRITON_DEVICE_MARKS  # compiled on a GPU (`pytest -m cuda`), else Triton's interpreter


def _keys(rows: int, seed: int = 7) -> torch.Tensor:
    return sample_row_keys(seed, torch.arange(rows), 1)[0].to(DEVICE)


def _same_rows(a, b) -> float:
    """The fraction of rows whose (ids, logprobs) agree exactly."""
    return ((a[0] == b[0]).all(-1) & (a[1] == b[1]).all(-1)).float().mean().item()


@pytest.mark.parametrize("impl, dtype, same_rows", [("torch", torch.float64, 1.0), ("triton", torch.float32, 0.95)])
def test_draws_are_the_inverse_cdf_at_the_row_uniforms(seed, impl, dtype, same_rows):
    """Three levels (shard, tile, column) select what one search of the whole row's fp64 cumulative
    softmax selects: rounding can differ only for a uniform within ~1e-16 (fp64) or ~1e-7 (fp32)
    of a boundary."""
    gen = torch.Generator().manual_seed(seed)
    vocab, vocab_size, rows, draws = 700, 650, 32, 24
    hidden = torch.randn(rows, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, 16, generator=gen, dtype=torch.float64)
    keys = _keys(rows)
    ids, lps = vocab_parallel_sample(hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), draws, row_keys=keys,
                                     vocab_size=vocab_size, impl=impl)
    z = hidden.to(dtype).double() @ weight.to(dtype).double().t()
    cdf = torch.softmax(z[:, :vocab_size], -1).cumsum(-1)
    u = draw_uniforms(keys.cpu(), draws) * cdf[:, -1:]
    want = torch.searchsorted(cdf, u, right=True).clamp_(max=vocab_size - 1)
    counts = torch.zeros(rows, vocab_size, dtype=torch.float64).scatter_add_(1, want, torch.ones_like(u))
    got = torch.zeros(rows, vocab_size, dtype=torch.float64)
    valid = ids.cpu() >= 0
    got[valid.nonzero()[:, 0], ids.cpu()[valid]] = (lps.cpu()[valid].double().exp() * draws).round()
    assert ((got == counts).all(-1)).double().mean().item() >= same_rows


@pytest.mark.parametrize("vocab, vocab_size, draws, temperature", [
    (700, 690, 40, 1.0),  # three tiles, the last one ragged, padding rows; draws not a multiple of 16
    (SAMPLE_TILE, None, 16, 2.0),  # exactly one tile, tempered
    (90, None, 64, 1.0),  # fewer columns than draws
])
def test_triton_draws_the_torch_path_tokens(seed, vocab, vocab_size, draws, temperature):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(48, 16, generator=gen).to(DEVICE)
    weight = (torch.randn(vocab, 16, generator=gen) * 0.8).to(DEVICE)
    kw = dict(row_keys=_keys(48), vocab_size=vocab_size, temperature=temperature, chunk_size=20)
    triton_draws = vocab_parallel_sample(hidden, weight, draws, impl="triton", **kw)
    torch_draws = vocab_parallel_sample(hidden, weight, draws, impl="torch", **kw)
    ids, lps = triton_draws
    assert ids.shape == lps.shape == (48, draws)
    counts = torch.where(ids >= 0, lps.exp(), 0.0) * draws
    assert torch.allclose(counts.sum(-1), torch.full((48,), float(draws), device=DEVICE), atol=1e-3)
    assert ids.max().item() < (vocab_size or vocab)
    assert _same_rows(triton_draws, torch_draws) >= 0.95


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_draws_follow_the_teacher_distribution(seed, impl):
    """One row of logits over three tiles, 400 keys x 80 draws = 32,000 draws: chi-square against
    softmax(z) over cells of consecutive ids holding >= 40 expected draws each."""
    gen = torch.Generator().manual_seed(seed)
    vocab, rows, draws = 600, 400, 80
    logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5
    weight = torch.zeros(vocab, 8, dtype=torch.float64)
    weight[:, 0] = logits
    hidden = torch.zeros(rows, 8)
    hidden[:, 0] = 1.0
    ids, lps = vocab_parallel_sample(hidden.to(DEVICE), weight.float().to(DEVICE), draws, row_keys=_keys(rows),
                                     impl=impl)
    valid = ids >= 0
    observed = torch.zeros(vocab, dtype=torch.float64).scatter_add_(
        0, ids[valid].cpu(), (lps[valid].exp() * draws).round().double().cpu())
    expected = torch.softmax(logits.float().double(), -1) * rows * draws
    assert observed.sum().item() == rows * draws
    cells, edges, acc = [], [0], 0.0  # consecutive ids merged until a cell expects >= 40 draws
    for i, e in enumerate(expected.tolist()):
        acc += e
        if acc >= 40.0:
            edges.append(i + 1)
            acc = 0.0
    edges[-1] = vocab
    obs = torch.stack([observed[a:b].sum() for a, b in zip(edges, edges[1:])])
    exp = torch.stack([expected[a:b].sum() for a, b in zip(edges, edges[1:])])
    chi2 = ((obs - exp) ** 2 / exp).sum()
    p_value = torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0, dtype=torch.float64), chi2 / 2)
    assert len(obs) >= 100 and p_value > 1e-6, (chi2.item(), len(obs))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_padding_and_massless_columns_are_never_drawn(seed, impl):
    """Padding rows past vocab_size carry the largest logits and are still never drawn; a row whose
    mass is all on one column (the others underflow to exp = 0 in fp32) draws it every time, and a
    tile boundary column (255) takes its draws like any other."""
    vocab, vocab_size, draws = 520, 500, 32
    weight = torch.randn(vocab, 4) * 0.1
    weight[vocab_size:, 0] = 100.0  # padding: would take every draw if it were a token
    weight[SAMPLE_TILE - 1, 1] = 200.0
    hidden = torch.zeros(6, 4)
    hidden[:3, 0] = 1.0  # rows 0-2: the real tokens' logits, padding far above them
    hidden[3:, 1] = 1.0  # rows 3-5: column 255 at 200, every other column near 0
    ids, lps = vocab_parallel_sample(hidden.to(DEVICE), weight.to(DEVICE), draws, row_keys=_keys(6),
                                     vocab_size=vocab_size, impl=impl)
    assert ids.max().item() < vocab_size
    assert ids[3:, 0].tolist() == [SAMPLE_TILE - 1] * 3 and lps[3:, 0].tolist() == [0.0] * 3
    assert (ids[3:, 1:] == -1).all()
    assert (ids[:3] >= 0).sum().item() > 3  # the real tokens' near-uniform rows spread their draws


def _tp_sample_worker(rank, world, seed, impl):
    from tests.fixtures.dist_utils import init_tensor_parallel, megatron_cpu_patches

    with megatron_cpu_patches():
        group = init_tensor_parallel(world)
        gen = torch.Generator().manual_seed(seed)
        vocab, vocab_size, rows, draws = 640, 300, 40, 24  # shards of 320: rank 1's rows all padding
        hidden = torch.randn(rows, 16, generator=gen)
        weight = torch.randn(vocab, 16, generator=gen)
        keys = sample_row_keys(seed, torch.arange(rows), 1)[0]
        kw = dict(row_keys=keys, vocab_size=vocab_size, impl=impl, chunk_size=16)
        split = vocab_parallel_sample(hidden, weight.chunk(world)[rank], draws, tp_group=group, **kw)
        alone = vocab_parallel_sample(hidden, weight, draws, **kw)
        assert split[0].max().item() < vocab_size
        assert _same_rows(split, alone) >= 0.95


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_tp2_draws_the_tp1_tokens_with_a_shard_of_padding(seed, impl):
    spawn(_tp_sample_worker, seed, impl, world_size=2)
