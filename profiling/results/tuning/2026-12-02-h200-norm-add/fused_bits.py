"""``rmsnorm.norm_add_fwd`` against ``rmsnorm.fwd`` then ``rmsnorm.add_fwd`` on CUDA: fp16 and bf16 rows,
weights of their dtype or fp32, offset 0 and 1, 2-D and 3-D contiguous rows; which path served the
call and how many outputs differ. ``python profiling/results/tuning/2026-12-02-h200-norm-add/fused_bits.py``"""

import torch

import torch_rmsnorm_op  # noqa: F401  (defines torch.ops.rmsnorm)
from torch_rmsnorm_op import dispatch, launch

torch.manual_seed(0)
DTYPES = ((torch.float16, torch.float16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
          (torch.bfloat16, torch.bfloat16))
for xdt, wdt in DTYPES:
    for off in (0.0, 1.0):
        for shape in [(64, 1024), (2048, 2048), (16, 5376), (3, 4, 2304)]:
            n = shape[-1]
            x, r = (torch.randn(shape, device="cuda", dtype=xdt) for _ in range(2))
            w1, w2 = torch.randn(n, device="cuda", dtype=wdt) * 0.5, torch.rand(n, device="cuda", dtype=wdt) + 0.5
            got = torch.ops.rmsnorm.norm_add_fwd(x, r, w1, 1e-6, w2, 1e-5, weight_offset=off)
            y1, xr = torch.ops.rmsnorm.fwd(x, w1, 1e-6, weight_offset=off)
            want = (*torch.ops.rmsnorm.add_fwd(r, y1, w2, 1e-5, weight_offset=off), xr)
            fuses = launch.norm_add_fuses(dispatch.forward_plan(x, w1), dispatch.forward_plan(r, w2, x), x, r)
            diffs = [int((a != b).sum()) for a, b in zip(got, want)]
            print(xdt, wdt, off, shape, "fused" if fuses else "two launches", "differ (y, sum, rstd, x_rstd):", diffs,
                  flush=True)
