"""The functional API: ``rms_norm`` (``torch.nn.functional.rms_norm``'s contract) and
``add_rms_norm`` (the residual add fused with the norm), backed by ``torch.ops.rmsnorm``.

In eager code where the dispatcher has nothing to add (no gradient to record, no autocast,
mode, transform, subclass, ``torch.jit.trace``), both call the ops' implementation directly:
the dispatcher's Python kernels cost more host time than the kernel launch itself, and since
nothing will read rstd, the kernels do not write it. The same outputs, bit for bit. Under
``torch.profiler`` such a call is recorded as the op it stands for. ``rms_norm`` also keeps
each such call's signature with its plan and launch (``_SIGNATURES``), so that a repeated call
checks only what can change between calls with the same signature.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_variadic

from torch_rmsnorm_op import _torch_compat, dispatch, ops, reference
from torch_rmsnorm_op.contract import (
    check_dtype_args,
    check_functional_values,
    check_residual_arg,
    float_arg,
    functional_args,
)
from torch_rmsnorm_op.dispatch import Plan
from torch_rmsnorm_op.fallback import record_fallback, record_kernel

_PLAIN_WEIGHT_TYPES = (Tensor, torch.nn.Parameter)
_NOT_KEPT = (Tensor, torch.SymInt, torch.SymFloat)  # an eps or offset of these: each call checks it
_profiler_enabled = _torch_compat.profiler_enabled
_forward_ad_level = _torch_compat.forward_ad_level


def _transform_reason() -> str | None:
    """Autodiff the ops' registered formulas do not serve: forward-mode AD (a custom op has no
    forward-mode formula: the tangent would be dropped) and torch.func's grad/jvp-style
    transforms. vmap is served by the ops."""
    transform = _torch_compat.functorch_transform()
    if transform is not None:
        return f"torch.func transform {transform}"
    if _forward_ad_level() >= 0:
        return "forward-mode AD"
    return None


def _plain(t: Tensor | None, weight: bool = False) -> bool:
    if t is None:
        return True
    if weight:
        return type(t) in _PLAIN_WEIGHT_TYPES and t.layout == torch.strided and not t.is_neg()
    return (type(t) is Tensor and (t.is_cuda or t.is_cpu) and t.layout == torch.strided and not t.is_nested
            and not t.is_neg())


def _nothing_to_dispatch(tensors: tuple[Tensor, ...], weight: Tensor | None) -> bool:
    """Whether dispatching the op on these inputs, here and now, would only reach its
    implementation: eager (not compiled), no gradient to record, plain strided CPU or CUDA
    tensors (no subclass, nested tensor, negative bit), and nothing in the dispatcher's state
    (``_torch_compat.dispatcher_has_nothing_to_do``)."""
    grad = torch.is_grad_enabled()
    if not _plain(weight, weight=True) or (grad and weight is not None and weight.requires_grad):
        return False
    for t in tensors:  # a loop, not all(...) over a generator: this runs on every eager call
        if not _plain(t) or (grad and t.requires_grad):
            return False
    return _torch_compat.dispatcher_has_nothing_to_do()


def _flatten(input: Tensor, shape: tuple[int, ...], weight: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``normalized_shape`` over several trailing dims as one: [..., prod(shape)]."""
    if len(shape) == 1:
        return input, weight
    n = math.prod(shape)
    return input.reshape(*input.shape[: input.dim() - len(shape)], n), None if weight is None else weight.reshape(n)


class _Signature(NamedTuple):
    """What the eager calls of one signature launch with, decided at its first call."""

    plan: Plan
    eps: float
    out_dtype: torch.dtype | None  # None: y is torch.empty_like(x) (x contiguous, y of x's dtype)
    launch: Callable[[Plan, Tensor, Tensor | None, float, Tensor], None]  # launch.forward_norm_only


# rms_norm's eager call signatures: x's sizes, strides, dtype and device; normalized_shape;
# the weight's; eps and the keywords. A signature fixes what the contract checks and what the
# plan depends on, so a call whose signature is kept runs no checks but the per-call state's.
# The arguments' types are part of it: values that compare (and hash) equal may differ in what
# the call does (40 and 40.0 in normalized_shape, 0.5 and Fraction(1, 2) as eps). Of
# normalized_shape, the last element's type: only a one-dim normalized_shape keeps a plan, a
# longer one's signature takes the general path, which checks every element.
# None: the general path serves the signature (its checks raise, or no kernel serves it).
_SIGNATURES: dict[tuple, _Signature | None] = {}
MAX_SIGNATURES = 4096  # cleared when full, as dispatch's plans are
_MISSING = object()


