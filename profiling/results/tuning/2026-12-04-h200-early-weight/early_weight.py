"""GPU time of the single-pass forward with the weight loaded after the row's sum and before x
(``KernelConfig.early_weight``), at the table's configuration for each shape (``fit_to_rows``
applied), and what ``config.with_early_weight`` picks there. Forward without rstd (inference),
y in x's dtype; inputs rotating over up to 64 sets, 512 MiB in all where M allows; median of 5
windows of 20 launches by ``torch.profiler``, two rounds. The two orders give the same bits
(checked). ``norm_add`` rows time the norm-add kernel (``launch.forward_norm_add``, both
weights loaded first or both late; its pick is ``launch._norm_add_config``'s).

    OUT=DIR PYTHONPATH=. python early_weight.py        # writes DIR/early-weight.json
"""
import dataclasses
import datetime
import json
import os
import pathlib

import torch
import triton

from torch_rmsnorm_op import dispatch, launch
from torch_rmsnorm_op.tools.benchmark import gpu_us

BF16, FP32 = torch.bfloat16, torch.float32
ROTATE_BYTES = 512 << 20
CASES = [(m, n, "plain", BF16, BF16) for n in (128, 1536, 2048, 3584, 4096, 5120, 7168)
         for m in (16, 64, 132, 264, 528, 1024, 2048, 4096, 8192)]
CASES += [(m, n, "residual", BF16, BF16) for n in (2048, 4096, 5120, 7168) for m in (16, 132, 528, 2048, 8192)]
CASES += [(m, n, "plain", FP32, BF16) for n in (2048, 4096) for m in (16, 528, 2048, 8192)]
CASES += [(m, n, "plain", FP32, FP32) for n in (1024, 8192, 16384, 32768) for m in (16, 528, 2048)]
CASES += [(m, n, "norm_add", BF16, BF16) for n in (2048, 5120, 7168) for m in (16, 528, 2048, 8192)]
if not torch.cuda.is_available():  # a dry run of the machinery through the Triton interpreter
    CASES = [(3, 5120, "residual", BF16, BF16), (5, 2048, "norm_add", BF16, BF16), (2, 128, "plain", FP32, FP32)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NORM_ADD_CONFIG = launch._norm_add_config


def case(m: int, n: int, kind: str, wdt: torch.dtype, xdt: torch.dtype) -> dict:
    sets = max(1, min(64, ROTATE_BYTES // (m * n * xdt.itemsize * (2 if kind == "plain" else 4))))
    xs = [torch.randn(m, n, device=DEV, dtype=xdt) for _ in range(sets)]
    rs = [torch.randn(m, n, device=DEV, dtype=xdt) if kind != "plain" else None for _ in range(sets)]
    w = (torch.rand(n, device=DEV) + 0.5).to(wdt)
    xw = (torch.rand(n, device=DEV) + 0.5).to(wdt)
    y, h = torch.empty_like(xs[0]), torch.empty_like(xs[0])
    plan = dispatch.forward_plan(xs[0], w, None if kind == "norm_add" else rs[0], store_rstd=False)
    row = {"M": m, "N": n, "kind": kind, "x": str(xdt), "weight": str(wdt), "cfg": str(plan.cfg),
           "table_early_weight": (launch._norm_add_config(plan.cfg, m, xs[0].device) if kind == "norm_add"
                                  else plan.cfg).early_weight}
    if plan.cfg.split > 1 or plan.cfg.looped:
        return row | {"note": "looped or split: no single-pass forward"}
    it = iter(range(10**9))

    def run(early: bool, i: int) -> None:
        p = dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, early_weight=early), launcher=None)
        if kind == "norm_add":  # the launcher picks the kernel's order itself: forced here
            launch._norm_add_config = lambda *a: dataclasses.replace(NORM_ADD_CONFIG(*a), early_weight=early)
            try:
                launch.forward_norm_add(p, xs[i], rs[i], xw, w, 1e-6, 1e-6, y, h, None, None)
            finally:
                launch._norm_add_config = NORM_ADD_CONFIG
        else:
            launch.forward(p, xs[i], w, 1e-6, y, None, residual=rs[i], h=None if rs[i] is None else h)

    outs = {}
    for early in (False, True):
        run(early, 0)
        outs[early] = (y.clone(), h.clone())
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True], strict=True)), row
    steps = {"late": lambda: run(False, next(it) % sets), "early": lambda: run(True, next(it) % sets)}
    for _ in range(2):
        for name, step in steps.items():
            row.setdefault(f"{name}_us", []).append(round(gpu_us(step, 20, 5), 2))
    return row


def main() -> None:
    out = pathlib.Path(os.environ.get("OUT", "."))
    rows = []
    for c in CASES:
        rows.append(case(*c))
        print(json.dumps(rows[-1]), flush=True)
        (out / "early-weight.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter dry run)",
             "torch": torch.__version__, "triton": triton.__version__, "date": str(datetime.date.today()),
             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
