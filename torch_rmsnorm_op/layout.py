"""How the kernels address a tensor's rows: ``[..., N]`` seen as M rows of N contiguous
elements, the leading dims merged where their strides allow into at most three."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

# Leading dims the kernels address after merging (kernels.common._row_offset).
MAX_LEAD_DIMS = 3


class RowLayout(NamedTuple):
    """Rows of a tensor as the kernels address them: ``dims`` (1 to 3) merged leading dims of
    sizes ``(*, size1, size2)`` and strides ``(stride0, stride1, stride2)``; unused sizes and
    strides are 1, which Triton specializes as constexprs, so a launch does not pass them. One
    dim is a single row stride."""

    dims: int
    size1: int
    size2: int
    stride0: int
    stride1: int
    stride2: int


def row_layout(t: Tensor) -> RowLayout | None:
    """The layout of ``t``'s rows, or None when the kernels cannot address them without a copy:
    a last dim that is not contiguous (N > 1), or leading dims that need more than three
    strides after merging."""
    n = t.shape[-1]
    if t.is_contiguous():  # the common case, without walking the dims
        return RowLayout(1, 1, 1, n, 1, 1)
    if n > 1 and t.stride(-1) != 1:
        return None
    dims: list[list[int]] = []  # [size, stride], outermost first
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = [dims[-1][0] * size, stride]
        else:
            dims.append([size, stride])
    if not dims:
        return RowLayout(1, 1, 1, n, 1, 1)
    if len(dims) > MAX_LEAD_DIMS:
        return None
    sizes = [d[0] for d in dims] + [1] * (MAX_LEAD_DIMS - len(dims))
    strides = [d[1] for d in dims] + [1] * (MAX_LEAD_DIMS - len(dims))
    return RowLayout(len(dims), sizes[1], sizes[2], *strides)


def row_stride(t: Tensor) -> int | None:
    """The single stride between consecutive rows of ``t`` seen as ``[M, N]``, or None when one
    stride does not address them."""
    layout = row_layout(t)
    return layout.stride0 if layout is not None and layout.dims == 1 else None
