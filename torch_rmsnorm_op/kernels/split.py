"""Split mode: rows too long for one program, spread over ``SPLIT`` programs each.

A persistent grid of row groups; a group's rows are spread over ``SPLIT`` consecutive programs
of one ``BLOCK_N`` chunk each, which walk the group's rows together (``INTERLEAVE``: group g
has rows g, g + groups, ..., so that at any time the groups work on neighbouring rows). Each
program publishes its partial sum for a row in a slot (flag and value in one 64-bit word) and
reads the row's slots until all are set, adding them in one fixed order (``_exchange``, one
inline PTX statement on the GPU): no counters, no fences, no float atomics. A program
publishes its group's next row before it waits for the current one, and Triton's pipeliner
loads rows ``STAGES - 1`` ahead into shared memory, so a row's slots are mostly full when read.
x (and dy) are read once. A row's programs must be resident together: they are numbered
consecutively (blocks start in id order) and the launcher never asks for more programs per
row than the GPU has SMs. Under the Triton interpreter, which runs programs one after another,
the same kernel runs in two launches instead (``PHASE`` 1 publishes, 2 reads), with the same
arithmetic in the same order.

Offsets within a chunk are 32-bit, from pointers moved to the chunk: 64-bit ones took more
registers (Triton 3.6: 220 vs 210 in the backward; the fp32 forward spilled).
"""

import triton
import triton.language as tl

from torch_rmsnorm_op.kernels.common import (
    _dot,
    _load_dy,
    _residual_sum,
    _row_offset,
    _rstd,
    _scale,
    _store_partial,
    _sum_sq,
    _weight,
)


