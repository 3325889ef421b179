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
best), and the package's own split forward, on the same x (256 MiB). GPU time:
``triton.testing.do_bench`` median. Prints one line per variant and writes them to ``--out``
as JSON.

    python profiling/tma_probe.py --out tma_probe.json
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

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


def _grid(m: int, split: int, per_sm: int, sms: int) -> tuple[int, int]:
    groups = max(1, per_sm * sms // split)
    return groups * split, triton.cdiv(m, groups)


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300)


def _probe_shape(dtype: torch.dtype, n: int, sms: int, results: list, package_only: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from torch_rmsnorm_op import kernels
    from torch_rmsnorm_op.config import forward_config

    elem = torch.empty((), dtype=dtype).element_size()
    m = (256 << 20) // (n * elem)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    floor = 2 * m * n * elem
    copy_gbs = floor / _ms(lambda: y.copy_(x)) / 1e6

    def record(name: str, fn, cfg) -> None:
        y.zero_()
        try:
            ms = _ms(fn)
        except Exception as e:  # a configuration that does not compile is reported, not fatal
            print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        gbs = floor / ms / 1e6
        err = None
        if name.startswith("copy loop"):
            err = (y - x).abs().max().item()
        elif isinstance(cfg, dict):  # what the probe's kernels compute: each chunk scaled by its own rms
            xc = x.view(m, n // cfg["block_n"], cfg["block_n"]).float()
            ref = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)
            err = (y.view_as(ref).float() - ref).abs().max().item()
        row = dict(dtype=str(dtype).removeprefix("torch."), n=n, variant=name, config=cfg, us=ms * 1e3, gbs=gbs,
                   pct_copy=100 * gbs / copy_gbs, copy_gbs=copy_gbs, max_abs_err=err)
        results.append(row)
        print(f"{row['dtype']:>8} N={n:<7} {name:<34} {cfg!s:<72} {ms * 1e3:8.1f} us {gbs:6.0f} GB/s "
              f"{row['pct_copy']:5.1f}% of copy" + ("" if err is None else f"  err {err:.2g}"), flush=True)

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
        for per_sm, warps, stages in ((2, table.num_warps, 2), (2, table.num_warps, 3), (2, table.num_warps, 4),
                                      (1, table.num_warps, 3), (4, max(4, table.num_warps // 2), 2),
                                      (4, max(4, table.num_warps // 2), 3), (8, 4, 2)):
            grid, rows = _grid(m, split, per_sm, sms)
            cfg = dict(block_n=blk, split=split, per_sm=per_sm, warps=warps, stages=stages)
            consts = dict(BLOCK_N=blk, SPLIT=split, STAGES=stages, num_warps=warps)
            record("ptr (no exchange)", functools.partial(_stream_ptr[(grid,)], x, y, n, m, n, rows, **consts), cfg)
            record("copy loop (ptr, no reduction)",
                   functools.partial(_stream_ptr[(grid,)], x, y, n, m, n, rows, REDUCE=False, **consts), cfg)
            for tma_store in (False, True):
                record("tma load" + (" + tma store" if tma_store else "") + " (no exchange)",
                       functools.partial(_stream_tma[(grid,)], xd, yd, y, n, m, n, rows, INNER_N=inner,
                                         TMA_STORE=tma_store, **consts), cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--package-only", action="store_true",
                        help="time the copy and the package's split forward only (e.g. with a variant applied)")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    results: list = []
    for dtype, n in ((torch.bfloat16, 65536), (torch.bfloat16, 262144), (torch.float32, 65536)):
        _probe_shape(dtype, n, sms, results, args.package_only)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
