"""The Triton kernels, by strategy. Each file reads top to bottom; shared ``@triton.jit``
helpers live in ``common.py``.

Math (``reference.py`` is the oracle), per row ``x`` of length ``N``::

    rstd = 1 / sqrt(mean(x**2) + eps)            y  = round(x * rstd) * (w + offset)
    u = dy * (w + offset),  c = mean(u * x)      dx = rstd * (u - x * rstd**2 * c)
    dw = sum over rows of dy * x * rstd

``round`` is a rounding to fp16/bf16 (``ROUND``; none by default). All arithmetic is
fp32; row offsets are 64-bit. With a residual (``HAS_RESIDUAL``) the forward first forms
``h = x + residual``, rounded to the dtype of the sum it stores, and normalizes ``h``; the
backward adds the gradient that reached that sum (``HAS_DRES``) into dx. A pointer that a
kernel's constexprs leave unread is None: Triton takes it as a constexpr, and the launch passes
one argument less.

- ``rows.py``: a program holds ``ROWS`` whole rows in registers (forward, and the norm-add
  forward: ``rmsnorm(residual + rmsnorm(x))``, norms on both sides of a residual add), or walks a
  group of rows holding one tile at a time (backward, with a dweight partial row per group);
- ``looped.py``: forward, one row per program in ``BLOCK_N`` steps, two passes over the row;
- ``split.py``: rows too long for one program: ``SPLIT`` programs share a row and exchange
  their partial sums (forward and backward);
- ``reduce.py``: the deterministic sum of the backward's dweight partial rows.

The kernels are defined when this package is imported; ``launch.py`` imports it on the
first launch, so ``TRITON_INTERPRET`` may be set any time before that.
"""

from torch_rmsnorm_op.kernels.looped import _rms_norm_fwd_looped
from torch_rmsnorm_op.kernels.reduce import _rms_norm_dw_reduce
from torch_rmsnorm_op.kernels.rows import _rms_norm_bwd_rows, _rms_norm_fwd_norm_add_rows, _rms_norm_fwd_rows
from torch_rmsnorm_op.kernels.split import _rms_norm_bwd_split, _rms_norm_fwd_split

__all__ = [
    "_rms_norm_bwd_rows",
    "_rms_norm_bwd_split",
    "_rms_norm_dw_reduce",
    "_rms_norm_fwd_looped",
    "_rms_norm_fwd_norm_add_rows",
    "_rms_norm_fwd_rows",
    "_rms_norm_fwd_split",
]
