"""Triton kernels for RMSNorm and the launchers that run them.

Math (``reference.py`` is the oracle), per row ``x`` of length ``N``::

    rstd = 1 / sqrt(mean(x**2) + eps)            y  = x * rstd * w
    u = dy * w,  c = mean(u * x)                 dx = rstd * (u - x * rstd**2 * c)
    dw = sum over rows of dy * x * rstd

All arithmetic is fp32; row offsets are 64-bit (split mode's offsets within a
chunk are 32-bit, from pointers moved to the chunk); rows may be strided (last
dim contiguous, any row stride). Three ways to cover a row:

- single-pass mode (``SPLIT == 1``): a program holds ``ROWS`` whole rows in
  registers and reads x once; the backward with ``RELOAD`` reads x and dy a
  second time after the row sum (from L1/L2) instead of keeping them in
  registers across it;
- looped mode (forward, ``LOOPED``): one row per program in ``BLOCK_N`` steps,
  a first pass for the sum of squares and a second that re-reads x (from L2) to
  write y, as Inductor's reductions do;
- split mode (``SPLIT > 1``, long rows): a row group's rows are spread over
  ``SPLIT`` consecutive programs of one ``BLOCK_N`` chunk each, which walk the
  group's rows together (with ``INTERLEAVE``, group g has rows g, g + groups,
  ..., so that the groups work on neighbouring rows at any time). Each publishes
  its partial sum for a row in a slot (flag and value in one 64-bit word) and
  reads the row's slots until all are set, adding them in one fixed order
  (``_exchange``, one inline PTX statement on the GPU); a program publishes its
  group's next row before it waits for the current one, and its loads run ahead
  (``STAGES``), so a row's slots are mostly full when read.
  Under the Triton interpreter, which runs programs one after another, the same
  kernel runs in two launches (``PHASE`` 1 publishes, 2 reads) instead.

Single-pass and looped forwards run without masks (``UNMASKED``) where the table
asks for it (``mask_free``) and the tiles cover x exactly (``exact_tiles``: N a
multiple of ``BLOCK_N``; single-pass, also M a multiple of ``ROWS``); the looped
one's loops then have a known length (``STEPS``, ``loop_steps``).

dweight is reduced deterministically: each backward program (single-pass) or
row group (split) has one fp32 partial row; where that scratch is large
(``config.partial_rows``), two groups share a row: the second to finish adds
its partial to the first's (``_merge_partial``; a + b == b + a in fp32, so the
bits do not depend on which is first). Scratch is groups (or groups / 2) x N,
never M x N. ``_rms_norm_dw_reduce`` then sums those rows in a fixed order, in
one stage or, when one would leave fewer programs than SMs, two
(``reduce_dweight``; tiles from ``config.reduce_tile``). No float atomics
anywhere. The launchers take validated 2-D tensors and write into the outputs
they are given; ``ops.py`` allocates and validates. A kernel's
first launch for a specialization goes through Triton's JIT, later ones through
the compiled kernel's own launcher (``_run``); an op's forward with 16-byte
aligned tensors, from its third launch on, through a launch plan kept for its
shape (``_FORWARD_PLANS``), which skips the rest of the launch's host work.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from torch_rmsnorm_op.config import (
    KernelConfig,
    backward_config,
    cdiv,
    forward_config,
    partial_rows,
    reduce_splits,
    reduce_tile,
    row_groups,
)
from torch_rmsnorm_op.layout import row_stride


@triton.jit
def _rstd(sum_sq, n, eps):
    return tl.rsqrt(sum_sq / n + eps)


@triton.jit
def _load_rows(ptrs, mask, POLICY: tl.constexpr):
    """Masked load (0 where masked) as fp32, with a cache eviction policy ("" for none)."""
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _slot_word(value):
    """Split mode: a partial as published, one 64-bit word: ready flag (bit 32) over its fp32 bits,
    written and read whole, so a reader that sees the flag sees the value: no counter, no fence."""
    return (value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | 0x100000000


# Split mode's exchange, per slot of a row (one thread each): publish this program's word if told
# to (the slot it owns in the next row), then read the slot until its flag is set. Relaxed
# gpu-scope accesses: other programs' words come from L2, and by the PTX memory model none of it
# is a data race. One asm statement, so the publish stays before the wait: Triton's loop
# pipeliner moves a store that depends on a pipelined load after other work (measured: the
# exchange then stalls every row), and a polling loop in the kernel would stop the pipeliner
# altogether (it skips loops with loops inside; a non-inlined function for the loop shared
# memory with the prefetched rows: wrong results at N = 262144, fp32).
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
    """Split mode: publish this program's fp32 partial in slot ``chunk`` of its row."""
    if PHASE != 2:
        tl.atomic_xchg(SLOTS + chunk, _slot_word(value), sem="relaxed")


