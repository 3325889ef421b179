"""Hardware counters of our kernels beside Inductor's, at the benchmark's shapes, under Nsight Compute.

For each job (``pass:dtype:N``, x of 256 MiB as in the benchmark) runs ours and Inductor's
compiled ``nn.RMSNorm`` (``fwd``: a no-grad forward; ``fwd+bwd``: forward and backward), warms
both up (compiles, autotunes) outside the profiled range, then one step each inside
``cudaProfilerStart`` / ``cudaProfilerStop``, an NVTX range naming it. Run under ncu:

    ncu --profile-from-start off --clock-control none --nvtx \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python profiling/ncu_kernels.py --jobs fwd:bfloat16:256,...

Each kernel's section tables give DRAM bytes read and written (against the byte floor), achieved
occupancy, waves and warp stall reasons. Without ncu it just runs the steps (a check that the
script works).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_rmsnorm_op.tools.benchmark import BANDWIDTH_BYTES, implementations  # noqa: E402


def steps(pass_name: str, n: int, dtype: torch.dtype):
    """(name, step) for ours and Inductor at one shape."""
    m = BANDWIDTH_BYTES // (n * dtype.itemsize)
    impls, w = implementations(n, dtype, "cuda")
    x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=pass_name != "fwd")
    dy = torch.randn_like(x)
    out = []
    for name in ("ours", "inductor"):
        fn = impls[name]
        if pass_name == "fwd":
            def step(fn=fn):
                with torch.no_grad():
                    fn(x)
        else:
            def step(fn=fn):
                x.grad = w.grad = None
                fn(x).backward(dy)
        out.append((f"{name} {pass_name} {m}x{n} {str(dtype).removeprefix('torch.')}", step))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="fwd:bfloat16:256,fwd:float32:4096")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch._dynamo.config.recompile_limit = 1000
    plan = []
    for job in args.jobs.split(","):
        pass_name, dtype_name, n = job.split(":")
        for name, step in steps(pass_name, int(n), getattr(torch, dtype_name)):
            for _ in range(3):  # compile, autotune, warm up: outside the profiled range
                step()
            plan.append((name, step))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, step in plan:
        with torch.cuda.nvtx.range(name):
            step()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("ran:", "; ".join(name for name, _ in plan))


if __name__ == "__main__":
    main()
