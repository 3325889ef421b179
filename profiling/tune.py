"""Sweep launch configurations on a GPU and print the best per N: the input to ``config.py``.

Times the launchers directly (GPU time, ``triton.testing.do_bench`` median, after
a correctness check against the float64 reference), bf16, M·N ≈ 128 Mi
elements. Also breaks down the host-side cost of one eager call.
Run: ``python profiling/tune.py --out DIR``; writes ``tune.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_rmsnorm_op as T  # noqa: E402
from torch_rmsnorm_op import kernels, reference  # noqa: E402
from torch_rmsnorm_op.config import KernelConfig, backward_config, forward_config  # noqa: E402

ELEMS = 128 * 2**20


def fwd_candidates(n):
    out = []
    if n <= 32768:
        for rows, warps in itertools.product((1, 2, 4, 8, 16), (4, 8, 16, 32)):
            if rows * n <= 32768 and rows * n >= 1024 and warps * 32 * 4 <= rows * n:
                out.append(KernelConfig(n, rows, warps))
    for split, warps in itertools.product((2, 4, 8, 16, 32, 64), (4, 8, 16)):
        block = triton.next_power_of_2(triton.cdiv(n, split))
        if 2048 <= block <= 32768 and block * split >= n and warps * 32 * 4 <= block:
            out.append(KernelConfig(block, 1, warps, split))
    return out


def bwd_candidates(n):
    out = []
    for pps in (1, 2, 4, 8):
        if n <= 16384:
            for rows, warps in itertools.product((1, 2, 4, 8, 16), (4, 8, 16)):
                if 1024 <= rows * n <= 16384 and warps * 32 * 4 <= rows * n:
                    out.append(KernelConfig(n, rows, warps, 1, pps))
        for split, warps in itertools.product((2, 4, 8, 16, 32, 64), (4, 8, 16)):
            block = triton.next_power_of_2(triton.cdiv(n, split))
            if 2048 <= block <= 16384 and block * split >= n and warps * 32 * 4 <= block:
                out.append(KernelConfig(block, 1, warps, split, pps))
    return out


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--ns", default="1024,4096,8192,16384,32768,65536,262144")
    args = p.parse_args()
    copy_a = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    copy_b = torch.empty_like(copy_a)
    copy_gbs = 4 * (1 << 30) / (bench(lambda: copy_b.copy_(copy_a)) * 1e-6) / 1e9
    print(f"copy ceiling (do_bench): {copy_gbs:.0f} GB/s", flush=True)
    results = {"copy_GBs": copy_gbs, "fwd": {}, "bwd": {}, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__}
    dtype = torch.bfloat16
    for n in map(int, args.ns.split(",")):
        m = ELEMS // n
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        dy = torch.randn_like(x)
        y, rstd = torch.empty_like(x), torch.empty(m, device="cuda")
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        y_ref, rstd_ref = reference.rms_norm_forward(x[:64].double(), w.double(), 1e-6)
        dx_ref, _ = reference.rms_norm_backward(dy[:64].double(), x[:64].double(), w.double(), rstd_ref)
        rows = []
        for cfg in [forward_config(n, dtype)] + fwd_candidates(n):
            try:
                kernels.launch_forward(x, w, 1e-6, y, rstd, cfg)
                err = (y[:64].double() - y_ref).abs().max().item()
                us = bench(lambda cfg=cfg: kernels.launch_forward(x, w, 1e-6, y, rstd, cfg))  # noqa: B023
                rows.append((us, cfg, err))
            except Exception as e:  # noqa: BLE001 - an unbuildable config is a data point
                print("fwd", n, cfg, "failed:", repr(e)[:120], flush=True)
        rows.sort(key=lambda r: r[0])
        results["fwd"][n] = [dict(us=r[0], pct=2 * m * n * 2 / (r[0] * 1e-6) / 1e9 / copy_gbs * 100,
                                  cfg=r[1].__dict__, max_err=r[2], table=r[1] == forward_config(n, dtype))
                             for r in rows]
        best = results["fwd"][n][0]
        cur = next(r for r in results["fwd"][n] if r["table"])
        print(f"fwd N={n}: best {best['pct']:.1f}% {best['cfg']} err {best['max_err']:.2e}; "
              f"table {cur['pct']:.1f}%", flush=True)
        kernels.launch_forward(x, w, 1e-6, y, rstd)
        ws_rows = []
        for cfg in [backward_config(n, dtype)] + bwd_candidates(n):
            try:
                ws = kernels.backward_workspace(m, n, x.device, dtype, cfg)
                kernels.launch_backward(dy, x, w, rstd, dx, dw, ws, cfg)
                err = (dx[:64].double() - dx_ref).abs().max().item()
                us = bench(lambda cfg=cfg, ws=ws: kernels.launch_backward(dy, x, w, rstd, dx, dw, ws, cfg))  # noqa: B023
                ws_rows.append((us, cfg, err, ws.numel() * 4 / 2**20))
            except Exception as e:  # noqa: BLE001
                print("bwd", n, cfg, "failed:", repr(e)[:120], flush=True)
        ws_rows.sort(key=lambda r: r[0])
        results["bwd"][n] = [dict(us=r[0], pct=3 * m * n * 2 / (r[0] * 1e-6) / 1e9 / copy_gbs * 100,
                                  cfg=r[1].__dict__, max_err=r[2], scratch_MiB=r[3],
                                  table=r[1] == backward_config(n, dtype)) for r in ws_rows]
        best = results["bwd"][n][0]
        cur = next(r for r in results["bwd"][n] if r["table"])
        print(f"bwd N={n}: best {best['pct']:.1f}% {best['cfg']} err {best['max_err']:.2e} "
              f"scratch {best['scratch_MiB']:.1f} MiB; table {cur['pct']:.1f}%", flush=True)
    # Host-side cost of one eager call at the tutorial's shape.
    x = torch.randn(128, 257, device="cuda")
    w = torch.randn(257, device="cuda")
    y, rstd = torch.empty_like(x), torch.empty(128, device="cuda")
    calls = {
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (257,), w, 1e-6),
        "T.rms_norm": lambda: T.rms_norm(x, (257,), w, 1e-6),
        "torch.ops.rmsnorm.fwd": lambda: torch.ops.rmsnorm.fwd(x, w, 1e-6),
        "launch_forward": lambda: kernels.launch_forward(x, w, 1e-6, y, rstd),
        "empty x2": lambda: (torch.empty_like(x), torch.empty(128, device="cuda")),
    }
    results["call_us"] = {}
    with torch.no_grad():
        for name, fn in calls.items():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            results["call_us"][name] = (time.perf_counter() - t0) / 500 * 1e6
            torch.cuda.synchronize()
            print(f"call {name}: {results['call_us'][name]:.1f} us", flush=True)
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