@triton.jit
def _exchange(value, publish, SLOTS, row, next_row, chunk, SPLIT: tl.constexpr, PHASE: tl.constexpr):
    """Split mode: publish ``value``, this program's partial of row ``next_row``, if ``publish``;
    then read row ``row``'s SPLIT slots until every flag is set and return the sum of their
    values in slot order (one fixed order). The launcher zeroes the slots and numbers a row's
    programs consecutively, so every one gets to publish. Under the interpreter (``PHASE`` 1,
    then 2) the publishing and the reading run in separate launches, without waiting."""
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
    """Split mode: ``(first row, step)`` of a row group's rows: ``rows_per_group`` consecutive
    rows, or with INTERLEAVE every ``groups``-th row from row ``group``, so that the groups work
    on neighbouring rows at any one time. Rows past M are phantoms either way; the slots have
    ``M + rows_per_group`` rows, past the last one either form reaches."""
    if INTERLEAVE:
        return group, tl.num_programs(0) // SPLIT
    return group * rows_per_group, 1


@triton.jit
def _load_chunk(P, stride, row_start, i, step, offs, width, M, rows_per_group):
    """Split mode: this program's chunk (``P`` moved to it, ``width`` columns left in the row)
    of its group's row i, row ``row_start + i * step``, as stored: zeros past M or past the
    group's rows."""
    row = row_start + i * step
    return tl.load(P + row * stride + offs, mask=offs < tl.where((row < M) & (i < rows_per_group), width, 0),
                   other=0.0)


