"""Split mode's streaming loop, with and without TMA loads (profiling/NOTES.md, session 15).

Split mode (forward N >= 65536) runs at 88-89% of the copy ceiling, and without any exchange
between programs (variant ``no_exchange``) its persistent loop runs at about the same: the loop
itself is the bound (sessions 12 and 15). This probe times a loop of that form alone, with no
exchange (each program scales its chunk by its own chunk's rms: wrong results, the same bytes),
two ways in one run:

- ``ptr``: pointer loads, pipelined by Triton into shared memory (``num_stages``), as the package's
  kernel does;
- ``tma``: the chunk loaded through a host tensor descriptor (Hopper's bulk tensor copy), x viewed
  as [M, N / 64, 64] (a box dimension is at most 256), stored through one as well (``TMA_STORE``)
  or by pointers;

against ``y.copy_(x)``, the same loop without the reduction (a copy: what the loop streams at
best), and the package's own split forward, on the same x (256 MiB). ``--part backward`` does
the same for the split backward's loop (x and dy read, dx written; pointer loads only), against
``torch.add(x, dy, out=dx)`` and the package's split backward. GPU time:
``triton.testing.do_bench`` median. Prints one line per variant and writes them to ``--out``
as JSON.

    python profiling/tma_probe.py --out tma_probe.json [--part forward|backward|all]
    python profiling/tma_probe.py --package-only   # e.g. after profiling/variants/apply.py no_exchange
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from torch import Tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from torch_rmsnorm_op.kernels import _exchange  # noqa: E402

INNER = 64  # the descriptor's last box dimension, in elements


@triton.jit
def _stream_ptr(X, Y, stride, M, N, rows_per_group, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                STAGES: tl.constexpr, REDUCE: tl.constexpr = True):
    pid = tl.program_id(0)
    chunk = pid % SPLIT
    group = pid // SPLIT
    step = tl.num_programs(0) // SPLIT
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    for i in tl.range(0, rows_per_group, num_stages=STAGES):
        row = (group + i * step).to(tl.int64)
        mask = offs < tl.where(row < M, N, 0)  # (the interpreter takes no scalar & block mask)
        x = tl.load(X + row * stride + offs, mask=mask, other=0.0)
        if REDUCE:
            x = x.to(tl.float32)
            x = x * tl.rsqrt(tl.sum(x * x, axis=0) / BLOCK_N + 1e-6)
        tl.store(Y + row * stride + offs, x.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _stream_tma(x_desc, y_desc, Y, stride, M, N, rows_per_group, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                STAGES: tl.constexpr, INNER_N: tl.constexpr, TMA_STORE: tl.constexpr):
    pid = tl.program_id(0)
    chunk = pid % SPLIT
    group = pid // SPLIT
    step = tl.num_programs(0) // SPLIT
    col = chunk * (BLOCK_N // INNER_N)
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    for i in tl.range(0, rows_per_group, num_stages=STAGES):
        row = group + i * step
        x = x_desc.load([row, col, 0]).to(tl.float32)  # [1, BLOCK_N // INNER_N, INNER_N], zeros past M
        y = x * tl.rsqrt(tl.sum(x * x) / BLOCK_N + 1e-6)
        if TMA_STORE:
            y_desc.store([row, col, 0], y.to(Y.dtype.element_ty))
        else:
            y = tl.reshape(y, [BLOCK_N])
            tl.store(Y + row.to(tl.int64) * stride + offs, y.to(Y.dtype.element_ty),
                     mask=offs < tl.where(row < M, N, 0))



@triton.jit
def _stream_bwd(X, DY, DX, W, RSTD, DW_PARTIAL, stride, M, N, rows_per_group, BLOCK_N: tl.constexpr,
                SPLIT: tl.constexpr, STAGES: tl.constexpr, REDUCE: tl.constexpr = True):
    """The split backward's loop without the exchange: each program's row dot is its own chunk's."""
    pid = tl.program_id(0)
    chunk = pid % SPLIT
    group = pid // SPLIT
    step = tl.num_programs(0) // SPLIT
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, rows_per_group, num_stages=STAGES):
        row = (group + i * step).to(tl.int64)
        mask = offs < tl.where(row < M, N, 0)
        x = tl.load(X + row * stride + offs, mask=mask, other=0.0)
        dy = tl.load(DY + row * stride + offs, mask=mask, other=0.0)
        if REDUCE:
            x, dy = x.to(tl.float32), dy.to(tl.float32)
            rstd = tl.load(RSTD + row, mask=row < M, other=0.0)
            u = dy * w
            dx = (u - x * (rstd * rstd * tl.sum(u * x, axis=0) / BLOCK_N)) * rstd
            dw += dy * x * rstd
        else:  # (in fp32: the interpreter adds bf16 wrongly)
            dx = x.to(tl.float32) + dy.to(tl.float32)
        tl.store(DX + row * stride + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + pid * BLOCK_N + tl.arange(0, BLOCK_N), dw)


