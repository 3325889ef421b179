"""vmap rules for the ``torch.ops.rmsnorm`` ops.

Each rule is registered twice: with ``torch.library.register_vmap`` for ``torch.vmap``, and on
the "Batched" dispatch key for the older vmap (``torch._vmap_internals``) under which
``torch.autograd.grad(..., is_grads_batched=True)``, ``torch.autograd.functional.jacobian(...,
vectorize=True)`` and ``gradcheck(..., check_batched_grad=True)`` run the registered backward on
a batch of output gradients.

The ops normalize over the last dim and treat every leading dim as more rows, so a batch dim is
just more rows: each rule moves the batch dims to the front, expands the unbatched operands to
the batch (a view) and calls the op once on all rows. Where the kernels cannot address such a
view's rows in place, the op copies them (``dispatch.Plan.copy_rows``).

The weight gradient of a batched backward is per sample: ``dweight[b]`` is the sum over sample
``b``'s rows of ``dy * x * rstd``. The kernels sum over all rows of a call, so the rules take
dx from the one call on all rows and compute the per-sample sums in torch, in the computation
dtype (float32; float64 for float64 inputs), as one ``sum`` over the rows of a ``(B, rows, N)``
product: a fixed order with no atomics, hence deterministic, and one launch whatever B is (a
call per sample would cost B launches, and B is the number of output elements in a jacobian).
When x and rstd are unbatched (the usual case in batched gradients, where only dy carries the
batch), ``x * rstd`` is computed once and broadcast over the batch. These sums are not counted
as a fallback: the kernels still serve the call, dx included.

Per-sample weights (the weight itself batched, e.g. vmap over an ensemble's stacked parameters)
are outside the kernels' reach (they take one weight row): the reference formula serves them,
counted as a fallback and governed by the fallback policy like every other.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torch_rmsnorm_op import (
    _torch_compat,
    ops,  # noqa: F401  (defines the ops the rules are registered on)
    reference,
)
from torch_rmsnorm_op.contract import check_backward_args, check_forward_args
from torch_rmsnorm_op.fallback import record_fallback

_PER_SAMPLE_WEIGHTS = "per-sample weights under vmap"


def _batched(t: Tensor | None, dim: int | None) -> Tensor | None:
    """``t`` with its batch dim first if it has one, else as it is (it broadcasts over the batch)."""
    return t.movedim(dim, 0) if t is not None and dim is not None else t


def _expanded(t: Tensor | None, dim: int | None, batch_size: int) -> Tensor | None:
    """``_batched(t, dim)``, an unbatched ``t`` expanded to the batch (a view)."""
    if t is None or dim is not None:
        return _batched(t, dim)
    return t.expand(batch_size, *t.shape)


def _sample(t: Tensor) -> Tensor:
    """A stand-in with one sample's shape, dtype and device (a stride-0 view of one element) for
    the contract checks, valid for a batch of 0 too; ``t`` is batch-first."""
    return t.new_empty(()).expand(t.shape[1:])


def _broadcast_weight(weight: Tensor, dim: int, ndim: int) -> Tensor:
    """Per-sample weights, ``[B, N]`` once batch-first, shaped to broadcast over batch-first
    operands of ``ndim`` dims."""
    w = weight.movedim(dim, 0)
    return w.reshape(w.shape[0], *[1] * (ndim - 2), w.shape[-1])


def _per_sample_dweight(dy: Tensor, x: Tensor, rstd: Tensor, weight: Tensor, batch_size: int,
                        sample_shape: torch.Size) -> Tensor:
    """``dweight[b]``: the sum over sample ``b``'s rows of ``dy * x * rstd``, in x's computation
    dtype, cast to the weight's dtype. Each operand is batch-first or unbatched (it broadcasts)."""
    ctype = reference.computation_dtype(x.dtype)
    prod = (dy.to(ctype) * (x.to(ctype) * rstd.to(ctype).unsqueeze(-1))).expand(batch_size, *sample_shape)
    rows = math.prod(sample_shape[:-1])
    return prod.reshape(batch_size, rows, sample_shape[-1]).sum(1).to(weight.dtype)