@triton.jit
def _rms_norm_fwd(
    X,  # input  [M, N], row stride stride_x, last dim contiguous
    W,  # weight [N] (ignored unless HAS_WEIGHT)
    Y,  # output [M, N], row stride stride_y
    RSTD,  # output [M] fp32 (written if STORE_RSTD)
    SLOTS,  # split mode: [M + rows_per_group, SPLIT] int64 zeros, the rows' published partial sums
    stride_x,
    stride_y,
    M,
    N,
    eps,
    rows_per_group,  # split mode
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SPLIT: tl.constexpr,
    PHASE: tl.constexpr,  # split mode: 0 = one launch, programs wait for the slots; 1 = publish only; 2 = read only
    LOOPED: tl.constexpr,  # one row per program in BLOCK_N steps, two passes over x
    UNMASKED: tl.constexpr,  # single-pass or looped, tiles that cover x exactly: no masks
    STAGES: tl.constexpr,  # loops' num_stages: > 1 has Triton prefetch their loads into shared memory
    STORE_RSTD: tl.constexpr,  # False when nothing will read rstd (inference): y only
    INTERLEAVE: tl.constexpr,  # split mode: group g walks rows g, g + groups, ... (_group_rows)
    STEPS: tl.constexpr,  # looped, UNMASKED: N // BLOCK_N, a loop of known length (unrolled); else 0
):
    if LOOPED:
        # The first pass keeps x in L2 (evict_last) for the second, which streams it out.
        row = tl.program_id(0).to(tl.int64)
        other = None if UNMASKED else 0.0
        end = N
        if STEPS > 0:
            end = STEPS * BLOCK_N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in tl.range(0, end, BLOCK_N, num_stages=STAGES, loop_unroll_factor=STEPS if STEPS > 0 else None):
            cols = start + tl.arange(0, BLOCK_N)
            mask = None if UNMASKED else cols < N
            x = tl.load(X + row * stride_x + cols, mask=mask, other=other, eviction_policy="evict_last")
            x = x.to(tl.float32)
            acc += x * x
        rstd = _rstd(tl.sum(acc, axis=0), N, eps)
        for start in tl.range(0, end, BLOCK_N, num_stages=STAGES, loop_unroll_factor=STEPS if STEPS > 0 else None):
            cols = start + tl.arange(0, BLOCK_N)
            mask = None if UNMASKED else cols < N
            x = tl.load(X + row * stride_x + cols, mask=mask, other=other, eviction_policy="evict_first")
            y = x.to(tl.float32) * rstd
            if HAS_WEIGHT:
                y = y * tl.load(W + cols, mask=mask, other=other, eviction_policy="evict_last").to(tl.float32)
            tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(RSTD + row, rstd)
    elif SPLIT == 1:
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        if UNMASKED:
            row_mask, col_mask, mask, other = None, None, None, None
        else:
            row_mask, col_mask, other = rows < M, cols < N, 0.0
            mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=other).to(tl.float32)
        rstd = _rstd(tl.sum(x * x, axis=1), N, eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=other).to(tl.float32)
            y = y * w[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        # Split mode, as in the backward: SPLIT programs per row group walk the group's rows
        # (_group_rows). At row i a program publishes its partial of the group's next row, then
        # waits for row i's total (_exchange), so the exchange overlaps a row's work; Triton's
        # pipeliner loads rows STAGES - 1 ahead into shared memory. Rows past M are phantoms
        # with slots of their own.
        pid = tl.program_id(0).to(tl.int64)
        chunk = pid % SPLIT
        row_start, step = _group_rows(pid // SPLIT, rows_per_group, SPLIT, INTERLEAVE)
        start = chunk * BLOCK_N
        X, Y, W = X + start, Y + start, W + start  # 32-bit offsets within the chunk
        offs = tl.arange(0, BLOCK_N)
        width = N - start
        x0 = _load_chunk(X, stride_x, row_start, 0, step, offs, width, M, rows_per_group)
        _publish(_sum_sq(x0), SLOTS + row_start * SPLIT, chunk, PHASE)
        for i in tl.range(0, rows_per_group, num_stages=STAGES):
            row = row_start + i * step
            x1 = _load_chunk(X, stride_x, row_start, i + 1, step, offs, width, M, rows_per_group)
            # published within the group's rows only (past them: another group's row or no slot)
            sum_sq = _exchange(_sum_sq(x1), i + 1 < rows_per_group, SLOTS, row, row + step, chunk, SPLIT, PHASE)
            if PHASE != 1:
                rstd = _rstd(sum_sq, N, eps)
                y = x0.to(tl.float32) * rstd
                if HAS_WEIGHT:
                    y = y * tl.load(W + offs, mask=offs < width, other=0.0).to(tl.float32)
                tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=offs < tl.where(row < M, width, 0))
                if STORE_RSTD:
                    tl.store(RSTD + row, rstd, mask=(chunk == 0) & (row < M))
            x0 = x1


@triton.jit
def _sum_sq(x):
    """Sum of squares in fp32."""
    x = x.to(tl.float32)
    return tl.sum(x * x, axis=0)


@triton.jit
def _dot(x, dy, w, HAS_WEIGHT: tl.constexpr):
    """This chunk's part of the row's sum of dy * w * x (fp32; ``w`` fp32, unused without a weight)."""
    u = dy.to(tl.float32)
    if HAS_WEIGHT:
        u = u * w
    return tl.sum(u * x.to(tl.float32), axis=0)


@triton.jit
def _weight_chunk(W, offs, width, HAS_WEIGHT: tl.constexpr):
    """Split mode: this program's chunk of the weight in fp32 (0.0 without a weight)."""
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(W + offs, mask=offs < width, other=0.0).to(tl.float32)
    return w


@triton.jit
def _merge_partial(value, ROW, mask, FLAG):
    """Add this program's dweight partial ``value`` into its pair's row ``ROW``: the first of the
    two to claim ``FLAG`` (0: free, 1: claimed, 2: stored) stores its partial, the second adds
    its own to what the first stored. fp32 addition is commutative, so the row holds the same
    bits whichever arrives first; and only a program that has claimed the flag is ever waited
    for, so nothing depends on which programs are resident. A lone program (odd group count)
    just stores."""
    if tl.atomic_cas(FLAG, 0, 1) == 0:
        tl.store(ROW, value, mask=mask)
        tl.debug_barrier()  # every thread's stores before the flag says so (acq_rel, gpu scope)
        tl.atomic_xchg(FLAG, 2)
    else:
        while tl.atomic_cas(FLAG, 2, 2) != 2:
            pass
        # From L2 (.cg): written by another multiprocessor.
        other = tl.load(ROW, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(ROW, other + value, mask=mask)


@triton.jit
def _store_partial(value, DW_PARTIAL, DW_FLAGS, group, N, cols, mask, SPLIT: tl.constexpr, chunk,
                   MERGE: tl.constexpr):
    """Write this program's dweight partial (columns ``cols`` of its group's): its group's row,
    or with MERGE its pair's (``_merge_partial``)."""
    if MERGE:
        _merge_partial(value, DW_PARTIAL + group // 2 * N + cols, mask, DW_FLAGS + group // 2 * SPLIT + chunk)
    else:
        tl.store(DW_PARTIAL + group * N + cols, value, mask=mask)


@triton.jit
def _rms_norm_bwd(
    DY,  # upstream gradient [M, N], row stride stride_dy
    X,  # forward input [M, N], row stride stride_x
    W,  # weight [N] (ignored unless HAS_WEIGHT)
    RSTD,  # [M] fp32, saved by the forward
    DX,  # output [M, N], row stride stride_dx
    DW_PARTIAL,  # scratch [row groups, N] fp32, or [cdiv(row groups, 2), N] if MERGE: dweight partials
    DW_FLAGS,  # if MERGE: [cdiv(row groups, 2) * SPLIT] int32 zeros, _merge_partial's flags
    SLOTS,  # split mode: [M + rows_per_group, SPLIT] int64 zeros, the rows' published partials
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    rows_per_group,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SPLIT: tl.constexpr,
    PHASE: tl.constexpr,  # split mode: 0 = one launch, programs wait for the slots; 1 = publish only; 2 = read only
    COUNTED_LOOP: tl.constexpr,  # single-pass loop form: 0..rows_per_group, else row_start..row_end
    RELOAD: tl.constexpr,  # single-pass: read x and dy again after the row sum (from L1/L2)
    STAGES: tl.constexpr,  # the row loop's num_stages: > 1 has Triton prefetch its loads into shared memory
    MERGE: tl.constexpr,  # two groups share a partial row (_merge_partial)
    INTERLEAVE: tl.constexpr,  # split mode: group g walks rows g, g + groups, ... (_group_rows)
):
    # Program (group, chunk) walks the group's rows; chunk is 0 in single-pass mode.
    pid = tl.program_id(0).to(tl.int64)
    group = pid // SPLIT
    chunk = pid % SPLIT
    row_start = group * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, M)  # single-pass mask; split mode masks by M
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if SPLIT == 1:
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        # The loop form alone moved the backward by several % of copy, each way at different N
        # (profiling/NOTES.md), so the table picks it per rung.
        if COUNTED_LOOP:
            loop_start, loop_end, base = 0, rows_per_group, row_start
        else:
            loop_start, loop_end, base = row_start, row_end, 0
        for first in tl.range(loop_start, loop_end, ROWS, num_stages=STAGES):
            rows = base + first + tl.arange(0, ROWS)
            mask = (rows < row_end)[:, None] & col_mask[None, :]
            x_ptrs = X + rows[:, None] * stride_x + cols[None, :]
            dy_ptrs = DY + rows[:, None] * stride_dy + cols[None, :]
            x = _load_rows(x_ptrs, mask, "evict_last" if RELOAD else "")
            dy = _load_rows(dy_ptrs, mask, "evict_last" if RELOAD else "")
            rstd = tl.load(RSTD + rows, mask=rows < row_end, other=0.0)
            u = dy
            if HAS_WEIGHT:
                u = dy * w[None, :]
                if not RELOAD:
                    dw_acc += dy * x * rstd[:, None]
            c = tl.sum(u * x, axis=1) / N
            if RELOAD:
                # Rather than keep x and dy in registers across the row sum (Inductor's loops do
                # the same); another eviction policy, so the compiler cannot merge the loads.
                x = _load_rows(x_ptrs, mask, "evict_first")
                dy = _load_rows(dy_ptrs, mask, "evict_first")
                u = dy
                if HAS_WEIGHT:
                    u = dy * w[None, :]
                    dw_acc += dy * x * rstd[:, None]
            dx = (u - x * (rstd * rstd * c)[:, None]) * rstd[:, None]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            _store_partial(tl.sum(dw_acc, axis=0), DW_PARTIAL, DW_FLAGS, group, N, cols, col_mask, 1, 0, MERGE)
    else:
        # Every group walks rows_per_group rows (_group_rows); its rows past M are phantoms
        # (nothing loaded or stored) with slots of their own (SLOTS has M + rows_per_group
        # rows), so all SPLIT programs of a group still meet at each one. At its row i a
        # program publishes its partial of the group's next row, then waits for row i's total
        # (_exchange); Triton's pipeliner loads rows STAGES - 1 ahead into shared memory. x and
        # dy stay in their own dtype until used, to leave registers for them; w is held across
        # rows (re-reading it every row cost 1-2 points: profiling/NOTES.md, session 15).
        # Offsets within the chunk are 32-bit, from pointers moved to the chunk: 64-bit ones took
        # more registers (Triton 3.6, session 5's form with three rows in registers: 220 vs 210;
        # the fp32 forward's spilled, 112 B).
        row_start, step = _group_rows(group, rows_per_group, SPLIT, INTERLEAVE)
        start = chunk * BLOCK_N
        X, DY, DX, W = X + start, DY + start, DX + start, W + start
        offs = tl.arange(0, BLOCK_N)
        width = N - start  # of this chunk, may exceed BLOCK_N
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        x0 = _load_chunk(X, stride_x, row_start, 0, step, offs, width, M, rows_per_group)
        dy0 = _load_chunk(DY, stride_dy, row_start, 0, step, offs, width, M, rows_per_group)
        w = _weight_chunk(W, offs, width, HAS_WEIGHT)
        _publish(_dot(x0, dy0, w, HAS_WEIGHT), SLOTS + row_start * SPLIT, chunk, PHASE)
        for i in tl.range(0, rows_per_group, num_stages=STAGES):
            row = row_start + i * step
            x1 = _load_chunk(X, stride_x, row_start, i + 1, step, offs, width, M, rows_per_group)
            dy1 = _load_chunk(DY, stride_dy, row_start, i + 1, step, offs, width, M, rows_per_group)
            # published within the group's rows only (past them: another group's row or no slot)
            dot = _exchange(_dot(x1, dy1, w, HAS_WEIGHT), i + 1 < rows_per_group, SLOTS, row, row + step, chunk,
                            SPLIT, PHASE)
            if PHASE != 1:
                x = x0.to(tl.float32)
                dy = dy0.to(tl.float32)
                u = dy
                if HAS_WEIGHT:
                    u = dy * w
                rstd = tl.load(RSTD + row, mask=row < M, other=0.0)
                dx = (u - x * (rstd * rstd * (dot / N))) * rstd
                tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty),
                         mask=offs < tl.where(row < M, width, 0))
                if HAS_WEIGHT:
                    dw_acc += dy * x * rstd
            x0, dy0 = x1, dy1
        if PHASE != 1 and HAS_WEIGHT:
            _store_partial(dw_acc, DW_PARTIAL, DW_FLAGS, group, N, start + offs, offs < width, SPLIT, chunk, MERGE)


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