# The split loops in their simplest form, with the package's exchange: at row i a program
# publishes row i's partial and waits for row i's total (EXCHANGE), while Triton's pipeliner
# has rows i + 1 .. i + STAGES - 1 in flight; nothing is held from one row to the next. Without
# EXCHANGE each program uses its own chunk's partial (wrong results, the same bytes).
@triton.jit
def _simple_fwd(X, Y, SLOTS, stride, M, N, eps, rows_per_group, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                STAGES: tl.constexpr, EXCHANGE: tl.constexpr):
    pid = tl.program_id(0)
    chunk = pid % SPLIT
    group = pid // SPLIT
    step = tl.num_programs(0) // SPLIT
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    for i in tl.range(0, rows_per_group, num_stages=STAGES):
        row = group + i * step
        mask = offs < tl.where(row < M, N, 0)
        x = tl.load(X + row.to(tl.int64) * stride + offs, mask=mask, other=0.0).to(tl.float32)
        sum_sq = tl.sum(x * x, axis=0)
        if EXCHANGE:
            sum_sq = _exchange(sum_sq, row >= 0, SLOTS, row, row, chunk, SPLIT, 0) / N
        else:
            sum_sq = sum_sq / BLOCK_N
        tl.store(Y + row.to(tl.int64) * stride + offs, (x * tl.rsqrt(sum_sq + eps)).to(Y.dtype.element_ty),
                 mask=mask)


@triton.jit
def _simple_bwd(X, DY, DX, W, RSTD, DW_PARTIAL, SLOTS, stride, M, N, rows_per_group, BLOCK_N: tl.constexpr,
                SPLIT: tl.constexpr, STAGES: tl.constexpr, EXCHANGE: tl.constexpr):
    pid = tl.program_id(0)
    chunk = pid % SPLIT
    group = pid // SPLIT
    step = tl.num_programs(0) // SPLIT
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, rows_per_group, num_stages=STAGES):
        row = group + i * step
        mask = offs < tl.where(row < M, N, 0)
        x = tl.load(X + row.to(tl.int64) * stride + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row.to(tl.int64) * stride + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < M, other=0.0)
        u = dy * w
        dot = tl.sum(u * x, axis=0)
        if EXCHANGE:
            dot = _exchange(dot, row >= 0, SLOTS, row, row, chunk, SPLIT, 0) / N
        else:
            dot = dot / BLOCK_N
        tl.store(DX + row.to(tl.int64) * stride + offs, ((u - x * (rstd * rstd * dot)) * rstd).to(DX.dtype.element_ty),
                 mask=mask)
        dw += dy * x * rstd
    tl.store(DW_PARTIAL + pid * BLOCK_N + tl.arange(0, BLOCK_N), dw)

def _grid(m: int, split: int, per_sm: int, sms: int) -> tuple[int, int]:
    groups = max(1, per_sm * sms // split)
    return groups * split, triton.cdiv(m, groups)


def _with_zeroed(slots: Tensor, launch):
    """``launch`` after zeroing the exchange's slots, as the package's launcher does."""
    def run():
        slots.zero_()
        launch()
    return run


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300)


