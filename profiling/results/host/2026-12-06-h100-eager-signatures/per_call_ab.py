"""``F.rms_norm`` against ``torch_rmsnorm_op.rms_norm`` per eager forward call, no grad, at
128x257 fp32 and 4096x4096 bf16: 31 windows of 200 back-to-back calls each, the two taken in
turn, medians of the wall time (the window ends on a synchronize) and of the host time (the
clock stops before it). ``python per_call_ab.py ROOT`` imports the package from ROOT."""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, sys.argv[1])
import torch_rmsnorm_op as T  # noqa: E402

WINDOWS, CALLS = 31, 200


def per_call(m: int, n: int, dtype: torch.dtype) -> dict:
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
    fns = {"F": lambda: F.rms_norm(x, (n,), w, 1e-6), "T": lambda: T.rms_norm(x, (n,), w, 1e-6)}
    torch.testing.assert_close(fns["T"]().float(), fns["F"]().float(), atol=2e-2, rtol=2e-2)
    wall = {k: [] for k in fns}
    host = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            for _ in range(50):
                f()
        for _ in range(WINDOWS):
            for k, f in fns.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    f()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                host[k].append((t1 - t0) / CALLS * 1e6)
                wall[k].append((t2 - t0) / CALLS * 1e6)
    r = {f"{k} {kind}": round(statistics.median(v[k]), 2) for kind, v in (("wall", wall), ("host", host)) for k in fns}
    r["ratio wall"] = round(r["T wall"] / r["F wall"], 3)
    r["ratio host"] = round(r["T host"] / r["F host"], 3)
    return r


def main() -> None:
    T.set_fallback_policy("error")
    out = {"package": T.__file__}
    for m, n, dtype in ((128, 257, torch.float32), (4096, 4096, torch.bfloat16)):
        out[f"{m}x{n} {dtype}"] = per_call(m, n, dtype)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
