"""GPU time of the eager forward with and without rstd stored (``rms_norm`` under ``no_grad``
writes no rstd; with x requiring grad it does), bf16, inputs rotating over 8 sets; two rounds.

    PYTHONPATH=. python rstd_store_probe.py
"""
import torch

import torch_rmsnorm_op as T
from torch_rmsnorm_op.tools.benchmark import gpu_us

for m, n in ((2048, 7168), (8192, 7168), (8192, 2048), (2048, 5120)):
    xs = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    xg = [x.clone().requires_grad_(True) for x in xs]
    it = iter(range(10**9))

    def no_rstd(xs=xs, w=w, n=n, it=it):
        with torch.no_grad():
            T.rms_norm(xs[next(it) % 8], (n,), w, 1e-6)

    def with_rstd(xg=xg, w=w, n=n, it=it):
        T.rms_norm(xg[next(it) % 8], (n,), w, 1e-6)

    for rnd in range(2):
        a, b = gpu_us(no_rstd, 20, 5), gpu_us(with_rstd, 20, 5)
        print(f"{m}x{n} round {rnd}: no rstd {a:.2f} us, rstd stored {b:.2f} us", flush=True)
