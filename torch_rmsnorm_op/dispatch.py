"""The one decision: do the Triton kernels serve this call, and how. ``forward_plan`` and
``backward_plan`` return a launch plan (``Plan``) or the reason the kernels do not serve the
input; everything else asks them.

Reasons are inputs that are valid but outside the kernels' reach (``fallback.py`` applies the
policy to them): no Triton-capable device, a dtype other than fp16/bf16/fp32, N above
``config.MAX_N``, a split mode the GPU cannot run, a CPU graph compiled into an AOTInductor
package. Rows the kernels cannot address in place (a last dim that is not contiguous, leading
dims over more than three strides) are not a reason: the plan says to copy them
(``Plan.copy_rows``), and the kernels run on the copy.
Invalid inputs are not reasons: they raise earlier (``contract.py``). Eager plans are kept
per input signature (device, dtypes, shape, strides, options), so a repeated call decides
nothing again; the signature fixes every input of the decision.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torch_rmsnorm_op import _torch_compat
from torch_rmsnorm_op.config import (
    MAX_N,
    KernelConfig,
    backward_config,
    fit_to_rows,
    forward_config,
    sm_count,
    with_early_weight,
)
from torch_rmsnorm_op.layout import RowLayout, row_layout, row_stride

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ROUND codes of the kernels (kernels.common._round): the dtype x * rstd is rounded to first.
ROUND_CODES = {None: 0, torch.float16: 1, torch.bfloat16: 2, torch.float32: 0}


@dataclass
class Plan:
    """How the kernels run one call: the configuration, x's row layout, the sizes, and the
    options fixed at the call (``round_code``, ``weight_offset``, whether rstd is stored).
    With ``copy_rows`` the kernels cannot address x's rows in place: the caller runs them on
    ``x.contiguous()``, whose layout ``layout`` is.
    ``launcher`` is filled in by ``launch.py`` for eager forward plans it can replay, and
    ``norm_add_cfg`` by ``launch.forward_norm_add`` (neither is carried by ``dataclasses.replace``
    when it changes ``cfg``: ``norm_add_cfg`` is not an init field)."""

    cfg: KernelConfig
    layout: RowLayout
    m: int
    n: int
    round_code: int = 0
    weight_offset: float = 0.0
    store_rstd: bool = True
    copy_rows: bool = False
    launcher: object = field(default=None, compare=False)
    replay: tuple = field(default=(), compare=False)
    norm_add_cfg: KernelConfig | None = field(default=None, init=False, compare=False)


@functools.cache
def interpreted() -> bool:
    """Whether the kernels run through the Triton interpreter (``TRITON_INTERPRET=1`` when they
    were defined), which serves CPU tensors."""
    from torch_rmsnorm_op._triton_compat import is_interpreted  # defines the kernels on first use

    return is_interpreted()


@functools.cache  # fixed per device and dtypes
def _device_dtype_reason(device: torch.device, dtypes: tuple[torch.dtype | None, ...]) -> str | None:
    if device.type == "cpu":
        if not interpreted():
            return "cpu tensor without the Triton interpreter (set TRITON_INTERPRET=1 before the first call)"
    elif device.type != "cuda":
        return f"no Triton kernel for device type {device.type!r}"
    names = ("x", "weight", "residual", "dy")
    for name, dtype in zip(names, dtypes):
        if dtype is not None and dtype not in KERNEL_DTYPES:
            return f"{name} dtype {dtype} (kernels serve float16, bfloat16, float32)"
    return None


def _programs_per_row(n: int, dtype: torch.dtype) -> int:
    """Programs the table gives a row of ``n`` in split mode, forward or backward (1: none)."""
    return max(forward_config(n, dtype).split, backward_config(n, dtype).split)


@functools.cache  # fixed per (n, dtype, device)
def split_mode_reason(n: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why split mode (long rows) cannot run rows of ``n`` on this GPU, or None: a row's programs
    must all be resident at once (each waits for the others' partials), so never more of them
    than the GPU has multiprocessors; and their exchange is inline NVIDIA PTX (not ROCm)."""
    split = _programs_per_row(n, dtype)
    if split > sm_count(device):
        return f"N = {n} needs {split} programs per row, more than this GPU's {sm_count(device)} SMs"
    if split > 1 and torch.version.hip is not None:
        return f"N = {n} needs split mode, whose exchange between programs is NVIDIA PTX (kernels/split.py)"
    return None


# The Triton interpreter runs in Python, which an AOTInductor package does not call back into:
# a CPU package computes the reference's operations, compiled by Inductor.
AOT_CPU_REASON = "cpu graph in an AOTInductor package, which Inductor compiles from the reference formula"


def _reason(x: Tensor, dtypes: tuple[torch.dtype | None, ...]) -> str | None:
    if x.device.type == "cpu" and not _is_concrete(x) and _torch_compat.aot_compiling():
        return AOT_CPU_REASON
    reason = _device_dtype_reason(x.device, dtypes)
    if reason is not None:
        return reason
    n = x.shape[-1]
    if n > MAX_N:
        return f"N = {n} above the kernels' maximum {MAX_N}"
    if x.device.type == "cuda":
        return split_mode_reason(int(n), x.dtype, x.device)
    return None


