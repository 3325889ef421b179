"""The ops ``torch.ops.rmsnorm.*``: schema, implementation, fake, autograd, vmap, autocast.

    fwd(Tensor x, Tensor? weight, float eps, *, float weight_offset=0.0,
        ScalarType? norm_dtype=None, ScalarType? out_dtype=None) -> (Tensor y, Tensor rstd)
    bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, *, float weight_offset=0.0)
        -> (Tensor dx, Tensor? dweight)
    add_fwd(Tensor x, Tensor residual, Tensor? weight, float eps, *, ...same keywords as fwd)
        -> (Tensor y, Tensor residual_out, Tensor rstd)
    add_bwd(Tensor dy, Tensor? dresidual_out, Tensor residual_out, Tensor? weight, Tensor rstd,
        *, float weight_offset=0.0) -> (Tensor dx, Tensor? dweight)
    norm_add_fwd(Tensor x, Tensor residual, Tensor? x_weight, float x_eps, Tensor? weight,
        float eps, *, float weight_offset=0.0, ScalarType? norm_dtype=None)
        -> (Tensor y, Tensor residual_out, Tensor rstd, Tensor x_rstd)

Per row of the last dim: ``rstd = 1 / sqrt(mean(x**2) + eps)``; ``y = round(x * rstd) *
(weight + weight_offset)``, where ``round`` rounds to ``norm_dtype`` when it is given (a norm's
cast back to the input dtype before the weight); ``y`` has ``out_dtype`` (default: x's dtype).
``add_fwd`` normalizes ``residual_out = x + residual`` (in their promoted dtype, as torch adds
them) and returns it; ``add_bwd`` adds ``dresidual_out`` (the gradient that reached
``residual_out``) into dx. ``norm_add_fwd`` is ``fwd`` of x, in x's dtype, then ``add_fwd`` of
the residual and that (a norm of a branch's output, the residual add, a norm of the sum):
``residual_out = residual + rmsnorm(x, x_weight, x_eps)``, ``y, rstd = rmsnorm(residual_out,
weight, eps)``, both norms with the same keywords; the two ops' values, bit for bit, in one
kernel where that holds (``launch.norm_add_fuses``), else in their two launches; its gradient
is theirs (``add_bwd`` then ``bwd``). ``y``, ``residual_out`` and ``dx`` are contiguous;
``rstd`` has shape ``x.shape[:-1]`` and the computation dtype (float32; float64 for float64 x); ``dweight`` has
the weight's shape and dtype.

Registration (``torch.library``): ``Library.define`` + ``impl`` for the implementations (an
eager call costs less host time than through ``custom_op``'s wrapper), ``register_fake``,
``register_autograd`` (the forward ops' formulas call the backward ops, so AOTAutograd puts
them into compiled backward graphs), ``register_autocast``; the vmap rules are in
``batching.py``, the DTensor sharding rules in ``distributed.py``. And a rule for
``FunctionalTensorMode``, the mode AOTAutograd traces compiled graphs under: there an op on
CUDA tensors decomposes into its implementation, whose kernels launch through
``torch.library.wrap_triton``, so Inductor sees the kernels and the generated code launches
them itself (what ``torch.library.triton_op`` does). The kernel-or-fallback decision is then
taken once per call site, while tracing, from what the graph guards on (device, dtypes, N,
layout), and counted in ``dispatch_stats()["compiled"]``; a fallback inlines the reference's
operations into the graph, and the "error" policy raises while compiling. CPU tensors stay one
opaque call each, which runs the kernels through the Triton interpreter (if enabled) at run
time, as in eager mode.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor

from torch_rmsnorm_op import _torch_compat, dispatch, reference
from torch_rmsnorm_op.contract import check_add_args, check_backward_args, check_forward_args, check_norm_add_args
from torch_rmsnorm_op.fallback import record_fallback, record_kernel
from torch_rmsnorm_op.layout import row_stride


@functools.cache
def launch_module():
    """``launch.py``, imported on first use: it imports Triton, which importing the package need not."""
    from torch_rmsnorm_op import launch

    return launch


_LIB = torch.library.Library("rmsnorm", "DEF")  # kept alive: a collected Library unregisters its ops
_FWD_KEYWORDS = "*, float weight_offset=0.0, ScalarType? norm_dtype=None, ScalarType? out_dtype=None"
_LIB.define(f"fwd(Tensor x, Tensor? weight, float eps, {_FWD_KEYWORDS}) -> (Tensor y, Tensor rstd)")
_LIB.define("bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, *, float weight_offset=0.0) "
            "-> (Tensor dx, Tensor? dweight)")
_LIB.define(f"add_fwd(Tensor x, Tensor residual, Tensor? weight, float eps, {_FWD_KEYWORDS}) "
            "-> (Tensor y, Tensor residual_out, Tensor rstd)")
_LIB.define("add_bwd(Tensor dy, Tensor? dresidual_out, Tensor residual_out, Tensor? weight, Tensor rstd, *, "
            "float weight_offset=0.0) -> (Tensor dx, Tensor? dweight)")
_LIB.define("norm_add_fwd(Tensor x, Tensor residual, Tensor? x_weight, float x_eps, Tensor? weight, float eps, *, "
            "float weight_offset=0.0, ScalarType? norm_dtype=None) "
            "-> (Tensor y, Tensor residual_out, Tensor rstd, Tensor x_rstd)")


def _like(t: Tensor, dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous tensor of ``t``'s shape and device: ``torch.empty_like``,
    which costs an eager call about half the host time of ``torch.empty(t.shape, ...)``."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def forward(x: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0,
            norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
            residual: Tensor | None = None, want_rstd: bool = True,
            traced: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``rmsnorm::fwd`` (``residual`` None) or ``rmsnorm::add_fwd`` on arguments that meet
    their contract: ``(y, residual_out or None, rstd)``. Without ``want_rstd`` (a caller that
    only needs y) the kernels neither allocate nor write rstd and it is None, unless the
    reference served the call or N is 0. Rows the kernels cannot address in place
    (``Plan.copy_rows``), and a residual whose rows one stride does not address, are copied
    first. ``traced``: the call is being traced for a compiled graph (launches go through
    ``wrap_triton``; the decision is counted as the graph's)."""
    op = "rmsnorm.fwd" if residual is None else "rmsnorm.add_fwd"
    n = x.shape[-1]
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    if residual is not None and row_stride(residual) is None:
        residual = residual.contiguous()
    plan = None
    if n > 0:
        plan = dispatch.forward_plan(x, weight, residual, norm_dtype=norm_dtype, weight_offset=weight_offset,
                                     store_rstd=want_rstd, out_dtype=out_dtype)
        if type(plan) is str:
            record_fallback(op, plan, compiled=traced)
            return _reference_forward(op, x, weight, eps, weight_offset, norm_dtype, out_dtype, residual, traced)
        record_kernel(op, compiled=traced)
        if plan.copy_rows:
            x = x.contiguous()
    y = _like(x, out_dtype or sum_dtype)
    h = None if residual is None else _like(x, sum_dtype)
    rstd = None
    if want_rstd or n == 0:
        rstd = torch.empty(x.shape[:-1], dtype=reference.computation_dtype(sum_dtype), device=x.device)
    if n == 0:  # nothing to normalize; the mean of an empty row is NaN, as in torch
        return y, None if h is None else h.copy_(x + residual), rstd.fill_(math.nan)
    w = None if weight is None else weight.contiguous()
    if traced or plan.launcher is None or not launch_module().replay_forward(plan, x, w, eps, y, rstd, residual, h):
        launch_module().forward(plan, x, w, eps, y, rstd, residual, h, traced=traced)
    return y, h, rstd


