"""The dweight reduction: the backward's fp32 partial rows summed in a fixed order."""

import triton
import triton.language as tl


@triton.jit
def _rms_norm_dw_reduce(
    PARTIAL,  # [P, N] fp32 partial rows
    OUT,  # [N] dweight
    P,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (column tile) sums every partial row. Fixed order: BLOCK_P-row tiles in sequence,
    # each summed by the same tree.
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + p[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)
