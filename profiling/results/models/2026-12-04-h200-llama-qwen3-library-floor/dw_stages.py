"""GPU time of ``rmsnorm.add_bwd`` (the backward and its dweight reduction) with the reduction's
stages as the table sets them against one stage always, bf16 rows with a bf16 weight, inputs
rotating past the L2, 4 alternating rounds of 20 calls under torch.profiler, the median round.

    OUT=DIR PYTHONPATH=. python profiling/results/models/2026-12-04-h200-llama-qwen3-library-floor/dw_stages.py
"""
import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from torch_rmsnorm_op import launch

orig = launch.reduce_splits
VARIANTS = {"table": orig, "one-stage": lambda rows, n, device: 1}


def gpu_us(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    by = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("_rms_norm"):
            by[e.name] = by.get(e.name, 0.0) + e.device_time / iters
    return by


out = []
SHAPES = [(2048, 2048), (8192, 1536), (8192, 2048), (16384, 2048), (8192, 3584), (8192, 4096), (8192, 5120),
          (16, 2048), (1024, 2048)]
for m, n in SHAPES:
    sets = max(1, (256 << 20) // (4 * m * n * 2))
    sets = min(sets, 8)
    data = []
    for _ in range(sets):
        h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        _, _, rstd = torch.ops.rmsnorm.add_fwd(h, torch.zeros_like(h), w, 1e-6)
        data.append((torch.randn_like(h), torch.randn_like(h), h, w, rstd))
    it = [0]

    def step(data=data, it=it, sets=sets):
        d = data[it[0] % sets]
        it[0] += 1
        torch.ops.rmsnorm.add_bwd(d[0], d[1], d[2], d[3], d[4])

    res = {}
    for rnd in range(4):
        for name in (VARIANTS if rnd % 2 == 0 else list(VARIANTS)[::-1]):
            launch.reduce_splits = VARIANTS[name]
            by = gpu_us(step)
            res.setdefault(name, []).append(by)
    launch.reduce_splits = orig
    row = {"M": m, "N": n}
    for name, runs in res.items():
        tot = [sum(b.values()) for b in runs]
        row[name] = round(statistics.median(tot), 2)
        row[name + "_kernels"] = {k: round(statistics.median([b.get(k, 0) for b in runs]), 2) for k in runs[0]}
    print(json.dumps(row), flush=True)
    out.append(row)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "dw-stages.json"), "w"), indent=1)
