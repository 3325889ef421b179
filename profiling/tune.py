"""Sweep launch configurations on a GPU at the shapes models run: the input to ``config.py``.

For each job (pass, M, N) it times the table's configuration and candidates around it, after
checking each against the float64 reference, with the package's launchers
(``torch_rmsnorm_op.launch``) and, with ``--inductor``, Inductor's compiled ``F.rms_norm`` at
the same shape. Times are GPU time (the sum of the device durations of every kernel and memset
a step launched, from ``torch.profiler``; median of windows), inputs random and rotating over
enough sets that none is read from L2. Candidates compile in parallel worker processes first
(``--workers``), which fill Triton's cache for the timing process.

Passes: ``fwd`` and ``bwd`` (the backward alone), ``add_fwd`` / ``add_bwd`` (with the residual
add fused). A backward job may name the gradient terms its launch sums (``bwd:M:N:3``, 1 to 3,
as ``fusion.fuse_gradient_sums`` hands them to the kernel; the launch then takes the rows per
tile and row-loop stages ``launch.summed_gradient_consts`` gives, not the candidate's). ``pct`` is the byte floor (fwd:
read x, write y; add_fwd: read x and the residual, write y and the sum; bwd: read x and dy, each
term of dy, write dx; add_bwd: also read the sum's gradient) over the time, against the copy
ceiling measured in the same run. ``copy_pct``: a ``copy_`` of the
same bytes at the same size (half read, half written; rotating like the inputs), what streaming
alone reaches at this size, launch and tail included. ``max_err``: the max abs error of y (or dx)
against the float64 reference; ``dweight_rel_err`` (backward): dweight's, over its largest
element.

Run: ``python profiling/tune.py --out DIR [--jobs fwd:8192:4096,add_bwd:8192:2048:3,...] [--dtype bfloat16]
[--wdtype float32] [--inductor] [--inference] [--rounds R] [--table-only | --dw-columns | --prefetch]``; writes
``DIR/<tag>.json``.

A forward job times a training forward unless ``--inference``: ours writes rstd, and Inductor's
figure (``inductor_fwd_train``) is its compiled forward graph for inputs that require grad, which
saves what the backward reads. With ``--inference`` ours writes no rstd and Inductor's
(``inductor_fwd``) runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing
import os
import statistics
import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_rmsnorm_op import dispatch, launch, reference  # noqa: E402
from torch_rmsnorm_op.config import (  # noqa: E402
    KernelConfig,
    backward_config,
    fit_to_rows,
    forward_config,
    with_early_weight,
)

EPS = 1e-6
ROTATE_BYTES = 512 * 2**20  # over 8x the H200's 60 MB L2
DEVICE = "cuda"
REAL_MS = (16, 2048, 8192, 16384)
REAL_NS = (128, 2048, 3584, 4096, 5120, 7168, 8192)


def fwd_candidates(n: int, cfg: KernelConfig) -> list[KernelConfig]:
    """Whole rows per program (512-16K elements, 1-16 warps, at least 8 elements per thread;
    without masks where N is a power of two) and the looped form (1K-4K columns per step, 4-16
    warps; where N is not a power of two, also 512-2K columns per step that divide N, without
    masks)."""
    block = triton.next_power_of_2(n)
    exact = block == n
    out = []
    for rows, warps in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16)):
        if 512 <= rows * block <= 16384 and warps * 32 * 8 <= rows * block:
            out.append(KernelConfig(block, rows, warps, mask_free=exact))
    if n >= 2048:
        out += [KernelConfig(b, 1, w, looped=True, mask_free=n % b == 0)
                for b, w in ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (2048, 16), (4096, 4), (4096, 8), (4096, 16))
                if b <= block]
    # Where N is not a power of two, steps that divide it: every lane loads, no masks.
    if n != block:
        steps = ((512, 1), (512, 2), (512, 4), (1024, 2), (1024, 4), (1024, 8), (2048, 4))
        out += [KernelConfig(b, 1, w, looped=True, mask_free=True) for b, w in steps if n % b == 0 and b < n]
    return list(dict.fromkeys(out))


def bwd_candidates(n: int, cfg: KernelConfig) -> list[KernelConfig]:
    """Row tiles of 2K-16K elements, 4-16 warps, 1-8 programs per SM, each with both row-loop
    forms; the table's configuration with a second read of x and dy, and with its loads
    prefetched by Triton's pipeliner (stages 2); tiles of 1, 2 or 4 rows that load the next tile
    into registers ahead (``prefetch``)."""
    block = triton.next_power_of_2(n)
    out = [KernelConfig(block, tile // block, warps, 1, pps, counted_loop=counted)
           for tile, warps, pps, counted in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16), (1, 2, 4, 8),
                                                              (False, True))
           if tile >= block and warps * 32 * 4 <= tile]
    if cfg.split == 1:  # the table's row-loop variants (split mode has its own loop)
        loop = dataclasses.replace(cfg, prefetch=False)
        out += [dataclasses.replace(loop, reload=True), dataclasses.replace(loop, stages=2),
                dataclasses.replace(loop, stages=2, counted_loop=not cfg.counted_loop)]
    out += [KernelConfig(block, rows, warps, 1, pps, counted_loop=counted, prefetch=True)
            for rows, warps, pps, counted in itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 3, 4), (False, True))
            if 2048 <= rows * block <= 16384 and warps * 32 * 4 <= rows * block]
    return out


@dataclasses.dataclass
class Job:
    pass_name: str
    m: int
    n: int
    dtype: torch.dtype
    wdtype: torch.dtype
    terms: int = 1  # tensors the backward's dy sums
    store_rstd: bool = True  # forward jobs: write rstd, as a training forward does (False: an inference one)

    def __post_init__(self) -> None:
        if not 1 <= self.terms <= 3 or (self.terms > 1 and not self.backward):
            raise ValueError(f"job {self.name}: gradient terms are 1 to 3, and only for bwd/add_bwd")

    @property
    def name(self) -> str:
        return f"{self.pass_name}:{self.m}:{self.n}" + (f":{self.terms}" if self.terms > 1 else "")

    @property
    def backward(self) -> bool:
        return self.pass_name.endswith("bwd")

    @property
    def residual(self) -> bool:
        return self.pass_name.startswith("add")

    def floor_bytes(self) -> int:
        e = self.dtype.itemsize
        reads_writes = {"fwd": 2, "add_fwd": 4, "bwd": 3, "add_bwd": 4}[self.pass_name] + self.terms - 1
        return reads_writes * self.m * self.n * e


def set_count(job: Job) -> int:
    """How many input sets a job rotates through, so that no step reads what the steps just
    before it left in L2: ``ROTATE_BYTES`` over the job's byte floor, 1 to 64."""
    return max(1, min(64, -(-ROTATE_BYTES // job.floor_bytes())))


class Sets:
    """``count`` input sets for a job, random, never zeros, with the outputs they need."""

    def __init__(self, job: Job, count: int):
        self.items = []
        g = torch.Generator(device=DEVICE).manual_seed(0)
        for _ in range(count):
            x = torch.randn(job.m, job.n, device=DEVICE, dtype=job.dtype, generator=g)
            r = torch.randn_like(x) if job.residual else None
            w = (torch.rand(job.n, device=DEVICE, generator=g) + 0.5).to(job.wdtype)
            s = x if r is None else x + r
            _, rstd = reference.rms_norm_forward(s, w, EPS)
            self.items.append(dict(x=x, r=r, w=w, s=s, rstd=rstd, dy=torch.randn_like(x),
                                   dy_terms=tuple(torch.randn_like(x) for _ in range(job.terms - 1)),
                                   dres=torch.randn_like(x) if job.residual else None, y=torch.empty_like(x),
                                   h=torch.empty_like(x) if job.residual else None, dx=torch.empty_like(x),
                                   dw=torch.empty_like(w), rstd_out=torch.empty_like(rstd)))


def run_ours(job: Job, cfg: KernelConfig, item: dict) -> None:
    if job.backward:
        plan = dispatch.backward_plan(item["s"], item["w"], item["dy"].dtype)
        plan = dataclasses.replace(plan, cfg=cfg)
        launch.backward(plan, item["dy"], item["s"], item["w"], item["rstd"], item["dx"], item["dw"], item["dres"],
                        dy_terms=item["dy_terms"])
    else:
        plan = dispatch.forward_plan(item["x"], item["w"], item["r"])
        plan = dataclasses.replace(plan, cfg=cfg, launcher=None)
        launch.forward(plan, item["x"], item["w"], EPS, item["y"], item["rstd_out"] if job.store_rstd else None,
                       item["r"], item["h"])


def check(job: Job, item: dict) -> tuple[float, float | None]:
    """Max abs error of the outputs just written (y, or dx) against the float64 reference, and
    for a backward dweight's max abs error relative to its largest element (None forward)."""
    s64 = item["s"].double()
    if job.backward:
        # The terms' sum as the kernel takes it: in fp32, rounded once to dy's dtype.
        dy = sum((t.float() for t in item["dy_terms"]), item["dy"].float()).to(item["dy"].dtype).double()
        if job.residual:
            dx, dw = reference.add_rms_norm_backward(dy, item["dres"].double(), s64, item["w"].double(),
                                                     item["rstd"].double())
        else:
            dx, dw = reference.rms_norm_backward(dy, s64, item["w"].double(), item["rstd"].double())
        dw_err = (item["dw"].double() - dw).abs().max().item() / max(dw.abs().max().item(), 1e-30)
        return (item["dx"].double() - dx).abs().max().item(), dw_err
    y, _ = reference.rms_norm_forward(s64, item["w"].double(), EPS)
    return (item["y"].double() - y).abs().max().item(), None


def gpu_us(step, count: int, iters: int = 10, repeats: int = 3) -> float:
    """Median over windows of the GPU time per step; ``step(i)`` uses input set ``i % count``."""
    for i in range(3):
        step(i % count)
    if DEVICE == "cpu":  # a dry run through the interpreter: no GPU time to read
        return 1.0
    torch.cuda.synchronize()
    windows = []
    i = 0
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step(i % count)
                i += 1
            torch.cuda.synchronize()
        windows.append(sum(e.time_range.elapsed_us() for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA) / iters)
    return statistics.median(windows)


DW_COLUMNS = (0, 32, 64, 128, 256)


def dw_column_candidates(n: int, cfg: KernelConfig) -> list[KernelConfig]:
    """The backward configuration with dweight from its partial rows and the reduction (0), and
    from column programs of each width up to N's next power of two (``KernelConfig.dw_columns``)."""
    if cfg.split > 1:
        return [cfg]
    return [dataclasses.replace(cfg, dw_columns=c) for c in DW_COLUMNS if c <= triton.next_power_of_2(n)]


def candidates(job: Job, table: KernelConfig, table_only: bool, dw_columns: bool = False,
               prefetch: bool = False) -> list[KernelConfig]:
    if table_only:
        return [table]
    if prefetch and job.backward:
        return list(dict.fromkeys([table, *(c for c in bwd_candidates(job.n, table) if c.prefetch)]))
    if dw_columns and job.backward:
        return list(dict.fromkeys([table, *dw_column_candidates(job.n, table)]))
    if job.backward:
        return list(dict.fromkeys([table, *bwd_candidates(job.n, table)]))
    # Each forward candidate with the weight's load where the launcher would place it at this M.
    return list(dict.fromkeys([table, *(with_early_weight(c, job.m, torch.device(DEVICE))
                                        for c in fwd_candidates(job.n, table))]))


def _precompile(job: Job, cfgs: list[KernelConfig]) -> int:
    """Worker: run each config once (Triton compiles and caches it)."""
    item = Sets(job, 1).items[0]
    done = 0
    for cfg in cfgs:
        try:
            run_ours(job, cfg, item)
            done += 1
        except Exception:  # noqa: BLE001 - an unbuildable config shows up when timed
            pass
    return done


def inductor_us(job: Job, sets: Sets) -> float:
    """GPU time of Inductor's compiled ``F.rms_norm`` (the residual add before it for ``add_*``
    jobs) at ``job``. Its outputs rotate as ours do: each input set keeps the outputs of its last
    step (and the gradients its backward wrote) until it comes round again, so that the caching
    allocator cannot hand every step the block the step before wrote, lines of which L2 still
    holds."""
    torch._dynamo.reset()
    n = job.n

    def f(x, r, w):
        s = x if r is None else x + r
        y = torch.nn.functional.rms_norm(s, (n,), w, EPS)
        return y if r is None else (y, s)

    compiled = torch.compile(f, dynamic=False)
    items = sets.items
    kept: list = [None] * len(items)
    if not job.backward and not job.store_rstd:  # an inference forward
        def infer(i):
            kept[i] = None
            kept[i] = compiled(items[i]["x"], items[i]["r"], items[i]["w"])

        with torch.no_grad():
            return gpu_us(infer, len(items))
    leaves = [dict(x=it["x"].detach().requires_grad_(),
                   r=None if it["r"] is None else it["r"].detach().requires_grad_(),
                   w=it["w"].detach().requires_grad_()) for it in items]

    def step(i):
        lf, it = leaves[i], items[i]
        kept[i] = None
        for t in lf.values():
            if t is not None:
                t.grad = None
        out = compiled(lf["x"], lf["r"], lf["w"])
        if not job.backward:  # a training forward: the compiled forward graph, which saves what its backward reads
            kept[i] = out
            return
        grads = (it["dy"],) if lf["r"] is None else (it["dy"], it["dres"])
        outs = (out,) if lf["r"] is None else out
        torch.autograd.backward(outs, grads)

    return gpu_us(step, len(items))


def copy_ceiling() -> float:
    """The copy ceiling in GB/s: a 2 GiB bf16 ``copy_`` on the GPU, read and write counted."""
    src = torch.randn(1 << 30, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 4 * (1 << 30) / (gpu_us(lambda i: dst.copy_(src), 1) * 1e-6) / 1e9


def precompile(jobs: list[tuple[Job, list[KernelConfig]]], workers: int) -> None:
    """Compile every job's candidates in ``workers`` processes (Triton caches them on disk)."""
    tasks = [(job, cfgs[i::workers]) for job, cfgs in jobs for i in range(min(workers, len(cfgs)))]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(_precompile, *zip(*tasks)))


def tune(job: Job, cfgs: list[KernelConfig], copy_gbs: float, with_inductor: bool, rounds: int = 1) -> dict:
    """Time ``cfgs`` (the table's first) at ``job``. With ``rounds`` > 1 the candidates are timed
    that many times, in turn, every other round in reverse order, and each keeps its median: a
    kernel of a few microseconds timed first in a job ran up to 0.45 us slower than the same
    kernel timed later."""
    table = cfgs[0]
    per_set = job.floor_bytes()
    sets = Sets(job, set_count(job))
    checked = {}
    for cfg in cfgs:
        try:
            run_ours(job, cfg, sets.items[0])
            checked[cfg] = check(job, sets.items[0])
        except Exception as e:  # noqa: BLE001 - an unbuildable config is a data point
            print(f"  {cfg} failed: {repr(e)[:100]}", flush=True)
    times = {cfg: [] for cfg in checked}
    for r in range(rounds):
        for cfg in (list(times) if r % 2 == 0 else list(times)[::-1]):
            times[cfg].append(gpu_us(lambda i, cfg=cfg: run_ours(job, cfg, sets.items[i]), len(sets.items)))
    rows = []
    for cfg, (err, dw_err) in checked.items():
        us = statistics.median(times[cfg])
        rows.append(dict(us=us, pct=per_set / (us * 1e-6) / 1e9 / copy_gbs * 100, cfg=cfg.__dict__, max_err=err,
                         table=cfg == table, **({} if dw_err is None else {"dweight_rel_err": dw_err}),
                         **({"us_rounds": times[cfg]} if rounds > 1 else {})))
    rows.sort(key=lambda r: r["us"])
    out = dict(job=job.name, dtype=str(job.dtype), wdtype=str(job.wdtype), rows=rows)
    cur = next(r for r in rows if r["table"])
    line = (f"{out['job']:>20} best {rows[0]['pct']:5.1f}% {rows[0]['us']:8.2f}us {rows[0]['cfg']}  "
            f"table {cur['pct']:5.1f}% {cur['us']:8.2f}us")
    # A copy of the job's bytes at this size (read and write halves of the floor): what a
    # kernel that only streams them reaches here, launch and tail included.
    pairs = [(torch.empty(per_set // 4, device=DEVICE, dtype=torch.bfloat16).normal_(),
              torch.empty(per_set // 4, device=DEVICE, dtype=torch.bfloat16)) for _ in range(len(sets.items))]
    copy_us = gpu_us(lambda i: pairs[i][1].copy_(pairs[i][0]), len(pairs))
    out["copy_us"] = copy_us
    out["copy_pct"] = per_set / (copy_us * 1e-6) / 1e9 / copy_gbs * 100
    line += f"  copy {out['copy_pct']:5.1f}%"
    if with_inductor and job.terms == 1:  # Inductor's F.rms_norm receives dy as one tensor
        # For a backward job Inductor's figure is its forward + backward (the compiled graph's
        # kernels of both passes), against that byte floor.
        us = inductor_us(job, sets)
        floor = per_set
        if job.backward:
            floor = (8 if job.residual else 5) * job.m * job.n * job.dtype.itemsize
        key = "inductor_fwd_bwd" if job.backward else "inductor_fwd" if not job.store_rstd else "inductor_fwd_train"
        out[key + "_us"] = us
        out[key + "_pct"] = floor / (us * 1e-6) / 1e9 / copy_gbs * 100
        line += f"  {key} {out[key + '_pct']:5.1f}% {us:8.2f}us"
    print(line, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--tag", default="tune")
    p.add_argument("--jobs", default=",".join(f"{k}:{m}:{n}" for k in ("fwd", "bwd") for m in (8192,) for n in REAL_NS),
                   help="comma-separated pass:M:N[:terms] (pass fwd, bwd, add_fwd, add_bwd; terms: the "
                        "backward's dy summed from 1-3 tensors)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--wdtype", default="bfloat16")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--rounds", type=int, default=1,
                   help="time the candidates this many times in turn (alternating order), median of each")
    p.add_argument("--table-only", action="store_true", help="only the table's configuration")
    p.add_argument("--dw-columns", action="store_true",
                   help="backward jobs: only the table's configuration with each dweight column width "
                        "(0: partial rows and the reduction launch)")
    p.add_argument("--prefetch", action="store_true",
                   help="backward jobs: only the table's configuration and the candidates that load the next "
                        "tile ahead (KernelConfig.prefetch)")
    p.add_argument("--inductor", action="store_true",
                   help="also time Inductor's compiled F.rms_norm (forward jobs: its training forward, the "
                        "compiled forward graph of inputs that require grad, as ours writes rstd)")
    p.add_argument("--inference", action="store_true",
                   help="forward jobs as an inference forward: ours without the rstd store, Inductor's under "
                        "torch.no_grad()")
    p.add_argument("--dry-run", action="store_true", help="CPU through the Triton interpreter: checks, no timings")
    args = p.parse_args()
    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
        args.workers = 1
    os.makedirs(args.out, exist_ok=True)
    copy_gbs = copy_ceiling() if DEVICE == "cuda" else 1.0
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter dry run)"
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; copy ceiling {copy_gbs:.0f} GB/s",
          flush=True)
    results = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, copy_GBs=copy_gbs, jobs=[])
    jobs = []
    for spec in args.jobs.split(","):
        pass_name, m, n, *terms = spec.split(":")
        job = Job(pass_name, int(m), int(n), getattr(torch, args.dtype), getattr(torch, args.wdtype),
                  int(terms[0]) if terms else 1, store_rstd=not args.inference)
        # The configuration dispatch runs at this M (fewer rows per program where M is small).
        if job.backward:
            cfg = backward_config(job.n, job.dtype, job.m)
        else:
            cfg = forward_config(job.n, job.dtype, job.residual, job.m, job.wdtype)
        table = fit_to_rows(cfg, job.m, torch.device(DEVICE))
        if not job.backward:
            table = with_early_weight(table, job.m, torch.device(DEVICE))
        jobs.append((job, candidates(job, table, args.table_only, args.dw_columns, args.prefetch)))
    if args.workers > 1:
        precompile(jobs, args.workers)
    for job, cfgs in jobs:
        results["jobs"].append(tune(job, cfgs, copy_gbs, args.inductor, args.rounds))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        with open(os.path.join(args.out, args.tag + ".json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
