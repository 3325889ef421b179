"""Benchmark: our ops vs Inductor's compiled nn.RMSNorm vs eager F.rms_norm, with the copy ceiling.

What each number is:
- ``us``: on CUDA, GPU time per iteration: the sum of the device durations of
  every kernel, memset and memcpy the step launched (``torch.profiler``),
  median of ``repeats`` profiled windows of ``iters`` iterations, after
  warm-up; CPU launch gaps are not counted. On CPU (``--smoke``: tiny shapes,
  kernels through the Triton interpreter) it is wall-clock time and **not a
  GPU timing**: a smoke test of the machinery only.
- ``GBs``: the byte floor over ``us``: forward reads x and writes y
  (2*M*N*elem); forward+backward adds reading x and dy and writing dx
  (5*M*N*elem). Weight, rstd and dweight bytes are not counted.
- ``pct_of_copy``: GBs over the device-to-device copy bandwidth measured in
  the same run (a 2 GiB bf16 copy, read + write counted).
- ``peak_extra_MiB`` (fwd+bwd rows): max_memory_allocated during one step
  above what was allocated before it.
- ``kernels_us`` (CUDA): that time by kernel name, per iteration, from the
  median window (so its sum can differ slightly from ``us``, the median of
  the windows' totals).
- ``call_us`` (latency row only): wall time per eager call, host side, for
  back-to-back calls (CPU-bound at this size).

Inputs are random, never zeros. Shapes that fit in L2 rotate among several
input sets. Run: ``python -m torch_rmsnorm_op bench`` (or ``python
profiling/bench.py``), which writes into ``runs/bench/`` (ignored by git; ``--out
DIR`` elsewhere, such as a new folder under ``profiling/results/`` for results to
keep). Output: ``<date>-<gpu>.json`` with
``{"gpu", "torch", "triton", "date", "copy_GBs", "rows": [...]}``, a Markdown
table and a PNG chart beside it.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import torch_rmsnorm_op as T

EPS = 1e-6
L2_BYTES = 60 * 2**20
BANDWIDTH_BYTES = 256 * 2**20  # x alone: far past the 60 MiB L2, so HBM is what is measured
KERNEL_NAME_CHARS = 80  # kernel names as the breakdown keys them (C++ templates run long)


def gpu_us(step, iters: int, repeats: int, kernels: dict[str, float] | None = None) -> float:
    """Median over ``repeats`` windows of the per-iteration time (GPU time on CUDA, wall time on CPU).
    On CUDA, ``kernels`` (if given) receives the median window's time per iteration by kernel name
    (memsets and memcpys included): where the step's GPU time goes."""
    for _ in range(3):
        step()
    if not torch.cuda.is_available():
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            samples.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(samples)
    torch.cuda.synchronize()
    windows = []
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
        by_name: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.name[:KERNEL_NAME_CHARS]
                by_name[name] = by_name.get(name, 0.0) + e.time_range.elapsed_us()
        windows.append((sum(by_name.values()) / iters, by_name))
    windows.sort(key=lambda w: w[0])
    _, by_name = windows[(len(windows) - 1) // 2]  # the median window (the lower one of an even count)
    if kernels is not None:
        kernels.update({name: round(us / iters, 2) for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])})
    return statistics.median(w[0] for w in windows)


