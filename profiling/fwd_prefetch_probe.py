"""Probe: a persistent rows forward that loads its next tile into registers ahead, against the
table's forward, a ``copy_`` of the same bytes and Inductor's compiled ``F.rms_norm``.

Each program walks tiles ``pid, pid + G, ...`` (G = SMs x programs per SM) and issues the next
tile's loads before the current tile's sum and store, so that an SM always has loads in flight.
bf16 x and weight, no residual, no rstd store (inference), inputs rotating past L2; GPU time as
``profiling/tune.py`` takes it.

Run: ``python profiling/fwd_prefetch_probe.py --out DIR [--shapes 8192x2048,...]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune  # noqa: E402

from torch_rmsnorm_op import dispatch  # noqa: E402

EPS = 1e-6


@triton.jit
def _fwd_rows_ahead(X, W, Y, M, N, eps, stride, tiles, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                    AHEAD: tl.constexpr, MASKED: tl.constexpr):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    if MASKED:
        nxt = tl.load(X + rows[:, None] * stride + cols[None, :], mask=(rows < M)[:, None] & col_mask[None, :],
                      other=0.0)
    else:
        nxt = tl.load(X + rows[:, None] * stride + cols[None, :])
    for t in range(pid, tiles, progs):
        x = nxt
        cur = rows
        rows = rows + progs * ROWS
        if AHEAD:
            nmask = (rows < M)[:, None] & col_mask[None, :]
            nxt = tl.load(X + rows[:, None] * stride + cols[None, :], mask=nmask, other=0.0)
        else:
            if t + progs < tiles:
                if MASKED:
                    nxt = tl.load(X + rows[:, None] * stride + cols[None, :],
                                  mask=(rows < M)[:, None] & col_mask[None, :], other=0.0)
                else:
                    nxt = tl.load(X + rows[:, None] * stride + cols[None, :])
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
        y = (xf * rstd[:, None]) * w
        if MASKED:
            tl.store(Y + cur[:, None] * stride + cols[None, :], y.to(Y.dtype.element_ty),
                     mask=(cur < M)[:, None] & col_mask[None, :])
        else:
            tl.store(Y + cur[:, None] * stride + cols[None, :], y.to(Y.dtype.element_ty))


def run_probe(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, rows: int, warps: int, pps: int, ahead: bool) -> None:
    """y = rms_norm(x) * w through the probe kernel: ``pps`` programs per SM (4 SMs on CPU, for
    the interpreter), ``rows`` rows a tile, the next tile loaded ahead unconditionally (``ahead``)
    or under a branch."""
    m, n = x.shape
    block = triton.next_power_of_2(n)
    tiles = triton.cdiv(m, rows)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    grid = (min(tiles, sms * pps),)
    masked = block != n or m % rows != 0
    _fwd_rows_ahead[grid](x, w, y, m, n, EPS, n, tiles, BLOCK_N=block, ROWS=rows, AHEAD=ahead, MASKED=masked,
                          num_warps=warps)


def probe_shape(m: int, n: int, copy_gbs: float) -> dict:
    """GPU time (us) and % of copy at M x N: the table's forward, Inductor's (``tune.inductor_us``),
    a ``copy_`` of the bytes and every candidate of the probe kernel, over ``tune.Sets``' rotating
    inputs and outputs."""
    job = tune.Job("fwd", m, n, torch.bfloat16, torch.bfloat16, store_rstd=False)
    floor = job.floor_bytes()
    count = tune.set_count(job)
    sets = tune.Sets(job, count)
    items = sets.items
    x, w, y = items[0]["x"], items[0]["w"], items[0]["y"]
    want = torch.nn.functional.rms_norm(x.float(), (n,), w.float(), EPS)
    cfg = dispatch.forward_plan(x, w).cfg
    row = dict(m=m, n=n, table_cfg=str(cfg), us={})
    row["us"]["table"] = tune.gpu_us(lambda i: tune.run_ours(job, cfg, items[i]), count)
    row["us"]["inductor"] = tune.inductor_us(job, sets)
    pairs = [(torch.empty(m * n, device=tune.DEVICE, dtype=torch.bfloat16).normal_(),
              torch.empty(m * n, device=tune.DEVICE, dtype=torch.bfloat16)) for _ in range(count)]
    row["us"]["copy"] = tune.gpu_us(lambda i: pairs[i][1].copy_(pairs[i][0]), count)
    block = triton.next_power_of_2(n)
    for rows, warps, pps, ahead in itertools.product((1, 2, 4), (2, 4, 8, 16), (1, 2, 4, 8), (True, False)):
        if not 8 <= rows * block // (warps * 32) <= 64:
            continue
        key = f"r{rows}w{warps}p{pps}{'a' if ahead else 'c'}"
        try:
            run_probe(x, w, y, rows, warps, pps, ahead)
            torch.cuda.synchronize()
            err = (y.float() - want).abs().max().item()
            if err > 0.05:
                print(f"{m}x{n} {key} wrong: {err}", flush=True)
                continue
            c = (rows, warps, pps, ahead)
            row["us"][key] = tune.gpu_us(lambda i, c=c: run_probe(items[i]["x"], items[i]["w"], items[i]["y"], *c),
                                         count)
        except Exception as e:  # noqa: BLE001 - an unbuildable candidate is a data point
            print(f"{m}x{n} {key} failed: {repr(e)[:120]}", flush=True)
    row["pct"] = {k: floor / (v * 1e-6) / 1e9 / copy_gbs * 100 for k, v in row["us"].items()}
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shapes", default="8192x2048,16384x2048,2048x8192,8192x8192,8192x4096,2048x4096,8192x7168")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    copy_gbs = tune.copy_ceiling()
    results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   copy_gbs=copy_gbs, shapes=[])
    for shape in a.shapes.split(","):
        m, n = map(int, shape.split("x"))
        row = probe_shape(m, n, copy_gbs)
        us, pct = row["us"], row["pct"]
        best = sorted((v, k) for k, v in us.items() if k not in ("table", "inductor", "copy"))[:5]
        print(f"{shape}: table {us['table']:.2f} ({pct['table']:.1f}%) inductor {us['inductor']:.2f} copy "
              f"{us['copy']:.2f} ({pct['copy']:.1f}%) best {[(k, round(v, 2)) for v, k in best]}", flush=True)
        results["shapes"].append(row)
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "fwd-prefetch-probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
