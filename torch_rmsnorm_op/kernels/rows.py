"""Whole rows per program: the forward for rows that fit in registers, and the backward.

Forward: a program holds ``ROWS`` rows of ``BLOCK_N >= N`` columns in registers and reads x
once; several rows per program for small N. Without masks (``UNMASKED``) where the tiles cover
x exactly. The weight is loaded after the row's sum, or, with ``EARLY_WEIGHT``, before x, so
that no load waits between the sum and y's store (``config.with_early_weight`` says where; a
forward that stores neither rstd nor a sum holds those loads there with a barrier). The
norm-add forward normalizes x, adds the result to the residual and normalizes the sum, all in
registers: x and the residual read once, the sum and y written once.

Backward: a program walks its group of ``rows_per_group`` rows one ``ROWS``-row tile at a
time, writes dx and accumulates its group's dweight partial row in fp32 (scratch is groups x
N, never M x N; ``reduce.py`` sums the partials in a fixed order). Over a few rows
(``DW_COLUMNS``) the launch has programs of a second kind after the row groups: each sums
dweight over every row for a block of columns, from dy, x and the saved rstd, and writes it;
the row groups then write dx only, and no scratch or reduction launch is needed.
"""

import triton
import triton.language as tl

from torch_rmsnorm_op.kernels.common import (
    _bf16_exact,
    _load_dy,
    _load_f32,
    _load_terms,
    _residual_sum,
    _row_offset,
    _rstd,
    _scale,
    _store_partial,
    _sum_terms,
    _weight,
)


@triton.jit
def _accumulate(acc, tile, ACC_ROWS: tl.constexpr):
    """``acc`` [ACC_ROWS, BLOCK_N] plus ``tile`` [ROWS, BLOCK_N]: row by row, or (ACC_ROWS 1) its column sums."""
    if ACC_ROWS == 1:
        acc += tl.sum(tile, axis=0)[None, :]
    else:
        acc += tile
    return acc


@triton.jit
def _dweight_columns(DY, DY2, DY3, DY4, DY5, X, RSTD, DW, M, N, block, x_size1, x_size2, x_stride0, x_stride1,
                     x_stride2, dy_stride, DW_COLUMNS: tl.constexpr, DW_ROWS: tl.constexpr, LEAD_DIMS: tl.constexpr,
                     DY_TERMS: tl.constexpr):
    """dweight for columns ``block * DW_COLUMNS`` on: the sum over all M rows of dy * x * rstd,
    ``DW_ROWS`` rows a step (fixed order), written in DW's dtype."""
    cols = block * DW_COLUMNS + tl.arange(0, DW_COLUMNS)
    col_mask = cols < N
    acc = tl.zeros([DW_ROWS, DW_COLUMNS], dtype=tl.float32)
    for first in range(0, M, DW_ROWS):
        rows = first + tl.arange(0, DW_ROWS).to(tl.int64)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        x_rows = _row_offset(rows, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS)
        x = _load_f32(X + x_rows[:, None] + cols[None, :], mask, "")
        dy = _load_dy(DY, DY2, DY3, DY4, DY5, rows[:, None] * dy_stride + cols[None, :], mask, "",
                      DY_TERMS).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        acc += dy * x * rstd[:, None]
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


