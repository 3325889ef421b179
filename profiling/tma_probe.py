"""Split mode's loops alone: how far they stream, with and without TMA loads and the exchange.

Split mode (forward N >= 65536, backward N >= 32768) runs its row loop on a persistent grid: the
programs of a row group walk interleaved rows, each over its chunk of the row. This probe times
that loop in its simplest form (row i read, its partial formed, row i finished; rows
i + 1 .. i + stages - 1 in flight in shared memory through Triton's pipeliner), over a few
configurations around the table's rung (profiling/NOTES.md, session 15):

- ``own``: no exchange, each program scales its chunk by its own chunk's partial (wrong
  results, the package's bytes); pointer loads;
- ``copy``: the same loop without the reduction (forward y = x, backward dx = x + dy): what the
  loop streams at best;
- ``exchange``: the package's exchange (``kernels._exchange``), published and awaited at the same
  row, where the package's kernels publish a row ahead: real results (checked);
- ``tma`` (forward only): ``own`` with x's chunks loaded through a host tensor descriptor
  (Hopper's bulk tensor copies; x viewed as [M, N / 64, 64], a box dimension being at most
  256), y stored by pointers or through a descriptor too;
- the package's own structure, piece by piece: ``ahead`` (row i held in registers while row
  i + 1 is loaded and its partial formed), ``ahead_exchange`` (that, with the exchange: the
  package's algorithm), and for the backward ``wrow``, ``ahead_wrow``, ``ahead_wrow_exchange``
  (the weight re-read every row, as the package did until session 15);

beside ``y.copy_(x)`` (forward; backward: ``torch.add(x, dy, out=dx)``, floor 3·M·N·elem) and the
package's own split kernels, on 256 MiB tensors. GPU time: ``triton.testing.do_bench``
median; every loop's output is checked against what it claims to compute. Prints a line per
run and writes them to ``--out`` as JSON.

    python profiling/tma_probe.py --out probe.json [--part forward|backward] [--loops own,copy,exchange,tma,...]
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

from torch_rmsnorm_op.kernels import _exchange, _publish  # noqa: E402

INNER = 64  # the descriptor's last box dimension, in elements


# What a probe loop does with a row's partial (the ``MODE`` constexpr):
COPY = tl.constexpr(0)  # no reduction: y = x (forward), dx = x + dy (backward)
OWN = tl.constexpr(1)  # no exchange: each program uses its own chunk's partial (wrong results, the same bytes)
EXCHANGE = tl.constexpr(2)  # the package's exchange, published and awaited at the same row: the real results


@triton.jit
def _program(BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """A program's chunk, row group and row step (groups on interleaved rows), and its columns."""
    pid = tl.program_id(0)
    chunk = pid % SPLIT
    return chunk, pid // SPLIT, tl.num_programs(0) // SPLIT, chunk * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _row_total(value, SLOTS, row, chunk, N, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr):
    """The row's mean of ``value`` (this program's partial): its own chunk's, or the row's (EXCHANGE)."""
    if MODE == EXCHANGE:
        return _exchange(value, row >= 0, SLOTS, row, row, chunk, SPLIT, 0) / N
    return value / BLOCK_N


@triton.jit
def _ahead_total(own, ahead, publish, SLOTS, row, chunk, step, N, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                 MODE: tl.constexpr):
    """Row-ahead form: publish the next row's partial ``ahead`` (if ``publish``), then return this
    row's mean: of its own chunk (``own``), or of the whole row (EXCHANGE), as the package's loops do."""
    if MODE == EXCHANGE:
        return _exchange(ahead, publish, SLOTS, row, row + step, chunk, SPLIT, 0) / N
    return own / BLOCK_N