def _fwd_vmap(info, in_dims, x: Tensor, weight: Tensor | None, eps: float, **kwargs):
    x_dim, w_dim, _ = in_dims
    x = _expanded(x, x_dim, info.batch_size)
    if w_dim is None:
        return torch.ops.rmsnorm.fwd(x, weight, eps, **kwargs), (0, 0)
    check_forward_args(_sample(x), _sample(weight.movedim(w_dim, 0)))
    record_fallback("rmsnorm.fwd", _PER_SAMPLE_WEIGHTS)
    return reference.rms_norm_forward(x, _broadcast_weight(weight, w_dim, x.dim()), eps, **kwargs), (0, 0)


def _bwd_vmap(info, in_dims, dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, *,
              weight_offset: float = 0.0):
    dy_dim, x_dim, w_dim, rstd_dim = in_dims
    size = info.batch_size
    dy_b, x_b, rstd_b = _batched(dy, dy_dim), _batched(x, x_dim), _batched(rstd, rstd_dim)
    dy_e, x_e, rstd_e = _expanded(dy, dy_dim, size), _expanded(x, x_dim, size), _expanded(rstd, rstd_dim, size)
    if w_dim is None:
        dx, _ = torch.ops.rmsnorm.bwd(dy_e, x_e, weight, rstd_e, weight_offset=weight_offset)
    else:
        check_backward_args(_sample(dy_e), _sample(x_e), _sample(weight.movedim(w_dim, 0)), _sample(rstd_e))
        record_fallback("rmsnorm.bwd", _PER_SAMPLE_WEIGHTS)
        w = _broadcast_weight(weight, w_dim, x_e.dim())
        dx, _ = reference.rms_norm_backward(dy_e, x_e, w, rstd_e, weight_offset)
    if weight is None:
        return (dx, None), (0, None)
    return (dx, _per_sample_dweight(dy_b, x_b, rstd_b, weight, size, x_e.shape[1:])), (0, 0)


def _add_fwd_vmap(info, in_dims, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, **kwargs):
    x_dim, r_dim, w_dim, _ = in_dims
    x, residual = _expanded(x, x_dim, info.batch_size), _expanded(residual, r_dim, info.batch_size)
    if w_dim is None:
        return torch.ops.rmsnorm.add_fwd(x, residual, weight, eps, **kwargs), (0, 0, 0)
    check_forward_args(_sample(x), _sample(weight.movedim(w_dim, 0)))
    record_fallback("rmsnorm.add_fwd", _PER_SAMPLE_WEIGHTS)
    w = _broadcast_weight(weight, w_dim, x.dim())
    return reference.add_rms_norm_forward(x, residual, w, eps, **kwargs), (0, 0, 0)


def _add_bwd_vmap(info, in_dims, dy: Tensor, dresidual_out: Tensor | None, residual_out: Tensor,
                  weight: Tensor | None, rstd: Tensor, *, weight_offset: float = 0.0):
    dy_dim, dr_dim, ro_dim, w_dim, rstd_dim = in_dims
    size = info.batch_size
    dy_b, ro_b, rstd_b = _batched(dy, dy_dim), _batched(residual_out, ro_dim), _batched(rstd, rstd_dim)
    dy_e, ro_e, rstd_e = (_expanded(dy, dy_dim, size), _expanded(residual_out, ro_dim, size),
                          _expanded(rstd, rstd_dim, size))
    dr_e = _expanded(dresidual_out, dr_dim, size)
    if w_dim is None:
        dx, _ = torch.ops.rmsnorm.add_bwd(dy_e, dr_e, ro_e, weight, rstd_e, weight_offset=weight_offset)
    else:
        check_backward_args(_sample(dy_e), _sample(ro_e), _sample(weight.movedim(w_dim, 0)), _sample(rstd_e))
        record_fallback("rmsnorm.add_bwd", _PER_SAMPLE_WEIGHTS)
        w = _broadcast_weight(weight, w_dim, ro_e.dim())
        dx, _ = reference.add_rms_norm_backward(dy_e, dr_e, ro_e, w, rstd_e, weight_offset)
    if weight is None:
        return (dx, None), (0, None)
    return (dx, _per_sample_dweight(dy_b, ro_b, rstd_b, weight, size, ro_e.shape[1:])), (0, 0)


