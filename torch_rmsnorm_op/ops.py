"""The ops ``torch.ops.rmsnorm.fwd`` / ``torch.ops.rmsnorm.bwd``: schema, fake, autograd, functional.

Defined with ``torch.library`` (a ``Library`` with ``define``/``impl``, then
``register_fake``, ``register_autograd``, ``register_vmap``, ``register_autocast``):
under ``torch.compile`` each op is one opaque call, so the fallback policy and the
dispatch counters act at run time, exactly as in eager mode, and CPU tensors run
the kernels through the Triton interpreter even inside compiled graphs (README,
"Design").

    fwd(Tensor x, Tensor? weight, float eps) -> (Tensor y, Tensor rstd)
    bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd) -> (Tensor dx, Tensor? dweight)

``y``/``dx`` are contiguous with x's shape and dtype; ``rstd`` has shape
``x.shape[:-1]`` and the computation dtype (float32; float64 for float64 x);
``dweight`` has the weight's shape and dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch._C._functorch import TransformType, peek_interpreter_stack

from torch_rmsnorm_op import reference
from torch_rmsnorm_op.contract import check_backward_args, check_forward_args, check_functional_args
from torch_rmsnorm_op.fallback import kernel_unsupported_reason, record_fallback, record_kernel
from torch_rmsnorm_op.layout import row_stride


@functools.cache
def _kernels():
    # Imported on first use: the kernels are defined then, so TRITON_INTERPRET may be
    # set any time before the first call (python -m torch_rmsnorm_op does so without CUDA).
    from torch_rmsnorm_op import kernels

    return kernels


def _kernels_serve(op: str, x: Tensor, weight: Tensor | None) -> bool:
    """Whether the kernels run this call, after the fallback policy has been applied if not."""
    reason = kernel_unsupported_reason(x, weight)
    if reason is not None:
        record_fallback(op, reason)
        return False
    record_kernel(op)
    return True


# ``custom_op`` would register the same kernels behind a Python wrapper of its own (an aliasing
# check and a dynamo-disabled frame on every call); ``define`` + ``impl`` calls ours directly.
_LIB = torch.library.Library("rmsnorm", "DEF")  # kept alive: a collected Library unregisters its ops
_LIB.define("fwd(Tensor x, Tensor? weight, float eps, *, float weight_offset=0.0, ScalarType? norm_dtype=None, "
            "ScalarType? out_dtype=None) -> (Tensor y, Tensor rstd)")
_LIB.define("bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, *, float weight_offset=0.0) "
            "-> (Tensor dx, Tensor? dweight)")
_LIB.define("add_fwd(Tensor x, Tensor residual, Tensor? weight, float eps, *, float weight_offset=0.0, "
            "ScalarType? norm_dtype=None, ScalarType? out_dtype=None) -> (Tensor y, Tensor residual_out, Tensor rstd)")
_LIB.define("add_bwd(Tensor dy, Tensor? dresidual_out, Tensor residual_out, Tensor? weight, Tensor rstd, *, "
            "float weight_offset=0.0) -> (Tensor dx, Tensor? dweight)")


def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
                 norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    check_forward_args(x, weight)
    if weight_offset or norm_dtype is not None or out_dtype is not None:
        return reference.rms_norm_forward(x, weight, eps, weight_offset, norm_dtype, out_dtype)
    return _forward(x, weight, eps)


def _forward(x: Tensor, weight: Tensor | None, eps: float, want_rstd: bool = True) -> tuple[Tensor, Tensor | None]:
    """``rmsnorm::fwd`` on arguments that meet its contract (``check_forward_args``). Without
    ``want_rstd`` (a caller that only needs y) rstd is neither allocated nor written by the
    kernels (``STORE_RSTD``) and the second result is None, unless the reference served the
    call or N is 0."""
    n = x.shape[-1]
    plan = None
    if n > 0:
        # Plans are kept only for inputs the kernels serve: with one, the policy has nothing to decide.
        plan = _kernels().forward_plan(x, weight, want_rstd) if x.is_cuda else None
        if plan is not None:
            record_kernel("rmsnorm.fwd")
        elif not _kernels_serve("rmsnorm.fwd", x, weight):
            with torch.profiler.record_function("rmsnorm.fwd [reference fallback]"):
                return reference.rms_norm_forward(x, weight, eps)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = None
    if want_rstd or n == 0:
        rstd = torch.empty(x.shape[:-1], dtype=reference.computation_dtype(x.dtype), device=x.device)
    if n == 0:  # nothing to normalize; mean of an empty row is NaN, as in torch
        return y, rstd.fill_(math.nan)
    w = None if weight is None else weight.contiguous()
    if plan is None or not _kernels().launch_planned(plan, x, w, eps, y, rstd):
        _kernels().launch_forward(x, w, eps, y, rstd, keep_plan=True)
    return y, rstd


@torch.library.register_fake("rmsnorm::fwd", lib=_LIB)
def _(x: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
      norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    check_forward_args(x, weight)
    return (
        x.new_empty(x.shape, dtype=out_dtype or x.dtype),
        x.new_empty(x.shape[:-1], dtype=reference.computation_dtype(x.dtype)),
    )


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, *,
                 weight_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    check_backward_args(dy, x, weight, rstd)
    if weight_offset or dy.dtype != x.dtype:
        return reference.rms_norm_backward(dy, x, weight, rstd, weight_offset)
    if x.shape[-1] > 0 and not _kernels_serve("rmsnorm.bwd", x, weight):
        with torch.profiler.record_function("rmsnorm.bwd [reference fallback]"):
            return reference.rms_norm_backward(dy, x, weight, rstd)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dweight = None if weight is None else torch.empty_like(weight, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return dx, None if dweight is None else dweight.zero_()
    if row_stride(dy) is None:  # e.g. an expanded gradient from .sum().backward(): copy, it is not x
        dy = dy.contiguous()
    _kernels().launch_backward(
        dy, x, None if weight is None else weight.contiguous(), rstd.contiguous(), dx, dweight
    )
    return dx, dweight


@torch.library.register_fake("rmsnorm::bwd", lib=_LIB)
def _(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, *,
      weight_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    check_backward_args(dy, x, weight, rstd)
    return x.new_empty(x.shape), None if weight is None else weight.new_empty(weight.shape)


def rms_norm_add_fwd(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
                     norm_dtype: torch.dtype | None = None,
                     out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    check_forward_args(x, weight)
    return reference.add_rms_norm_forward(x, residual, weight, eps, weight_offset, norm_dtype, out_dtype)


@torch.library.register_fake("rmsnorm::add_fwd", lib=_LIB)
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
      norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    check_forward_args(x, weight)
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (
        x.new_empty(x.shape, dtype=out_dtype or sum_dtype),
        x.new_empty(x.shape, dtype=sum_dtype),
        x.new_empty(x.shape[:-1], dtype=reference.computation_dtype(sum_dtype)),
    )


def rms_norm_add_bwd(dy: Tensor, dresidual_out: Tensor | None, residual_out: Tensor, weight: Tensor | None,
                     rstd: Tensor, *, weight_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    return reference.add_rms_norm_backward(dy, dresidual_out, residual_out, weight, rstd, weight_offset)


@torch.library.register_fake("rmsnorm::add_bwd", lib=_LIB)
def _(dy: Tensor, dresidual_out: Tensor | None, residual_out: Tensor, weight: Tensor | None, rstd: Tensor, *,
      weight_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    return residual_out.new_empty(residual_out.shape), None if weight is None else weight.new_empty(weight.shape)


_LIB.impl("fwd", rms_norm_fwd, "CompositeExplicitAutograd")
_LIB.impl("bwd", rms_norm_bwd, "CompositeExplicitAutograd")
_LIB.impl("add_fwd", rms_norm_add_fwd, "CompositeExplicitAutograd")
_LIB.impl("add_bwd", rms_norm_add_bwd, "CompositeExplicitAutograd")


@torch.library.register_vmap("rmsnorm::fwd", lib=_LIB)
def _(info, in_dims, x: Tensor, weight: Tensor | None, eps: float):
    # The op normalizes the last dim; any other dim is just more rows: one call for the batch.
    x_dim, w_dim, _ = in_dims
    x = x.movedim(x_dim, 0) if x_dim is not None else x.expand(info.batch_size, *x.shape)
    if w_dim is None:
        return torch.ops.rmsnorm.fwd(x, weight, eps), (0, 0)
    # Per-sample weights: the kernels take one weight row, so the reference formula (which
    # broadcasts them) serves it, under the fallback policy like any other fallback.
    record_fallback("rmsnorm.fwd", "per-sample weights under vmap")
    w = weight.movedim(w_dim, 0).reshape(info.batch_size, *[1] * (x.dim() - 2), x.shape[-1])
    return reference.rms_norm_forward(x, w, eps), (0, 0)


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    x, weight, eps = inputs
    ctx.weight_offset = keyword_only_inputs.get("weight_offset", 0.0)
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    # rstd never has a gradient: without this autograd would zero-fill one ([M] fp32, a kernel
    # launch per backward) just to hand it to _backward, which ignores it.
    ctx.set_materialize_grads(False)
    ctx.eps = eps
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy: Tensor | None, _drstd: Tensor | None):
    if dy is None:  # no gradient reached y (grads are not materialized): none flows back
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # create_graph=True: the gradient must itself be differentiable, rstd included,
        # so take the reference formula over a recomputed rstd.
        rstd = reference.rms_norm_forward(x, None, ctx.eps)[1]
        dx, dweight = reference.rms_norm_backward(dy, x, weight, rstd, ctx.weight_offset)
    else:
        dx, dweight = torch.ops.rmsnorm.bwd(dy, x, weight, rstd, weight_offset=ctx.weight_offset)
    need_x, need_w, _ = ctx.needs_input_grad
    return (dx if need_x else None), (dweight if need_w else None), None


torch.library.register_autograd("rmsnorm::fwd", _backward, setup_context=_setup_context, lib=_LIB)


def _add_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    x, residual, weight, eps = inputs
    _, residual_out, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.weight_offset = keyword_only_inputs.get("weight_offset", 0.0)
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.save_for_backward(residual_out, weight, rstd)


def _add_backward(ctx, dy: Tensor | None, dresidual_out: Tensor | None, _drstd: Tensor | None):
    residual_out, weight, rstd = ctx.saved_tensors
    if dy is None:
        if dresidual_out is None:
            return None, None, None, None
        dy = torch.zeros_like(residual_out)
    dsum, dweight = torch.ops.rmsnorm.add_bwd(dy, dresidual_out, residual_out, weight, rstd,
                                             weight_offset=ctx.weight_offset)
    need_x, need_r, need_w, _ = ctx.needs_input_grad
    dx_dtype, dr_dtype = ctx.dtypes
    return ((dsum.to(dx_dtype) if need_x else None), (dsum.to(dr_dtype) if need_r else None),
            (dweight if need_w else None), None)


torch.library.register_autograd("rmsnorm::add_fwd", _add_backward, setup_context=_add_setup_context, lib=_LIB)
# Autocast as aten's rms_norm has it in this torch: where it is on a device's autocast fp32
# list (CUDA's in torch 2.13, not CPU's), F.rms_norm computes from fp32 inputs and returns
# fp32 there, so the op does the same; elsewhere inputs pass through as they are.
for _device, _key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", _key):
        torch.library.register_autocast("rmsnorm::fwd", _device, torch.float32, lib=_LIB)


def _transform_reason() -> str | None:
    """Autodiff the op's registered formula does not serve: forward-mode AD (a custom op has
    no forward-mode formula: the tangent would be dropped) and torch.func's grad/jvp-style
    transforms. vmap is served by the op."""
    interpreter = peek_interpreter_stack()
    if interpreter is not None and interpreter.key() != TransformType.Vmap:
        return f"torch.func transform {interpreter.key().name}"
    if torch.autograd.forward_ad._current_level >= 0:
        return "forward-mode AD"
    return None


_PLAIN_WEIGHT_TYPES = (Tensor, torch.nn.Parameter)


def _nothing_to_dispatch(input: Tensor, weight: Tensor | None) -> bool:
    """Whether dispatching ``rmsnorm::fwd`` on these inputs, here and now, would only reach
    ``rms_norm_fwd``: eager (not compiled, not recorded by ``torch.jit.trace``), no gradient to
    record, no autocast, no torch function or dispatch mode, no vmap (its batched tensors are
    plain tensors to Python; ``rms_norm`` has sent forward-mode AD and torch.func's other
    transforms to the reference already), plain strided CPU or CUDA tensors (no subclass, nested
    tensor, negative bit). ``rms_norm`` then calls the op's implementation directly: the
    dispatcher's Python kernels (autograd, then the op) cost more host time than the launch
    (profiling/NOTES.md, session 7). A profiler does not change the path (what it times is what
    runs without it); ``rms_norm`` names the call ``rmsnorm::fwd`` in its trace instead."""
    if weight is not None and (
        type(weight) not in _PLAIN_WEIGHT_TYPES or weight.layout != torch.strided or weight.is_neg()
    ):
        return False
    return (
        type(input) is Tensor
        and (input.is_cuda or input.is_cpu)
        and input.layout == torch.strided
        and not input.is_nested
        and not input.is_neg()
        and not (torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)))
        and not torch._C._is_any_autocast_enabled()
        and torch._C._len_torch_function_stack() == 0
        and torch._C._len_torch_dispatch_stack() == 0
        and peek_interpreter_stack() is None
        and not torch._C._is_tracing()  # torch.jit.is_tracing() outside TorchScript
    )


def rms_norm(
    input: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None, *,
    weight_offset: float = 0.0, norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``torch.nn.functional.rms_norm`` backed by ``torch.ops.rmsnorm``: same signature, defaults
    (``eps=None`` is the computation dtype's epsilon, as in torch), shapes, dtypes and gradients.
    ``normalized_shape`` may span several trailing dims; complex inputs take the reference path.
    In eager mode, when the dispatcher has nothing to add (no gradient, mode, autocast,
    subclass), the op's implementation is called without it, and since nothing will read rstd,
    the kernels do not write it: the same y, bit for bit. Under ``torch.profiler`` that call is
    recorded as ``rmsnorm::fwd``, as the op would be."""
    shape = check_functional_args(input, normalized_shape, weight)
    if eps is None:
        eps = reference.default_eps(input.dtype)
    if input.is_complex() or (weight is not None and weight.is_complex()):
        record_fallback("rms_norm", f"complex dtype {input.dtype}")
        return reference.rms_norm_reference(input, shape, weight, eps)
    direct = False
    if not torch.compiler.is_compiling():
        transform = _transform_reason()
        if transform is not None:
            record_fallback("rms_norm", transform)
            return reference.rms_norm_reference(input, shape, weight, eps)
        # check_functional_args has checked what check_forward_args would
        direct = (_nothing_to_dispatch(input, weight) and weight_offset == 0.0 and norm_dtype is None
                  and out_dtype is None)
    x, w = input, weight
    if len(shape) > 1:
        n = math.prod(shape)
        x = input.reshape(*input.shape[: input.dim() - len(shape)], n)
        w = None if weight is None else weight.reshape(n)
    if not direct:
        y = torch.ops.rmsnorm.fwd(x, w, float(eps), weight_offset=weight_offset, norm_dtype=norm_dtype,
                                  out_dtype=out_dtype)[0]
    elif torch._C._autograd._profiler_enabled():
        with torch.profiler.record_function("rmsnorm::fwd"):
            y = _forward(x, w, float(eps), want_rstd=False)[0]
    else:
        y = _forward(x, w, float(eps), want_rstd=False)[0]
    return y if len(shape) == 1 else y.view(input.shape)


def add_rms_norm(
    input: Tensor, residual: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
    eps: float | None = None, *, weight_offset: float = 0.0, norm_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(input + residual, ...), input + residual)`` in one pass."""
    shape = check_functional_args(input, normalized_shape, weight)
    if eps is None:
        eps = reference.default_eps(torch.promote_types(input.dtype, residual.dtype))
    y, residual_out, _ = torch.ops.rmsnorm.add_fwd(input, residual, weight, float(eps),
                                                   weight_offset=weight_offset, norm_dtype=norm_dtype,
                                                   out_dtype=out_dtype)
    return y, residual_out