@triton.jit
def _slot_word(value):
    """A partial as published, one 64-bit word: ready flag (bit 32) over its fp32 bits, written
    and read whole, so a reader that sees the flag sees the value: no counter, no fence."""
    return (value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | 0x100000000


# The exchange, per slot of a row (one thread each): publish this program's word if told to (the
# slot it owns in the next row), then read the slot until its flag is set. Relaxed gpu-scope
# accesses: other programs' words come from L2, and by the PTX memory model none of it is a
# data race. One asm statement, so the publish stays before the wait: Triton's loop pipeliner
# moves a store that depends on a pipelined load after other work (the exchange then stalls
# every row), and a polling loop in the kernel stops the pipeliner altogether (it skips loops
# with loops inside; a non-inlined function for the loop shared memory with the prefetched
# rows: wrong results at N = 262144, fp32).
_EXCHANGE_ASM = tl.constexpr("""{
.reg .pred p;
.reg .b64 w;
setp.ne.b32 p, $3, 0;
@p st.relaxed.gpu.global.b64 [$2], $4;
LAB_WAIT:
ld.relaxed.gpu.global.b64 w, [$1];
setp.lt.u64 p, w, 4294967296;
@p bra LAB_WAIT;
mov.b64 $0, w;
}""")


@triton.jit
def _publish(value, SLOTS, chunk, PHASE: tl.constexpr):
    """Publish this program's fp32 partial in slot ``chunk`` of its row."""
    if PHASE != 2:
        tl.atomic_xchg(SLOTS + chunk, _slot_word(value), sem="relaxed")


@triton.jit
def _exchange(value, publish, SLOTS, row, next_row, chunk, SPLIT: tl.constexpr, PHASE: tl.constexpr):
    """Publish ``value``, this program's partial of row ``next_row``, if ``publish``; then read
    row ``row``'s SPLIT slots until every flag is set and return the sum of their values in
    slot order (one fixed order). The launcher zeroes the slots and numbers a row's programs
    consecutively, so every one gets to publish. Under the interpreter (``PHASE`` 1, then 2)
    the publishing and the reading run in separate launches, without waiting."""
    slots = tl.arange(0, SPLIT)
    total = 0.0
    if PHASE == 0:
        words = tl.inline_asm_elementwise(
            _EXCHANGE_ASM, "=l,l,l,r,l",
            [SLOTS + row * SPLIT + slots, SLOTS + next_row * SPLIT + slots,
             ((slots == chunk) & publish).to(tl.int32), _slot_word(value) + tl.zeros([SPLIT], tl.int64)],
            dtype=tl.int64, is_pure=False, pack=1)
    else:
        if publish:
            _publish(value, SLOTS + next_row * SPLIT, chunk, PHASE)
        words = tl.load(SLOTS + row * SPLIT + slots)
    if PHASE != 1:
        total = tl.sum((words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), axis=0)
    return total


@triton.jit
def _group_rows(group, rows_per_group, SPLIT: tl.constexpr, INTERLEAVE: tl.constexpr):
    """``(first row, step)`` of a row group's rows: ``rows_per_group`` consecutive rows, or with
    INTERLEAVE every ``groups``-th row from row ``group``. Rows past M are phantoms either way;
    the slots have ``M + rows_per_group`` rows, past the last one either form reaches."""
    if INTERLEAVE:
        return group, tl.num_programs(0) // SPLIT
    return group * rows_per_group, 1


@triton.jit
def _chunk_mask(row, i, offs, width, M, rows_per_group):
    """This program's columns of its group's row i (row ``row``): none past M or past the group's rows."""
    return offs < tl.where((row < M) & (i < rows_per_group), width, 0)


@triton.jit
def _fwd_chunk(X, R, H, row, mask, offs, x_size1, x_size2, x_stride0, x_stride1, x_stride2, r_stride, h_stride,
               LEAD_DIMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PHASE: tl.constexpr):
    """This program's chunk of row ``row`` as the forward normalizes it: x, or with a residual
    the sum, stored to H as it is formed (once: not by the interpreter's reading phase)."""
    x = tl.load(X + _row_offset(row, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS) + offs,
                mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * r_stride + offs, mask=mask, other=0.0)
        x = _residual_sum(x, r, H.dtype.element_ty)
        if PHASE != 2:
            tl.store(H + row * h_stride + offs, x, mask=mask)
    return x


@triton.jit
def _rms_norm_fwd_split(
    X,  # input [M, N], rows addressed by _row_offset (last dim contiguous)
    R,  # residual [M, N], row stride r_stride (read if HAS_RESIDUAL, else None)
    W,  # weight [N] (read if HAS_WEIGHT, else None)
    Y,  # output [M, N], row stride y_stride
    H,  # output x + residual [M, N], row stride h_stride (written if HAS_RESIDUAL, else None)
    RSTD,  # output [M] fp32 (written if STORE_RSTD, else None)
    SLOTS,  # [M + rows_per_group, SPLIT] int64 zeros: the rows' published partial sums
    M,
    N,
    eps,
    rows_per_group,
    x_size1,
    x_size2,
    x_stride0,
    x_stride1,
    x_stride2,
    r_stride,
    y_stride,
    h_stride,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LEAD_DIMS: tl.constexpr,
    PHASE: tl.constexpr,  # 0 = one launch, programs wait for the slots; 1 = publish only; 2 = read only
    STAGES: tl.constexpr,  # the row loop's num_stages
    STORE_RSTD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    ROUND: tl.constexpr,
):
    # At row i a program publishes its partial of the group's next row, then waits for row i's
    # total (_exchange), so the exchange overlaps a row's work. Rows past M are phantoms with
    # slots of their own.
    pid = tl.program_id(0).to(tl.int64)
    chunk = pid % SPLIT
    row_start, step = _group_rows(pid // SPLIT, rows_per_group, SPLIT, INTERLEAVE)
    start = chunk * BLOCK_N
    X, Y = X + start, Y + start
    if HAS_RESIDUAL:  # else R and H are None (constexprs), as W without a weight
        R, H = R + start, H + start
    if HAS_WEIGHT:
        W = W + start
    offs = tl.arange(0, BLOCK_N)
    width = N - start
    x0 = _fwd_chunk(X, R, H, row_start, _chunk_mask(row_start, 0, offs, width, M, rows_per_group), offs, x_size1,
                    x_size2, x_stride0, x_stride1, x_stride2, r_stride, h_stride, LEAD_DIMS, HAS_RESIDUAL, PHASE)
    _publish(_sum_sq(x0), SLOTS + row_start * SPLIT, chunk, PHASE)
    for i in tl.range(0, rows_per_group, num_stages=STAGES):
        row = row_start + i * step
        next_row = row + step
        x1 = _fwd_chunk(X, R, H, next_row, _chunk_mask(next_row, i + 1, offs, width, M, rows_per_group), offs,
                        x_size1, x_size2, x_stride0, x_stride1, x_stride2, r_stride, h_stride, LEAD_DIMS,
                        HAS_RESIDUAL, PHASE)
        # published within the group's rows only (past them: another group's row or no slot)
        sum_sq = _exchange(_sum_sq(x1), i + 1 < rows_per_group, SLOTS, row, next_row, chunk, SPLIT, PHASE)
        if PHASE != 1:
            rstd = _rstd(sum_sq, N, eps)
            # The weight chunk is read per row (from L1/L2): held in registers it would compete
            # with the rows in flight.
            w = 0.0
            if HAS_WEIGHT:
                w = _weight(tl.load(W + offs, mask=offs < width, other=0.0), WEIGHT_OFFSET)
            y = _scale(x0.to(tl.float32), rstd, w, HAS_WEIGHT, ROUND)
            tl.store(Y + row * y_stride + offs, y.to(Y.dtype.element_ty), mask=offs < tl.where(row < M, width, 0))
            if STORE_RSTD:
                tl.store(RSTD + row, rstd, mask=(chunk == 0) & (row < M))
        x0 = x1


@triton.jit
def _bwd_chunks(X, DY, DY2, DY3, DY4, DY5, row, mask, offs, x_size1, x_size2, x_stride0, x_stride1, x_stride2,
                dy_stride, LEAD_DIMS: tl.constexpr, DY_TERMS: tl.constexpr):
    """This program's chunks of x and dy in row ``row``, in their own dtypes."""
    x = tl.load(X + _row_offset(row, x_size1, x_size2, x_stride0, x_stride1, x_stride2, LEAD_DIMS) + offs,
                mask=mask, other=0.0)
    dy = _load_dy(DY, DY2, DY3, DY4, DY5, row * dy_stride + offs, mask, "", DY_TERMS)
    return x, dy


@triton.jit
def _rms_norm_bwd_split(
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
    DW_PARTIAL,  # scratch [row groups, N] fp32, or [cdiv(row groups, 2), N] if MERGE
    DW_FLAGS,  # if MERGE: [cdiv(row groups, 2) * SPLIT] int32 zeros; else None
    SLOTS,  # [M + rows_per_group, SPLIT] int64 zeros: the rows' published partials
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
    SPLIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DRES: tl.constexpr,
    LEAD_DIMS: tl.constexpr,
    PHASE: tl.constexpr,
    STAGES: tl.constexpr,
    MERGE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    WEIGHT_OFFSET: tl.constexpr,
    DY_TERMS: tl.constexpr,  # dy is the sum of this many tensors (kernels.common._load_dy)
):
    # Every group walks rows_per_group rows; its rows past M are phantoms (nothing loaded or
    # stored) with slots of their own, so all SPLIT programs of a group still meet at each one.
    # x and dy stay in their own dtype until used, to leave registers for them; w is held across
    # rows (re-reading it every row cost 1-2 points of copy bandwidth).
    pid = tl.program_id(0).to(tl.int64)
    group = pid // SPLIT
    chunk = pid % SPLIT
    row_start, step = _group_rows(group, rows_per_group, SPLIT, INTERLEAVE)
    start = chunk * BLOCK_N
    X, DY, DX = X + start, DY + start, DX + start
    if DY_TERMS > 1:  # else DY2 ... DY5 are None (constexprs), as DRES and W where unread
        DY2 = DY2 + start
    if DY_TERMS > 2:
        DY3 = DY3 + start
    if DY_TERMS > 3:
        DY4 = DY4 + start
    if DY_TERMS > 4:
        DY5 = DY5 + start
    if HAS_DRES:
        DRES = DRES + start
    if HAS_WEIGHT:
        W = W + start
    offs = tl.arange(0, BLOCK_N)
    width = N - start  # of this chunk, may exceed BLOCK_N
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    x0, dy0 = _bwd_chunks(X, DY, DY2, DY3, DY4, DY5, row_start,
                          _chunk_mask(row_start, 0, offs, width, M, rows_per_group), offs, x_size1, x_size2,
                          x_stride0, x_stride1, x_stride2, dy_stride, LEAD_DIMS, DY_TERMS)
    w = 0.0
    if HAS_WEIGHT:
        w = _weight(tl.load(W + offs, mask=offs < width, other=0.0), WEIGHT_OFFSET)
    _publish(_dot(x0, dy0, w, HAS_WEIGHT), SLOTS + row_start * SPLIT, chunk, PHASE)
    for i in tl.range(0, rows_per_group, num_stages=STAGES):
        row = row_start + i * step
        next_row = row + step
        x1, dy1 = _bwd_chunks(X, DY, DY2, DY3, DY4, DY5, next_row,
                              _chunk_mask(next_row, i + 1, offs, width, M, rows_per_group), offs, x_size1, x_size2,
                              x_stride0, x_stride1, x_stride2, dy_stride, LEAD_DIMS, DY_TERMS)
        # published within the group's rows only (past them: another group's row or no slot)
        dot = _exchange(_dot(x1, dy1, w, HAS_WEIGHT), i + 1 < rows_per_group, SLOTS, row, next_row, chunk,
                        SPLIT, PHASE)
        if PHASE != 1:
            x = x0.to(tl.float32)
            dy = dy0.to(tl.float32)
            u = dy
            if HAS_WEIGHT:
                u = dy * w
            rstd = tl.load(RSTD + row, mask=row < M, other=0.0)
            dx = (u - x * (rstd * rstd * (dot / N))) * rstd
            row_mask = offs < tl.where(row < M, width, 0)
            if HAS_DRES:
                dx += tl.load(DRES + row * dres_stride + offs, mask=row_mask, other=0.0).to(tl.float32)
            tl.store(DX + row * dx_stride + offs, dx.to(DX.dtype.element_ty), mask=row_mask)
            if HAS_WEIGHT:
                dw_acc += dy * x * rstd
        x0, dy0 = x1, dy1
    if PHASE != 1 and HAS_WEIGHT:
        _store_partial(dw_acc, DW_PARTIAL, DW_FLAGS, group, N, start + offs, offs < width, SPLIT, chunk, MERGE)