# The split loops in their simplest form: at row i a program reads row i, forms its partial
# and finishes the row; nothing is held from one row to the next, and Triton's pipeliner has
# rows i + 1 .. i + STAGES - 1 in flight. The package's loops instead hold row i in registers
# while row i + 1's partial is published (profiling/NOTES.md, session 15).
@triton.jit
def _loop_fwd(X, Y, SLOTS, stride, M, N, eps, rows_per_group, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
              STAGES: tl.constexpr, MODE: tl.constexpr, AHEAD: tl.constexpr = False):
    """``AHEAD`` (MODE OWN or EXCHANGE): the package's structure instead, row i held in registers
    while row i + 1 is loaded and its partial published."""
    chunk, group, step, offs = _program(BLOCK_N, SPLIT)
    if AHEAD:
        x0 = tl.load(X + group.to(tl.int64) * stride + offs, mask=offs < tl.where(group < M, N, 0), other=0.0)
        own = tl.sum(x0.to(tl.float32) * x0.to(tl.float32), axis=0)
        if MODE == EXCHANGE:
            _publish(own, SLOTS + group * SPLIT, chunk, 0)
        for i in tl.range(0, rows_per_group, num_stages=STAGES):
            row = group + i * step
            x1 = tl.load(X + (row + step).to(tl.int64) * stride + offs,
                         mask=offs < tl.where((row + step < M) & (i + 1 < rows_per_group), N, 0), other=0.0)
            ahead = tl.sum(x1.to(tl.float32) * x1.to(tl.float32), axis=0)
            total = _ahead_total(own, ahead, i + 1 < rows_per_group, SLOTS, row, chunk, step, N, BLOCK_N, SPLIT, MODE)
            tl.store(Y + row.to(tl.int64) * stride + offs, (x0.to(tl.float32) * tl.rsqrt(total + eps)).to(
                Y.dtype.element_ty), mask=offs < tl.where(row < M, N, 0))
            x0, own = x1, ahead
    else:
        for i in tl.range(0, rows_per_group, num_stages=STAGES):
            row = group + i * step
            mask = offs < tl.where(row < M, N, 0)  # (the interpreter takes no scalar & block mask)
            x = tl.load(X + row.to(tl.int64) * stride + offs, mask=mask, other=0.0)
            if MODE != COPY:
                x = x.to(tl.float32)
                x = x * tl.rsqrt(_row_total(tl.sum(x * x, axis=0), SLOTS, row, chunk, N, BLOCK_N, SPLIT, MODE) + eps)
            tl.store(Y + row.to(tl.int64) * stride + offs, x.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _loop_tma(x_desc, y_desc, Y, stride, M, N, rows_per_group, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
              STAGES: tl.constexpr, INNER_N: tl.constexpr, TMA_STORE: tl.constexpr):
    """``_loop_fwd`` (MODE OWN) with x's chunks loaded through a descriptor (and stored by one)."""
    chunk, group, step, offs = _program(BLOCK_N, SPLIT)
    col = chunk * (BLOCK_N // INNER_N)
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
def _bwd_row(x, dy, w, rstd, dot):
    """A row chunk's dx and dweight term, from x and dy in fp32 and the row's mean of dy * w * x."""
    u = dy * w
    return (u - x * (rstd * rstd * dot)) * rstd, dy * x * rstd


@triton.jit
def _loop_bwd(X, DY, DX, W, RSTD, DW_PARTIAL, SLOTS, stride, M, N, rows_per_group, BLOCK_N: tl.constexpr,
              SPLIT: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr, AHEAD: tl.constexpr = False,
              W_PER_ROW: tl.constexpr = False):
    """``AHEAD`` (MODE OWN or EXCHANGE): the package's structure instead, row i held in registers
    while row i + 1 is loaded and its partial published; ``W_PER_ROW``: w re-read every row, as the
    package does."""
    chunk, group, step, offs = _program(BLOCK_N, SPLIT)
    w = tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    if AHEAD:
        x0 = tl.load(X + group.to(tl.int64) * stride + offs, mask=offs < tl.where(group < M, N, 0), other=0.0)
        dy0 = tl.load(DY + group.to(tl.int64) * stride + offs, mask=offs < tl.where(group < M, N, 0), other=0.0)
        own = tl.sum(dy0.to(tl.float32) * w * x0.to(tl.float32), axis=0)
        if MODE == EXCHANGE:
            _publish(own, SLOTS + group * SPLIT, chunk, 0)
        for i in tl.range(0, rows_per_group, num_stages=STAGES):
            row = group + i * step
            ahead = offs < tl.where((row + step < M) & (i + 1 < rows_per_group), N, 0)
            x1 = tl.load(X + (row + step).to(tl.int64) * stride + offs, mask=ahead, other=0.0)
            dy1 = tl.load(DY + (row + step).to(tl.int64) * stride + offs, mask=ahead, other=0.0)
            if W_PER_ROW:
                w = tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
            ahead = tl.sum(dy1.to(tl.float32) * w * x1.to(tl.float32), axis=0)
            dot = _ahead_total(own, ahead, i + 1 < rows_per_group, SLOTS, row, chunk, step, N, BLOCK_N, SPLIT, MODE)
            dx, dw_row = _bwd_row(x0.to(tl.float32), dy0.to(tl.float32), w,
                                  tl.load(RSTD + row, mask=row < M, other=0.0), dot)
            dw += dw_row
            tl.store(DX + row.to(tl.int64) * stride + offs, dx.to(DX.dtype.element_ty),
                     mask=offs < tl.where(row < M, N, 0))
            x0, dy0, own = x1, dy1, ahead
    else:
        for i in tl.range(0, rows_per_group, num_stages=STAGES):
            row = group + i * step
            mask = offs < tl.where(row < M, N, 0)
            # fp32 even to copy: the interpreter adds bf16 wrongly
            x = tl.load(X + row.to(tl.int64) * stride + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row.to(tl.int64) * stride + offs, mask=mask, other=0.0).to(tl.float32)
            if MODE == COPY:
                dx = x + dy
            else:
                if W_PER_ROW:
                    w = tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
                dot = _row_total(tl.sum(dy * w * x, axis=0), SLOTS, row, chunk, N, BLOCK_N, SPLIT, MODE)
                dx, dw_row = _bwd_row(x, dy, w, tl.load(RSTD + row, mask=row < M, other=0.0), dot)
                dw += dw_row
            tl.store(DX + row.to(tl.int64) * stride + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PARTIAL + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), dw)


# The probe's loops by name (``--loops``): (forward row name or None, backward row name or
# None, MODE, further constexprs). Rows of the first three kept the names of session 15's runs.
LOOPS = {
    "own": ("ptr (no exchange)", "bwd loop (ptr, no exchange)", OWN.value, {}),
    "copy": ("copy loop (ptr, no reduction)", "copy loop (ptr, x + dy)", COPY.value, {}),
    "exchange": ("simple + exchange", "simple + exchange", EXCHANGE.value, {}),
    "wrow": (None, "bwd loop, w per row", OWN.value, dict(W_PER_ROW=True)),
    "ahead": ("row ahead (no exchange)", "bwd loop, row ahead", OWN.value, dict(AHEAD=True)),
    "ahead_wrow": (None, "bwd loop, row ahead + w per row", OWN.value, dict(AHEAD=True, W_PER_ROW=True)),
    "ahead_exchange": ("row ahead + exchange", "row ahead + exchange", EXCHANGE.value, dict(AHEAD=True)),
    "ahead_wrow_exchange": (None, "row ahead + w per row + exchange", EXCHANGE.value,
                            dict(AHEAD=True, W_PER_ROW=True)),
}
ALL_LOOPS = (*LOOPS, "tma")


def _grid(m: int, n: int, device: torch.device, split: int, per_sm: int) -> tuple[int, int]:
    """(programs, rows per group) of the package's own split grid for these programs
    (``config.row_groups``). Runs a-h of session 15 filled the grid instead (per_sm * SMs // split
    groups, session 11's variant): their numbers are that probe's, at the commits they name."""
    from torch_rmsnorm_op.config import KernelConfig, row_groups

    groups, rows = row_groups(m, n, device, KernelConfig(block_n=n // split, rows=1, num_warps=4, split=split,
                                                         programs_per_sm=per_sm))
    return groups * split, rows


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


def _probe_forward(dtype: torch.dtype, n: int, results: list, loops: frozenset[str]) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from torch_rmsnorm_op import kernels
    from torch_rmsnorm_op.config import forward_config

    elem = torch.empty((), dtype=dtype).element_size()
    m = (256 << 20) // (n * elem)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    floor = 2 * m * n * elem

    def check(name: str, cfg: dict) -> float:
        mode = LOOPS[cfg["loop"]][2] if "loop" in cfg else OWN.value  # (TMA loops: own chunks)
        if mode == COPY.value:
            return (y - x).abs().max().item()
        if mode == EXCHANGE.value:  # the real thing
            return (y.float() - torch.nn.functional.rms_norm(x.float(), (n,), eps=1e-6)).abs().max().item()
        xc = x.view(m, n // cfg["block_n"], cfg["block_n"]).float()  # each chunk scaled by its own rms
        ref = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y.view_as(ref).float() - ref).abs().max().item()

    record = _Recorder(dtype, n, floor, floor / _ms(lambda: y.copy_(x)) / 1e6, results, y, check)
    record("copy", lambda: y.copy_(x), "")
    table = forward_config(n, dtype)
    record("package split forward", lambda: kernels.launch_forward(x, None, 1e-6, y, None), str(table))
    if not loops:
        return
    inner = INNER * 2 // elem
    for split_mul in (1, 2):
        split, blk = table.split * split_mul, table.block_n // split_mul
        box = [1, blk // inner, inner]
        xd = TensorDescriptor.from_tensor(x.view(m, n // inner, inner), box)
        yd = TensorDescriptor.from_tensor(y.view(m, n // inner, inner), box)
        for per_sm, warps, stages in _configs(table)[1:]:
            grid, rows = _grid(m, n, x.device, split, per_sm)
            cfg = dict(block_n=blk, split=split, per_sm=per_sm, warps=warps, stages=stages)
            consts = dict(BLOCK_N=blk, SPLIT=split, STAGES=stages, num_warps=warps)
            slots = torch.zeros(grid // split * rows, split, dtype=torch.int64, device="cuda")
            for loop, (name, _, mode, more) in LOOPS.items():
                if loop in loops and name is not None:
                    record(name, _with_zeroed(slots, functools.partial(
                        _loop_fwd[(grid,)], x, y, slots, n, m, n, 1e-6, rows, MODE=mode, **more, **consts)),
                        dict(cfg, loop=loop))
            for tma_store in (False, True) if "tma" in loops else ():
                record("tma load" + (" + tma store" if tma_store else "") + " (no exchange)",
                       functools.partial(_loop_tma[(grid,)], xd, yd, y, n, m, n, rows, INNER_N=inner,
                                         TMA_STORE=tma_store, **consts), cfg)


def _probe_backward(dtype: torch.dtype, n: int, results: list, loops: frozenset[str]) -> None:
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
        mode = LOOPS[cfg["loop"]][2]
        if mode == COPY.value:
            return (dx.float() - (x.float() + dy.float())).abs().max().item()
        shape = (m, 1, n) if mode == EXCHANGE.value else (m, n // cfg["block_n"], cfg["block_n"])
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
    if not loops:
        return
    for split_mul in (1, 2):
        split, blk = table.split * split_mul, table.block_n // split_mul
        for per_sm, warps, stages in _configs(table):
            grid, rows = _grid(m, n, x.device, split, per_sm)
            cfg = dict(block_n=blk, split=split, per_sm=per_sm, warps=warps, stages=stages)
            partial = torch.empty(grid, blk, device="cuda")  # the dweight partials, one row per program
            consts = dict(BLOCK_N=blk, SPLIT=split, STAGES=stages, num_warps=warps)
            slots = torch.zeros(grid // split * rows, split, dtype=torch.int64, device="cuda")
            args = (x, dy, dx, w, rstd, partial, slots, n, m, n, rows)
            for loop, (_, name, mode, more) in LOOPS.items():
                if loop in loops and name is not None:
                    record(name, _with_zeroed(slots, functools.partial(
                        _loop_bwd[(grid,)], *args, MODE=mode, **more, **consts)), dict(cfg, loop=loop))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--package-only", action="store_true",
                        help="time the ceilings and the package's split kernels only (e.g. with a variant applied)")
    parser.add_argument("--part", choices=("forward", "backward", "all"), default="all")
    parser.add_argument("--loops", default="own,copy,exchange,tma",
                        help=f"the probe's loops to time (default %(default)s), of {','.join(ALL_LOOPS)} "
                             "(tma: forward only; wrow, ahead_wrow, ahead_wrow_exchange: backward only)")
    args = parser.parse_args()
    loops = frozenset() if args.package_only else frozenset(filter(None, args.loops.split(",")))
    if not loops <= set(ALL_LOOPS):
        parser.error(f"--loops: unknown {sorted(loops - set(ALL_LOOPS))}")
    results: list = []
    if args.part in ("forward", "all"):
        for dtype, n in ((torch.bfloat16, 65536), (torch.bfloat16, 262144), (torch.float32, 65536)):
            _probe_forward(dtype, n, results, loops)
    if args.part in ("backward", "all"):
        for dtype, n in ((torch.bfloat16, 32768), (torch.bfloat16, 65536), (torch.bfloat16, 262144),
                         (torch.float32, 65536)):
            _probe_backward(dtype, n, results, loops)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
