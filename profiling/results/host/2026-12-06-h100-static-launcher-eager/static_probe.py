"""Per eager forward call: Triton 3.6's C launch against torch's static CUDA launcher for the
launch a plan keeps (run at cd04c3e, where ``_triton_compat._launcher`` takes ``static``).

Run: ``OUT=DIR python static_probe.py`` from the repository root; writes ``DIR/static-probe.json``.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import torch_rmsnorm_op as T  # noqa: E402
from torch_rmsnorm_op import _triton_compat, dispatch  # noqa: E402
from torch_rmsnorm_op.tools.benchmark import EPS, calls_us  # noqa: E402


def measure(m: int, n: int, dtype: torch.dtype) -> list[dict]:
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    with torch.no_grad():
        for _ in range(3):  # the JIT, the compiled kernel's launcher, the plan's kept launch
            T.rms_norm(x, (n,), w, EPS)
    plan = dispatch.forward_plan(x, w, store_rstd=False)
    static = plan.launcher
    triton_c = _triton_compat._launcher(static.compiled, static=False)
    print(m, n, "kept launch:", static.call.__qualname__, _triton_compat.static_parameters(static.compiled), flush=True)
    ys = []
    for launcher in (static, triton_c):
        plan.launcher = launcher
        with torch.no_grad():
            ys.append(T.rms_norm(x, (n,), w, EPS))
    assert torch.equal(ys[0], ys[1]), "the launchers' bits differ"
    grid3, sizes, tail = plan.replay
    y = torch.empty_like(x)
    args = [x.data_ptr(), None, w.data_ptr(), y.data_ptr(), None, None, *sizes, EPS, *tail]

    def ours(launcher):
        def call():
            plan.launcher = launcher
            return T.rms_norm(x, (n,), w, EPS)
        return call

    calls = {
        "F.rms_norm": lambda: F.rms_norm(x, (n,), w, EPS),
        "rms_norm, static launcher": ours(static),
        "rms_norm, Triton C launch": ours(triton_c),
        "launch alone, static launcher": lambda: static.call(*grid3, 0, *args),
        "launch alone, Triton C launch": lambda: triton_c.call(*grid3, 0, *triton_c.head, *args),
    }
    rounds = []
    for _ in range(4):
        rounds.append({k: round(v, 2) for k, v in calls_us(calls, calls=300, windows=7).items()})
        print(m, n, rounds[-1], flush=True)
    return rounds


out = {f"{m}x{n} {dtype}": measure(m, n, dtype)
       for m, n, dtype in [(128, 257, torch.float32), (4096, 4096, torch.bfloat16)]}
with open(os.path.join(os.environ.get("OUT", "/tmp"), "static-probe.json"), "w") as f:
    json.dump(out, f, indent=1)
