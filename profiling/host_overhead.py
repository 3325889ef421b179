"""Where the host time of one forward call goes, on a CUDA machine (profiling/NOTES.md).

At 128x257 fp32 and 4096x4096 bf16, back-to-back calls (``benchmark.calls_us``, windows in turn):
``F.rms_norm``; ``torch_rmsnorm_op.rms_norm``; ``torch.ops.rmsnorm.fwd``; the launcher
with preallocated outputs; Triton's JIT launch of the forward kernel; the compiled
kernel's own launcher (``CompiledKernel[grid]``), ``compiled.run`` and ``kernels._launcher``'s
call (Triton 3.6: its C launch) with the same arguments; and the
pieces a launch needs (the launch key ``kernels._run`` computes, the current stream). Under
``torch.compile(mode="reduce-overhead")``: ours and Inductor's ``F.rms_norm``, wall
time and GPU time per call, with and without ``mark_static_address`` on the input,
and the cudagraph skip counter. Then a cProfile of the eager call. "host only" rows: the host's
time per call of a few of these, not waiting for the GPU (``host_us``).

Run: ``python profiling/host_overhead.py --out DIR`` (writes ``DIR/host_overhead.json``
and ``DIR/host_overhead_profile.txt``). ``TRITON_INTERPRET=1 python profiling/host_overhead.py
--cpu`` prints the op's own host time on CPU, the launcher replaced by a no-op.
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
from torch_rmsnorm_op import contract, kernels, ops  # noqa: E402
from torch_rmsnorm_op.config import forward_config  # noqa: E402
from torch_rmsnorm_op.tools.benchmark import EPS, LATENCY_SHAPES, call_us, calls_us, cuda_graph, gpu_us  # noqa: E402


def eager_rows(m: int, n: int, dtype: torch.dtype) -> dict:
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    y, rstd = torch.empty_like(x), torch.empty(m, device="cuda")
    cfg = forward_config(n, dtype)
    grid = triton.cdiv(m, cfg.rows)
    meta = kernels.constexprs(cfg, backward=False, has_weight=True)  # single-pass at these shapes
    args = [x, w, y, rstd, x, x.stride(0), y.stride(0), m, n, EPS, 0]  # SLOTS unused; rows_per_group 0
    compiled = kernels._rms_norm_fwd[(grid,)](*args, **meta, num_warps=cfg.num_warps, **kernels.COMPILE_OPTIONS)
    full = args + list(meta.values())  # the compiled launcher takes every argument, constexprs too
    stream = torch.cuda.current_stream().cuda_stream
    launcher = compiled[(grid, 1, 1)]
    # The same arguments with the tensors' addresses as ints: the C launcher then skips the
    # data_ptr() call and the driver's pointer check (cuPointerGetAttribute) it makes per tensor.
    addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in full]
    bare = (grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None)
    bare_launcher = kernels._launcher(compiled)  # Triton 3.6: its C launch without CudaLauncher.__call__
    for _ in range(2):  # the JIT's launch, then the compiled kernel's, which keeps the plan
        kernels.launch_forward(x, w, EPS, y, rstd, keep_plan=True)
    plan = kernels.forward_plan(x, w, True)
    assert plan is not None
    want = F.rms_norm(x.float(), (n,), w.float(), EPS)
    torch.testing.assert_close(y.float(), want, atol=1e-2, rtol=2e-2)
    y.zero_()
    launcher(*full, stream=stream)
    torch.testing.assert_close(y.float(), want, atol=1e-2, rtol=2e-2)
    calls = {
        "F.rms_norm": lambda: F.rms_norm(x, (n,), w, EPS),
        "torch_rmsnorm_op.rms_norm": lambda: T.rms_norm(x, (n,), w, EPS),
        "torch.ops.rmsnorm.fwd": lambda: torch.ops.rmsnorm.fwd(x, w, EPS),
        "kernels.launch_forward": lambda: kernels.launch_forward(x, w, EPS, y, rstd),
        "kernels.forward_plan + launch_planned": lambda: kernels.launch_planned(
            kernels.forward_plan(x, w, True), x, w, EPS, y, rstd),
        "kernels.launch_planned": lambda: kernels.launch_planned(plan, x, w, EPS, y, rstd),
        "JIT launch (kernel[grid](...))": lambda: kernels._rms_norm_fwd[(grid,)](
            *args, **meta, num_warps=cfg.num_warps, **kernels.COMPILE_OPTIONS
        ),
        "compiled launcher, stream given": lambda: launcher(*full, stream=stream),
        "compiled launcher, stream looked up": lambda: launcher(*full),
        "compiled.run, no hooks (kernels._run's call)": lambda: compiled.run(*bare, *full),
        "compiled.run, no hooks, int addresses": lambda: compiled.run(*bare, *addresses),
        "kernels._launcher(compiled).call, int addresses": lambda: bare_launcher.call(
            grid, 1, 1, stream, *bare_launcher.head, *addresses),
        "five data_ptr() calls": lambda: [x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), x.data_ptr()],
        "current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "launch key (kernels._specialization)": lambda: kernels._specialization(args),
        "two torch.empty": lambda: (torch.empty_like(x), torch.empty(m, device="cuda")),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "torch.empty_like(x, memory_format=contiguous)": lambda: torch.empty_like(
            x, memory_format=torch.contiguous_format),
        "torch.empty(x.shape, dtype, device)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "x.new_empty(x.shape)": lambda: x.new_empty(x.shape),
        "ops._forward, no rstd (rms_norm's call after its checks)": lambda: ops._forward(x, w, EPS, False),
        "check_functional_args": lambda: contract.check_functional_args(x, (n,), w),
        "ops._nothing_to_dispatch": lambda: ops._nothing_to_dispatch(x, w),
        "kernels.forward_plan": lambda: kernels.forward_plan(x, w, False),
    }
    out = {name: round(us, 2) for name, us in calls_us(calls, calls=300).items()}
    host = {name: calls[name] for name in ("F.rms_norm", "torch_rmsnorm_op.rms_norm", "kernels.launch_planned",
                                          "torch.empty_like(x, memory_format=contiguous)")}
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
    """The op's own host time without a kernel: CPU tensors, the launcher replaced by a no-op
    (run with ``TRITON_INTERPRET=1``); comparable across commits on one machine."""
    kernels.launch_forward = lambda *args, **kwargs: None
    x, w = torch.randn(128, 257), torch.randn(257)
    calls = {
        "torch_rmsnorm_op.rms_norm": lambda: T.rms_norm(x, (257,), w, EPS),
        "torch.ops.rmsnorm.fwd": lambda: torch.ops.rmsnorm.fwd(x, w, EPS),
    }
    return {name: round(call_us(fn, calls=2000), 2) for name, fn in calls.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--cpu", action="store_true", help="only the op's own host time on CPU (no kernel)")
    p.add_argument("--eager-only", action="store_true", help="skip the reduce-overhead rows")
    args = p.parse_args()
    if args.cpu:
        print(json.dumps(cpu_op_cost()))
        return
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
