"""Backward launches of the N = 4,097-8,192 rung (one row a tile, the next loaded ahead) at 5-4,100
rows, with 1-3 gradient terms and the residual's gradient, dweight from the launch's column
programs (up to 300 rows here) and from row-group partials and the reduction (2,048 and 4,100
rows): the program run under ``compute-sanitizer --tool memcheck`` and ``--tool initcheck``."""

import torch

from torch_rmsnorm_op import dispatch, launch, reference

for m, n, terms, res in ((37, 5120, 1, False), (300, 8192, 3, True), (5, 7168, 2, True), (2048, 8192, 2, True),
                         (4100, 5120, 1, False)):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    dy, *more = (torch.randn_like(x) for _ in range(terms))
    dres = torch.randn_like(x) if res else None
    _, rstd = reference.rms_norm_forward(x, w, 1e-6)
    plan = dispatch.backward_plan(x, w, x.dtype)
    print(m, n, plan.cfg)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    launch.backward(plan, dy, x, w, rstd, dx, dw, dres, dy_terms=tuple(more))
    torch.cuda.synchronize()
print("ok")