class _Recorder:
    """Times launches of one shape against the copy ceiling and checks what they wrote."""

    def __init__(self, dtype: torch.dtype, n: int, floor: int, copy_gbs: float, results: list, out: Tensor,
                 check) -> None:
        self.dtype, self.n, self.floor, self.copy_gbs = dtype, n, floor, copy_gbs
        self.results, self.out, self.check = results, out, check

    def __call__(self, name: str, fn, cfg) -> None:
        self.out.zero_()
        try:
            ms = _ms(fn)
        except Exception as e:  # a configuration that does not compile is reported, not fatal
            print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        gbs = self.floor / ms / 1e6
        err = self.check(name, cfg) if isinstance(cfg, dict) else None
        row = dict(dtype=str(self.dtype).removeprefix("torch."), n=self.n, variant=name, config=cfg, us=ms * 1e3,
                   gbs=gbs, pct_copy=100 * gbs / self.copy_gbs, copy_gbs=self.copy_gbs, max_abs_err=err)
        self.results.append(row)
        print(f"{row['dtype']:>8} N={self.n:<7} {name:<34} {cfg!s:<72} {ms * 1e3:8.1f} us {gbs:6.0f} GB/s "
              f"{row['pct_copy']:5.1f}% of copy" + ("" if err is None else f"  err {err:.2g}"), flush=True)