def forward_norm_add(x: Tensor, residual: Tensor, x_weight: Tensor | None, x_eps: float, weight: Tensor | None,
                     eps: float, weight_offset: float = 0.0, norm_dtype: torch.dtype | None = None,
                     traced: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``rmsnorm::norm_add_fwd`` on arguments that meet its contract: ``(y, residual_out, rstd,
    x_rstd)``. The kernels serve it where they serve both norms (x's as ``fwd`` would, the
    sum's as ``add_fwd(residual, x's norm)`` would): in one launch where that gives the two ops'
    values (``launch.norm_add_fuses``), else in those two ops' launches."""
    op = "rmsnorm.norm_add_fwd"
    if row_stride(residual) is None:
        residual = residual.contiguous()
    n = x.shape[-1]
    keywords = dict(norm_dtype=norm_dtype, weight_offset=weight_offset)
    plan = sum_plan = "N = 0"
    if n > 0:
        plan = dispatch.forward_plan(x, x_weight, **keywords)
        if type(plan) is not str and plan.copy_rows:
            x = x.contiguous()
        sum_plan = dispatch.forward_plan(residual, weight, x, **keywords)  # x's norm has x's dtype
        reason = plan if type(plan) is str else sum_plan if type(sum_plan) is str else None
        if reason is not None:
            record_fallback(op, reason, compiled=traced)
        else:
            record_kernel(op, compiled=traced)
    if type(plan) is str or type(sum_plan) is str:  # a fallback, or nothing to normalize
        with _fallback_region(op, traced) if n > 0 else contextlib.nullcontext():
            return reference.norm_add_rms_norm_forward(x, residual, x_weight, x_eps, weight, eps, weight_offset,
                                                       norm_dtype)
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    y, h = _like(x, sum_dtype), _like(x, sum_dtype)
    rstd, x_rstd = (torch.empty(x.shape[:-1], dtype=reference.computation_dtype(t), device=x.device)
                    for t in (sum_dtype, x.dtype))
    x_weight = None if x_weight is None else x_weight.contiguous()
    weight = None if weight is None else weight.contiguous()
    if launch_module().norm_add_fuses(plan, sum_plan, x, residual):
        launch_module().forward_norm_add(plan, x, residual, x_weight, weight, x_eps, eps, y, h, rstd, x_rstd,
                                         traced=traced)
    else:
        x_normed = _like(x, x.dtype)
        launch_module().forward(plan, x, x_weight, x_eps, x_normed, x_rstd, traced=traced)
        launch_module().forward(sum_plan, residual, weight, eps, y, rstd, x_normed, h, traced=traced)
    return y, h, rstd, x_rstd


