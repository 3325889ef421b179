"""The norm-add kernel (``launch.forward_norm_add``) forced onto inputs ``launch.norm_add_fuses``
sends to two launches, on CUDA: how many outputs differ from ``rmsnorm.fwd`` then
``rmsnorm.add_fwd``. ``python profiling/results/tuning/2026-12-02-h200-norm-add/forced_fusion_bits.py``
(from the repository root, with it on ``PYTHONPATH``)."""

import torch

from torch_rmsnorm_op import dispatch, launch

torch.manual_seed(0)
for dtype, kw in ((torch.float32, {}), (torch.bfloat16, {"norm_dtype": torch.bfloat16}), (torch.bfloat16, {})):
    for shape in [(64, 1024), (2048, 2048)]:
        n = shape[-1]
        x, r = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
        w1, w2 = torch.randn(n, device="cuda", dtype=dtype), torch.rand(n, device="cuda", dtype=dtype) + 0.5
        plan = dispatch.forward_plan(x, w1, **kw)
        sum_plan = dispatch.forward_plan(r, w2, x, **kw)
        y, h = torch.empty_like(x), torch.empty_like(x)
        rstd, xr = (torch.empty(shape[:-1], device="cuda") for _ in range(2))
        launch.forward_norm_add(plan, x, r, w1, w2, 1e-6, 1e-5, y, h, rstd, xr)
        y1, xr1 = torch.ops.rmsnorm.fwd(x, w1, 1e-6, **kw)
        want = torch.ops.rmsnorm.add_fwd(r, y1, w2, 1e-5, **kw)
        print(dtype, shape, kw, "same cfg:", plan.cfg == sum_plan.cfg, "differ: y", int((y != want[0]).sum()),
              "h", int((h != want[1]).sum()), "x_rstd", int((xr != xr1).sum()), "of", y.numel(), flush=True)
