"""The dweight reduction: the backward's fp32 partial rows summed in a fixed order."""

import triton
import triton.language as tl


@triton.jit
def _rms_norm_dw_reduce(
    PARTIAL,  # [P, N] fp32 partial rows
    OUT,  # [splits, N]: fp32 (first of two stages) or dweight's dtype ([1, N], last stage)
    P,
    N,
    rows_per_split,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (column tile, split) sums its split's partial rows. Fixed order: BLOCK_P-row
    # tiles in sequence, each summed by the same tree; the launcher fixes the splits.
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1).to(tl.int64)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, rows_per_split, BLOCK_P):
        i = start + tl.arange(0, BLOCK_P)
        p = split * rows_per_split + i
        mask = ((i < rows_per_split) & (p < P))[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + p[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + split * N + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)
