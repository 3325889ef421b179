"""Per-call cost of a forward compiled with ``mode="reduce-overhead"``: ours (``rms_norm``),
Inductor's ``F.rms_norm`` and a graph without any norm (``x * 2``), at 128x257 fp32 and
4096x4096 bf16.

For each it writes our graph's Inductor code (``$OUT/ours-code-<M>x<N>.txt``), times 200
back-to-back calls (no grad, wall time including the final synchronize) and prints a
``torch.profiler`` table of 50 calls, by host time and by device time: where a call's time goes
(the input copy into the graph's static buffer, the graph launch, the compiled wrapper). Each
graph is timed in its own window, one after the other.

Run on a CUDA machine: ``OUT=DIR python profiling/reduce_overhead_calls.py > DIR/calls.txt``.
"""

import os
import time

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

import torch_rmsnorm_op as T

EPS = 1e-6


def main() -> None:
    out = os.environ.get("OUT", ".")
    for m, n, dtype in [(128, 257, torch.float32), (4096, 4096, torch.bfloat16)]:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        for name, fn in (("ours", T.rms_norm), ("Inductor", F.rms_norm), ("x2", None)):
            torch._dynamo.reset()
            f = (lambda x: x * 2) if fn is None else (lambda x, fn=fn, n=n, w=w: fn(x, (n,), w, EPS))
            g = torch.compile(f, mode="reduce-overhead", dynamic=False)
            with torch.no_grad():
                _, codes = run_and_get_code(g, x)
                if name == "ours":
                    with open(f"{out}/ours-code-{m}x{n}.txt", "w") as file:
                        file.write("\n\n".join(codes))
                for _ in range(30):
                    g(x)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    g(x)
                torch.cuda.synchronize()
                us = (time.perf_counter() - t0) / 200 * 1e6
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(50):
                        g(x)
                    torch.cuda.synchronize()
            print(f"==== {m}x{n} {name}: {us:.2f} us/call", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=70))


if __name__ == "__main__":
    main()
