"""The input contract: what the ops and ``rms_norm`` accept, checked before anything is written.

Every check reads metadata only (shape, dtype, device), so the same code runs on
real and fake tensors. Errors name the argument and the rule. Where
``torch.nn.functional.rms_norm`` raises, we raise with the same leading words
(its OpInfo error tests match on them); the classes subclass the builtin
types torch uses, so ``except RuntimeError`` keeps working.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from torch_rmsnorm_op.reference import computation_dtype


class RMSNormInputError(ValueError, RuntimeError):
    """An input breaks the contract (shape, device, layout of the arguments)."""


class RMSNormDTypeError(RMSNormInputError, NotImplementedError):
    """An input has a dtype RMSNorm is not defined for (integer, bool, complex for the ops)."""



def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _refuse_layout(op: str, name: str, t: Tensor, jagged: bool = False) -> None:
    """Raise for ``t``, which is not a strided tensor (with ``jagged``, nor a jagged nested
    one): sparse, sparse-compressed, MKL-DNN and strided nested tensors have no rows the
    kernels or the reference can address. Callers test the layout inline (every call does)."""
    also = " or a jagged nested tensor (layout=torch.jagged)" if jagged else ""
    raise RMSNormInputError(f"{op}: {name} must be a strided tensor{also}, got {_layout(t)}")


def _layout(t: Tensor) -> str:
    return f"a nested tensor of layout {t.layout}" if t.is_nested else f"layout {t.layout}"


def _check_real_float(name: str, t: Tensor, op: str) -> None:
    if not t.dtype.is_floating_point:
        raise RMSNormDTypeError(
            f"{op}: {name} must have a real floating-point dtype (float16, bfloat16, float32 or "
            f"float64), got {t.dtype}"
        )


_INT64 = range(-(2**63), 2**63)


def _type_name(value: object) -> str:
    return type(value).__name__


def _shape_element(s: object, shape: tuple, op: str) -> int | torch.SymInt:
    """One element of ``normalized_shape`` as torch's argument parser takes an int: an int
    (not a bool), a SymInt, anything with ``__index__`` (numpy integers), or a one-element
    integer tensor; within int64."""
    if isinstance(s, torch.SymInt):
        return s
    if isinstance(s, Tensor):
        if s.numel() == 1 and not (s.dtype.is_floating_point or s.dtype.is_complex):
            if s.dtype == torch.bool:  # torch's parser takes it as a tensor, then refuses the bool value
                raise RMSNormInputError(f"{op}(): argument 'normalized_shape' must hold integers, got {shape}")
            return int(s.item())
        value = None
    elif isinstance(s, bool):
        value = None
    else:
        try:
            value = operator.index(s)
        except Exception:  # whatever __index__ raises, torch's parser reports a TypeError
            value = None
    if value is None:
        raise TypeError(f"{op}(): argument 'normalized_shape' must be tuple of ints, but found element of type "
                        f"{_type_name(s)} in {shape}")
    if value not in _INT64:
        raise TypeError(f"{op}(): argument 'normalized_shape' must be tuple of ints within int64, got {shape}")
    return value


def normalized_shape_arg(normalized_shape: object, op: str = "rms_norm") -> tuple[int, ...]:
    """``normalized_shape`` as ``F.rms_norm``'s argument parser takes it: a tuple or a list
    (``torch.Size`` is a tuple), each element an int as ``_shape_element`` takes it; returned
    as a tuple of ints (SymInts stay SymInts: ``int()`` would specialize a dynamic dim under
    ``torch.compile``). Anything else raises ``TypeError`` (a one-element bool tensor the
    ``RuntimeError`` torch raises)."""
    if not isinstance(normalized_shape, (tuple, list)):
        raise TypeError(f"{op}(): argument 'normalized_shape' must be tuple of ints, not "
                        f"{_type_name(normalized_shape)}")
    shape = tuple(normalized_shape)
    compiling = torch.compiler.is_compiling()  # a traced dim is a SymInt that Dynamo sees as an int: no range
    for s in shape:  # a loop, not all(...) over a generator: this runs on every general-path call
        if type(s) is not int or (not compiling and s not in _INT64):
            return tuple(_shape_element(s, shape, op) for s in shape)
    return shape


def float_arg(value: object, name: str, op: str = "rms_norm") -> float | int | torch.SymFloat | torch.SymInt:
    """``value`` as torch's argument parser takes a ``float`` (``F.rms_norm``'s ``eps``): a
    Python or numpy number (a bool, an int, a numpy complex's real part), a SymFloat or
    SymInt, or a 0-dim tensor that does not require grad (its value; a complex one only with
    no imaginary part, else the ``RuntimeError`` torch raises). An int or a float is returned
    as it is (``torch.compile`` keeps an int a constant), any other as a float (Sym values as
    they are); anything else raises ``TypeError`` naming the argument."""
    if type(value) is float or type(value) is int:
        return value
    if isinstance(value, (int, float)):  # bool and int subclasses included, as by torch
        return float(value)
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value
    if isinstance(value, np.generic) and isinstance(value, (np.number, np.bool_)):
        return float(value.real) if isinstance(value, np.complexfloating) else float(value)
    if isinstance(value, Tensor) and value.dim() == 0 and not value.requires_grad:
        item = value.item()
        if isinstance(item, complex):
            if item.imag:
                raise RMSNormInputError(f"{op}(): argument '{name}': value {item} cannot be converted to "
                                        f"type double without overflow")
            item = item.real
        return float(item)
    raise TypeError(f"{op}(): argument '{name}' must be float, not {_type_name(value)}"
                    + (" (a tensor must be 0-dim and not require grad)" if isinstance(value, Tensor) else ""))


_NO_RESIDUAL = object()


def functional_args(input: object, normalized_shape: object, weight: object, eps: object,
                    op: str = "rms_norm", residual: object = _NO_RESIDUAL
                    ) -> tuple[tuple[int, ...], float | None]:
    """The arguments of ``F.rms_norm(input, normalized_shape, weight, eps)`` as its argument
    parser takes them, in its order, before any value is checked (so that a wrong type raises
    its ``TypeError`` first, as in torch): ``input`` (and ``add_rms_norm``'s ``residual``) a
    tensor, ``normalized_shape`` (``normalized_shape_arg``), ``weight`` a tensor or None,
    ``eps`` None or ``float_arg``. Returns ``(normalized_shape, eps)`` converted."""
    if not isinstance(input, Tensor):
        raise TypeError(f"{op}(): argument 'input' must be Tensor, not {_type_name(input)}")
    if residual is not _NO_RESIDUAL and not isinstance(residual, Tensor):
        raise TypeError(f"{op}(): argument 'residual' must be Tensor, not {_type_name(residual)}")
    shape = normalized_shape_arg(normalized_shape, op)
    if weight is not None and not isinstance(weight, Tensor):
        raise TypeError(f"{op}(): argument 'weight' must be Tensor or None, not {_type_name(weight)}")
    return shape, None if eps is None else float_arg(eps, "eps", op)


def check_functional_args(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None
) -> tuple[int, ...]:
    """Validate ``rms_norm(input, normalized_shape, weight)`` as ``F.rms_norm`` does: the
    arguments' types (``functional_args``), then ``check_functional_values``. Returns
    ``normalized_shape`` as a tuple of ints."""
    shape, _ = functional_args(input, normalized_shape, weight, None)
    check_functional_values(input, shape, weight)
    return shape


def check_functional_values(input: Tensor, shape: tuple[int, ...], weight: Tensor | None) -> None:
    """Validate the values of ``rms_norm(input, shape, weight)`` (``shape`` as
    ``normalized_shape_arg`` returns it) as ``F.rms_norm`` does: layouts, dtype, shapes, devices."""
    # Checks ordered cheapest-first for valid calls: this runs on every general-path call.
    if not shape:
        raise RMSNormInputError(
            "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one "
            f"element, but got normalized_shape = {list(shape)}"
        )
    if (input.layout != torch.strided or input.is_nested) and input.layout != torch.jagged:
        _refuse_layout("rms_norm", "input", input, jagged=True)
    if weight is not None and (weight.layout != torch.strided or weight.is_nested):
        _refuse_layout("rms_norm", "weight", weight)
    dtype = input.dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        raise RMSNormDTypeError(
            f'"rms_norm" not implemented for {dtype}: input must be a floating-point or complex tensor'
        )
    if weight is not None and weight.shape != shape:
        raise RMSNormInputError(
            "Expected weight to be of same shape as normalized_shape, but got weight of shape "
            f"{_shape(weight)} and normalized_shape = {list(shape)}"
        )
    if input.shape[-len(shape):] != shape:  # also when input has fewer dims
        raise RMSNormInputError(
            f"Given normalized_shape={list(shape)}, expected input with shape [*"
            f"{', '.join(str(s) for s in shape)}], but got input of size{_shape(input)}"
        )
    if weight is not None and weight.device != input.device:
        raise RMSNormInputError(
            f"rms_norm: weight must be on the same device as input (weight: {weight.device}, "
            f"input: {input.device})"
        )


def _check_dtype_arg(op: str, name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise RMSNormDTypeError(f"{op}: {name} must be None or a real floating-point dtype, got {dtype}")


def check_dtype_args(norm_dtype: torch.dtype | None, out_dtype: torch.dtype | None, op: str = "rmsnorm.fwd") -> None:
    """``norm_dtype`` and ``out_dtype`` are each None or a real floating-point dtype. What
    ``rms_norm``'s direct path checks beside ``check_functional_args``, which has checked x and
    the weight."""
    _check_dtype_arg(op, "norm_dtype", norm_dtype)
    _check_dtype_arg(op, "out_dtype", out_dtype)


def check_forward_args(x: Tensor, weight: Tensor | None, norm_dtype: torch.dtype | None = None,
                       out_dtype: torch.dtype | None = None, op: str = "rmsnorm.fwd") -> None:
    """Validate ``rmsnorm::fwd(x, weight, eps, norm_dtype=..., out_dtype=...)``: normalizes over
    x's last dim."""
    if x.layout != torch.strided or x.is_nested:
        _refuse_layout(op, "x", x)
    if x.dim() < 1:
        raise RMSNormInputError(f"{op}: x must have at least 1 dimension (the normalized one), got a 0-dim tensor")
    _check_real_float("x", x, op)
    _check_weight(op, x, weight)
    check_dtype_args(norm_dtype, out_dtype, op)


def check_residual_arg(x: Tensor, residual: Tensor, op: str = "rmsnorm.add_fwd") -> None:
    """``residual`` has x's shape and device and a real floating-point dtype (they are added as
    torch adds them, no broadcast)."""
    if residual.layout != torch.strided or residual.is_nested:
        _refuse_layout(op, "residual", residual)
    if residual.device != x.device:
        raise RMSNormInputError(f"{op}: residual must be on x's device (residual: {residual.device}, x: {x.device})")
    if residual.shape != x.shape:
        raise RMSNormInputError(f"{op}: residual must have x's shape {_shape(x)}, got {_shape(residual)}")
    _check_real_float("residual", residual, op)


def check_add_args(x: Tensor, residual: Tensor, weight: Tensor | None, norm_dtype: torch.dtype | None = None,
                   out_dtype: torch.dtype | None = None, op: str = "rmsnorm.add_fwd") -> None:
    """Validate ``rmsnorm::add_fwd(x, residual, weight, eps, ...)``: ``fwd``'s rules, and
    ``check_residual_arg``'s."""
    check_forward_args(x, weight, norm_dtype, out_dtype, op)
    check_residual_arg(x, residual, op)


def check_norm_add_args(x: Tensor, residual: Tensor, x_weight: Tensor | None, weight: Tensor | None,
                        norm_dtype: torch.dtype | None = None) -> None:
    """Validate ``rmsnorm::norm_add_fwd(x, residual, x_weight, x_eps, weight, eps, ...)``: the
    rules of ``add_fwd`` for x, residual and weight, and ``x_weight`` a weight of x's."""
    op = "rmsnorm.norm_add_fwd"
    check_add_args(x, residual, weight, norm_dtype, op=op)
    _check_weight(op, x, x_weight, "x_weight")


def _check_weight(op: str, x: Tensor, weight: Tensor | None, name: str = "weight") -> None:
    if weight is None:
        return
    if weight.layout != torch.strided or weight.is_nested:
        _refuse_layout(op, name, weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise RMSNormInputError(
            f"{op}: {name} must have shape [N] = [{x.shape[-1]}] (x's last dim), got {_shape(weight)}"
        )
    if weight.device != x.device:
        raise RMSNormInputError(
            f"{op}: {name} must be on the same device as x ({name}: {weight.device}, x: {x.device})"
        )
    if weight.dtype.is_complex:
        raise RMSNormDTypeError(f"{op}: {name} must be real, got {weight.dtype}")


def check_backward_args(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor,
                        dresidual_out: Tensor | None = None, op: str = "rmsnorm.bwd") -> None:
    """Validate ``rmsnorm::bwd(dy, x, weight, rstd)`` (or ``add_bwd``, x being the forward's
    ``residual_out``) against the forward's contract."""
    check_forward_args(x, weight, op=op)
    for name, t in (("dy", dy), ("dresidual_out", dresidual_out)):
        if t is None:
            continue
        if t.layout != torch.strided or t.is_nested:
            _refuse_layout(op, name, t)
        if t.device != x.device:
            raise RMSNormInputError(f"{op}: {name} must be on x's device ({name}: {t.device}, x: {x.device})")
        if t.shape != x.shape:
            raise RMSNormInputError(f"{op}: {name} must have x's shape {_shape(x)}, got {_shape(t)}")
        _check_real_float(name, t, op)
    want = computation_dtype(x.dtype)
    if rstd.device != x.device:
        raise RMSNormInputError(f"{op}: rstd must be on x's device (rstd: {rstd.device}, x: {x.device})")
    if rstd.shape != x.shape[:-1]:
        raise RMSNormInputError(
            f"{op}: rstd must have shape x.shape[:-1] = {_shape(x)[:-1]}, got {_shape(rstd)}"
        )
    if rstd.dtype != want:
        raise RMSNormDTypeError(f"{op}: rstd must be {want} for x of dtype {x.dtype}, got {rstd.dtype}")
