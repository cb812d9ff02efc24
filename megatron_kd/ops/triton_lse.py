"""Per-lane online log-sum-exp pieces of the Triton kernels (the teacher top-K pass), and ``LOG2E``
for every kernel of both ops.

A program walks a row in tiles of BLOCK_V lanes; every lane keeps its own running max m and
s = Σ exp2((x - m)·scale) (scale = log2(e)/τ), so no cross-lane reduction happens inside the loop.
Lanes that have seen no finite value yet (m = -inf) are referenced to 0 instead, which keeps the
arithmetic free of inf - inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A constexpr so kernels may read it as a global (Triton refuses plain Python globals); host code
# uses LOG2E.value.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def online_sumexp(s, m_old, m_new, z, scale):
    """s rescaled from running max m_old to m_new = max(m_old, z), plus this tile's term."""
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return s * tl.exp2((m_old - m_ref) * scale) + tl.exp2((z - m_ref) * scale)


@triton.jit
def lanes_sumexp(s, m, row_max, scale):
    """Σ over lanes of s rescaled to the row max: the row's Σ exp2((x - row_max)·scale)."""
    lane_ref = tl.where(m == float("-inf"), row_max, m)
    return tl.sum(s * tl.exp2((lane_ref - row_max) * scale), axis=0)