def is_interpreted() -> bool:
    """True when the kernels were defined under ``TRITON_INTERPRET=1`` (they run on CPU tensors)."""
    return not isinstance(_rms_norm_fwd, triton.runtime.JITFunction)


def _squeeze_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a scalar kernel argument used as a ``range`` bound into an
    index with ``int()`` of a 1-element array, which numpy 2 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"); Triton 3.9 squeezes the array first. Give
    older interpreters that same conversion (CPU runs only; compiled kernels are untouched)."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


if is_interpreted():
    _squeeze_interpreter_loop_bounds()


# Fused multiply-adds on, stated rather than left to Triton's default, which Triton 3.9 warns
# will change in 3.10: the kernels' rounding (and bits) must not move with it. Inductor also
# sets it explicitly.
COMPILE_OPTIONS = dict(enable_fp_fusion=True)


_SAME_DEVICE = contextlib.nullcontext()


def _on(device: torch.device):
    """Triton launches on the current CUDA device: switch to the tensors' own where it differs."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _SAME_DEVICE


@functools.cache
def constexprs(cfg: KernelConfig, backward: bool, has_weight: bool, store_rstd: bool = True,
               merge: bool = False, exact_tiles: bool = False, steps: int = 0) -> Mapping:
    """The ``tl.constexpr`` arguments of the forward or backward kernel for ``cfg``, in the
    kernel's parameter order (``PHASE`` 0: one launch); read-only, built once per config.
    ``exact_tiles``: the forward's tiles cover x exactly (``kernels.exact_tiles``): no masks for a
    config that asks for it (``mask_free``); ``steps``: the looped forward's ``loop_steps``."""
    out = dict(BLOCK_N=cfg.block_n, ROWS=cfg.rows, HAS_WEIGHT=has_weight, SPLIT=cfg.split, PHASE=0)
    if backward:
        out |= dict(COUNTED_LOOP=cfg.counted_loop, RELOAD=cfg.reload, STAGES=cfg.stages, MERGE=merge,
                    INTERLEAVE=cfg.interleave)
    else:
        out |= dict(LOOPED=cfg.looped, UNMASKED=cfg.mask_free and exact_tiles, STAGES=cfg.stages,
                    STORE_RSTD=store_rstd, INTERLEAVE=cfg.interleave, STEPS=steps)
    return MappingProxyType(out)


