"""Forward GPU time of the library's kernels launched by a compiled graph's generated code,
against the same kernels launched eagerly and against Inductor's own compiled norm, at the
shapes models run and at some of the 256 MiB sweep's; bf16 and fp32, inference (no rstd
needs keeping, yet a compiled graph of the op writes it).

Graphs, each ``torch.compile(..., dynamic=False, fullgraph=True)``, under ``no_grad``:

- ``norm``: ``rms_norm(x, (N,), w)`` (ours eager, ours compiled) against ``nn.RMSNorm`` compiled,
  floor 2·M·N·elem (read x, write y);
- ``add_norm``: ``add_rms_norm(x, r, (N,), w)`` against ``h = x + r; F.rms_norm(h, ...)``
  compiled, floor 4·M·N·elem (read x and r, write y and h).

GPU time as ``python -m torch_rmsnorm_op bench`` measures it (``tools.benchmark.gpu_us``: the
device time of every kernel and memset a call launched, median of 5 windows of 20 calls,
inputs rotating past L2); % of the copy ceiling measured in the same run. A graph that does
not compile is recorded with its error. Writes ``$OUT/compiled-forward-<label>.json``.

    OUT=DIR PYTHONPATH=. python compiled_forward.py --label LABEL
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import torch_rmsnorm_op as T
from torch_rmsnorm_op.tools.benchmark import EPS, L2_BYTES, copy_ceiling, gpu_us

SHAPES = [(m, n, torch.bfloat16) for m in (2048, 8192) for n in (2048, 4096, 5120, 7168, 8192)]
SHAPES += [(131072, 1024, torch.bfloat16), (8192, 16384, torch.bfloat16), (512, 262144, torch.bfloat16),
           (16384, 4096, torch.float32), (1024, 65536, torch.float32)]


def graphs(n: int, dtype: torch.dtype) -> dict:
    module = nn.RMSNorm(n, eps=EPS, device="cuda", dtype=dtype)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    w = module.weight

    def ours(x, r):
        return T.rms_norm(x, (n,), w, EPS)

    def ours_add(x, r):
        return T.add_rms_norm(x, r, (n,), w, EPS)

    def stock_add(x, r):
        h = x + r
        return F.rms_norm(h, (n,), w, EPS), h

    def compiled(f):
        return torch.compile(f, dynamic=False, fullgraph=True)

    return {
        ("norm", "ours"): ours,
        ("norm", "ours_compiled"): compiled(ours),
        ("norm", "inductor"): compiled(lambda x, r: module(x)),
        ("add_norm", "ours"): ours_add,
        ("add_norm", "ours_compiled"): compiled(ours_add),
        ("add_norm", "inductor"): compiled(stock_add),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    args = p.parse_args()
    out = os.environ.get("OUT", ".")
    torch.manual_seed(0)
    copy_gbs = copy_ceiling(20, 5, "cuda")
    rows = []
    for m, n, dtype in SHAPES:
        torch._dynamo.reset()
        elem = dtype.itemsize
        sets = max(1, min(8, (4 * L2_BYTES) // max(1, 4 * m * n * elem))) if 2 * m * n * elem < L2_BYTES else 1
        xs = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
        rs = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
        for (graph, impl), fn in graphs(n, dtype).items():
            it = iter(range(10**12))

            def step(fn=fn, it=it, xs=xs, rs=rs, sets=sets):
                i = next(it) % sets
                with torch.no_grad():
                    fn(xs[i], rs[i])

            row = dict(M=m, N=n, dtype=str(dtype).removeprefix("torch."), graph=graph, impl=impl)
            kernels: dict[str, float] = {}
            try:
                us = gpu_us(step, 20, 5, kernels)
            except Exception as e:  # a graph that does not compile: recorded, the run goes on
                lines = [line for line in str(e).splitlines() if "Error" in line and "TORCHDYNAMO" not in line]
                rows.append(dict(row, error=f"{type(e).__name__}: {(lines or [str(e)])[-1].strip()[:300]}"))
                print(f"{m}x{n} {row['dtype']} {graph} {impl}: {rows[-1]['error']}", flush=True)
                continue
            floor = (2 if graph == "norm" else 4) * m * n * elem
            rows.append(dict(row, us=round(us, 2), pct_of_copy=round(100 * floor / (us * 1e-6) / 1e9 / copy_gbs, 1),
                             kernels_us=kernels))
            print(f"{m}x{n} {row['dtype']} {graph} {impl}: {us:.2f} us, {rows[-1]['pct_of_copy']}%", flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                  label=args.label, copy_GBs=round(copy_gbs, 1), dispatch=T.dispatch_stats(), rows=rows)
    with open(os.path.join(out, f"compiled-forward-{args.label}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
