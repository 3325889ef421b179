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
    # Split-mode backward: request row i + 1's x and dy before row i's barrier; w reloaded per row.
    "prefetch": (
        """        for i in range(0, rows_per_group):
            row = row_start + i
            live = cols < tl.where(row < M, N, 0)
            x = tl.load(X + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=live, other=0.0).to(tl.float32)
            u = dy
            if HAS_WEIGHT:
                u = dy * w
""",
        """        first = cols < tl.where(row_start < M, N, 0)
        x_next = tl.load(X + row_start * stride_x + cols, mask=first, other=0.0)
        dy_next = tl.load(DY + row_start * stride_dy + cols, mask=first, other=0.0)
        for i in range(0, rows_per_group):
            row = row_start + i
            live = cols < tl.where(row < M, N, 0)
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            ahead = cols < tl.where((row + 1 < M) & (i + 1 < rows_per_group), N, 0)
            x_next = tl.load(X + (row + 1) * stride_x + cols, mask=ahead, other=0.0)
            dy_next = tl.load(DY + (row + 1) * stride_dy + cols, mask=ahead, other=0.0)
            u = dy
            if HAS_WEIGHT:
                u = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
""",
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