def _reference_forward(op: str, x: Tensor, weight: Tensor | None, eps: float, weight_offset: float,
                       norm_dtype: torch.dtype | None, out_dtype: torch.dtype | None, residual: Tensor | None,
                       traced: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    with _fallback_region(op, traced):
        if residual is None:
            y, rstd = reference.rms_norm_forward(x, weight, eps, weight_offset, norm_dtype, out_dtype)
            return y, None, rstd
        return reference.add_rms_norm_forward(x, residual, weight, eps, weight_offset, norm_dtype, out_dtype)


def _fallback_region(op: str, traced: bool):
    """Fallbacks show in profiler traces as ``<op> [reference fallback]`` (not while tracing)."""
    return contextlib.nullcontext() if traced else torch.profiler.record_function(f"{op} [reference fallback]")


def backward(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, weight_offset: float = 0.0,
             dresidual_out: Tensor | None = None, add: bool = False,
             traced: bool = False) -> tuple[Tensor, Tensor | None]:
    """``rmsnorm::bwd`` (``add`` False; x is the forward's input) or ``rmsnorm::add_bwd`` (x is
    the forward's ``residual_out``, ``dresidual_out`` the gradient that reached it, or None) on
    arguments that meet their contract. x's rows are copied where the kernels cannot address
    them in place (``Plan.copy_rows``), dy's and dresidual_out's where one stride does not."""
    op = "rmsnorm.add_bwd" if add else "rmsnorm.bwd"
    n = x.shape[-1]
    if n > 0:
        plan = dispatch.backward_plan(x, weight, dy.dtype, weight_offset=weight_offset,
                                      dres_dtype=None if dresidual_out is None else dresidual_out.dtype)
        if type(plan) is str:
            record_fallback(op, plan, compiled=traced)
            with _fallback_region(op, traced):
                if add:
                    return reference.add_rms_norm_backward(dy, dresidual_out, x, weight, rstd, weight_offset)
                return reference.rms_norm_backward(dy, x, weight, rstd, weight_offset)
        record_kernel(op, compiled=traced)
        if plan.copy_rows:
            x = x.contiguous()
    dx = _like(x, x.dtype)
    dweight = None if weight is None else _like(weight, weight.dtype)
    if x.numel() == 0:
        return dx, None if dweight is None else dweight.zero_()
    if row_stride(dy) is None:  # e.g. the expanded gradient of .sum(): copied, it is not x
        dy = dy.contiguous()
    if dresidual_out is not None and row_stride(dresidual_out) is None:
        dresidual_out = dresidual_out.contiguous()
    launch_module().backward(plan, dy, x, None if weight is None else weight.contiguous(), rstd.contiguous(), dx,
                             dweight, dresidual_out, traced=traced)
    return dx, dweight


# --- implementations, fakes ----------------------------------------------------------------


def _fwd(x: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
         norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
         traced: bool = False) -> tuple[Tensor, Tensor]:
    check_forward_args(x, weight, norm_dtype, out_dtype)
    y, _, rstd = forward(x, weight, eps, weight_offset, norm_dtype, out_dtype, traced=traced)
    return y, rstd


def _bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, *, weight_offset: float = 0.0,
         traced: bool = False) -> tuple[Tensor, Tensor | None]:
    check_backward_args(dy, x, weight, rstd)
    return backward(dy, x, weight, rstd, weight_offset, traced=traced)


