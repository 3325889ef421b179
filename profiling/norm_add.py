"""Norm, residual add, norm (Gemma's and GLM 4's norms around each residual add), three ways, on
CUDA: ``python profiling/norm_add.py --out FILE [--family gemma|glm4] [--rows 16,2048,8192,16384]
[--cols 1152,2048,...]``.

Per (M, N), bf16, eps 1e-6, in the family's order: Gemma's weight offset (``1 + w``, the
normalized row rounded after it), or GLM 4's (Llama's) ``w * normed.to(bf16)``, rounded before the
weight (``norm_dtype=bfloat16``):

- ``fused_us``: ``torch.ops.rmsnorm.norm_add_fwd`` (one kernel where both norms share a
  single-pass configuration, else the two ops' launches);
- ``chain_us``: ``rmsnorm.fwd`` then ``rmsnorm.add_fwd``, what a patched graph ran before;
- ``inductor_us``: the pair as Gemma 3's code writes it, ``torch.compile(dynamic=False)``.

Each number is the GPU time of all kernels of one call (``torch.profiler`` device events, 40
calls, averaged), inputs rotating through a pool of at least 200 MB so that none comes from
L2; host time is not included. ``same_bits_as_chain``: the fused op's y and sum equal the
chain's; ``max_abs_diff_vs_inductor``: the largest difference of either from Inductor's.
``floor_us``: the pair's least traffic (read x and the residual, write y and the sum) at
4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_rmsnorm_op  # noqa: E402,F401  (defines torch.ops.rmsnorm)

EPS = 1e-6


def _gemma_norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    tf = t.float()
    out = tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + EPS)
    return (out * (1.0 + w.float())).type_as(t)


def _glm4_norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    tf = t.float()
    return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + EPS)).to(t.dtype)


FAMILIES = {"gemma": (_gemma_norm, {"weight_offset": 1.0}), "glm4": (_glm4_norm, {"norm_dtype": torch.bfloat16})}
NORM, KEYWORDS = FAMILIES["gemma"]


def pair(x, r, w1, w2):
    h = r + NORM(x, w1)
    return NORM(h, w2), h


def chain(x, r, w1, w2):
    y1, _ = torch.ops.rmsnorm.fwd(x, w1, EPS, **KEYWORDS)
    y, h, _ = torch.ops.rmsnorm.add_fwd(r, y1, w2, EPS, **KEYWORDS)
    return y, h


def fused(x, r, w1, w2):
    y, h, _, _ = torch.ops.rmsnorm.norm_add_fwd(x, r, w1, EPS, w2, EPS, **KEYWORDS)
    return y, h


def gpu_us(fn, pool: list, iters: int = 40) -> float:
    for i in range(3):
        fn(*pool[i % len(pool)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(*pool[i % len(pool)])
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / iters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma")
    parser.add_argument("--rows", default="16,2048,8192,16384")
    parser.add_argument("--cols", default="1152,2048,2304,2560,3584,3840,4608,5376")
    args = parser.parse_args(argv)
    global NORM, KEYWORDS
    NORM, KEYWORDS = FAMILIES[args.family]
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1000)  # one graph per shape, never eager
    compiled = torch.compile(pair, dynamic=False)
    rows = []
    for m in map(int, args.rows.split(",")):
        for n in map(int, args.cols.split(",")):
            count = max(2, int(200e6 // (m * n * 2 * 2)) + 1)
            scale, shift = (0.1, 0.0) if args.family == "gemma" else (0.1, 1.0)  # w near 0 (1 + w) or near 1
            pool = [(torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
                     torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
                     torch.randn(n, device="cuda", dtype=torch.bfloat16) * scale + shift,
                     torch.randn(n, device="cuda", dtype=torch.bfloat16) * scale + shift) for _ in range(count)]
            a, b, c = fused(*pool[0]), chain(*pool[0]), compiled(*pool[0])
            row = dict(m=m, n=n, fused_us=gpu_us(fused, pool), chain_us=gpu_us(chain, pool),
                       inductor_us=gpu_us(compiled, pool),
                       same_bits_as_chain=all(torch.equal(u, v) for u, v in zip(a, b)),
                       max_abs_diff_vs_inductor=max((u.float() - v.float()).abs().max().item() for u, v in zip(a, c)),
                       floor_us=4 * m * n * 2 / 4.8e6)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del pool
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                family=args.family)
    with open(args.out, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
