"""Where the host time of one eager forward call goes, layer by layer, on a CUDA machine.

At ``benchmark.LATENCY_SHAPES`` (128x257 fp32, 4096x4096 bf16), no grad, back-to-back calls
(``benchmark.calls_us``: windows of every row in turn, median), each layer timed alone:
``F.rms_norm``; ``torch_rmsnorm_op.rms_norm``; ``torch.ops.rmsnorm.fwd``; ``ops.forward`` (the
ops' implementation: plan, outputs, launch), without rstd as ``rms_norm`` calls it and with;
then, outputs preallocated, the plan lookup and the launch: ``dispatch.forward_plan`` +
``launch.replay_forward``, ``launch.replay_forward`` (the launch an eager plan keeps),
``launch.forward`` (the launcher's own path, through the compiled kernel's launcher after the
first call), Triton's JIT launch of the plan's kernel (``kernel[grid](...)``), the kept
compiled kernel launched as ``CompiledKernel[grid]``, and its bare call (``Plan.launcher.call``,
what ``replay_forward`` runs) with the tensors' addresses as ints; and the pieces a call needs:
the argument checks, the plan lookup, the allocations, the pointers, the current stream.
"host only" rows: the host's time per call of a few of these, not waiting for the GPU
(``host_us``). Under ``torch.compile(mode="reduce-overhead")``: ours and Inductor's
``F.rms_norm``, wall time and GPU time per call, with and without ``mark_static_address`` on the
input, the cudagraph skip counter, and a ``torch.cuda.CUDAGraph`` replay of our call. Then a
cProfile of the eager call.

Run: ``python profiling/host_overhead.py --out DIR [--eager-only]`` (writes
``DIR/host_overhead.json`` and ``DIR/host_overhead_profile.txt``).
``TRITON_INTERPRET=1 python profiling/host_overhead.py --cpu`` prints the op's own host time on
CPU, the launch replaced by a no-op (comparable across commits on one machine).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_rmsnorm_op as T  # noqa: E402
from torch_rmsnorm_op import contract, dispatch, kernels, launch, ops  # noqa: E402
from torch_rmsnorm_op.tools.benchmark import EPS, LATENCY_SHAPES, call_us, calls_us, cuda_graph, gpu_us  # noqa: E402

# The launches' compile option (fused multiply-adds on): the JIT row compiles the kernel the launcher runs.
COMPILE_OPTIONS = dict(enable_fp_fusion=True)


def forward_kernel(plan: dispatch.Plan):
    """The kernel ``launch.forward`` runs for ``plan``."""
    if plan.cfg.split > 1:
        return kernels._rms_norm_fwd_split
    return kernels._rms_norm_fwd_looped if plan.cfg.looped else kernels._rms_norm_fwd_rows


def eager_rows(m: int, n: int, dtype: torch.dtype) -> dict:
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    y, rstd = torch.empty_like(x), torch.empty(m, device="cuda")
    for _ in range(2):  # the JIT's launch, then the compiled kernel's, which the plan keeps
        ops.forward(x, w, EPS)
    plan = dispatch.forward_plan(x, w)  # the plan ops.forward used (kept per input signature)
    if type(plan) is str or plan.launcher is None:
        raise SystemExit(f"{m}x{n} {dtype}: no replayable plan ({plan if type(plan) is str else 'no launch kept'})")
    # The launch as launch.forward makes it: x stands in for the residual and its sum (no residual).
    ptrs = [x, x, w, y, x, rstd]
    grid3, sizes, tail = plan.replay  # tail: the row strides, then the constexprs in parameter order
    kernel, launcher = forward_kernel(plan), plan.launcher
    stream = torch.cuda.current_stream().cuda_stream
    args = [*ptrs, *sizes, EPS, *tail]
    # The tensors' addresses as ints: the C launcher then skips the data_ptr() call and the
    # driver's pointer check it makes per tensor.
    addresses = [t.data_ptr() for t in ptrs] + [*sizes, EPS, *tail]
    want = F.rms_norm(x.float(), (n,), w.float(), EPS)
    for name, run in (("launch.replay_forward", lambda: launch.replay_forward(plan, x, w, EPS, y, rstd)),
                      ("Plan.launcher.call", lambda: launcher.call(*grid3, stream, *launcher.head, *addresses))):
        y.zero_()
        run()
        torch.testing.assert_close(y.float(), want, atol=1e-2, rtol=2e-2, msg=lambda s, name=name: f"{name}: {s}")
    calls = {
        "F.rms_norm": lambda: F.rms_norm(x, (n,), w, EPS),
        "torch_rmsnorm_op.rms_norm": lambda: T.rms_norm(x, (n,), w, EPS),
        "torch.ops.rmsnorm.fwd": lambda: torch.ops.rmsnorm.fwd(x, w, EPS),
        "ops.forward, no rstd (rms_norm's call after its checks)": lambda: ops.forward(x, w, EPS, want_rstd=False),
        "ops.forward": lambda: ops.forward(x, w, EPS),
        "dispatch.forward_plan + launch.replay_forward": lambda: launch.replay_forward(
            dispatch.forward_plan(x, w), x, w, EPS, y, rstd),
        "launch.replay_forward": lambda: launch.replay_forward(plan, x, w, EPS, y, rstd),
        "launch.forward": lambda: launch.forward(plan, x, w, EPS, y, rstd),
        "JIT launch (kernel[grid](...))": lambda: kernel[grid3[:1]](*args, num_warps=plan.cfg.num_warps,
                                                                  **COMPILE_OPTIONS),
        "CompiledKernel[grid], stream given": lambda: launcher.compiled[grid3](*args, stream=stream),
        "Plan.launcher.call, int addresses": lambda: launcher.call(*grid3, stream, *launcher.head, *addresses),
        "six data_ptr() calls": lambda: [t.data_ptr() for t in ptrs],
        "current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "two torch.empty": lambda: (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                                    torch.empty(m, device="cuda")),
        "torch.empty(x.shape, dtype, device)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "contract.check_functional_args": lambda: contract.check_functional_args(x, (n,), w),
        "contract.check_forward_args": lambda: contract.check_forward_args(x, w),
        "dispatch.forward_plan": lambda: dispatch.forward_plan(x, w),
    }
    out = {name: round(us, 2) for name, us in calls_us(calls, calls=300).items()}
    host = {name: calls[name] for name in ("F.rms_norm", "torch_rmsnorm_op.rms_norm", "launch.replay_forward",
                                          "torch.empty(x.shape, dtype, device)")}
    out |= {f"host only: {name}": round(us, 2) for name, us in host_us(host).items()}
    return out


def host_us(fns: dict, calls: int = 200, windows: int = 11) -> dict[str, float]:
    """Host time per call without waiting for the GPU: as ``benchmark.calls_us``, but each
    window's clock stops before the synchronize that ends it (``calls`` launches stay far
    below the launch queue's depth, so the host never waits on the GPU inside a window)."""
    samples = {name: [] for name in fns}
    with torch.no_grad():
        for _ in range(windows):
            for name, fn in fns.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


