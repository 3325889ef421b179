"""Kernel variants for comparison runs on a throwaway GPU copy of the repo (profiling/NOTES.md).

``python profiling/variants/apply.py NAME [--revert]`` rewrites ``torch_rmsnorm_op/kernels.py``
in place: each variant is one text replacement of the current code.
"""

import pathlib
import sys

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "torch_rmsnorm_op" / "kernels.py"

VARIANTS = {
    # Row barrier: every thread polls the counter with volatile loads (one atomic acquire at the end).
    "volatile_poll": (
        """    while count < expected:
        count = tl.atomic_add(COUNTER, 0, sem="acquire")
""",
        """    while count < expected:
        count = tl.load(COUNTER, volatile=True)
    tl.atomic_add(COUNTER, 0, sem="acquire")
""",
    ),
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
        """            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)""",
        """            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)""",
    ),
}

name, revert = sys.argv[1], "--revert" in sys.argv
current, variant = VARIANTS[name]
old, new = (variant, current) if revert else (current, variant)
text = KERNELS.read_text()
if text.count(old) != 1:
    sys.exit(f"{KERNELS}: the text to replace for {name!r} is not there exactly once")
KERNELS.write_text(text.replace(old, new))
print(f"kernels.py: {name}", "reverted" if revert else "applied")