def _kept_signature(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None,
                    weight_offset: float | None, norm_dtype: torch.dtype | None,
                    out_dtype: torch.dtype | None) -> _Signature | None:
    """The kept signature of an eager ``rms_norm`` call the dispatcher has nothing to add to
    (``_nothing_to_dispatch``), made at its first call; None where the general path serves the
    call. Unhashable or unusual arguments (a tensor eps, a non-finite one) take the general
    path, which checks them. A torch function mode or a tensor subclass sees the call through
    the general path (``__torch_function__``), before anything reads x's attributes."""
    if type(x) is not Tensor or not _torch_compat.dispatcher_has_nothing_to_do() or _forward_ad_level() >= 0:
        return None
    if x.is_nested or x.layout is not torch.strided or x.is_neg():
        return None
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return None
    if type(normalized_shape) is list:
        normalized_shape = tuple(normalized_shape)
    try:  # the arguments' types join the key (module comment above _SIGNATURES)
        if weight is None:
            key = (x.shape, x.stride(), x.dtype, x.device, normalized_shape, eps, weight_offset, norm_dtype, out_dtype,
                   type(normalized_shape[-1]), type(eps), type(weight_offset))
        elif (type(weight) in _PLAIN_WEIGHT_TYPES and weight.layout is torch.strided and not weight.is_neg()
              and not (grad and weight.requires_grad)):
            key = (x.shape, x.stride(), x.dtype, x.device, normalized_shape, eps, weight_offset, norm_dtype, out_dtype,
                   type(normalized_shape[-1]), type(eps), type(weight_offset),
                   weight.shape, weight.stride(), weight.dtype, weight.device)
        else:
            return None
        signature = _SIGNATURES.get(key, _MISSING)
    except Exception:  # an argument that is no sequence or cannot be hashed: the general path checks it
        return None
    if signature is _MISSING:
        return _signature(key, x, normalized_shape, weight, eps, weight_offset, norm_dtype, out_dtype)
    return signature


def _signature(key: tuple, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None,
               weight_offset: float | None, norm_dtype: torch.dtype | None,
               out_dtype: torch.dtype | None) -> _Signature | None:
    """What the calls of ``key``'s signature launch with, kept for its later calls; None where
    the general path serves them. Arguments the contract rejects raise its errors here, as
    the general path would, before anything is written."""
    shape, eps_value = functional_args(x, normalized_shape, weight, eps)
    offset = 0.0 if weight_offset is None else float_arg(weight_offset, "weight_offset")
    check_functional_values(x, shape, weight)
    plain = (
        all(type(s) is int for s in normalized_shape)
        and (eps is None or (not isinstance(eps, _NOT_KEPT) and math.isfinite(eps_value)))
        and not isinstance(weight_offset, _NOT_KEPT) and math.isfinite(offset)
        and all(d is None or type(d) is torch.dtype for d in (norm_dtype, out_dtype))
    )
    if not plain:  # not kept: each call checks such arguments
        return None
    check_dtype_args(norm_dtype, out_dtype)
    signature = None
    n = shape[0] if len(shape) == 1 else 0
    if n > 0 and x.numel() > 0 and not x.is_complex() and (weight is None or weight.is_contiguous()):
        plan = dispatch.forward_plan(x, weight, norm_dtype=norm_dtype, weight_offset=float(offset),
                                     store_rstd=False, out_dtype=out_dtype)
        if type(plan) is not str and not plan.copy_rows:
            eps_value = reference.default_eps(x.dtype) if eps_value is None else eps_value
            y_dtype = out_dtype or x.dtype
            keeps_layout = y_dtype == x.dtype and x.stride() == _contiguous_strides(x.shape)
            signature = _Signature(plan, float(eps_value), None if keeps_layout else y_dtype,
                                   ops.launch_module().forward_norm_only)
    if len(_SIGNATURES) >= MAX_SIGNATURES:
        _SIGNATURES.clear()
    _SIGNATURES[key] = signature
    return signature


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, as torch gives them."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _direct(op: str, run):
    """Run an eager shortcut, named ``op`` in profiler traces."""
    if _profiler_enabled():
        with torch.profiler.record_function(op):
            return run()
    return run()


_RAGGED_DIM = "rms_norm(): Normalization over the ragged dim not supported for nested tensors"