@triton.jit
def _rms_norm_fwd_rows(
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
    ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LEAD_DIMS: tl.constexpr,  # x's leading dims after merging (_row_offset)
    UNMASKED: tl.constexpr,  # the tiles cover x exactly: no masks
    STORE_RSTD: tl.constexpr,  # False when nothing will read rstd (inference)
    WEIGHT_OFFSET: tl.constexpr,  # the weight scales as w + WEIGHT_OFFSET
    ROUND: tl.constexpr,  # round x * rstd to fp16 (1) or bf16 (2) before the weight
    EARLY_WEIGHT: tl.constexpr,  # load the weight before x, not after the row's sum (KernelConfig)
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    if UNMASKED:
        row_mask, col_mask, mask, other = None, None, None, None
    else:
        row_mask, col_mask, other = rows < M, cols < N, 0.0
        mask = row_mask[:, None] & col_mask[None, :]
    w = 0.0
    if HAS_WEIGHT and EARLY_WEIGHT:
        w = _weight(tl.load(W + cols, mask=col_mask, other=other), WEIGHT_OFFSET)[None, :]
    x_rows = _row_offset(rows, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS)
    x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=other)
    if HAS_WEIGHT and EARLY_WEIGHT and not STORE_RSTD and not HAS_RESIDUAL:
        # ptxas moves no load across a barrier. Without it (and without the rstd store, which
        # changes its schedule) it issues most of a wide tile's weight loads after the row's sum,
        # where their latency sits before y's store (config.EARLY_WEIGHT_ELEMENTS)
        tl.debug_barrier()
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * r_stride + cols[None, :], mask=mask, other=other)
        x = _residual_sum(x, r, H.dtype.element_ty)
        tl.store(H + rows[:, None] * h_stride + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    rstd = _rstd(tl.sum(x * x, axis=1), N, eps)
    if HAS_WEIGHT and not EARLY_WEIGHT:
        w = _weight(tl.load(W + cols, mask=col_mask, other=other), WEIGHT_OFFSET)[None, :]
    y = _scale(x, rstd[:, None], w, HAS_WEIGHT, ROUND)
    tl.store(Y + rows[:, None] * y_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_fwd_norm_add_rows(
    X,  # input [M, N], rows addressed by _row_offset (last dim contiguous)
    R,  # residual [M, N], row stride r_stride
    XW,  # x's weight [N] (read if HAS_X_WEIGHT, else None)
    W,  # weight [N] of the sum's norm (read if HAS_WEIGHT, else None)
    Y,  # output [M, N], row stride y_stride
    H,  # output residual + rmsnorm(x) [M, N], row stride h_stride
    RSTD,  # output [M] fp32, the sum's (written if STORE_RSTD, else None)
    X_RSTD,  # output [M] fp32, x's (written if STORE_RSTD, else None)
    M,
    N,
    x_eps,
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
    ROWS: tl.constexpr,
    HAS_X_WEIGHT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    LEAD_DIMS: tl.constexpr,
    UNMASKED: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,  # both weights scale as w + WEIGHT_OFFSET
    ROUND: tl.constexpr,  # both norms round x * rstd so before their weight
    EARLY_WEIGHT: tl.constexpr,  # load both weights before x, as in _rms_norm_fwd_rows
):
    # The prologue and the normalization as in _rms_norm_fwd_rows, written out: a @triton.jit helper
    # cannot return the None masks of UNMASKED (Triton 3.6: "cannot convert None ... to tensor").
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    if UNMASKED:
        row_mask, col_mask, mask, other = None, None, None, None
    else:
        row_mask, col_mask, other = rows < M, cols < N, 0.0
        mask = row_mask[:, None] & col_mask[None, :]
    xw, w = 0.0, 0.0
    if EARLY_WEIGHT:
        if HAS_X_WEIGHT:
            xw = _weight(tl.load(XW + cols, mask=col_mask, other=other), WEIGHT_OFFSET)[None, :]
        if HAS_WEIGHT:
            w = _weight(tl.load(W + cols, mask=col_mask, other=other), WEIGHT_OFFSET)[None, :]
    x_rows = _row_offset(rows, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS)
    x = tl.load(X + x_rows[:, None] + cols[None, :], mask=mask, other=other)
    r = tl.load(R + rows[:, None] * r_stride + cols[None, :], mask=mask, other=other)
    # x's norm, rounded to x's dtype as the op without a residual writes it
    x_normed_ty = x.dtype
    x = x.to(tl.float32)
    x_rstd = _rstd(tl.sum(x * x, axis=1), N, x_eps)
    if HAS_X_WEIGHT and not EARLY_WEIGHT:
        xw = _weight(tl.load(XW + cols, mask=col_mask, other=other), WEIGHT_OFFSET)[None, :]
    x_normed = _scale(x, x_rstd[:, None], xw, HAS_X_WEIGHT, ROUND)
    if ROUND == 2:  # bf16 x, rounded before its weight too (the launcher's rule): kept from the add's contraction
        x_normed = _bf16_exact(x_normed)
    else:
        x_normed = x_normed.to(x_normed_ty)
    # then the op with a residual on (residual, x_normed)
    h = _residual_sum(x_normed, r, H.dtype.element_ty)
    tl.store(H + rows[:, None] * h_stride + cols[None, :], h, mask=mask)
    h = h.to(tl.float32)
    rstd = _rstd(tl.sum(h * h, axis=1), N, eps)
    if HAS_WEIGHT and not EARLY_WEIGHT:
        w = _weight(tl.load(W + cols, mask=col_mask, other=other), WEIGHT_OFFSET)[None, :]
    y = _scale(h, rstd[:, None], w, HAS_WEIGHT, ROUND)
    tl.store(Y + rows[:, None] * y_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_mask)
        tl.store(X_RSTD + rows, x_rstd, mask=row_mask)


@triton.jit
def _load_tile(X, DY, DY2, DY3, DY4, DY5, RSTD, rows, row_end, cols, col_mask, x_size1, x_size2, x_stride0,
               x_stride1, x_stride2, dy_stride, LEAD_DIMS: tl.constexpr, DY_TERMS: tl.constexpr):
    """Rows ``rows`` of x and of each dy term, in their own dtypes (0 past ``row_end``), and their rstd."""
    row_mask = rows < row_end
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + _row_offset(rows, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS)[:, None]
                + cols[None, :], mask=mask, other=0.0)
    dy, dy2, dy3, dy4, dy5 = _load_terms(DY, DY2, DY3, DY4, DY5, rows[:, None] * dy_stride + cols[None, :], mask,
                                         "", DY_TERMS)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    return x, dy, dy2, dy3, dy4, dy5, rstd


@triton.jit
def _rms_norm_bwd_rows(
    DY,  # upstream gradient [M, N], row stride dy_stride
    DY2,  # more terms of it, [M, N] with DY's strides, summed into it (read if DY_TERMS > 1, else None)
    DY3,  # (read if DY_TERMS > 2, else None)
    DY4,  # (read if DY_TERMS > 3, else None)
    DY5,  # (read if DY_TERMS > 4, else None)
    X,  # forward input [M, N], rows addressed by _row_offset
    W,  # weight [N] (read if HAS_WEIGHT, else None)
    RSTD,  # [M] fp32, saved by the forward
    DX,  # output [M, N], row stride dx_stride
    DRES,  # gradient that reached x + residual [M, N], row stride dres_stride (read if HAS_DRES, else None)
    DW_PARTIAL,  # scratch [row groups, N] fp32, or [cdiv(row groups, 2), N] if MERGE: dweight partials;
    # dweight itself [N] with one row group, or with DW_COLUMNS
    DW_FLAGS,  # if MERGE: [cdiv(row groups, 2)] int32 zeros, _merge_partial's flags; else None
    M,
    N,
    rows_per_group,
    x_size1,
    x_size2,
    x_stride0,
    x_stride1,
    x_stride2,
    dy_stride,
    dx_stride,
    dres_stride,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DRES: tl.constexpr,
    LEAD_DIMS: tl.constexpr,
    COUNTED_LOOP: tl.constexpr,  # the row loop runs 0..rows_per_group, else row_start..row_end
    RELOAD: tl.constexpr,  # read x and dy again after the row sum (from L1/L2)
    STAGES: tl.constexpr,  # the row loop's num_stages: > 1 has Triton prefetch its loads into shared memory
    PREFETCH: tl.constexpr,  # each iteration loads the next tile into registers before its own arithmetic
    MERGE: tl.constexpr,  # two groups share a partial row (_merge_partial)
    WEIGHT_OFFSET: tl.constexpr,
    ACC_ROWS: tl.constexpr,  # rows of the dweight accumulator: ROWS, or 1 (each tile summed as it goes)
    DY_TERMS: tl.constexpr,  # dy is the sum of this many tensors (kernels.common._load_dy)
    DW_COLUMNS: tl.constexpr,  # > 0 (with a weight): programs past the row groups write dweight, this many
    # columns each
    DW_ROWS: tl.constexpr,  # rows a step of those programs
):
    group = tl.program_id(0).to(tl.int64)
    if DW_COLUMNS > 0:
        groups = tl.cdiv(M, rows_per_group)
        if group >= groups:
            _dweight_columns(DY, DY2, DY3, DY4, DY5, X, RSTD, DW_PARTIAL, M, N, group - groups, x_size1, x_size2,
                             x_stride0, x_stride1, x_stride2, dy_stride, DW_COLUMNS, DW_ROWS, LEAD_DIMS, DY_TERMS)
            return
    # The row groups accumulate dweight partials unless the programs above write it.
    PARTIALS: tl.constexpr = HAS_WEIGHT and DW_COLUMNS == 0
    row_start = group * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = _weight(tl.load(W + cols, mask=col_mask, other=0.0), WEIGHT_OFFSET)
    # One accumulator row per tile row leaves the tile's row sum to the end; one row in all sums
    # each tile as it goes, which costs nothing where every thread holds whole columns of the
    # tile (launch.dweight_acc_rows) and saves ROWS - 1 rows of registers.
    dw_acc = tl.zeros([ACC_ROWS, BLOCK_N], dtype=tl.float32)
    # The loop form alone moves the backward by several % of copy, each way at different N,
    # so the table picks it per rung.
    if COUNTED_LOOP:
        loop_start, loop_end, base = 0, rows_per_group, row_start
    else:
        loop_start, loop_end, base = row_start, row_end, 0
    if PREFETCH:
        next_x, next_dy, next_dy2, next_dy3, next_dy4, next_dy5, next_rstd = _load_tile(
            X, DY, DY2, DY3, DY4, DY5, RSTD, base + loop_start + tl.arange(0, ROWS), row_end, cols, col_mask, x_size1,
            x_size2, x_stride0, x_stride1, x_stride2, dy_stride, LEAD_DIMS, DY_TERMS)
    for first in tl.range(loop_start, loop_end, ROWS, num_stages=STAGES):
        rows = base + first + tl.arange(0, ROWS)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        x_ptrs = X + _row_offset(rows, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS)[:, None] \
            + cols[None, :]
        dy_offs = rows[:, None] * dy_stride + cols[None, :]
        if PREFETCH:
            # The next tile's loads issue before this tile's arithmetic, in its raw dtype: no
            # conversion waits on them until the next iteration.
            x, dy, dy2, dy3, dy4, dy5, rstd = next_x, next_dy, next_dy2, next_dy3, next_dy4, next_dy5, next_rstd
            next_x, next_dy, next_dy2, next_dy3, next_dy4, next_dy5, next_rstd = _load_tile(
                X, DY, DY2, DY3, DY4, DY5, RSTD, rows + ROWS, row_end, cols, col_mask, x_size1, x_size2, x_stride0,
                x_stride1, x_stride2, dy_stride, LEAD_DIMS, DY_TERMS)
            x = x.to(tl.float32)
            dy = _sum_terms(dy, dy2, dy3, dy4, dy5, DY_TERMS).to(tl.float32)
        else:
            x = _load_f32(x_ptrs, mask, "evict_last" if RELOAD else "")
            dy = _load_dy(DY, DY2, DY3, DY4, DY5, dy_offs, mask, "evict_last" if RELOAD else "",
                          DY_TERMS).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < row_end, other=0.0)
        u = dy
        if HAS_WEIGHT:
            u = dy * w[None, :]
            if PARTIALS and not RELOAD:
                dw_acc = _accumulate(dw_acc, dy * x * rstd[:, None], ACC_ROWS)
        c = tl.sum(u * x, axis=1) / N
        if RELOAD:
            # Rather than keep x and dy in registers across the row sum (Inductor's loops do
            # the same); another eviction policy, so the compiler cannot merge the loads.
            x = _load_f32(x_ptrs, mask, "evict_first")
            dy = _load_dy(DY, DY2, DY3, DY4, DY5, dy_offs, mask, "evict_first", DY_TERMS).to(tl.float32)
            u = dy
            if HAS_WEIGHT:
                u = dy * w[None, :]
                if PARTIALS:
                    dw_acc = _accumulate(dw_acc, dy * x * rstd[:, None], ACC_ROWS)
        dx = (u - x * (rstd * rstd * c)[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += _load_f32(DRES + rows[:, None] * dres_stride + cols[None, :], mask, "")
        tl.store(DX + rows[:, None] * dx_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if PARTIALS:
        _store_partial(tl.sum(dw_acc, axis=0), DW_PARTIAL, DW_FLAGS, group, N, cols, col_mask, 1, 0, MERGE)
