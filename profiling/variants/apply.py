"""Kernel variants for comparison runs on a throwaway GPU copy of the repo (profiling/NOTES.md).

``python profiling/variants/apply.py NAME [--revert]`` rewrites ``torch_rmsnorm_op/kernels.py``
(or the package file a variant names third) in place: each variant is one text replacement of
the current code. Variants of code that is gone live in git history: polling the row
barrier's counter with volatile loads (``volatile_poll``, session 2) at 9ab62dd, before flag
words replaced the counter; the looped forward without masks (``unmasked_looped``,
``unmasked_looped2``, session 9) at 7cefc12, since then the kernel's ``UNMASKED``; split
groups cut to whole blocks of rows (``block_row_groups``, config.py, session 11) at 499a133,
reverted with the code it undid.
"""

import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "torch_rmsnorm_op"

VARIANTS = {
    # Streaming hint on the single-pass forward's x load (x is read once; Inductor's kernels
    # mark such loads).
    "evict_first_fwd": (
        """        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = _rstd(""",
        """        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
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
}

name, revert = sys.argv[1], "--revert" in sys.argv
current, variant, *where = VARIANTS[name]
path = PACKAGE / (where[0] if where else "kernels.py")
old, new = (variant, current) if revert else (current, variant)
text = path.read_text()
if text.count(old) != 1:
    sys.exit(f"{path}: the text to replace for {name!r} is not there exactly once")
path.write_text(text.replace(old, new))
print(f"{path.name}: {name}", "reverted" if revert else "applied")
