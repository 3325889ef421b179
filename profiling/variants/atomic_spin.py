"""Variant for comparison runs: the row barrier polls with atomics (the first version),
instead of volatile loads. ``python profiling/variants/atomic_spin.py [--revert]`` rewrites
``torch_rmsnorm_op/kernels.py`` in place; used only on a throwaway GPU copy."""

import pathlib
import sys

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "torch_rmsnorm_op" / "kernels.py"
CURRENT = """    while count < expected:
        count = tl.load(COUNTER, volatile=True)
    tl.atomic_add(COUNTER, 0, sem="acquire")  # the siblings' partial stores are visible after this
"""
VARIANT = """    while count < expected:
        count = tl.atomic_add(COUNTER, 0, sem="acquire")
"""

old, new = (VARIANT, CURRENT) if "--revert" in sys.argv else (CURRENT, VARIANT)
text = KERNELS.read_text()
if text.count(old) != 1:
    sys.exit(f"{KERNELS}: the text to replace is not there exactly once")
KERNELS.write_text(text.replace(old, new))
print("kernels.py:", "reverted" if "--revert" in sys.argv else "atomic spin")
