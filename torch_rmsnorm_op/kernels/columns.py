"""The backward for a few rows: each program owns a block of columns of every row.

A grid of row groups over a few rows leaves one program per row and a dweight partial row
per program, which a second launch sums (``reduce.py``). Here every program holds all of the
rows (``BLOCK_M >= M``): it first sums each row's ``dy * w * x`` over the whole of N, in steps
of ``BLOCK_N`` columns (every program computes the same sums in the same order), then writes
dx and dweight for its own ``COLUMNS`` columns. dweight is a column sum over all the rows, so
the program stores it finished: one launch, no scratch. Each program reads all of x and dy
once (from L2 after the first), which bounds the rows this serves (``config.BWD_COLUMNS_MAX_M``).
"""

import triton
import triton.language as tl

from torch_rmsnorm_op.kernels.common import _load_dy, _load_f32, _row_offset, _weight


@triton.jit
def _rms_norm_bwd_columns(
    DY,  # upstream gradient [M, N], row stride dy_stride
    DY2,  # more terms of it, [M, N] with DY's strides, summed into it (read if DY_TERMS > 1)
    DY3,  # (read if DY_TERMS > 2)
    X,  # forward input [M, N], rows addressed by _row_offset
    W,  # weight [N] (read if HAS_WEIGHT)
    RSTD,  # [M] fp32, saved by the forward
    DX,  # output [M, N], row stride dx_stride
    DRES,  # gradient that reached x + residual [M, N], row stride dres_stride (read if HAS_DRES)
    DW,  # output dweight [N] (written if HAS_WEIGHT), in its own dtype
    M,
    N,
    x_size1,
    x_size2,
    x_stride0,
    x_stride1,
    x_stride2,
    dy_stride,
    dx_stride,
    dres_stride,
    BLOCK_M: tl.constexpr,  # >= M: every row in one tile
    BLOCK_N: tl.constexpr,  # columns per step of the row sums
    COLUMNS: tl.constexpr,  # columns of dx and dweight this program writes
    HAS_WEIGHT: tl.constexpr,
    HAS_DRES: tl.constexpr,
    LEAD_DIMS: tl.constexpr,
    STAGES: tl.constexpr,  # the row sums' loop num_stages
    WEIGHT_OFFSET: tl.constexpr,
    DY_TERMS: tl.constexpr,  # dy is the sum of this many tensors (kernels.common._load_dy)
):
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_mask = rows < M
    x_rows = _row_offset(rows, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS)[:, None]
    dy_rows = rows[:, None] * dy_stride
    # Each row's sum of dy * w * x over all of N.
    c = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in tl.range(0, N, BLOCK_N, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_f32(X + x_rows + cols[None, :], mask, "evict_last")
        u = _load_dy(DY, DY2, DY3, dy_rows + cols[None, :], mask, "evict_last", DY_TERMS).to(tl.float32)
        if HAS_WEIGHT:
            u = u * _weight(tl.load(W + cols, mask=col_mask, other=0.0), WEIGHT_OFFSET)[None, :]
        c += tl.sum(u * x, axis=1)
    c = c / N
    # This program's columns of dx and dweight.
    cols = tl.program_id(0) * COLUMNS + tl.arange(0, COLUMNS)
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = _load_f32(X + x_rows + cols[None, :], mask, "evict_first")
    dy = _load_dy(DY, DY2, DY3, dy_rows + cols[None, :], mask, "evict_first", DY_TERMS).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    u = dy
    if HAS_WEIGHT:
        u = dy * _weight(tl.load(W + cols, mask=col_mask, other=0.0), WEIGHT_OFFSET)[None, :]
    dx = (u - x * (rstd * rstd * c)[:, None]) * rstd[:, None]
    if HAS_DRES:
        dx += _load_f32(DRES + rows[:, None] * dres_stride + cols[None, :], mask, "")
    tl.store(DX + rows[:, None] * dx_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        dw = tl.sum(dy * x * rstd[:, None], axis=0)
        tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=col_mask)
