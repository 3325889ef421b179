"""Inductor's generated Triton code for the benchmark's compiled ``nn.RMSNorm``, to read beside ours.

For each bf16 shape (x of 256 MiB, as in the benchmark, or ``--m`` rows), compiles the module as the
benchmark does, runs a forward (no grad) and a forward+backward, and writes every
generated source into one file, with the kernels' launch configurations as Inductor's
autotuner left them in the code.
Run on a CUDA machine: ``python profiling/inductor_code.py --out DIR [--n 1024,32768] [--m 8192]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_rmsnorm_op.tools.benchmark import BANDWIDTH_BYTES, implementations  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--n", default="256,1024,8192,16384,32768,65536")
    p.add_argument("--m", type=int, help="rows of x (default: the benchmark's, x of 256 MiB)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    parts = [f"# torch {torch.__version__}, {torch.cuda.get_device_name()}\n"]
    for n in map(int, args.n.split(",")):
        m = args.m or BANDWIDTH_BYTES // (n * 2)
        impls, _ = implementations(n, torch.bfloat16, "cuda")
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def fwd(f=impls["inductor"], x=x):
            with torch.no_grad():
                f(x)

        def fwd_bwd(f=impls["inductor"], x=x, dy=dy):
            f(x).backward(dy)

        for name, fn in (("forward, no grad", fwd), ("forward+backward", fwd_bwd)):
            _, codes = run_and_get_code(fn)
            for i, code in enumerate(codes):
                parts.append(f"\n# ===== {m}x{n} bfloat16, {name}, source {i} =====\n{code}")
    with open(os.path.join(args.out, "inductor_code.txt"), "w") as f:
        f.write("".join(parts))


if __name__ == "__main__":
    main()
