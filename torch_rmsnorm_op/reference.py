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


def default_eps(dtype: torch.dtype) -> float:
    """What ``F.rms_norm`` uses for ``eps=None``: the computation dtype's machine epsilon."""
    ctype = computation_dtype(dtype)
    return torch.finfo(torch.float64 if ctype in (torch.float64, torch.complex128) else torch.float32).eps


def rms_norm_forward(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """Normalize over the last dim. Returns ``(y, rstd)``; ``y`` in x's dtype, contiguous;
    ``rstd`` of shape ``x.shape[:-1]`` in the computation dtype."""
    xc = x.to(computation_dtype(x.dtype))
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = xc * rstd
    if weight is not None:
        y = y * weight
    return y.to(x.dtype).contiguous(), rstd.squeeze(-1).contiguous()


def rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The manual backward formula. Returns ``(dx, dweight)``; ``dweight`` is None
    without a weight, else in the weight's dtype."""
    ctype = computation_dtype(x.dtype)
    xc, dyc = x.to(ctype), dy.to(ctype)
    r = rstd.to(ctype).unsqueeze(-1)
    u = dyc * weight.to(ctype) if weight is not None else dyc
    c = (u * xc).mean(dim=-1, keepdim=True)
    dx = r * (u - xc * r * r * c)
    dweight = None
    if weight is not None:
        dweight = (dyc * xc * r).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype).contiguous(), dweight


def rms_norm_reference(
    input: Tensor, normalized_shape: list[int] | tuple[int, ...], weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """``F.rms_norm`` semantics, composed from plain torch ops (autograd handles gradients)."""
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    if eps is None:
        eps = default_eps(input.dtype)
    xc = input.to(computation_dtype(input.dtype))
    y = xc * torch.rsqrt(xc.pow(2).mean(dim=dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y.to(input.dtype)