def split_mode_serves(x: Tensor) -> bool:
    """Whether the kernels serve rows of x's N and dtype on x's device in split mode, forward or
    backward. A compiled graph keeps such an op as one opaque call (``ops._decomposes``): split
    mode's exchange between programs is an inline PTX statement with side effects, which
    Inductor's analysis of what a user-defined kernel writes cannot read (torch 2.11-2.13: it
    then takes every input as written), and whose source Inductor's generated module does not
    quote intact."""
    if _reason(x, (x.dtype,)) is not None:
        return False  # the reference serves the call: decomposed, Inductor compiles it
    return _programs_per_row(int(x.shape[-1]), x.dtype) > 1


def _rows(x: Tensor) -> tuple[RowLayout, bool]:
    """x's row layout, and whether the kernels need its rows copied first (then the layout is
    that of the contiguous copy): a last dim that is not contiguous (the transpose of a
    convolution's output, ``x.t()``) or leading dims over more than three strides."""
    layout = row_layout(x)
    if layout is not None:
        return layout, False
    return RowLayout(1, 1, 1, x.shape[-1], 1, 1), True


_PLANS: dict[tuple, Plan | str] = {}
MAX_PLANS = 4096  # cleared when full, so that shapes that keep changing cannot grow it without bound


def _keep(key: tuple, plan: Plan | str) -> Plan | str:
    """Keep ``plan`` under ``key``, the kept plans cleared first when full."""
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _is_concrete(x: Tensor) -> bool:
    return type(x) is Tensor or type(x) is torch.nn.Parameter


def forward_plan(x: Tensor, weight: Tensor | None, residual: Tensor | None = None, *,
                 norm_dtype: torch.dtype | None = None, weight_offset: float = 0.0,
                 store_rstd: bool = True, out_dtype: torch.dtype | None = None) -> Plan | str:
    """The plan for the forward of ``x`` [..., N] (N >= 1; with ``residual``, of their sum)
    into a y of ``out_dtype`` (default: the sum's dtype), or why the kernels do not serve it.
    ``residual`` must have single-stride rows (callers copy it otherwise)."""
    if not _is_concrete(x):  # traced: sizes may be symbolic, nothing to keep
        return _forward_plan(x, weight, residual, norm_dtype, weight_offset, store_rstd)
    key = ("fwd", x.device, x.dtype, x.shape, x.stride(), None if weight is None else weight.dtype,
           None if residual is None else (residual.dtype, row_stride(residual)), norm_dtype, weight_offset,
           store_rstd, out_dtype)  # a kept launch was compiled for y's dtype
    plan = _PLANS.get(key)
    if plan is None:
        plan = _keep(key, _forward_plan(x, weight, residual, norm_dtype, weight_offset, store_rstd))
    return plan


def _forward_plan(x: Tensor, weight: Tensor | None, residual: Tensor | None, norm_dtype: torch.dtype | None,
                  weight_offset: float, store_rstd: bool) -> Plan | str:
    dtypes = (x.dtype, None if weight is None else weight.dtype, None if residual is None else residual.dtype)
    reason = _reason(x, dtypes)
    if reason is not None:
        return reason
    layout, copy_rows = _rows(x)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    n = int(x.shape[-1])
    m = x.numel() // n
    cfg = forward_config(n, sum_dtype, residual is not None, m, None if weight is None else weight.dtype)
    cfg = with_early_weight(fit_to_rows(cfg, m, x.device), m, x.device)
    return Plan(cfg, layout, m, n, ROUND_CODES[norm_dtype], float(weight_offset), store_rstd, copy_rows)


def backward_plan(x: Tensor, weight: Tensor | None, dy_dtype: torch.dtype, *, weight_offset: float = 0.0,
                  dres_dtype: torch.dtype | None = None) -> Plan | str:
    """The plan for the backward over ``x`` [..., N] (N >= 1), or why the kernels do not serve it."""
    if not _is_concrete(x):
        return _backward_plan(x, weight, dy_dtype, weight_offset, dres_dtype)
    key = ("bwd", x.device, x.dtype, x.shape, x.stride(), None if weight is None else weight.dtype, dy_dtype,
           dres_dtype, weight_offset)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _keep(key, _backward_plan(x, weight, dy_dtype, weight_offset, dres_dtype))
    return plan


def _backward_plan(x: Tensor, weight: Tensor | None, dy_dtype: torch.dtype, weight_offset: float,
                   dres_dtype: torch.dtype | None) -> Plan | str:
    reason = _reason(x, (x.dtype, None if weight is None else weight.dtype, dres_dtype, dy_dtype))
    if reason is not None:
        return reason
    layout, copy_rows = _rows(x)
    n = int(x.shape[-1])
    m = x.numel() // n
    return Plan(fit_to_rows(backward_config(n, x.dtype, m), m, x.device), layout, m, n,
                weight_offset=float(weight_offset), copy_rows=copy_rows)