def _specialization(args: list) -> tuple:
    """What Triton's JIT specializes kernel arguments on, or finer: per tensor its dtype and
    16-byte alignment; per int whether it is 1, a multiple of 16, in int32 range, beyond int64;
    a float (eps, fp32 for Triton) by type; anything else by type and value."""
    return tuple([
        (a.dtype, a.data_ptr() & 15 == 0) if type(a) is Tensor
        else (a == 1, a & 15 == 0, -(2**31) <= a < 2**31, a >= 2**63) if type(a) is int
        else float if type(a) is float
        else (type(a), a)
        for a in args
    ])


# Compiled kernels by (kernel, device index, num_warps, constexprs, argument keys). Triton's JIT
# dispatch (binding the arguments, its cache key, the lookup) costs about as much host time
# as the launch itself (profiling/NOTES.md, sessions 3 and 7), on every call; once it has
# compiled a specialization, ``_run`` launches that through the compiled kernel's own launcher.
_COMPILED: dict[tuple, _Launcher] = {}
_STREAM = None


class _Launcher(NamedTuple):
    """A compiled kernel and its hook-free launch: ``call(gx, gy, gz, stream, *head, *args)``,
    ``args`` every kernel parameter in order, constexprs included (``_launcher``)."""

    compiled: Any  # triton.compiler.CompiledKernel
    call: Callable
    head: tuple


