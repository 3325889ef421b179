"""Probe: where ptxas puts the weight's loads in the single-pass forward, and what moves them.

The table's forward at N = 7,168 (one row of an 8,192-column block a program, 4 warps, the
weight loaded before x: ``early_weight``) runs faster storing rstd than not (56.65 against 57.74
µs at 8,192 rows). Compiled without the rstd store, the kernel takes 128 registers and ptxas
issues 6 of the weight's 8 vector loads after the row's warp-level sum, so their latency sits
between the sum and y's store; with the store, 117 registers and every load before the sum
(SASS of ``_rms_norm_fwd_rows``, Triton 3.6, sm_90a). This probe times the same kernel (bf16,
the table's block, rows and warps for each shape, no residual) under variants that might keep
the loads first without a store nothing reads:

- ``plain``: the table's tiles with the weight loaded first, no rstd; ``rstd``: rstd stored;
- ``volatile``, ``evict_last``, ``cg``: the weight loaded with that flag or cache hint;
- ``maxnreg168``, ``maxnreg128``: the launch's register cap;
- ``barrier``: ``tl.debug_barrier()`` after the loads (ptxas moves no load across it);
  ``barrier_rstd``: that and the rstd store.

The kernel is the table's single-pass forward cut down to contiguous bf16 rows (``table``, the
package's own launch, is timed beside it): compare the variants with ``plain``. GPU time as
``profiling/tune.py`` takes it (``tune.gpu_us`` over ``tune.Sets``' rotating inputs),
each variant's output checked against ``F.rms_norm`` in fp32. Run: ``python
profiling/fwd_weight_schedule_probe.py --out DIR [--shapes 2048x7168,...]``; on CPU (``--dry-run``,
the Triton interpreter) it checks the variants' outputs only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune  # noqa: E402

from torch_rmsnorm_op import dispatch  # noqa: E402

EPS = 1e-6


@triton.jit
def _fwd_weight_first(X, W, Y, RSTD, M, N, eps, stride, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                      UNMASKED: tl.constexpr, LOAD: tl.constexpr, STORE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    if UNMASKED:
        row_mask, col_mask, mask, other = None, None, None, None
    else:
        row_mask, col_mask, other = rows < M, cols < N, 0.0
        mask = row_mask[:, None] & col_mask[None, :]
    if LOAD == 2:
        w = tl.load(W + cols, mask=col_mask, other=other, volatile=True)
    elif LOAD == 3:
        w = tl.load(W + cols, mask=col_mask, other=other, eviction_policy="evict_last")
    elif LOAD == 4:
        w = tl.load(W + cols, mask=col_mask, other=other, cache_modifier=".cg")
    else:
        w = tl.load(W + cols, mask=col_mask, other=other)
    x = tl.load(X + rows[:, None] * stride + cols[None, :], mask=mask, other=other)
    if LOAD == 7:
        tl.debug_barrier()
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = (x * rstd[:, None]) * w.to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE:
        tl.store(RSTD + rows, rstd, mask=row_mask)


# name: (LOAD, the launch's maxnreg or None, STORE)
VARIANTS = {"plain": (0, None, False), "rstd": (0, None, True), "volatile": (2, None, False),
            "evict_last": (3, None, False), "cg": (4, None, False), "maxnreg168": (0, 168, False),
            "maxnreg128": (0, 128, False), "barrier": (7, None, False), "barrier_rstd": (7, None, True)}


def run_variant(item: dict, cfg, variant: str, m: int, n: int) -> None:
    """y (and rstd where the variant stores it) for ``item``'s x and weight, in ``cfg``'s tiles."""
    load, maxnreg, store = VARIANTS[variant]
    options = dict(num_warps=cfg.num_warps)
    if maxnreg and item["x"].is_cuda:
        options["maxnreg"] = maxnreg
    unmasked = cfg.mask_free and m % cfg.rows == 0 and cfg.block_n == n
    _fwd_weight_first[(triton.cdiv(m, cfg.rows),)](
        item["x"], item["w"], item["y"], item["rstd_out"], m, n, EPS, n, BLOCK_N=cfg.block_n, ROWS=cfg.rows,
        UNMASKED=unmasked, LOAD=load, STORE=store, **options)


def probe_shape(m: int, n: int) -> dict:
    """GPU time (µs) of the table's forward and of every variant at M x N, bf16, no rstd."""
    job = tune.Job("fwd", m, n, torch.bfloat16, torch.bfloat16, store_rstd=False)
    count = tune.set_count(job)
    items = tune.Sets(job, count).items
    cfg = dispatch.forward_plan(items[0]["x"], items[0]["w"]).cfg
    row = {"cfg": str(cfg)}
    if cfg.looped or cfg.split > 1:
        return row  # not the single-pass forward
    row["table"] = tune.gpu_us(lambda i: tune.run_ours(job, cfg, items[i]), count)
    want = torch.nn.functional.rms_norm(items[0]["x"].float(), (n,), items[0]["w"].float(), EPS)
    for variant in VARIANTS:
        run_variant(items[0], cfg, variant, m, n)
        err = (items[0]["y"].float() - want).abs().max().item()
        if err > 0.05:
            raise AssertionError(f"{m}x{n} {variant}: max error {err}")
        row[variant] = tune.gpu_us(lambda i, v=variant: run_variant(items[i], cfg, v, m, n), count, repeats=5)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shapes", default="2048x7168,8192x7168,16384x7168,2048x2048,8192x2048,16384x2048,"
                                       "2048x3584,8192x3584,2048x5120,16x7168")
    p.add_argument("--dry-run", action="store_true", help="CPU through the Triton interpreter: checks, no timings")
    a = p.parse_args()
    if a.dry_run:
        tune.DEVICE = "cpu"
    os.makedirs(a.out, exist_ok=True)
    results = {}
    for shape in a.shapes.split(","):
        m, n = map(int, shape.split("x"))
        results[shape] = probe_shape(m, n)
        print(shape, {k: round(v, 2) if isinstance(v, float) else v for k, v in results[shape].items()}, flush=True)
    with open(os.path.join(a.out, "fwd-weight-schedule-probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
