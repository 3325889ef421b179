"""Benchmark: our ops vs Inductor's compiled nn.RMSNorm vs eager F.rms_norm, with the copy ceiling.

What each number is:
- ``us``: GPU time per iteration, the sum of the device durations of every
  kernel, memset and memcpy the step launched (``torch.profiler``), median of
  ``--repeats`` profiled windows of ``--iters`` iterations, after warm-up. CPU
  launch gaps are not counted.
- ``GBs``: the byte floor over ``us``: forward reads x and writes y
  (2*M*N*elem); forward+backward adds reading x and dy and writing dx
  (5*M*N*elem). Weight, rstd and dweight bytes are not counted.
- ``pct_of_copy``: GBs over the device-to-device copy bandwidth measured in
  the same run (a 2 GiB bf16 copy, read + write counted).
- ``peak_extra_MiB`` (fwd+bwd rows): max_memory_allocated during one step
  above what was allocated before it.
- ``call_us`` (latency row only): wall time per eager call, host side, for
  back-to-back calls (CPU-bound at this size).

Inputs are random, never zeros. Shapes that fit in L2 rotate among several
input sets. Run on a GPU: ``python profiling/bench.py --out profiling/results``.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_rmsnorm_op as T  # noqa: E402

EPS = 1e-6
L2_BYTES = 60 * 2**20
BANDWIDTH_BYTES = 256 * 2**20  # x alone; >= 128 MiB as the spec asks


def gpu_us(step, iters: int, repeats: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
        total = sum(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
        samples.append(total / iters)
    return statistics.median(samples)


def copy_ceiling(iters: int, repeats: int) -> float:
    a = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    us = gpu_us(lambda: b.copy_(a), iters, repeats)
    return 2 * (1 << 30) * 2 / (us * 1e-6) / 1e9


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


def implementations(n: int, dtype: torch.dtype):
    module = nn.RMSNorm(n, eps=EPS, device="cuda", dtype=dtype)
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


def bench_shape(m, n, dtype, iters, repeats, copy_gbs):
    elem = torch.tensor([], dtype=dtype).element_size()
    sets = max(1, min(8, (4 * L2_BYTES) // max(1, 2 * m * n * elem))) if m * n * elem < L2_BYTES else 1
    xs = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
    dys = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
    impls, w = implementations(n, dtype)
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
                us = gpu_us(step, iters, repeats)
                gbs = floor * m * n * elem / (us * 1e-6) / 1e9
                rec.update(us=round(us, 2), GBs=round(gbs, 1), pct_of_copy=round(100 * gbs / copy_gbs, 1))
                if pass_name == "fwd+bwd":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    rec["peak_extra_MiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
                if m * n < 1 << 16 and pass_name == "fwd":
                    with torch.no_grad():
                        for _ in range(20):
                            fn(xs[0])
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(200):
                            fn(xs[0])
                        rec["call_us"] = round((time.perf_counter() - t0) / 200 * 1e6, 2)
                        torch.cuda.synchronize()
            except Exception as e:  # a failing implementation is a result, not a crash
                rec["error"] = repr(e)[:300]
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    return rows


def write_results(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    gpu = result["gpu"].replace(" ", "-")
    stem = os.path.join(out_dir, f"{result['date']}-{gpu}-bench")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        f"# RMSNorm benchmark on {result['gpu']}",
        "",
        f"torch {result['torch']}, Triton {result['triton']}, {result['date']}. Copy ceiling measured in this run: "
        f"**{result['copy_GBs']:.0f} GB/s**. GPU time per step from torch.profiler (median); % = byte floor "
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
        if k in seen:
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
        lines += ["", "Eager per-call wall time (host side, back-to-back calls):", ""]
        lines += [f"- {r['M']}×{r['N']} {r['dtype']} {r['impl']}: {r['call_us']} µs" for r in calls]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, pass_name in zip(axes, ("fwd", "fwd+bwd")):
            for impl in ("ours", "inductor", "eager"):
                pts = sorted((r["N"], r["pct_of_copy"]) for r in result["rows"]
                             if r["impl"] == impl and r["pass"] == pass_name and r["dtype"] == "bfloat16"
                             and "pct_of_copy" in r)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"bf16 {pass_name}")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="profiling/results")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch._dynamo.config.recompile_limit = 1000
    import triton

    copy_gbs = copy_ceiling(args.iters, args.repeats)
    print(f"copy ceiling: {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for m, n, dt in shapes(args.quick):
        rows += bench_shape(m, n, dt, args.iters, args.repeats, copy_gbs)
        torch.cuda.empty_cache()
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.date.today().isoformat(), "copy_GBs": round(copy_gbs, 1), "rows": rows,
        "dispatch_stats": T.dispatch_stats(),
    }
    stem = write_results(result, args.out)
    print(open(stem + ".md").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