def _jagged_rms_norm(input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float,
                     weight_offset: float, norm_dtype: torch.dtype | None, out_dtype: torch.dtype | None) -> Tensor:
    """``rms_norm`` of a jagged nested tensor (``layout=torch.jagged``, arguments checked) over
    dims after its ragged one, as ``F.rms_norm`` takes it: its values hold every row
    (``[total, ..., N]`` where the ragged dim is the first after the batch), normalized as a
    dense tensor and rewrapped with the input's offsets. Ragged in a later dim (a transposed
    one), or with holes between its sequences (``lengths`` given), whose values hold rows no
    sequence has: the reference, which torch's nested ops run, counted as a fallback."""
    ragged, min_seqlen, max_seqlen = _torch_compat.jagged_layout(input)
    if len(normalized_shape) > input.dim() - ragged - 1:
        raise ValueError(_RAGGED_DIM)
    if ragged != 1 or input.lengths() is not None:
        record_fallback("rms_norm", f"nested tensor ragged in dim {ragged}" if ragged != 1
                        else "nested tensor with holes between its sequences")
        return reference.rms_norm_reference(input, tuple(normalized_shape), weight, eps, weight_offset, norm_dtype,
                                            out_dtype)
    values = rms_norm(input.values(), normalized_shape, weight, eps, weight_offset=weight_offset,
                      norm_dtype=norm_dtype, out_dtype=out_dtype)
    return torch.nested.nested_tensor_from_jagged(values, input.offsets(), min_seqlen=min_seqlen, max_seqlen=max_seqlen)


def _is_nested(t: object) -> bool:
    """A nested tensor: ``rms_norm`` normalizes a jagged one's values itself (its
    ``__torch_function__`` takes only ``F.rms_norm``'s arguments) and refuses the others. A
    plain tensor is not asked (a torch function mode would see the question)."""
    return type(t) is not Tensor and isinstance(t, Tensor) and t.is_nested


def _keywords(weight_offset: float | None, norm_dtype: torch.dtype | None, out_dtype: torch.dtype | None) -> dict:
    """The keyword-only arguments a call passed, for its ``__torch_function__`` handler (and the
    node a ``torch.fx`` trace records): those left at their default are left out."""
    given = {"weight_offset": weight_offset, "norm_dtype": norm_dtype, "out_dtype": out_dtype}
    return {name: value for name, value in given.items() if value is not None}