# Triton 3.6's CUDA launcher: ``CudaLauncher.__call__(self, gridX, gridY, gridZ, stream, function,
# *args)`` allocates no scratch for a kernel that needs none and calls its C ``launch`` with
# these leading arguments (the driver module's ``_BASE_ARGS_FORMAT``).
_RUN_PARAMS = ("self", "gridX", "gridY", "gridZ", "stream", "function")
_C_LAUNCH_FORMAT = "iiiKKppOOOOOO"  # grid, stream, function, cooperative, pdl, two scratch, metadata, hooks


def _launcher(compiled) -> _Launcher:
    """What ``compiled[grid](*args, stream=stream)`` runs when no launch hook is registered,
    without its closure, its launch metadata and the two empty hook chains it hands the launcher
    (``compiled.run``). Where the launcher is Triton 3.6's (``_RUN_PARAMS``, ``_C_LAUNCH_FORMAT``)
    and the kernel needs no scratch, its C ``launch`` itself, without the Python ``__call__``
    around it (profiling/NOTES.md, session 14); any other launcher through ``compiled.run``."""
    run = compiled.run
    code = getattr(type(run).__call__, "__code__", None)
    driver = sys.modules.get(type(run).__module__)
    if (code is not None and code.co_argcount == len(_RUN_PARAMS) and code.co_varnames[:len(_RUN_PARAMS)] == _RUN_PARAMS
            and getattr(driver, "_BASE_ARGS_FORMAT", None) == _C_LAUNCH_FORMAT
            and getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0
            and hasattr(run, "launch")):
        head = (compiled.function, bool(run.launch_cooperative_grid), bool(run.launch_pdl), None, None,
                compiled.packed_metadata, None, None, None)
        return _Launcher(compiled, run.launch, head)
    return _Launcher(compiled, run, (compiled.function, compiled.packed_metadata, None, None, None))


def _run(kernel, device: torch.device, grid: tuple[int, ...], args: list, consts: dict,
         num_warps: int = 4) -> _Launcher | None:
    """``kernel[grid](*args, **consts, num_warps=num_warps, **COMPILE_OPTIONS)`` on ``device``,
    the current device: through Triton's JIT the first time a specialization is seen (and
    always when interpreted), through the compiled kernel's launcher after that. Returns the
    launcher it launched through, or None for a launch through the JIT."""
    if is_interpreted():
        kernel[grid](*args, **consts, num_warps=num_warps, **COMPILE_OPTIONS)
        return None
    global _STREAM
    if _STREAM is None:
        _STREAM = triton.runtime.driver.active.get_current_stream
    key = (id(kernel), device.index, num_warps, *consts.values(), _specialization(args))
    launcher = _COMPILED.get(key)
    if launcher is None:
        _COMPILED[key] = _launcher(kernel[grid](*args, **consts, num_warps=num_warps, **COMPILE_OPTIONS))
        return None
    # The compiled launcher takes every parameter in order, constexprs included.
    grid3 = grid + (1,) * (3 - len(grid))
    stream = _STREAM(device.index)
    if _no_launch_hooks():
        launcher.call(*grid3, stream, *launcher.head, *args, *consts.values())
    else:
        launcher.compiled[grid3](*args, *consts.values(), stream=stream)
    return launcher


# Before ``triton.knobs`` (Triton < 3.4) the launch hooks lived elsewhere: there, always Triton's runner.
_KNOBS = getattr(triton, "knobs", None)


def _no_launch_hooks() -> bool:
    """Whether no Triton launch hook (a profiler's, e.g. proton) is registered: the knobs are
    hook chains (empty by default) or single callables, depending on the Triton version."""
    if _KNOBS is None:
        return False
    runtime = _KNOBS.runtime
    return _empty_hook(runtime.launch_enter_hook) and _empty_hook(runtime.launch_exit_hook)


def _empty_hook(hook) -> bool:
    return hook is None or (type(hook) is triton.knobs.HookChain and not hook.calls)


def _launch(kernel, grid: int, m: int, device: torch.device, cfg: KernelConfig, before: list, after: list,
            consts: Mapping, pad_rows: int = 0) -> _Launcher | None:
    """Launch with SLOTS between ``before`` and ``after``. Split mode's programs meet at each
    row's slots in one launch, or run two phases when interpreted (programs run one by one).
    Returns what ``_run`` does for a single launch without slots (SPLIT 1), else None."""
    if cfg.split == 1:
        return _run(kernel, device, (grid,), [*before, before[0], *after], consts, cfg.num_warps)
    # Zeros: no flag set. The phantom rows past M (pad_rows) get slots too.
    slots = torch.zeros((m + pad_rows, cfg.split), dtype=torch.int64, device=device)
    for phase in (1, 2) if is_interpreted() else (0,):
        _run(kernel, device, (grid,), [*before, slots, *after], dict(consts, PHASE=phase), cfg.num_warps)
    return None


def exact_tiles(cfg: KernelConfig, m: int, n: int) -> bool:
    """Whether a single-pass or looped forward's tiles cover [m, n] exactly: N a multiple of the
    block (looped: of the step), and for single-pass M a multiple of the rows per program."""
    return n % cfg.block_n == 0 and (cfg.looped or m % cfg.rows == 0)


