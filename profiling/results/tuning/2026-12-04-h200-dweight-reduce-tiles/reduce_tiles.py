"""GPU time of the backward with its dweight reduction: the table's (``launch.reduce_dweight``:
one launch, tiles by ``config.reduce_tile``), the reduction before it (tiles of 4,096 elements,
128 x 32 at many partial rows, and two launches, the first splitting the partial rows, where one
would leave fewer programs than half the SMs; its kernel is copied here), and one launch of fixed
tiles (rows x columns x warps). bf16 rows with a bf16 weight unless marked, inputs rotating past
the L2, 4 alternating rounds of 20 calls under torch.profiler, the median round;
``<variant>_reduce``: the reduction's launches alone. ``rmsnorm.add_bwd`` (the residual's gradient
added) at the shapes models run from N = 1,536, ``rmsnorm.bwd`` at N = 128 and at the benchmark's
256 MiB shapes. Each variant's dweight is checked against the table's (within 4 roundings of
dweight's dtype at its largest element).

    OUT=DIR PYTHONPATH=. python profiling/results/tuning/2026-12-04-h200-dweight-reduce-tiles/reduce_tiles.py
"""
import json
import os
import statistics

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from torch_rmsnorm_op import launch
from torch_rmsnorm_op.config import cdiv, next_power_of_2, sm_count

table = launch.reduce_dweight


@triton.jit
def _dw_reduce_split(PARTIAL, OUT, P, N, rows_per_split, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # The reduction's kernel before: program (column tile, split) sums its split's partial rows.
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1).to(tl.int64)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, rows_per_split, BLOCK_P):
        i = start + tl.arange(0, BLOCK_P)
        p = split * rows_per_split + i
        mask = ((i < rows_per_split) & (p < P))[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + p[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + split * N + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


def before_tile(rows):
    block_p = min(128, next_power_of_2(rows))
    return block_p, 4096 // block_p


def before_splits(partial_rows, n, device):
    sms = sm_count(device)
    if 2 * cdiv(n, before_tile(partial_rows)[1]) >= sms:
        return 1
    want = cdiv(2 * sms, cdiv(n, before_tile(32)[1]))
    splits = max(1, min(want, cdiv(partial_rows, 32)))
    return cdiv(partial_rows, cdiv(partial_rows, splits))


def _stage(partial, out, splits):
    p, n = partial.shape
    rows = cdiv(p, splits)
    block_p, block_n = before_tile(rows)
    _dw_reduce_split[(cdiv(n, block_n), splits)](partial, out, p, n, rows, BLOCK_P=block_p, BLOCK_N=block_n,
                                                 num_warps=4)


def before(partial, dweight, rows_bound=1, traced=False, kernels=None):
    p, n = partial.shape
    splits = before_splits(p, n, partial.device)
    if splits > 1:
        mid = torch.empty((splits, n), dtype=torch.float32, device=partial.device)
        _stage(partial, mid, splits)
        partial = mid
    _stage(partial, dweight.view(1, n), 1)


def fixed(block_p, block_n, warps):
    def reduce(partial, dweight, rows_bound=1, traced=False, kernels=None):
        p, n = partial.shape
        launch._launch(launch._kernels()._rms_norm_dw_reduce, (cdiv(n, block_n),), [partial, dweight, p, n],
                       dict(BLOCK_P=min(block_p, next_power_of_2(p)), BLOCK_N=block_n), warps, partial.device,
                       traced)
    return reduce


VARIANTS = {"table": table, "before": before}
for bp, bn, w in [(128, 32, 4), (128, 16, 4), (64, 16, 4), (128, 8, 4), (64, 8, 2), (256, 8, 4), (32, 32, 4),
                  (64, 32, 4)]:
    VARIANTS[f"one-{bp}x{bn}x{w}"] = fixed(bp, bn, w)


def gpu_us(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    by = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name] = by.get(e.name, 0.0) + e.device_time / iters
    return by


out = []
MODEL_SHAPES = [(8192, 2048), (16384, 2048), (2048, 2048), (1024, 2048), (8192, 1536), (8192, 3584),
                (8192, 4096), (8192, 5120), (16384, 4096), (8192, 128), (131072, 128)]
SWEEP_SHAPES = [(524288, 256), (131072, 1024), (32768, 4096), (16384, 8192), (8192, 16384), (2048, 65536),
                (512, 262144)]
SWEEP_FP32 = [(65536, 1024), (16384, 4096), (1024, 65536)]
CASES = ([(m, n, torch.bfloat16, n >= 1536) for m, n in MODEL_SHAPES]
         + [(m, n, torch.bfloat16, False) for m, n in SWEEP_SHAPES]
         + [(m, n, torch.float32, False) for m, n in SWEEP_FP32])
for m, n, dtype, add in CASES:
    sets = min(8, max(1, (512 << 20) // (4 * m * n * dtype.itemsize)))
    data = []
    for _ in range(sets):
        h = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
        if add:
            _, _, rstd = torch.ops.rmsnorm.add_fwd(h, torch.zeros_like(h), w, 1e-6)
            data.append((torch.randn_like(h), torch.randn_like(h), h, w, rstd))
        else:
            _, rstd = torch.ops.rmsnorm.fwd(h, w, 1e-6)
            data.append((torch.randn_like(h), None, h, w, rstd))
    it = [0]

    def step(data=data, it=it, sets=sets, add=add):
        d = data[it[0] % sets]
        it[0] += 1
        if add:
            return torch.ops.rmsnorm.add_bwd(d[0], d[1], d[2], d[3], d[4])
        return torch.ops.rmsnorm.bwd(d[0], d[2], d[3], d[4])

    ref = None
    res = {}
    for rnd in range(4):
        for name in (VARIANTS if rnd % 2 == 0 else list(VARIANTS)[::-1]):
            launch.reduce_dweight = VARIANTS[name]
            if rnd == 0:  # every variant's dweight of the first input set, against the table's
                it[0] = 0
                dw = step()[1].float()
                ref = dw if ref is None else ref
                tol = 4 * torch.finfo(dtype).eps * ref.abs().max()
                assert (dw - ref).abs().max() <= tol, (m, n, name, (dw - ref).abs().max().item(), tol.item())
            res.setdefault(name, []).append(gpu_us(step))
    launch.reduce_dweight = table
    row = {"M": m, "N": n, "dtype": str(dtype).removeprefix("torch."), "op": "add_bwd" if add else "bwd"}
    for name, runs in res.items():
        row[name] = round(statistics.median(sum(b.values()) for b in runs), 2)
        row[name + "_reduce"] = round(statistics.median(
            sum(v for k, v in b.items() if "dw_reduce" in k) for b in runs), 2)
    print(json.dumps(row), flush=True)
    out.append(row)
    del data
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "rows": out},
          open(os.path.join(os.environ.get("OUT", "."), "reduce-tiles.json"), "w"), indent=1)