def copy_ceiling(iters: int, repeats: int, device: str, numel: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, read + write counted, GB/s."""
    a = torch.randn(numel, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    us = gpu_us(lambda: b.copy_(a), iters, repeats)
    return 2 * numel * 2 / (us * 1e-6) / 1e9


SMOKE_SHAPES = [(64, 256, torch.float32), (128, 257, torch.float32)]


def shapes(quick: bool) -> list[tuple[int, int, torch.dtype]]:
    ns = [256, 1024, 4096, 8192, 16384, 32768, 65536, 262144]
    if quick:
        ns = [1024, 4096, 32768, 262144]
    out = [(BANDWIDTH_BYTES // (n * 2), n, torch.bfloat16) for n in ns]
    for dt in (torch.float16, torch.float32):
        for n in ([1024, 4096, 65536] if not quick else [4096]):
            out.append((BANDWIDTH_BYTES // (n * torch.tensor([], dtype=dt).element_size()), n, dt))
    out.append((128, 257, torch.float32))  # the tutorial's shape: latency
    return out


def implementations(n: int, dtype: torch.dtype, device: str):
    module = nn.RMSNorm(n, eps=EPS, device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    torch._dynamo.reset()
    inductor = torch.compile(module, dynamic=False)
    w = module.weight
    return {
        "ours": lambda x: T.rms_norm(x, (n,), w, EPS),
        "inductor": inductor,
        "eager": lambda x: F.rms_norm(x, (n,), w, EPS),
    }, w


def bench_shape(m, n, dtype, iters, repeats, copy_gbs, device="cuda"):
    elem = torch.tensor([], dtype=dtype).element_size()
    sets = max(1, min(8, (4 * L2_BYTES) // max(1, 2 * m * n * elem))) if m * n * elem < L2_BYTES else 1
    xs = [torch.randn(m, n, device=device, dtype=dtype) for _ in range(sets)]
    dys = [torch.randn(m, n, device=device, dtype=dtype) for _ in range(sets)]
    impls, w = implementations(n, dtype, device)
    rows = []
    for name, fn in impls.items():
        it = iter(range(10**12))

        xg = [x.detach().clone().requires_grad_(True) for x in xs]

        def fwd(fn=fn, it=it):
            with torch.no_grad():
                fn(xs[next(it) % sets])

        def fwd_bwd(fn=fn, it=it, xg=xg):
            i = next(it) % sets
            xg[i].grad = None
            w.grad = None
            fn(xg[i]).backward(dys[i])

        for pass_name, step, floor in (("fwd", fwd, 2), ("fwd+bwd", fwd_bwd, 5)):
            rec = {"M": m, "N": n, "dtype": str(dtype).removeprefix("torch."), "impl": name, "pass": pass_name}
            try:
                kernels: dict[str, float] = {}
                us = gpu_us(step, iters, repeats, kernels)
                gbs = floor * m * n * elem / (us * 1e-6) / 1e9
                rec.update(us=round(us, 2), GBs=round(gbs, 1), pct_of_copy=round(100 * gbs / copy_gbs, 1))
                if kernels:
                    rec["kernels_us"] = kernels
                if pass_name == "fwd+bwd" and device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    rec["peak_extra_MiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            except Exception as e:  # a failing implementation is a result, not a crash
                rec["error"] = repr(e)[:300]
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    return rows


def call_us(fn, calls: int = 200, windows: int = 5) -> float:
    """Wall time per call, host side, for back-to-back calls (after warm-up): the median over
    ``windows`` windows of ``calls`` calls (a shared host's noise moves single windows)."""
    return calls_us({"fn": fn}, calls, windows)["fn"]


def calls_us(fns: dict, calls: int = 200, windows: int = 5) -> dict[str, float]:
    """``call_us`` of each of ``fns`` (name: function), their windows taken in turn, so that a
    host whose load drifts during the measurement weighs on each of them alike."""
    samples = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(20):
                fn()
        for _ in range(windows):
            for name, fn in fns.items():
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


LATENCY_SHAPES = [(128, 257, torch.float32), (4096, 4096, torch.bfloat16)]


def cuda_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn()`` captured in a ``torch.cuda.CUDAGraph`` (after one warm-up call): ``.replay()``
    costs the launch of the captured kernels and nothing of the Python that issued them."""
    graph = torch.cuda.CUDAGraph()
    fn()
    with torch.cuda.graph(graph):
        fn()
    return graph


def latency_rows(m: int, n: int, dtype: torch.dtype, device: str = "cuda") -> list[dict]:
    """Per-call cost of one forward: ours and ``F.rms_norm`` eager; ours and Inductor's
    ``F.rms_norm`` compiled with ``mode="reduce-overhead"`` (CUDA graphs); a replay of our call
    captured in a ``torch.cuda.CUDAGraph``; ``x * 2`` compiled the same way (what any
    reduce-overhead call costs); and our kernels' GPU time alone."""
    x = torch.randn(m, n, device=device, dtype=dtype)
    w = torch.rand(n, device=device, dtype=dtype) + 0.5
    ours = lambda: T.rms_norm(x, (n,), w, EPS)  # noqa: E731
    fns = {"ours": ours, "eager": lambda: F.rms_norm(x, (n,), w, EPS), "ours CUDAGraph.replay": cuda_graph(ours).replay}
    base = {"M": m, "N": n, "dtype": str(dtype).removeprefix("torch."), "pass": "call"}
    # Windows in turn, and more of them than call_us's default: the eager rows differ by a few µs
    # on a host whose load moves them by more than that.
    rows = [dict(base, impl=name, call_us=round(us, 2)) for name, us in calls_us(fns, windows=11).items()]
    # "x * 2": a graph without any norm, the floor of a reduce-overhead call on this host.
    for name, fn in (("ours", T.rms_norm), ("Inductor", F.rms_norm), ("x * 2", None)):
        torch._dynamo.reset()
        graphed = torch.compile((lambda x: x * 2) if fn is None else (lambda x, fn=fn: fn(x, (n,), w, EPS)),
                                mode="reduce-overhead", dynamic=False)
        us = call_us(lambda graphed=graphed: graphed(x))
        rows.append(dict(base, impl=f"{name} reduce-overhead", call_us=round(us, 2)))
    with torch.no_grad():
        rows.append(dict(base, impl="ours kernel", call_us=round(gpu_us(fns["ours"], 20, 5), 2)))
    print(json.dumps(rows), flush=True)
    return rows


def write_results(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    gpu = "".join(c if c.isalnum() or c in "-_." else "-" for c in result["gpu"])
    stem = os.path.join(out_dir, f"{result['date']}-{gpu}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# RMSNorm benchmark on {result['gpu']}",
        "",
        f"torch {result['torch']}, Triton {result['triton']}, {result['date']}. Copy ceiling measured in this run: "
        f"**{result['copy_GBs']:.0f} GB/s**. " + result["timing"] + " % = byte floor "
        "(fwd 2·M·N·elem, fwd+bwd 5·M·N·elem) / time / copy ceiling.",
        "",
        "| M×N dtype | pass | ours µs | ours % | Inductor µs | Inductor % | eager µs | eager % | ours vs Inductor |"
        " peak extra MiB (ours / Inductor / eager) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keyed = {(r["M"], r["N"], r["dtype"], r["pass"], r["impl"]): r for r in result["rows"]}
    seen = []
    for r in result["rows"]:
        k = (r["M"], r["N"], r["dtype"], r["pass"])
        if k in seen or r["pass"] == "call":
            continue
        seen.append(k)
        cells = {i: keyed.get(k + (i,), {}) for i in ("ours", "inductor", "eager")}
        speed = (cells["inductor"].get("us", 0) / cells["ours"]["us"]) if cells["ours"].get("us") else 0
        peaks = " / ".join(str(cells[i].get("peak_extra_MiB", "–")) for i in cells)
        lines.append(
            f"| {k[0]}×{k[1]} {k[2]} | {k[3]} | "
            + " | ".join(f"{cells[i].get('us', 'err')} | {cells[i].get('pct_of_copy', 'err')}" for i in cells)
            + f" | {speed:.2f}× | {peaks if k[3] == 'fwd+bwd' else ''} |"
        )
    calls = [r for r in result["rows"] if "call_us" in r]
    if calls:
        lines += ["", "Per-call wall time of a forward (host side, back-to-back calls, no grad); "
                  "`ours kernel` is the GPU time of our kernels alone for the same call:", ""]
        lines += [f"- {r['M']}×{r['N']} {r['dtype']} {r['impl']}: {r['call_us']} µs" for r in calls]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        dtypes = [r["dtype"] for r in result["rows"]]
        plot_dtype = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, pass_name in zip(axes, ("fwd", "fwd+bwd")):
            for impl in ("ours", "inductor", "eager"):
                pts = sorted((r["N"], r["pct_of_copy"]) for r in result["rows"]
                             if r["impl"] == impl and r["pass"] == pass_name and r["dtype"] == plot_dtype
                             and "pct_of_copy" in r)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{plot_dtype} {pass_name}")
            ax.set_xlabel("N")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("% of copy ceiling")
        axes[0].legend()
        fig.suptitle(f"RMSNorm on {result['gpu']} (torch {result['torch']}, Triton {result['triton']}, "
                     f"{result['date']})")
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
    return stem


def run(out_dir: str, iters: int = 20, repeats: int = 5, quick: bool = False, smoke: bool = False) -> str:
    """Run the sweep (``smoke``: tiny shapes, also on CPU), write the results; returns the path stem."""
    import triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not smoke:
        raise RuntimeError("the full benchmark needs a CUDA GPU; use --smoke on CPU")
    torch._dynamo.config.recompile_limit = 1000
    if smoke:
        iters, repeats = min(iters, 2), 1
    copy_gbs = copy_ceiling(iters, repeats, device, numel=1 << (24 if smoke else 30))
    print(f"copy ceiling: {copy_gbs:.0f} GB/s", flush=True)
    timing = ("GPU time per step from torch.profiler device events (median)." if device == "cuda" else
              "**CPU smoke run through the Triton interpreter: wall-clock times, not GPU timings.**")
    result = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter",
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "copy_GBs": round(copy_gbs, 1), "timing": timing,
        "rows": [], "dispatch_stats": {},
    }
    plan = SMOKE_SHAPES if smoke else shapes(quick)
    for i, (m, n, dt) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {m}x{n} {str(dt).removeprefix('torch.')}", flush=True)
        result["rows"] += bench_shape(m, n, dt, iters, repeats, copy_gbs, device)
        result["dispatch_stats"] = T.dispatch_stats()
        write_results(result, out_dir)  # after every shape: a run cut short keeps what it measured
        if device == "cuda":
            torch.cuda.empty_cache()
    for m, n, dt in LATENCY_SHAPES if device == "cuda" and not smoke else []:
        result["rows"] += latency_rows(m, n, dt)
    return write_results(result, out_dir)