def _configs(table) -> tuple:
    """(programs per SM, warps, stages) around a split rung."""
    half = max(4, table.num_warps // 2)
    return ((table.programs_per_sm, table.num_warps, table.stages), (2, table.num_warps, 2),
            (2, table.num_warps, 3), (2, table.num_warps, 4), (1, table.num_warps, 3), (4, half, 2), (4, half, 3),
            (8, 4, 2))


def _probe_forward(dtype: torch.dtype, n: int, sms: int, results: list, package_only: bool,
                   simple_only: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from torch_rmsnorm_op import kernels
    from torch_rmsnorm_op.config import forward_config

    elem = torch.empty((), dtype=dtype).element_size()
    m = (256 << 20) // (n * elem)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    floor = 2 * m * n * elem

    def check(name: str, cfg: dict) -> float:
        if name.startswith("copy loop"):
            return (y - x).abs().max().item()
        if name.startswith("simple + exchange"):  # the real thing
            return (y.float() - torch.nn.functional.rms_norm(x.float(), (n,), eps=1e-6)).abs().max().item()
        xc = x.view(m, n // cfg["block_n"], cfg["block_n"]).float()  # each chunk scaled by its own rms
        ref = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y.view_as(ref).float() - ref).abs().max().item()

    record = _Recorder(dtype, n, floor, floor / _ms(lambda: y.copy_(x)) / 1e6, results, y, check)
    record("copy", lambda: y.copy_(x), "")
    table = forward_config(n, dtype)
    record("package split forward", lambda: kernels.launch_forward(x, None, 1e-6, y, None), str(table))
    if package_only:
        return
    inner = INNER * 2 // elem
    for split_mul in (1, 2):
        split, blk = table.split * split_mul, table.block_n // split_mul
        box = [1, blk // inner, inner]
        xd = TensorDescriptor.from_tensor(x.view(m, n // inner, inner), box)
        yd = TensorDescriptor.from_tensor(y.view(m, n // inner, inner), box)
        for per_sm, warps, stages in _configs(table)[1:]:
            grid, rows = _grid(m, split, per_sm, sms)
            cfg = dict(block_n=blk, split=split, per_sm=per_sm, warps=warps, stages=stages)
            consts = dict(BLOCK_N=blk, SPLIT=split, STAGES=stages, num_warps=warps)
            slots = torch.zeros(grid // split * rows, split, dtype=torch.int64, device="cuda")
            for exchange in (True, False):
                record("simple + exchange" if exchange else "simple (no exchange)",
                       _with_zeroed(slots, functools.partial(_simple_fwd[(grid,)], x, y, slots, n, m, n, 1e-6, rows,
                                                             EXCHANGE=exchange, **consts)), cfg)
            if simple_only:
                continue
            record("ptr (no exchange)", functools.partial(_stream_ptr[(grid,)], x, y, n, m, n, rows, **consts), cfg)
            record("copy loop (ptr, no reduction)",
                   functools.partial(_stream_ptr[(grid,)], x, y, n, m, n, rows, REDUCE=False, **consts), cfg)
            for tma_store in (False, True):
                record("tma load" + (" + tma store" if tma_store else "") + " (no exchange)",
                       functools.partial(_stream_tma[(grid,)], xd, yd, y, n, m, n, rows, INNER_N=inner,
                                         TMA_STORE=tma_store, **consts), cfg)


def _probe_backward(dtype: torch.dtype, n: int, sms: int, results: list, package_only: bool,
                    simple_only: bool) -> None:
    """The backward's loop: x and dy read, dx written (floor 3·M·N·elem; the dweight partials and
    their reduction are not counted), against ``torch.add(x, dy, out=dx)``."""
    from torch_rmsnorm_op import kernels
    from torch_rmsnorm_op.config import backward_config

    elem = torch.empty((), dtype=dtype).element_size()
    m = (256 << 20) // (n * elem)
    x, dy = torch.randn(m, n, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    rstd = torch.rand(m, device="cuda") + 0.5
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    floor = 3 * m * n * elem

    def check(name: str, cfg: dict) -> float:
        if name.startswith("copy loop"):
            return (dx.float() - (x.float() + dy.float())).abs().max().item()
        shape = (m, 1, n) if name.startswith("simple + exchange") else (m, n // cfg["block_n"], cfg["block_n"])
        xc, u = x.view(shape).float(), dy.view(shape).float() * w.view(shape[1:]).float()
        r = rstd.view(m, 1, 1)
        ref = (u - xc * (r * r * (u * xc).mean(-1, keepdim=True))) * r
        return (dx.view(shape).float() - ref).abs().max().item()

    add_gbs = floor / _ms(lambda: torch.add(x, dy, out=dx)) / 1e6
    record = _Recorder(dtype, n, floor, add_gbs, results, dx, check)
    record("add (x + dy, aten)", lambda: torch.add(x, dy, out=dx), "")
    table = backward_config(n, dtype)
    workspace = kernels.backward_workspace(m, n, x.device, dtype)
    record("package split backward", lambda: kernels.launch_backward(dy, x, w, rstd, dx, dw, workspace), str(table))
    if package_only:
        return
    for split_mul in (1, 2):
        split, blk = table.split * split_mul, table.block_n // split_mul
        for per_sm, warps, stages in _configs(table):
            grid, rows = _grid(m, split, per_sm, sms)
            cfg = dict(block_n=blk, split=split, per_sm=per_sm, warps=warps, stages=stages)
            partial = torch.empty(grid, blk, device="cuda")
            consts = dict(BLOCK_N=blk, SPLIT=split, STAGES=stages, num_warps=warps)
            args = (x, dy, dx, w, rstd, partial, n, m, n, rows)
            slots = torch.zeros(grid // split * rows, split, dtype=torch.int64, device="cuda")
            for exchange in (True, False):
                record("simple + exchange" if exchange else "simple (no exchange)",
                       _with_zeroed(slots, functools.partial(_simple_bwd[(grid,)], x, dy, dx, w, rstd, partial, slots,
                                                             n, m, n, rows, EXCHANGE=exchange, **consts)), cfg)
            if simple_only:
                continue
            record("bwd loop (ptr, no exchange)", functools.partial(_stream_bwd[(grid,)], *args, **consts), cfg)
            record("copy loop (ptr, x + dy)",
                   functools.partial(_stream_bwd[(grid,)], *args, REDUCE=False, **consts), cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--package-only", action="store_true",
                        help="time the ceilings and the package's split kernels only (e.g. with a variant applied)")
    parser.add_argument("--part", choices=("forward", "backward", "all"), default="all")
    parser.add_argument("--simple-only", action="store_true", help="of the loops, only the simple ones")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    results: list = []
    if args.part in ("forward", "all"):
        for dtype, n in ((torch.bfloat16, 65536), (torch.bfloat16, 262144), (torch.float32, 65536)):
            _probe_forward(dtype, n, sms, results, args.package_only, args.simple_only)
    if args.part in ("backward", "all"):
        for dtype, n in ((torch.bfloat16, 32768), (torch.bfloat16, 65536), (torch.bfloat16, 262144),
                         (torch.float32, 65536)):
            _probe_backward(dtype, n, sms, results, args.package_only, args.simple_only)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