def _add_fwd(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
             norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
             traced: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    check_add_args(x, residual, weight, norm_dtype, out_dtype)
    return forward(x, weight, eps, weight_offset, norm_dtype, out_dtype, residual=residual, traced=traced)


def _add_bwd(dy: Tensor, dresidual_out: Tensor | None, residual_out: Tensor, weight: Tensor | None, rstd: Tensor,
             *, weight_offset: float = 0.0, traced: bool = False) -> tuple[Tensor, Tensor | None]:
    check_backward_args(dy, residual_out, weight, rstd, dresidual_out, op="rmsnorm.add_bwd")
    return backward(dy, residual_out, weight, rstd, weight_offset, dresidual_out, add=True, traced=traced)


def _norm_add_fwd(x: Tensor, residual: Tensor, x_weight: Tensor | None, x_eps: float, weight: Tensor | None,
                  eps: float, *, weight_offset: float = 0.0, norm_dtype: torch.dtype | None = None,
                  traced: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_norm_add_args(x, residual, x_weight, weight, norm_dtype)
    return forward_norm_add(x, residual, x_weight, x_eps, weight, eps, weight_offset, norm_dtype, traced=traced)


def _before_compiling(op: str) -> None:
    """What a graph that calls ``op`` needs before it is compiled, done from the fake
    implementations, which run while Dynamo captures the graph (before AOTAutograd keys its
    cache): the kernels' source in the cache's key for graphs calling ``op``
    (``launch.register_kernels_for_cache_key``, as ``torch.library.triton_op`` registers its own)."""
    launch_module().register_kernels_for_cache_key(op)


_IMPLS = {"fwd": _fwd, "bwd": _bwd, "add_fwd": _add_fwd, "add_bwd": _add_bwd, "norm_add_fwd": _norm_add_fwd}
for _name, _impl in _IMPLS.items():
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")


@torch.library.register_fake("rmsnorm::fwd", lib=_LIB)
def _(x: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
      norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    check_forward_args(x, weight, norm_dtype, out_dtype)
    _before_compiling("rmsnorm::fwd")
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype),
            x.new_empty(x.shape[:-1], dtype=reference.computation_dtype(x.dtype)))


@torch.library.register_fake("rmsnorm::bwd", lib=_LIB)
def _(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, *,
      weight_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    check_backward_args(dy, x, weight, rstd)
    _before_compiling("rmsnorm::bwd")
    return x.new_empty(x.shape), None if weight is None else weight.new_empty(weight.shape)


@torch.library.register_fake("rmsnorm::add_fwd", lib=_LIB)
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
      norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    check_add_args(x, residual, weight, norm_dtype, out_dtype)
    _before_compiling("rmsnorm::add_fwd")
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=out_dtype or sum_dtype), x.new_empty(x.shape, dtype=sum_dtype),
            x.new_empty(x.shape[:-1], dtype=reference.computation_dtype(sum_dtype)))


