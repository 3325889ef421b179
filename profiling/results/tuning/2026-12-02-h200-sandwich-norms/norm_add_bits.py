"""``rmsnorm.norm_add_fwd`` against ``rmsnorm.fwd`` then ``rmsnorm.add_fwd`` on CUDA, bf16 rows, in
GLM 4's order (rounded before the weight, ``norm_dtype=bfloat16``), with Gemma's weight offset
and with neither; bf16 and fp32 weights: whether one kernel ran, and how many outputs differ.
``python profiling/results/tuning/2026-12-02-h200-sandwich-norms/norm_add_bits.py`` (from the
repository root, with it on ``PYTHONPATH``)."""

import torch

from torch_rmsnorm_op import dispatch, launch

SHAPES = [(16, 2048), (64, 1024), (2048, 2048), (8192, 2048), (4096, 4096), (8192, 4096), (16384, 4096),
          (3000, 4096), (2, 3, 4096), (8192, 1152), (1024, 5120), (4096, 5376), (333, 3072), (8192, 7168)]

torch.manual_seed(0)
for kw in ({"norm_dtype": torch.bfloat16}, {"weight_offset": 1.0}, {}):
    for shape in SHAPES:
        for wdtype in (torch.bfloat16, torch.float32):
            n = shape[-1]
            x, r = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            w1, w2 = torch.randn(n, device="cuda", dtype=wdtype), torch.rand(n, device="cuda", dtype=wdtype) + 0.5
            got = torch.ops.rmsnorm.norm_add_fwd(x, r, w1, 1e-6, w2, 1e-5, **kw)
            y1, xr1 = torch.ops.rmsnorm.fwd(x, w1, 1e-6, **kw)
            want = (*torch.ops.rmsnorm.add_fwd(r, y1, w2, 1e-5, **kw), xr1)
            plans = dispatch.forward_plan(x, w1, **kw), dispatch.forward_plan(r, w2, x, **kw)
            fused = launch.norm_add_fuses(*plans, x, r)
            diff = [int((a != b).sum()) for a, b in zip(got, want)]
            print(kw, tuple(shape), str(wdtype)[6:], "one kernel:", fused, "differ y/h/rstd/x_rstd:", diff,
                  "of", x.numel(), flush=True)
