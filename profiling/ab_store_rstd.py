"""A/B on one GPU: the forward kernel writing rstd or not (``launch_forward(..., rstd=None)``),
same process, alternating, at the benchmark's forward shapes (GPU time, % of copy measured here).

Run: ``python profiling/ab_store_rstd.py --out DIR`` (writes DIR/ab_store_rstd.json)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_rmsnorm_op import kernels  # noqa: E402
from torch_rmsnorm_op.tools.benchmark import BANDWIDTH_BYTES, copy_ceiling, gpu_us  # noqa: E402

SHAPES = [(256, torch.bfloat16), (8192, torch.bfloat16), (32768, torch.bfloat16), (65536, torch.bfloat16),
          (262144, torch.bfloat16), (65536, torch.float32)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    copy = copy_ceiling(20, 5, "cuda")
    result = {"gpu": torch.cuda.get_device_name(), "copy_GBs": round(copy, 1), "rows": []}
    for n, dtype in SHAPES:
        m = BANDWIDTH_BYTES // (n * dtype.itemsize)
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        y, rstd = torch.empty_like(x), torch.empty(m, device="cuda")
        times = {"rstd": [], "no rstd": []}
        for _ in range(args.rounds):
            for name, r in (("rstd", rstd), ("no rstd", None)):
                step = lambda x=x, w=w, y=y, r=r: kernels.launch_forward(x, w, 1e-6, y, r)  # noqa: E731
                times[name].append(gpu_us(step, 20, 5))
        row = {"M": m, "N": n, "dtype": str(dtype).removeprefix("torch.")}
        for name, ts in times.items():
            best = min(ts)
            row[name] = {"us": [round(t, 2) for t in ts],
                         "pct_of_copy_best": round(100 * 2 * m * n * dtype.itemsize / (best * 1e-6) / 1e9 / copy, 1)}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_store_rstd.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