@torch.library.register_fake("rmsnorm::add_bwd", lib=_LIB)
def _(dy: Tensor, dresidual_out: Tensor | None, residual_out: Tensor, weight: Tensor | None, rstd: Tensor, *,
      weight_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    check_backward_args(dy, residual_out, weight, rstd, dresidual_out, op="rmsnorm.add_bwd")
    _before_compiling("rmsnorm::add_bwd")
    return residual_out.new_empty(residual_out.shape), None if weight is None else weight.new_empty(weight.shape)


@torch.library.register_fake("rmsnorm::norm_add_fwd", lib=_LIB)
def _(x: Tensor, residual: Tensor, x_weight: Tensor | None, x_eps: float, weight: Tensor | None, eps: float, *,
      weight_offset: float = 0.0, norm_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_norm_add_args(x, residual, x_weight, weight, norm_dtype)
    _before_compiling("rmsnorm::norm_add_fwd")
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=sum_dtype), x.new_empty(x.shape, dtype=sum_dtype),
            x.new_empty(x.shape[:-1], dtype=reference.computation_dtype(sum_dtype)),
            x.new_empty(x.shape[:-1], dtype=reference.computation_dtype(x.dtype)))


# --- compiled graphs: decomposition into the kernels' launches ---------------------------------

# Where each op's x (the tensor whose device decides) sits in its arguments.
_X_ARG = {"fwd": 0, "bwd": 1, "add_fwd": 0, "add_bwd": 2, "norm_add_fwd": 0}
_PLAIN_TYPES = (Tensor, _torch_compat.FakeTensor, _torch_compat.FunctionalTensor)


def _decomposes(x: Tensor) -> bool:
    """Whether a graph traced over ``x`` holds the op's decomposition rather than one opaque call:
    on CUDA (the kernels' launches, or the reference's operations where they do not serve the
    call), but for rows the kernels serve in split mode (``dispatch.split_mode_serves``) and for
    a row count the graph learns only when it runs (an unbacked size: ``x[mask]`` or ``nonzero``
    under ``capture_dynamic_output_shape_ops``), whose launch would need that count while
    tracing: those run as in eager mode. On CPU wherever the Triton interpreter cannot run the
    kernels when the graph runs, which leaves the reference, decided while tracing and compiled
    by Inductor: without ``TRITON_INTERPRET``, and in an AOTInductor package (which calls back
    into no Python). With the interpreter a CPU graph keeps the op whole, and each call runs the
    kernels interpreted. The compile caches keep the two CPU graphs apart: only without the
    interpreter do the kernels join the cache's key (``launch.register_kernels_for_cache_key``)."""
    if x.device.type == "cuda":
        # Imported here: at the top of the module it would add 0.25 s to the package's import.
        from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols

        return not has_free_unbacked_symbols(x.shape) and not dispatch.split_mode_serves(x)
    return x.device.type == "cpu" and (_torch_compat.aot_compiling() or not dispatch.interpreted())


