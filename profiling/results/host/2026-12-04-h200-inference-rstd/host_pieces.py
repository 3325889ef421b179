"""Host time per call of a compiled residual add + RMSNorm at 16 x 2,048 bf16 without grad
(default mode), and its pieces: the library's ``add_rms_norm`` compiled with the post-grad
pass (no rstd buffer: ``fusion.drop_unread_rstd``) and without it (rstd allocated and
written), Inductor's own fused add and norm, and ``x + r`` with ``h * 2``. Whole calls: 16
windows of 300 calls per graph, the graphs in turn. Pieces: each graph's kernel launch
(``CachingAutotuner.run`` with the arguments the graph passed it) alone, and the allocation
of a 16-element fp32 buffer, 16 windows of 2,000 each. Writes host-pieces.json and each
graph's generated code.

    OUT=DIR PYTHONPATH=. python host_pieces.py
"""
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch._inductor import config
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from torch._inductor.utils import run_and_get_code

import torch_rmsnorm_op as T
from torch_rmsnorm_op import fusion, static_launch

OUT = os.environ.get("OUT", ".")
M, N = 16, 2048
x, r = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
w = torch.rand(N, device="cuda", dtype=torch.bfloat16) + 0.5


def stock(x, r, w):
    h = x + r
    return F.rms_norm(h, (N,), w, 1e-6), h


def ours(x, r, w):
    return T.add_rms_norm(x, r, (N,), w, 1e-6)


def ours_rstd(x, r, w):  # a code object of its own, compiled apart from ``ours``
    return T.add_rms_norm(x, r, (N,), w, 1e-6)


def plain(x, r, w):
    h = x + r
    return h * 2, h


fusion.install()
static_launch.install()  # before the first compile starts Inductor's workers, as patching does
launches = {}  # graph: [(kernel, args, kwargs)] of one call
real_run = CachingAutotuner.run
recording = []


def recorded_run(self, *args, **kwargs):
    if recording:
        recording.append((self, args, kwargs))
    return real_run(self, *args, **kwargs)


CachingAutotuner.run = recorded_run
fns = {}
for name, f, post_grad in (("stock", stock, None), ("ours", ours, "installed"), ("ours-rstd", ours_rstd, None),
                           ("plain", plain, None)):
    with config.patch(post_grad_custom_post_pass=config.post_grad_custom_post_pass if post_grad else None):
        c = torch.compile(f, fullgraph=True)
        with torch.no_grad():
            _, codes = run_and_get_code(c, x, r, w)
    with open(os.path.join(OUT, f"code-{name}.txt"), "w") as fh:
        fh.write("\n\n# ---- next graph ----\n\n".join(codes))

    def call(c=c):
        with torch.no_grad():
            c(x, r, w)

    for _ in range(100):
        call()
    recording.append(None)
    call()
    launches[name] = recording[1:]
    recording.clear()
    fns[name] = call


def windows(fns, calls, rounds=16):
    times = {n: [] for n in fns}
    order = list(fns)
    for f in fns.values():
        for _ in range(200):
            f()
    for rnd in range(rounds):
        for name in (order if rnd % 2 == 0 else order[::-1]):
            f = fns[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            t1 = time.perf_counter()
            times[name].append((t1 - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return {n: {"us": round(statistics.median(v), 3), "windows": [round(t, 3) for t in v]} for n, v in times.items()}


results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [M, N],
           "calls": windows(fns, 300)}
pieces = {}
for name, recorded in launches.items():
    for i, (kernel, args, kwargs) in enumerate(recorded):
        pieces[f"{name}: launch {i} ({kernel.fn.__name__}, {len(args)} arguments)"] = (
            lambda kernel=kernel, args=args, kwargs=kwargs: kernel.run(*args, **kwargs))
pieces["allocate and free 16 fp32"] = lambda: torch.empty_strided((16,), (1,), dtype=torch.float32, device="cuda")
results["pieces"] = windows(pieces, 2000)
results["launchers"] = {name: [type(k.compile_results[0]).__name__ if k.compile_results else "?"
                               for k, _, _ in recorded] for name, recorded in launches.items()}
for section in ("calls", "pieces"):
    for name, v in results[section].items():
        print(f"{section:6} {v['us']:8.3f} us  {name}", flush=True)
print(results["launchers"])
json.dump(results, open(os.path.join(OUT, "host-pieces.json"), "w"), indent=1)