def loop_steps(cfg: KernelConfig, m: int, n: int) -> int:
    """A looped forward's steps per row when it runs without masks (``mask_free``, tiles that
    cover x exactly), else 0. Passed as a constexpr (``STEPS``), it makes the two passes loops
    of known length, which Triton unrolls, so a pass's loads are issued together, as in
    Inductor's kernels, whose row length is a constant; one compile per step count."""
    return n // cfg.block_n if cfg.looped and cfg.mask_free and exact_tiles(cfg, m, n) else 0


# Forward launches by what fixes them except the tensors' addresses and eps (``_plan_key``): the
# launcher, grid, row strides and sizes, constexprs. ``launch_forward(keep_plan=True)``, which
# ``ops`` uses for the inputs the kernels serve, keeps one after a launch through a compiled
# kernel with every pointer 16-byte aligned (so that is what the kernel is specialized on; the
# ints are in the key) and y's rows contiguous. A later call with the same key and aligned
# pointers launches it straight away, the addresses passed as ints (the launcher then skips a
# driver query per pointer); ``ops`` skips the fallback decision too, which the key fixes. What
# this saves per eager call: profiling/NOTES.md, sessions 13 and 14. Cleared when full, so that
# shapes that keep changing (M) cannot grow it without bound.
class _ForwardPlan(NamedTuple):
    launcher: _Launcher
    grid3: tuple[int, int, int]
    sizes: tuple[int, int, int, int]  # x's and y's row strides, M, N
    tail: tuple  # rows_per_group (0) and the constexprs


_FORWARD_PLANS: dict[tuple, _ForwardPlan] = {}
MAX_FORWARD_PLANS = 4096


def _plan_key(x: Tensor, weight: Tensor | None, want_rstd: bool) -> tuple:
    n = x.shape[-1]
    return (x.get_device(), x.dtype, None if weight is None else weight.dtype, want_rstd, x.numel() // n, n,
            row_stride(x))


def forward_plan(x: Tensor, weight: Tensor | None, want_rstd: bool) -> _ForwardPlan | None:
    """The launch plan kept for the forward of CUDA ``x`` [..., N] (N >= 1) with a weight of
    ``weight``'s dtype (or none) into a y with contiguous rows, writing rstd or not; None if none
    is kept. Plans are kept only for inputs the kernels serve (``launch_forward``'s
    ``keep_plan``); ``launch_planned`` takes the weight contiguous."""
    return _FORWARD_PLANS.get(_plan_key(x, weight, want_rstd))


def launch_planned(plan: _ForwardPlan, x: Tensor, weight: Tensor | None, eps: float, y: Tensor,
                   rstd: Tensor | None) -> bool:
    """``launch_forward(x, weight, eps, y, rstd)`` from ``plan`` (``forward_plan``'s for these x,
    weight and rstd; y's rows contiguous) when it serves: the pointers 16-byte aligned, x's
    device the current one, no launch hook. Returns whether it launched."""
    ptrs = (x.data_ptr(), x.data_ptr() if weight is None else weight.data_ptr(), y.data_ptr(),
            y.data_ptr() if rstd is None else rstd.data_ptr())
    index = x.get_device()
    # torch.cuda.current_device() without its lazy-init check: a plan means CUDA is up
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15 or index != torch._C._cuda_getDevice() \
            or not _no_launch_hooks():
        return False
    launcher = plan.launcher
    # The arguments as _launch passes them: SLOTS is x (unused: plans are never split mode).
    # The launcher takes eps as an fp32, as the kernel was compiled for.
    launcher.call(*plan.grid3, _STREAM(index), *launcher.head, *ptrs, ptrs[0], *plan.sizes, eps, *plan.tail)
    return True