def _decomposition(name: str):
    impl, x_arg = _IMPLS[name], _X_ARG[name]

    def rule(mode, op, types, args, kwargs):
        x = args[x_arg]
        # export's setting first: keeping the op whole needs no look at x's device
        if not _torch_compat.decomposing_custom_triton_ops() or not _decomposes(x):
            return mode.__torch_dispatch__(op, types, args, kwargs)  # one opaque call
        if any(t not in _PLAIN_TYPES and not issubclass(t, _torch_compat.FakeTensor) for t in types):
            return NotImplemented
        with mode:
            return impl(*args, **kwargs, traced=True)

    return rule


for _name in _IMPLS:
    torch.library.register_torch_dispatch(f"rmsnorm::{_name}", _torch_compat.FunctionalTensorMode,
                                          _decomposition(_name), lib=_LIB)


# --- autograd --------------------------------------------------------------------------------


def _double_backward(op: str) -> bool:
    """Whether this backward runs with ``create_graph=True`` (eager): its result must itself be
    differentiable, which the kernels' is not, so the reference formula serves it, as a
    fallback under the policy."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        record_fallback(op, "create_graph=True: the gradient is differentiated again")
        return True
    return False


def _savable(t: Tensor | None) -> Tensor | None:
    """``t``, or its copy where it is an inference tensor, which autograd cannot save: an input
    made under ``torch.inference_mode`` (frozen features, say) normalized outside it by a norm
    whose weight is trained. ``F.rms_norm``, composed of differentiable ops, accepts it."""
    return t.clone() if t is not None and t.is_inference() else t


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    x, weight, eps = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    # rstd never has a gradient: without this autograd would zero-fill one ([M] fp32, a kernel
    # launch per backward) just to hand it to _backward, which ignores it.
    ctx.set_materialize_grads(False)
    ctx.eps = eps
    ctx.weight_offset = keyword_only_inputs.get("weight_offset", 0.0)
    ctx.save_for_backward(_savable(x), _savable(weight), rstd)


def _norm_grads(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, eps: float,
                weight_offset: float) -> tuple[Tensor, Tensor | None]:
    """``fwd``'s gradients (dx, dweight) from dy: ``rmsnorm.bwd``, or under ``create_graph=True``
    the reference formula with rstd recomputed differentiably."""
    if _double_backward("rmsnorm.bwd"):
        rstd = reference.rms_norm_forward(x, None, eps)[1]
        return reference.rms_norm_backward(dy, x, weight, rstd, weight_offset)
    return torch.ops.rmsnorm.bwd(dy, x, weight, rstd, weight_offset=weight_offset)


def _sum_grads(dy: Tensor | None, dresidual_out: Tensor | None, residual_out: Tensor, weight: Tensor | None,
               rstd: Tensor, eps: float, weight_offset: float) -> tuple[Tensor | None, Tensor | None]:
    """``add_fwd``'s gradients of the sum and of the weight: ``rmsnorm.add_bwd``, or under
    ``create_graph=True`` the reference formula; with no dy, the sum's own gradient only (or
    none)."""
    if dy is None:
        return dresidual_out, None
    if _double_backward("rmsnorm.add_bwd"):
        rstd = reference.rms_norm_forward(residual_out, None, eps)[1]
        return reference.add_rms_norm_backward(dy, dresidual_out, residual_out, weight, rstd, weight_offset)
    return torch.ops.rmsnorm.add_bwd(dy, dresidual_out, residual_out, weight, rstd, weight_offset=weight_offset)


def _backward(ctx, dy: Tensor | None, _drstd: Tensor | None):
    if dy is None:  # no gradient reached y (grads are not materialized): none flows back
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = _norm_grads(dy, x, weight, rstd, ctx.eps, ctx.weight_offset)
    need_x, need_w, _ = ctx.needs_input_grad
    return (dx if need_x else None), (dweight if need_w else None), None


torch.library.register_autograd("rmsnorm::fwd", _backward, setup_context=_setup_context, lib=_LIB)


def _add_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    x, residual, weight, eps = inputs
    _, residual_out, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.eps = eps
    ctx.weight_offset = keyword_only_inputs.get("weight_offset", 0.0)
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.save_for_backward(residual_out, _savable(weight), rstd)


def _add_backward(ctx, dy: Tensor | None, dresidual_out: Tensor | None, _drstd: Tensor | None):
    residual_out, weight, rstd = ctx.saved_tensors
    need_x, need_r, need_w, _ = ctx.needs_input_grad
    dsum, dweight = _sum_grads(dy, dresidual_out, residual_out, weight, rstd, ctx.eps, ctx.weight_offset)
    if dsum is None:
        return None, None, None, None
    x_dtype, r_dtype = ctx.dtypes
    return ((dsum.to(x_dtype) if need_x else None), (dsum.to(r_dtype) if need_r else None),
            (dweight if need_w else None), None)


torch.library.register_autograd("rmsnorm::add_fwd", _add_backward, setup_context=_add_setup_context, lib=_LIB)


def _norm_add_setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    x, residual, x_weight, x_eps, weight, eps = inputs
    _, residual_out, rstd, x_rstd = output
    ctx.mark_non_differentiable(rstd, x_rstd)
    ctx.set_materialize_grads(False)
    ctx.eps, ctx.x_eps = eps, x_eps
    ctx.weight_offset = keyword_only_inputs.get("weight_offset", 0.0)
    ctx.residual_dtype = residual.dtype
    ctx.save_for_backward(_savable(x), _savable(x_weight), x_rstd, residual_out, _savable(weight), rstd)


def _norm_add_backward(ctx, dy: Tensor | None, dresidual_out: Tensor | None, _drstd: Tensor | None,
                       _dx_rstd: Tensor | None):
    """The gradients of ``add_fwd`` (the sum's) and then of ``fwd`` (x's norm): the ops'
    backward ops, one after the other."""
    x, x_weight, x_rstd, residual_out, weight, rstd = ctx.saved_tensors
    need_x, need_r, need_xw, _, need_w, _ = ctx.needs_input_grad
    dsum, dweight = _sum_grads(dy, dresidual_out, residual_out, weight, rstd, ctx.eps, ctx.weight_offset)
    if dsum is None:
        return None, None, None, None, None, None
    dx = dx_weight = None
    if need_x or need_xw:  # x's norm has x's dtype, and so has its gradient
        dx, dx_weight = _norm_grads(dsum.to(x.dtype), x, x_weight, x_rstd, ctx.x_eps, ctx.weight_offset)
    return ((dx if need_x else None), (dsum.to(ctx.residual_dtype) if need_r else None),
            (dx_weight if need_xw else None), None, (dweight if need_w else None), None)


torch.library.register_autograd("rmsnorm::norm_add_fwd", _norm_add_backward, setup_context=_norm_add_setup_context,
                                lib=_LIB)


# --- autocast --------------------------------------------------------------------------


# Autocast as aten's rms_norm has it in this torch: where it is on a device's autocast fp32
# list (CUDA's in torch 2.13, not CPU's), F.rms_norm computes from fp32 inputs and returns
# fp32 there, so the forward ops do the same; elsewhere inputs pass through as they are.
for _device, _key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    if _torch_compat.has_kernel_for_dispatch_key("aten::rms_norm", _key):
        for _op in ("rmsnorm::fwd", "rmsnorm::add_fwd", "rmsnorm::norm_add_fwd"):
            torch.library.register_autocast(_op, _device, torch.float32, lib=_LIB)