def rms_norm(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None, *,
    weight_offset: float | None = None, norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``torch.nn.functional.rms_norm`` backed by ``torch.ops.rmsnorm.fwd``: same signature,
    defaults (``eps=None`` is the computation dtype's epsilon, as in torch), shapes, dtypes,
    errors and gradients; ``normalized_shape`` may span several trailing dims; complex inputs
    take the reference path.

    The keyword-only arguments serve the RMSNorm variants of model families: the normalized
    row is rounded to ``norm_dtype`` before the weight multiplies it (a norm that casts it back
    to the input dtype first); the weight scales as ``weight + weight_offset`` in fp32 (a norm
    that scales by ``1 + weight``; None is no offset); the result has ``out_dtype`` (default: the input's
    dtype).

    A jagged nested tensor is normalized over dims after its ragged one, as by ``F.rms_norm``."""
    signature = None if torch.compiler.is_compiling() else _kept_signature(
        input, normalized_shape, weight, eps, weight_offset, norm_dtype, out_dtype)
    if signature is not None:  # the eager lane: allocate, count, launch
        if signature.out_dtype is None:
            y = torch.empty_like(input)
        else:
            y = torch.empty_like(input, dtype=signature.out_dtype, memory_format=torch.contiguous_format)
        record_kernel("rmsnorm.fwd")
        if _profiler_enabled():
            with torch.profiler.record_function("rmsnorm::fwd"):
                signature.launch(signature.plan, input, weight, signature.eps, y)
        else:
            signature.launch(signature.plan, input, weight, signature.eps, y)
        return y
    if has_torch_function_variadic(input, weight) and not _is_nested(input):
        # Tensor subclasses, torch function modes and torch.fx's Proxy see the call, as F.rms_norm's
        return handle_torch_function(rms_norm, (input, weight), input, normalized_shape, weight, eps,
                                     **_keywords(weight_offset, norm_dtype, out_dtype))
    shape, eps = functional_args(input, normalized_shape, weight, eps)
    # A float default (or a float attribute) would reach torch.compile as a graph input of its
    # own; None, and an int, stay constants.
    weight_offset = 0.0 if weight_offset is None else float_arg(weight_offset, "weight_offset")
    check_functional_values(input, shape, weight)
    if eps is None:
        eps = reference.default_eps(input.dtype)
    if input.is_complex() or (weight is not None and weight.is_complex()):
        record_fallback("rms_norm", f"complex dtype {input.dtype}")
        return reference.rms_norm_reference(input, shape, weight, eps, weight_offset, norm_dtype, out_dtype)
    direct = False
    if not torch.compiler.is_compiling():
        transform = _transform_reason()
        if transform is not None:
            record_fallback("rms_norm", transform)
            return reference.rms_norm_reference(input, shape, weight, eps, weight_offset, norm_dtype, out_dtype)
        direct = _nothing_to_dispatch((input,), weight)
    if not direct and input.is_nested and input.layout == torch.jagged:  # not a plain tensor: never direct
        return _jagged_rms_norm(input, shape, weight, eps, weight_offset, norm_dtype, out_dtype)
    x, w = _flatten(input, shape, weight)
    if direct:  # x and the weight are checked, and real (complex took the reference)
        check_dtype_args(norm_dtype, out_dtype)
        y = _direct("rmsnorm::fwd", lambda: ops.forward(x, w, float(eps), float(weight_offset), norm_dtype,
                                                        out_dtype, want_rstd=False)[0])
    else:
        y = torch.ops.rmsnorm.fwd(x, w, float(eps), weight_offset=weight_offset, norm_dtype=norm_dtype,
                                  out_dtype=out_dtype)[0]
    return y if len(shape) == 1 else y.view(input.shape)


def add_rms_norm(
    input: Tensor, residual: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
    eps: float | None = None, *, weight_offset: float | None = None, norm_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(input + residual, ...), input + residual)`` in one pass over the rows, backed
    by ``torch.ops.rmsnorm.add_fwd``. The sum is what ``input + residual`` gives (their promoted
    dtype, no broadcasting: residual has input's shape); the norm's default ``eps`` and output
    dtype are the sum's. Gradients reach both inputs (the sum's own gradient included). Jagged
    nested tensors are added by torch, then normalized as ``rms_norm`` takes them."""
    if has_torch_function_variadic(input, weight, residual) and not (_is_nested(input) or _is_nested(residual)):
        return handle_torch_function(add_rms_norm, (input, weight, residual), input, residual, normalized_shape,
                                     weight, eps, **_keywords(weight_offset, norm_dtype, out_dtype))
    shape, eps = functional_args(input, normalized_shape, weight, eps, "add_rms_norm", residual=residual)
    weight_offset = 0.0 if weight_offset is None else float_arg(weight_offset, "weight_offset", "add_rms_norm")
    check_functional_values(input, shape, weight)
    sum_dtype = torch.promote_types(input.dtype, residual.dtype)
    if eps is None:
        eps = reference.default_eps(sum_dtype)
    direct = False
    if input.is_complex() or residual.is_complex() or (weight is not None and weight.is_complex()):
        record_fallback("add_rms_norm", f"complex dtype {sum_dtype}")
        s = input + residual
        return reference.rms_norm_reference(s, shape, weight, eps, weight_offset, norm_dtype, out_dtype), s
    if not torch.compiler.is_compiling():
        transform = _transform_reason()
        if transform is not None:
            record_fallback("add_rms_norm", transform)
            s = input + residual
            return reference.rms_norm_reference(s, shape, weight, eps, weight_offset, norm_dtype, out_dtype), s
        direct = _nothing_to_dispatch((input, residual), weight)
    if not direct and (input.is_nested or residual.is_nested):  # not plain tensors: never direct
        s = input + residual
        return rms_norm(s, shape, weight, eps, weight_offset=weight_offset, norm_dtype=norm_dtype,
                        out_dtype=out_dtype), s
    x, w = _flatten(input, shape, weight)
    r = residual if len(shape) == 1 else residual.reshape(x.shape)
    if direct:
        check_residual_arg(x, r)
        check_dtype_args(norm_dtype, out_dtype, "rmsnorm.add_fwd")
        y, s, _ = _direct("rmsnorm::add_fwd", lambda: ops.forward(x, w, float(eps), float(weight_offset),
                                                                  norm_dtype, out_dtype, residual=r,
                                                                  want_rstd=False))
    else:
        y, s, _ = torch.ops.rmsnorm.add_fwd(x, r, w, float(eps), weight_offset=weight_offset, norm_dtype=norm_dtype,
                                            out_dtype=out_dtype)
    if len(shape) > 1:
        y, s = y.view(input.shape), s.view(input.shape)
    return y, s
