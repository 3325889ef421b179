"""Looped forward: one row per program in ``BLOCK_N``-column steps, two passes.

The first pass sums the squares (and, with a residual, writes ``h = x + residual``), keeping
what it read in L2 (``evict_last``); the second re-reads it (x, or h) to write y, streaming
it out (``evict_first``): the structure of Inductor's own reduction kernels. No row is held
in registers, so several programs share an SM. Without masks (``UNMASKED``) where N is a
multiple of the step; then the loops have a known length (``STEPS``), which Triton unrolls.
"""

import triton
import triton.language as tl

from torch_rmsnorm_op.kernels.common import _residual_sum, _row_offset, _rstd, _scale, _weight


@triton.jit
def _rms_norm_fwd_looped(
    X,  # input [M, N], rows addressed by _row_offset (last dim contiguous)
    R,  # residual [M, N], row stride r_stride (read if HAS_RESIDUAL, else None)
    W,  # weight [N] (read if HAS_WEIGHT, else None)
    Y,  # output [M, N], row stride y_stride
    H,  # output x + residual [M, N], row stride h_stride (written if HAS_RESIDUAL, else None)
    RSTD,  # output [M] fp32 (written if STORE_RSTD, else None)
    M,
    N,
    eps,
    x_size1,
    x_size2,
    x_stride0,
    x_stride1,
    x_stride2,
    r_stride,
    y_stride,
    h_stride,
    BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LEAD_DIMS: tl.constexpr,
    UNMASKED: tl.constexpr,  # N is a multiple of BLOCK_N: no masks
    STAGES: tl.constexpr,  # the loops' num_stages
    STORE_RSTD: tl.constexpr,
    STEPS: tl.constexpr,  # UNMASKED: N // BLOCK_N, a loop of known length (unrolled); else 0
    WEIGHT_OFFSET: tl.constexpr,
    ROUND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + _row_offset(row, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS)
    other = None if UNMASKED else 0.0
    end = N
    if STEPS > 0:
        end = STEPS * BLOCK_N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in tl.range(0, end, BLOCK_N, num_stages=STAGES, loop_unroll_factor=STEPS if STEPS > 0 else None):
        cols = start + tl.arange(0, BLOCK_N)
        mask = None if UNMASKED else cols < N
        x = tl.load(x_row + cols, mask=mask, other=other, eviction_policy="evict_last")
        if HAS_RESIDUAL:
            r = tl.load(R + row * r_stride + cols, mask=mask, other=other, eviction_policy="evict_first")
            x = _residual_sum(x, r, H.dtype.element_ty)
            tl.store(H + row * h_stride + cols, x, mask=mask, eviction_policy="evict_last")
        x = x.to(tl.float32)
        acc += x * x
    rstd = _rstd(tl.sum(acc, axis=0), N, eps)
    if HAS_RESIDUAL:
        # The second pass reads back the sum this program stored: its threads' stores first.
        tl.debug_barrier()
        x_row = H + row * h_stride
    for start in tl.range(0, end, BLOCK_N, num_stages=STAGES, loop_unroll_factor=STEPS if STEPS > 0 else None):
        cols = start + tl.arange(0, BLOCK_N)
        mask = None if UNMASKED else cols < N
        x = tl.load(x_row + cols, mask=mask, other=other, eviction_policy="evict_first")
        w = 0.0
        if HAS_WEIGHT:
            w = _weight(tl.load(W + cols, mask=mask, other=other, eviction_policy="evict_last"), WEIGHT_OFFSET)
        y = _scale(x.to(tl.float32), rstd, w, HAS_WEIGHT, ROUND)
        tl.store(Y + row * y_stride + cols, y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