def launch_forward(x: Tensor, weight: Tensor | None, eps: float, y: Tensor, rstd: Tensor | None,
                   cfg: KernelConfig | None = None, keep_plan: bool = False) -> None:
    """Write ``y`` and, unless None, ``rstd`` (M values, contiguous) for ``x``: x and y are
    [M, N] or any [..., N] whose rows ``layout.row_stride`` can address (``N >= 1``); weight
    contiguous [N] or None. ``cfg`` overrides the table (for tuning). ``keep_plan``: keep a
    launch plan for later calls (``forward_plan``, ``launch_planned``); only for inputs the
    kernels serve: the caller has applied the fallback policy."""
    w = x if weight is None else weight
    r = y if rstd is None else rstd
    n = x.shape[-1]
    m = x.numel() // n
    if m == 0:
        return
    eps = float(eps)  # an int eps would be specialized apart
    device = x.device
    stride_x, stride_y = row_stride(x), row_stride(y)
    keep_plan = keep_plan and cfg is None and device.type == "cuda" and stride_y == n
    cfg = cfg or forward_config(n, x.dtype)
    grid, rows_per_group = cdiv(m, cfg.rows), 0
    if cfg.split > 1:
        groups, rows_per_group = row_groups(m, n, device, cfg)
        grid = groups * cfg.split
    consts = constexprs(cfg, False, weight is not None, rstd is not None, exact_tiles=exact_tiles(cfg, m, n),
                        steps=loop_steps(cfg, m, n))
    # Without rstd, RSTD is y: never written (STORE_RSTD is off).
    before = [x, w, y, r]
    with _on(device):
        launcher = _launch(_rms_norm_fwd, grid, m, device, cfg, before,
                           [stride_x, stride_y, m, n, eps, rows_per_group], consts, pad_rows=rows_per_group)
    if keep_plan and launcher is not None and all(t.data_ptr() & 15 == 0 for t in before):
        if len(_FORWARD_PLANS) >= MAX_FORWARD_PLANS:
            _FORWARD_PLANS.clear()
        _FORWARD_PLANS[_plan_key(x, weight, rstd is not None)] = _ForwardPlan(
            launcher, (grid, 1, 1), (stride_x, stride_y, m, n), (rows_per_group, *consts.values()))


def backward_workspace(m: int, n: int, device: torch.device, dtype: torch.dtype,
                       cfg: KernelConfig | None = None) -> Tensor:
    """Uninitialized fp32 scratch for the dweight partials: [partial rows + reduce splits, N],
    one partial row per row group or per pair of them (``config.partial_rows``), then the first
    reduce stage's rows when the reduction has two stages (``reduce_dweight`` reads only the
    partials with one)."""
    rows = partial_rows(row_groups(m, n, device, cfg or backward_config(n, dtype))[0], m, n, dtype)
    splits = reduce_splits(rows, n, device)
    return torch.empty((rows + (splits if splits > 1 else 0), n), dtype=torch.float32, device=device)


@functools.cache
def _reduce_consts(block_p: int, block_n: int) -> Mapping:
    return MappingProxyType(dict(BLOCK_P=block_p, BLOCK_N=block_n))


def _reduce_stage(partial: Tensor, out: Tensor, splits: int) -> None:
    """``out`` [splits, N] = sums of ``splits`` consecutive runs of the rows of ``partial`` [P, N]."""
    p, n = partial.shape
    rows = cdiv(p, splits)
    consts = _reduce_consts(*reduce_tile(rows))
    _run(_rms_norm_dw_reduce, partial.device, (cdiv(n, consts["BLOCK_N"]), splits), [partial, out, p, n, rows], consts)


def reduce_dweight(partial: Tensor, dweight: Tensor, mid: Tensor | None = None) -> None:
    """``dweight`` [N] = the sum of the fp32 rows of ``partial`` [P, N], in a fixed order: one
    stage, or, given ``mid`` [splits, N] fp32, two (splits of the rows, then ``mid``'s rows)."""
    with _on(partial.device):
        if mid is not None and mid.shape[0] > 1:
            _reduce_stage(partial, mid, mid.shape[0])
            partial = mid
        _reduce_stage(partial, dweight, 1)


def launch_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor, dweight: Tensor | None,
    workspace: Tensor | None = None, cfg: KernelConfig | None = None,
) -> None:
    """Write ``dx`` and, with a weight, ``dweight`` [N] (``M, N >= 1``). dy, x and dx are [M, N]
    or any [..., N] whose rows ``layout.row_stride`` can address; rstd holds M contiguous values.

    ``workspace`` is the dweight scratch (``backward_workspace``), allocated when None;
    ``cfg`` overrides the table (for tuning).
    """
    n = x.shape[-1]
    m = x.numel() // n
    cfg = cfg or backward_config(n, x.dtype)
    groups, rows_per_group = row_groups(m, n, x.device, cfg)
    has_weight = weight is not None
    partial = flags = dx  # placeholders, unused without a weight
    merge = False
    if has_weight:
        if workspace is None:
            workspace = backward_workspace(m, n, x.device, x.dtype, cfg)
        rows = partial_rows(groups, m, n, x.dtype)
        partial, mid = workspace[:rows], workspace[rows:]
        merge = rows < groups
        if merge:
            flags = torch.zeros(rows * cfg.split, dtype=torch.int32, device=x.device)
    with _on(x.device):
        _launch(
            _rms_norm_bwd, groups * cfg.split, m, x.device, cfg,
            [dy, x, weight if has_weight else x, rstd, dx, partial, flags],
            [row_stride(dy), row_stride(x), row_stride(dx), m, n, rows_per_group],
            constexprs(cfg, True, has_weight, merge=merge), pad_rows=rows_per_group,
        )
    if has_weight:
        reduce_dweight(partial, dweight, mid)