def graph_rows(m: int, n: int, dtype: torch.dtype) -> dict:
    from torch._dynamo.utils import counters

    out = {}
    for static in (False, True):
        for name, fn in (("ours", T.rms_norm), ("Inductor F.rms_norm", F.rms_norm)):
            torch._dynamo.reset()
            counters.clear()
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
            if static:
                torch._dynamo.mark_static_address(x)
            compiled = torch.compile(lambda x, fn=fn, w=w: fn(x, (n,), w, EPS), mode="reduce-overhead")
            label = f"{name}{', static input' if static else ''}"
            call = lambda compiled=compiled, x=x: compiled(x)  # noqa: E731
            wall = call_us(call, calls=200)  # under no_grad
            with torch.no_grad():  # the same graph
                gpu = gpu_us(call, 20, 5)
            out[label] = {"call_us": round(wall, 2), "gpu_us": round(gpu, 2),
                          "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    graph = cuda_graph(lambda: T.rms_norm(x, (n,), w, EPS))
    out["torch.cuda.CUDAGraph.replay (ours captured)"] = {"call_us": round(call_us(graph.replay, calls=200), 2)}
    return out


def cpu_op_cost() -> dict:
    """The op's own host time without a kernel: CPU tensors, ``launch.forward`` replaced by a
    no-op (run with ``TRITON_INTERPRET=1``, so that the kernels serve CPU tensors)."""
    x, w = torch.randn(128, 257), torch.randn(257)
    plan = dispatch.forward_plan(x, w)
    if type(plan) is str:
        raise SystemExit(f"the kernels do not serve CPU tensors here: {plan}")
    calls = {
        "torch_rmsnorm_op.rms_norm": lambda: T.rms_norm(x, (257,), w, EPS),
        "torch.ops.rmsnorm.fwd": lambda: torch.ops.rmsnorm.fwd(x, w, EPS),
        "ops.forward": lambda: ops.forward(x, w, EPS),
        "dispatch.forward_plan": lambda: dispatch.forward_plan(x, w),
    }
    forward = launch.forward
    launch.forward = lambda *args, **kwargs: None
    try:
        return {name: round(call_us(fn, calls=2000), 2) for name, fn in calls.items()}
    finally:
        launch.forward = forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--cpu", action="store_true", help="only the op's own host time on CPU (no kernel)")
    p.add_argument("--eager-only", action="store_true", help="skip the reduce-overhead rows")
    args = p.parse_args()
    if args.cpu:
        print(json.dumps(cpu_op_cost()))
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (--cpu measures the op's host time on CPU)")
    os.makedirs(args.out, exist_ok=True)
    T.set_fallback_policy("error")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for m, n, dtype in LATENCY_SHAPES:
        shape = f"{m}x{n} {str(dtype).removeprefix('torch.')}"
        result[shape] = {"eager_call_us": eager_rows(m, n, dtype)}
        print(shape, json.dumps(result[shape]), flush=True)
        if not args.eager_only:
            result[shape]["reduce_overhead"] = graph_rows(m, n, dtype)
            print(shape, json.dumps(result[shape]["reduce_overhead"]), flush=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump(result, f, indent=1)
    m, n, dtype = LATENCY_SHAPES[0]
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.runcall(lambda: [T.rms_norm(x, (n,), w, EPS) for _ in range(2000)])
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with open(os.path.join(args.out, "host_overhead_profile.txt"), "w") as f:
        f.write(text.getvalue())
    print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
