"""The oracle: RMSNorm written for reading, in PyTorch.

Forward, per row ``x`` of length ``N``::

    rstd = 1 / sqrt(mean(x**2) + eps)
    y    = x * rstd * weight

Backward, with ``u = dy * weight`` and ``c = mean(u * x)`` (per row)::

    dx      = rstd * (u - x * rstd**2 * c)
    dweight = sum over rows of (dy * x * rstd)

Both work in the *computation dtype* (float32 for fp16/bf16/fp32, float64
for float64), as ``torch.nn.functional.rms_norm`` does, and cast ``y``/``dx``
back to the input's dtype. The backward is built from differentiable torch
ops, so it also serves double backward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def computation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64, complex stays complex; every other float computes in float32."""
    if dtype in (torch.float64, torch.complex128):
        return dtype
    if dtype.is_complex:
        return torch.complex64
    return torch.float32


def _computation_eps(dtype: torch.dtype) -> float:
    return torch.finfo(computation_dtype(dtype)).eps  # a complex dtype's finfo is its real part's


# every eager call with eps=None asks; a dict lookup costs less than torch.finfo
_DEFAULT_EPS = {dtype: _computation_eps(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32,
                                                             torch.float64, torch.complex64, torch.complex128)}


def default_eps(dtype: torch.dtype) -> float:
    """What ``F.rms_norm`` uses for ``eps=None``: the computation dtype's machine epsilon."""
    eps = _DEFAULT_EPS.get(dtype)
    return _computation_eps(dtype) if eps is None else eps


def rms_norm_forward(
    x: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0,
    norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Normalize over the last dim. Returns ``(y, rstd)``; ``y`` in ``out_dtype`` (default x's
    dtype), contiguous; ``rstd`` of shape ``x.shape[:-1]`` in the computation dtype. The
    normalized row is rounded to ``norm_dtype`` (if given) before the weight multiplies it;
    the weight enters as ``weight + weight_offset``, both in the computation dtype."""
    ctype = computation_dtype(x.dtype)
    xc = x.to(ctype)
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = xc * rstd
    if norm_dtype is not None:
        y = y.to(norm_dtype).to(ctype)
    if weight is not None:
        y = y * (weight.to(ctype) + weight_offset)
    return y.to(out_dtype or x.dtype).contiguous(), rstd.squeeze(-1).contiguous()


def rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, weight_offset: float = 0.0
) -> tuple[Tensor, Tensor | None]:
    """The manual backward formula. Returns ``(dx, dweight)``; ``dx`` in x's dtype;
    ``dweight`` is None without a weight, else in the weight's dtype."""
    ctype = computation_dtype(x.dtype)
    xc, dyc = x.to(ctype), dy.to(ctype)
    r = rstd.to(ctype).unsqueeze(-1)
    u = dyc * (weight.to(ctype) + weight_offset) if weight is not None else dyc
    c = (u * xc).mean(dim=-1, keepdim=True)
    dx = r * (u - xc * r * r * c)
    dweight = None
    if weight is not None:
        dweight = (dyc * xc * r).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype).contiguous(), dweight


def rms_norm_reference(
    input: Tensor, normalized_shape: list[int] | tuple[int, ...], weight: Tensor | None = None,
    eps: float | None = None, weight_offset: float = 0.0, norm_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``F.rms_norm`` semantics (plus ``rms_norm_forward``'s weight offset and roundings),
    composed from plain torch ops (autograd handles gradients)."""
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    if eps is None:
        eps = default_eps(input.dtype)
    ctype = computation_dtype(input.dtype)
    xc = input.to(ctype)
    y = xc * torch.rsqrt(xc.pow(2).mean(dim=dims, keepdim=True) + eps)
    if norm_dtype is not None:
        y = y.to(norm_dtype).to(ctype)
    if weight is not None:
        y = y * (weight.to(ctype) + weight_offset) if weight_offset else y * weight
    return y.to(out_dtype or input.dtype)


def add_rms_norm_forward(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0,
    norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, residual_out, rstd)`` with ``residual_out = x + residual`` (in their promoted dtype,
    as torch adds them) and ``y, rstd = rms_norm_forward(residual_out, ...)``."""
    residual_out = (x + residual).contiguous()
    y, rstd = rms_norm_forward(residual_out, weight, eps, weight_offset, norm_dtype, out_dtype)
    return y, residual_out, rstd


def norm_add_rms_norm_forward(
    x: Tensor, residual: Tensor, x_weight: Tensor | None, x_eps: float, weight: Tensor | None, eps: float,
    weight_offset: float = 0.0, norm_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, residual_out, rstd, x_rstd)``: ``residual_out = residual + rmsnorm(x, x_weight,
    x_eps)`` (x's norm in x's dtype) and ``y, rstd = rms_norm_forward(residual_out, weight, eps)``,
    both norms with ``weight_offset`` and ``norm_dtype``."""
    x_normed, x_rstd = rms_norm_forward(x, x_weight, x_eps, weight_offset, norm_dtype)
    y, residual_out, rstd = add_rms_norm_forward(residual, x_normed, weight, eps, weight_offset, norm_dtype)
    return y, residual_out, rstd, x_rstd


def add_rms_norm_backward(
    dy: Tensor, dresidual_out: Tensor | None, residual_out: Tensor, weight: Tensor | None, rstd: Tensor,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """The gradient of ``residual_out`` (the norm's, plus ``dresidual_out`` if given) in its
    dtype, and dweight: the gradient of both inputs of the sum."""
    ctype = computation_dtype(residual_out.dtype)
    dx, dweight = rms_norm_backward(dy, residual_out.to(ctype), weight, rstd, weight_offset)
    if dresidual_out is not None:
        dx = dx + dresidual_out  # in the computation dtype, rounded once below
    return dx.to(residual_out.dtype), dweight