def _norm_add_fwd_vmap(info, in_dims, x: Tensor, residual: Tensor, x_weight: Tensor | None, x_eps: float,
                       weight: Tensor | None, eps: float, **kwargs):
    x_dim, r_dim, xw_dim, _, w_dim, _ = in_dims
    x, residual = _expanded(x, x_dim, info.batch_size), _expanded(residual, r_dim, info.batch_size)
    if xw_dim is None and w_dim is None:
        return torch.ops.rmsnorm.norm_add_fwd(x, residual, x_weight, x_eps, weight, eps, **kwargs), (0, 0, 0, 0)
    for w, dim in ((x_weight, xw_dim), (weight, w_dim)):
        check_forward_args(_sample(x), None if w is None else _sample(_expanded(w, dim, info.batch_size)))
    record_fallback("rmsnorm.norm_add_fwd", _PER_SAMPLE_WEIGHTS)
    xw, w = (None if t is None else _broadcast_weight(_expanded(t, d, info.batch_size), 0, x.dim())
             for t, d in ((x_weight, xw_dim), (weight, w_dim)))
    return reference.norm_add_rms_norm_forward(x, residual, xw, x_eps, w, eps, **kwargs), (0, 0, 0, 0)


# torch.autograd.grad(is_grads_batched=True), jacobian(vectorize=True) and gradcheck's batched
# check run the backward under torch._vmap_internals' vmap, whose tensors carry the "Batched"
# dispatch key (not functorch's FuncTorchBatched, which register_vmap serves). Its per-sample
# loop fallback refuses ops with an optional result (bwd, add_bwd), and would cost B calls for
# the others, so a kernel on "Batched" unwraps its tensors and runs the rules above. That vmap
# has no public API: the calls below (``_torch_compat``'s add_batch_dim, remove_batch_dim and
# vmap_nesting) are the ones torch/_vmap_internals.py itself makes.


class _VmapInfo(NamedTuple):
    """What the rules read of functorch's ``VmapInfo``."""

    batch_size: int
    randomness: str = "error"


def _legacy_batch_size(t: Tensor, level: int) -> int | None:
    """The size of ``t``'s batch dim at ``level``, or None if it has none there: an unbatched
    tensor comes back expanded to the size asked for, a batched one at its own."""
    one, two = _torch_compat.remove_batch_dim(t, level, 1, 0), _torch_compat.remove_batch_dim(t, level, 2, 0)
    return one.shape[0] if one.shape[0] == two.shape[0] else None


# The nesting count is thread-local, and the autograd engine runs a CUDA backward on its device
# thread, where it reads 0 while the tensors stay batched: there the levels up to this are tried.
MAX_LEGACY_LEVEL = 8


def _innermost_level(tensors: list[Tensor]) -> tuple[int, int]:
    """The innermost vmap level any of ``tensors`` is batched at, and its batch size."""
    top = _torch_compat.vmap_nesting()
    for level in range(top or MAX_LEGACY_LEVEL, 0, -1):
        for t in tensors:
            size = _legacy_batch_size(t, level)
            if size is not None:
                return level, size
    raise RuntimeError("rmsnorm: a batched tensor outside any torch._vmap_internals vmap level")


def _legacy_batched(rule: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``rule`` on ``args`` unwrapped at their innermost vmap level and wrap its results
    back; a tensor still batched at an outer level is served again by this kernel."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    level, size = _innermost_level(tensors)
    physical, in_dims = [], []
    for a in args:
        batched = isinstance(a, Tensor) and _legacy_batch_size(a, level) is not None
        physical.append(_torch_compat.remove_batch_dim(a, level, size, 0) if batched else a)
        in_dims.append(0 if batched else None)
    outputs, out_dims = rule(_VmapInfo(size), tuple(in_dims), *physical, **kwargs)
    return tuple(o if d is None else _torch_compat.add_batch_dim(o, d, level) for o, d in zip(outputs, out_dims))


_LIB = torch.library.Library("rmsnorm", "FRAGMENT")  # kept alive: a collected Library unregisters its kernels
for _name, _rule in (("fwd", _fwd_vmap), ("bwd", _bwd_vmap), ("add_fwd", _add_fwd_vmap), ("add_bwd", _add_bwd_vmap),
                     ("norm_add_fwd", _norm_add_fwd_vmap)):
    torch.library.register_vmap(f"rmsnorm::{_name}", _rule, lib=_LIB)
    _LIB.impl(_name, functools.partial(_legacy_batched, _rule), "Batched")
