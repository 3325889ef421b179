"""Kernel variants for comparison runs on a throwaway GPU copy of the repo (profiling/NOTES.md).

``python profiling/variants/apply.py NAME [--revert]`` rewrites ``torch_rmsnorm_op/kernels.py``
(or the package file a variant names third) in place: each variant is one text replacement of
the current code, or a list of them. Variants of code that is gone live in git history: polling the row
barrier's counter with volatile loads (``volatile_poll``, session 2) at 9ab62dd, before flag
words replaced the counter; the looped forward without masks (``unmasked_looped``,
``unmasked_looped2``, session 9) at 7cefc12, since then the kernel's ``UNMASKED``; split
groups cut to whole blocks of rows (``block_row_groups``, config.py, session 11) at 499a133,
reverted with the code it undid; the split backward's weight held across rows
(``split_bwd_weight_held``, session 15) at 2a761e7, adopted in the kernel since.
"""

import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "torch_rmsnorm_op"

VARIANTS = {
    # Streaming hint on the single-pass forward's x load (x is read once; Inductor's kernels
    # mark such loads).
    "evict_first_fwd": (
        """        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=other).to(tl.float32)
        rstd = _rstd(""",
        """        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=other,
                    eviction_policy="evict_first").to(tl.float32)
        rstd = _rstd(""",
    ),
    # The same on the single-pass backward's x and dy loads.
    "evict_first_bwd": (
        """            x = _load_rows(x_ptrs, mask, "evict_last" if RELOAD else "")
            dy = _load_rows(dy_ptrs, mask, "evict_last" if RELOAD else "")""",
        """            x = _load_rows(x_ptrs, mask, "evict_last" if RELOAD else "evict_first")
            dy = _load_rows(dy_ptrs, mask, "evict_last" if RELOAD else "evict_first")""",
    ),
    # Split mode's exchange with a back-off: a program whose row total is not ready sleeps
    # ~100 ns between polls instead of re-reading its slots back to back (session 9: under ncu
    # the split forward's L2 hit rate was 61% against 51% for the single-pass one, the polls).
    "poll_backoff": (
        """LAB_WAIT:
ld.relaxed.gpu.global.b64 w, [$1];
setp.lt.u64 p, w, 4294967296;
@p bra LAB_WAIT;
mov.b64 $0, w;""",
        """LAB_WAIT:
ld.relaxed.gpu.global.b64 w, [$1];
setp.ge.u64 p, w, 4294967296;
@p bra LAB_DONE;
nanosleep.u32 100;
bra LAB_WAIT;
LAB_DONE:
mov.b64 $0, w;""",
    ),
    # Diagnostics, wrong results by design (session 12): what split mode's exchange costs. The
    # exchange without its wait: each slot read once, set or not (the same stores and loads, no
    # polling, no waiting for the slowest program of a row).
    "no_wait": (
        """LAB_WAIT:
ld.relaxed.gpu.global.b64 w, [$1];
setp.lt.u64 p, w, 4294967296;
@p bra LAB_WAIT;
mov.b64 $0, w;""",
        """ld.relaxed.gpu.global.b64 w, [$1];
mov.b64 $0, w;""",
    ),
    # No exchange at all: every slot "reads" this program's own word (no memory access), so a
    # program never waits for another and the row sums are SPLIT times its own partial.
    "no_exchange": (
        """setp.ne.b32 p, $3, 0;
@p st.relaxed.gpu.global.b64 [$2], $4;
LAB_WAIT:
ld.relaxed.gpu.global.b64 w, [$1];
setp.lt.u64 p, w, 4294967296;
@p bra LAB_WAIT;
mov.b64 $0, w;""",
        """mov.b64 $0, $4;""",
    ),
    # The looped forward's loops with a run-time bound (N), as before session 12's ``loop_steps``.
    "loop_steps_off": (
        """                        steps=loop_steps(cfg, m, n))""",
        """                        steps=0)""",
    ),
    # 32-bit row offsets in the single-pass forward (Inductor's kernels index in int32 where the
    # tensor allows; ours are 64-bit so that any M * stride works). Valid only below 2**31 elements.
    "int32_rows_fwd": (
        """        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)""",
        """        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)""",
    ),
    # The same in the looped forward.
    "int32_row_looped": (
        """        row = tl.program_id(0).to(tl.int64)
        other = None if UNMASKED else 0.0""",
        """        row = tl.program_id(0)
        other = None if UNMASKED else 0.0""",
    ),
    # The split backward with fewer instructions per element (session 13, not kept: the bf16
    # backward alone moved within a point either way): bf16 widened by bit operations on the
    # 32-bit words that hold two elements, and a row's x * dy formed once for both its partial
    # and its dweight term (one multiply per element fewer). Loop body 767 -> 677 SASS
    # instructions at bf16 N = 65536 (sm_90a), 202 -> 212 registers. Two replacements.
    "split_bwd_fewer_instructions": [
        ('''@triton.jit
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


''',
         '''_WIDEN_BF16_ASM = tl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }")


@triton.jit
def _f32(x, PHASE: tl.constexpr):
    """``x`` in fp32. On the GPU (split mode's ``PHASE`` 0) bf16 is widened by bit operations, one
    per element, on the 32-bit words that hold two: Triton's conversion moves the upper element
    to a register of its own first (a PRMT, then a shift: three instructions per pair)."""
    if PHASE == 0 and x.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_WIDEN_BF16_ASM, "=r,=r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    return x.to(tl.float32)


@triton.jit
def _dot(p, w, HAS_WEIGHT: tl.constexpr):
    """This chunk's part of the row's sum of w * p, where ``p = x * dy`` (fp32; ``w`` fp32, unused
    without a weight)."""
    if HAS_WEIGHT:
        p = p * w
    return tl.sum(p, axis=0)


@triton.jit
def _weight_chunk(W, offs, width, HAS_WEIGHT: tl.constexpr, PHASE: tl.constexpr):
    """Split mode: this program's chunk of the weight in fp32 (0.0 without a weight)."""
    w = 0.0
    if HAS_WEIGHT:
        w = _f32(tl.load(W + offs, mask=offs < width, other=0.0), PHASE)
    return w


'''),
        ('''        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
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
''',
         '''        # A row's x * dy serves both its partial (sum of w * x * dy) and its dweight term
        # (x * dy * rstd, rstd saved by the forward), so both are taken when the row is the next
        # one: one multiply per element fewer than forming dy * w for the partial.
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        x0 = _load_chunk(X, stride_x, row_start, 0, step, offs, width, M, rows_per_group)
        dy0 = _load_chunk(DY, stride_dy, row_start, 0, step, offs, width, M, rows_per_group)
        p = _f32(x0, PHASE) * _f32(dy0, PHASE)
        w = _weight_chunk(W, offs, width, HAS_WEIGHT, PHASE)
        _publish(_dot(p, w, HAS_WEIGHT), SLOTS + row_start * SPLIT, chunk, PHASE)
        rstd0 = tl.load(RSTD + row_start, mask=row_start < M, other=0.0)
        if HAS_WEIGHT:
            dw_acc += p * rstd0
        for i in tl.range(0, rows_per_group, num_stages=STAGES):
            row = row_start + i * step
            x1 = _load_chunk(X, stride_x, row_start, i + 1, step, offs, width, M, rows_per_group)
            dy1 = _load_chunk(DY, stride_dy, row_start, i + 1, step, offs, width, M, rows_per_group)
            p = _f32(x1, PHASE) * _f32(dy1, PHASE)
            rstd1 = tl.load(RSTD + row + step, mask=(row + step < M) & (i + 1 < rows_per_group), other=0.0)
            if PHASE != 1 and HAS_WEIGHT:
                dw_acc += p * rstd1  # p is 0 past the group's rows
            # published within the group's rows only (past them: another group's row or no slot)
            dot = _exchange(_dot(p, w, HAS_WEIGHT), i + 1 < rows_per_group, SLOTS, row, row + step, chunk,
                            SPLIT, PHASE)
            if PHASE != 1:
                u = _f32(dy0, PHASE)
                if HAS_WEIGHT:
                    u = u * w
                dx = (u - _f32(x0, PHASE) * (rstd0 * rstd0 * (dot / N))) * rstd0
                tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty),
                         mask=offs < tl.where(row < M, width, 0))
            x0, dy0, rstd0 = x1, dy1, rstd1
'''),
    ],
}

name, revert = sys.argv[1], "--revert" in sys.argv
# A variant is one replacement (current, variant[, file]) or a list of them.
replacements = VARIANTS[name] if isinstance(VARIANTS[name], list) else [VARIANTS[name]]
for current, variant, *where in replacements:
    path = PACKAGE / (where[0] if where else "kernels.py")
    old, new = (variant, current) if revert else (current, variant)
    text = path.read_text()
    if text.count(old) != 1:
        sys.exit(f"{path}: the text to replace for {name!r} is not there exactly once")
    path.write_text(text.replace(old, new))
print(f"{path.name}: {name}", "reverted" if revert else "applied")
