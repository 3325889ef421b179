"""Host time per call of a compiled residual add + RMSNorm at few rows (default mode), never
patched: Inductor's own fused kernel against the library's ``add_rms_norm`` launched by the
generated code, and a graph of two elementwise kernels for scale; inference, and forward +
backward; 16 windows of 300 calls each, the graphs taken in turn. Writes host-calls.json (with
the launcher Inductor gave each of our kernels) and each graph's generated code.

    OUT=DIR PYTHONPATH=. python host_calls.py                                # static launch (default)
    OUT=DIR PYTHONPATH=. TORCH_RMSNORM_OP_STATIC_LAUNCH=0 python host_calls.py  # Triton's launcher
"""
import collections
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch._inductor.codecache import PyCodeCache
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from torch._inductor.utils import run_and_get_code

import torch_rmsnorm_op as T

OUT = os.environ.get("OUT", ".")
M, N = 16, 2048
dev, dt = "cuda", torch.bfloat16


def stock(x, r, w):
    h = x + r
    return F.rms_norm(h, (N,), w, 1e-6), h


def ours(x, r, w):
    return T.add_rms_norm(x, r, (N,), w, 1e-6)


def plain(x, r, w):
    h = x + r
    return h * 2, h


GRAPHS = {"stock": stock, "ours": ours, "plain": plain}
results = {}
for mode in ("infer", "train"):
    grad = mode == "train"
    x = torch.randn(M, N, device=dev, dtype=dt, requires_grad=grad)
    r = torch.randn(M, N, device=dev, dtype=dt, requires_grad=grad)
    w = (torch.rand(N, device=dev, dtype=dt) + 0.5).requires_grad_(grad)
    fns = {}
    for name, f in GRAPHS.items():
        c = torch.compile(f, fullgraph=True)

        def call(c=c, grad=grad, x=x, r=r, w=w):
            if grad:
                y, h = c(x, r, w)
                (y.sum() + h.sum()).backward()
            else:
                with torch.no_grad():
                    c(x, r, w)

        _, codes = run_and_get_code(call)
        with open(os.path.join(OUT, f"code-{mode}-{name}.txt"), "w") as fh:
            fh.write("\n\n# ---- next graph ----\n\n".join(codes))
        fns[name] = call
    for f in fns.values():
        for _ in range(200):
            f()
    torch.cuda.synchronize()
    wall, cpu = {n: [] for n in fns}, {n: [] for n in fns}
    order = list(fns)
    for rnd in range(16):
        for name in (order if rnd % 2 == 0 else order[::-1]):
            f = fns[name]
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(300):
                f()
            c1 = time.thread_time()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            wall[name].append((t1 - t0) / 300 * 1e6)
            cpu[name].append((c1 - c0) / 300 * 1e6)
    results[mode] = {n: {"wall_us": round(statistics.median(wall[n]), 2), "cpu_us": round(statistics.median(cpu[n]), 2),
                         "wall_us_windows": [round(v, 2) for v in wall[n]]} for n in fns}
    print(mode, {n: (v["wall_us"], v["cpu_us"]) for n, v in results[mode].items()}, flush=True)
kinds = collections.Counter()
for module in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
    for name, kernel in vars(module).items():
        if isinstance(kernel, CachingAutotuner) and name.startswith("_rms_norm"):
            kinds.update(type(r).__name__ for r in kernel.compile_results)
results["our_launchers"] = dict(kinds)
results["static_launch_setting"] = os.environ.get("TORCH_RMSNORM_OP_STATIC_LAUNCH", "default (on)")
print(results["our_launchers"], flush=True)
json.dump(results, open(os.path.join(OUT, "host-calls.json"), "w"), indent=1)
