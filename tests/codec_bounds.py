"""How far a store's log-probs may be from the teacher's, by the store's codec (megatron_kd/cache/encodings.py).

topk-v1 and topk-v2 keep every probability >= 2^-30 within 2^-9 relative (uint16 codes of 1/257
nat); topk-v3 keeps |p̂ - p| <= (e^(step/2) - 1)·(min(p, 1 - p) + c) (one-byte levels), plus the
float32 rounding of the decoded log-prob. Tests of the store's mechanics (resume, partitions, the
teacher pass) compare through this, so they hold whichever codec the writer picks by default.
"""

from __future__ import annotations

import math

import torch

from megatron_kd.cache import entry_codecs as ec
from megatron_kd.cache.encodings import TOPK_V1, TOPK_V2, TOPK_V3

CODE_FLOOR = -30 * math.log(2)  # topk-v1/v2: below p = 2^-30 the relative bound is not promised
LEVEL_ERR = math.expm1(ec.LEVEL_STEP / 2)  # topk-v3: a level's relative error of p (or of 1 - p)


def topk_v3_bound(want, *, slack: float = 0.0) -> torch.Tensor:
    """Per entry, the most |p̂ - p| topk-v3 allows for the teacher's log-probs ``want`` (float64):
    its level's error, float32 rounding of the decoded log-prob, and ``slack`` nats before coding."""
    want = torch.as_tensor(want).double()
    p = want.exp()
    rounding = p * (want.abs() + 1) * 2.0**-23
    return LEVEL_ERR * (torch.minimum(p, 1 - p) + ec.LEVEL_FLOOR) + (1 + LEVEL_ERR) * p * math.expm1(slack) + rounding


def assert_within_codec(got, want, codec: str, *, slack: float = 0.0) -> None:
    """``got``: log-probs read from a store of ``codec``; ``want``: the teacher's, entry for entry.
    ``slack``: nats by which the pass's log-probs may differ from ``want`` before coding (two
    computations of the same teacher)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert got.shape == want.shape, (got.shape, want.shape)
    if codec in (TOPK_V1, TOPK_V2):
        err = torch.expm1(got - want).abs()
        bound = torch.full_like(err, math.expm1(slack) + 2**-9)
        checked = want >= CODE_FLOOR
    elif codec == TOPK_V3:
        err = (got.exp() - want.exp()).abs()
        bound = topk_v3_bound(want, slack=slack)
        checked = torch.ones_like(err, dtype=torch.bool)
    else:
        raise ValueError(f"no log-prob bound for codec {codec!r}")
    over = checked & (err > bound)
    assert not over.any(), (f"{codec}: {int(over.sum())} entries beyond the codec's bound, worst "
                            f"{float((err / bound)[checked].max()):.3g}x it (want {want[over][:4].tolist()}, "
                            f"got {got[over][:4].tolist()})")
