"""The tests' one tolerance table, declared here before any comparison: ``TOL[dtype]`` gives
``assert_close``'s ``atol``/``rtol`` for a result in that dtype computed from the same inputs as
its reference. ``GRAD_FACTOR`` widens them for gradients, which go through one more reduction
and rounding than the forward; ``MODEL`` is for whole models (several layers of bf16 or fp32
arithmetic before the compared output).

The named entries below are for comparisons the table does not cover, each with its reason.
Bit-for-bit comparisons use ``torch.equal``. The table is the tests' own: a tool's thresholds
(``python -m torch_rmsnorm_op check``) may change without loosening what the tests accept."""

import math

import torch

TOL: dict[torch.dtype, dict[str, float]] = {
    # fp32: a row's sum of squares reduced in another order than the reference's, a few dozen
    # units of its 2^-23 roundoff, and 1e-5 absolute for values near zero.
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    # fp16: about 6 units of its 2^-11 unit roundoff, the output's own rounding among them.
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    # bf16: twice its machine epsilon 2^-7, the output's own rounding being up to half of that.
    torch.bfloat16: dict(atol=2 * 2.0**-7, rtol=2 * 2.0**-7),
    # the reference paths: float64 arithmetic throughout, and complex64's fp32 parts.
    torch.float64: dict(atol=1e-12, rtol=1e-10),
    torch.complex64: dict(atol=1e-5, rtol=1e-4),
}
GRAD_FACTOR = 4


def grad_tol(dtype: torch.dtype) -> dict[str, float]:
    return {k: GRAD_FACTOR * v for k, v in TOL[dtype].items()}


MODEL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
}


def dweight_tol(dtype: torch.dtype, m: int) -> dict[str, float]:
    """dweight sums M rows: its absolute error grows like sqrt(M), so ``TOL[dtype]``'s atol is
    scaled by it."""
    return dict(atol=TOL[dtype]["atol"] * math.sqrt(m), rtol=TOL[dtype]["rtol"])


# dweight over as many rows as a GPU has row groups, or more (a few hundred fp32 rows on an
# H200, 16384 bf16 ones), where the sqrt(M) rule of ``dweight_tol`` would grow past what the
# sums need. fp32: the sum's error, which counts next to zero where the rows cancel, within
# that rule's value for 100 rows. bf16: an fp32 sum rounded once to bf16 (at most one unit in
# the last place, within TOL's rtol 2^-6), and 2^-3 absolute for the fp32 sum's own error next
# to zero.
DWEIGHT: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2**-3, rtol=2**-6),
}

# A bf16 result rounded once from fp32 arithmetic (a norm's output, a dweight reduced in fp32)
# against its float64 value: within one unit in the last place (the interpreter rounds toward
# zero, a GPU to nearest), 2^-7 relative; TOL's bf16 entry (2^-6) also allows for a rounding
# of the inputs or of an intermediate.
BF16_ONE_ROUNDING = dict(atol=2**-7, rtol=2**-7)


def few_roundings(dtype: torch.dtype) -> dict[str, float]:
    """Two computations of one value a few roundings apart (the kernels against a module or a
    per-sample call, reducing in another order; two ranks against one process over the same
    rows; an fp32 sum of a few rows against float64): in a 2-byte dtype (or float64) one unit in
    its last place, its machine epsilon relative; in fp32 a few dozen of its 2^-23 units, 1e-5
    relative; 1e-5 absolute for values near zero."""
    return dict(atol=1e-5, rtol=1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps)


# A semantics' PyTorch reference against the module whose forward it stands for, both fp32
# through torch's own ops on the same rows: the same operations, a few fp32 units apart.
SAME_OPS_FP32 = dict(atol=1e-6, rtol=1e-6)

# One fp32 norm from the kernels against a module's forward: y = x * rstd carries rstd's
# relative error (a row's mean of squares reduced in another order, a few fp32 units), so an
# output near zero is off by even less than its size: 1e-6 absolute.
NORM_FP32 = dict(atol=1e-6, rtol=1e-5)

# Two ranks against one process on GPUs, whole layers and their gradients: compiled graphs and
# cuBLAS pick kernels by shape, and the ranks' shapes are half the single run's.
MULTI_GPU = dict(atol=5e-5, rtol=5e-4)
