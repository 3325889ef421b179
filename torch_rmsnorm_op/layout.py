"""How the kernels address a tensor's rows: ``[..., N]`` seen as ``[M, N]`` at one row stride."""

from __future__ import annotations

from torch import Tensor


def row_stride(t: Tensor) -> int | None:
    """The stride between consecutive rows of ``t`` seen as ``[M, N]`` with a contiguous last
    dim (N = ``t.shape[-1]``), or None when the rows cannot be addressed that way (no copy)."""
    n = t.shape[-1]
    if t.is_contiguous():  # the common case, without building a view
        return n
    if n > 1 and t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, n).stride(0)
    except RuntimeError:
        return None
