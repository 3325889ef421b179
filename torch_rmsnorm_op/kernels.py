"""Triton kernels for RMSNorm and the launchers that run them.

Math (``reference.py`` is the oracle), per row ``x`` of length ``N``::

    rstd = 1 / sqrt(mean(x**2) + eps)            y  = x * rstd * w
    u = dy * w,  c = mean(u * x)                 dx = rstd * (u - x * rstd**2 * c)
    dw = sum over rows of dy * x * rstd

All arithmetic is fp32. Rows may be strided (last dim contiguous, any row
stride); offsets are 64-bit. dweight is reduced deterministically: each
backward program writes one fp32 partial row (scratch is programs x N, never
M x N), then ``_rms_norm_dw_reduce`` sums the partials in a fixed order. No
float atomics anywhere.

The launchers take validated 2-D tensors and write into the outputs they are
given; ``ops.py`` allocates, validates and decides when to use them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from torch_rmsnorm_op.config import REDUCE_BLOCK_N, REDUCE_BLOCK_P, backward_config, backward_programs, forward_config


@triton.jit
def _rstd(sum_sq, n, eps):
    return tl.rsqrt(sum_sq / n + eps)


@triton.jit
def _rms_norm_fwd(
    X,  # input  [M, N], row stride stride_x, last dim contiguous
    W,  # weight [N] (ignored unless HAS_WEIGHT)
    Y,  # output [M, N], row stride stride_y
    RSTD,  # output [M] fp32
    stride_x,
    stride_y,
    M,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK_N)
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * stride_y
    if SINGLE_PASS:
        # The whole row tile lives in registers: x is read once.
        mask = row_mask[:, None] & (cols[None, :] < N)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = _rstd(tl.sum(x * x, axis=1), N, eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = y * w[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < N)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = _rstd(tl.sum(acc, axis=1), N, eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < N)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            y = x * rstd[:, None]
            if HAS_WEIGHT:
                w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                y = y * w[None, :]
            tl.store(y_rows + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd(
    DY,  # upstream gradient [M, N], row stride stride_dy
    X,  # forward input [M, N], row stride stride_x
    W,  # weight [N] (ignored unless HAS_WEIGHT)
    RSTD,  # [M] fp32, saved by the forward
    DX,  # output [M, N], row stride stride_dx
    DW_PARTIAL,  # scratch [programs, N] fp32: this program's dweight partial row
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    rows_per_program,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)
    dw_row = DW_PARTIAL + pid * N
    if SINGLE_PASS:
        col_mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for first in range(row_start, row_end, ROWS):
            rows = first + tl.arange(0, ROWS)
            mask = (rows < row_end)[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < row_end, other=0.0)
            u = dy
            if HAS_WEIGHT:
                u = dy * w[None, :]
                dw_acc += dy * x * rstd[:, None]
            c = tl.sum(u * x, axis=1) / N
            dx = (u - x * (rstd * rstd * c)[:, None]) * rstd[:, None]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        for row in range(row_start, row_end):
            x_row = X + row * stride_x
            dy_row = DY + row * stride_dy
            rstd = tl.load(RSTD + row)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                x = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
                u = tl.load(dy_row + c, mask=c < N, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    u = u * tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                acc += u * x
            scale = rstd * rstd * (tl.sum(acc, axis=0) / N)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                x = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + c, mask=c < N, other=0.0).to(tl.float32)
                u = dy
                if HAS_WEIGHT:
                    u = dy * tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                    # The program's first row starts the partial: its load is fully masked.
                    prev_n = tl.where(row > row_start, N, 0)
                    prev = tl.load(dw_row + c, mask=c < prev_n, other=0.0)
                    tl.store(dw_row + c, prev + dy * x * rstd, mask=c < N)
                dx = (u - x * scale) * rstd
                tl.store(DX + row * stride_dx + c, dx.to(DX.dtype.element_ty), mask=c < N)


@triton.jit
def _rms_norm_dw_reduce(
    DW_PARTIAL,  # [P, N] fp32 partial rows
    DW,  # output [N], the weight's dtype
    P,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    # Fixed order: P tiles in sequence, each summed by the same tree.
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & col_mask[None, :]
        acc += tl.load(DW_PARTIAL + p[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


def launch_forward(x: Tensor, weight: Tensor | None, eps: float, y: Tensor, rstd: Tensor) -> None:
    """Write ``y`` [M, N] and ``rstd`` [M] for ``x`` [M, N] (``N >= 1``, last dims contiguous,
    weight contiguous [N] or None)."""
    m, n = x.shape
    if m == 0:
        return
    cfg = forward_config(n, x.dtype)
    _rms_norm_fwd[(triton.cdiv(m, cfg.rows),)](
        x, weight if weight is not None else x, y, rstd,
        x.stride(0), y.stride(0), m, n, eps,
        BLOCK_N=cfg.block_n, ROWS=cfg.rows, HAS_WEIGHT=weight is not None,
        SINGLE_PASS=cfg.single_pass, num_warps=cfg.num_warps,
    )


def backward_workspace(m: int, n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Uninitialized fp32 scratch for the dweight partials: [programs, N]."""
    programs, _ = backward_programs(m, n, device, backward_config(n, dtype))
    return torch.empty((programs, n), dtype=torch.float32, device=device)


def launch_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor, dweight: Tensor | None,
    workspace: Tensor | None = None,
) -> None:
    """Write ``dx`` [M, N] and, with a weight, ``dweight`` [N] (``M, N >= 1``).

    ``workspace`` is the dweight scratch (``backward_workspace``); allocated when None.
    """
    m, n = x.shape
    cfg = backward_config(n, x.dtype)
    programs, rows_per_program = backward_programs(m, n, x.device, cfg)
    has_weight = weight is not None
    if has_weight and workspace is None:
        workspace = backward_workspace(m, n, x.device, x.dtype)
    _rms_norm_bwd[(programs,)](
        dy, x, weight if has_weight else x, rstd, dx, workspace if has_weight else dx,
        dy.stride(0), x.stride(0), dx.stride(0), m, n, rows_per_program,
        BLOCK_N=cfg.block_n, ROWS=cfg.rows, HAS_WEIGHT=has_weight,
        SINGLE_PASS=cfg.single_pass, num_warps=cfg.num_warps,
    )
    if has_weight:
        _rms_norm_dw_reduce[(triton.cdiv(n, REDUCE_BLOCK_N),)](
            workspace, dweight, programs, n, BLOCK_P=REDUCE_BLOCK_P, BLOCK_N=REDUCE_BLOCK_N,
        )


def is_interpreted() -> bool:
    """True when the kernels were defined under ``TRITON_INTERPRET=1`` (they run on CPU tensors)."""
    return not isinstance(_rms_norm_fwd, triton.runtime.JITFunction)
