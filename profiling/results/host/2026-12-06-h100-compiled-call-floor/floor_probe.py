"""The per-call floor of a compiled call against a CUDA-graph replay, at 128x257 fp32, no grad.

Rows, timed in interleaved windows (``benchmark.calls_us``: 31 windows of 200 back-to-back
calls, each window ending on a synchronize; medians, µs a call):
- ``torch.cuda.CUDAGraph`` replay of our eager ``rms_norm`` call;
- ``torch.compile`` with a backend that returns a precomputed output (the frame's guards and
  Dynamo's call, nothing else), for ``rms_norm``, ``F.rms_norm`` and ``x * 2``;
- ``torch.compile(mode="reduce-overhead")`` of the same three, and of ours with the input marked
  static (``torch._dynamo.mark_static_address``: no copy into the graph's buffer);
and the cudagraph skip counter of each reduce-overhead graph.

Run on a CUDA machine: ``python floor_probe.py > DIR/floor.json``.
"""

import json

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import torch_rmsnorm_op as T
from torch_rmsnorm_op.tools.benchmark import calls_us, cuda_graph

EPS, M, N = 1e-6, 128, 257
WINDOWS, CALLS = 31, 200


def main() -> None:
    T.set_fallback_policy("error")
    x = torch.randn(M, N, device="cuda")
    w = torch.rand(N, device="cuda") + 0.5
    bodies = {
        "rms_norm": lambda x: T.rms_norm(x, (N,), w, EPS),
        "F.rms_norm": lambda x: F.rms_norm(x, (N,), w, EPS),
        "x * 2": lambda x: x * 2,
    }
    done = torch.empty_like(x)

    def precomputed(gm, example_inputs):
        return lambda *args: (done,)

    calls, skips = {}, {}
    graph = cuda_graph(lambda: T.rms_norm(x, (N,), w, EPS))
    calls["torch.cuda.CUDAGraph replay of our call"] = graph.replay
    for name, body in bodies.items():
        compiled = torch.compile(body, backend=precomputed, dynamic=False)
        calls[f"compiled, precomputed output: {name}"] = lambda compiled=compiled: compiled(x)
    static_x = x.clone()
    torch._dynamo.mark_static_address(static_x)
    for name, body, arg in [*((n, b, x) for n, b in bodies.items()), ("rms_norm, static input", bodies["rms_norm"],
                                                                        static_x)]:
        counters.clear()
        compiled = torch.compile(body, mode="reduce-overhead", dynamic=False)
        with torch.no_grad():
            for _ in range(5):
                compiled(arg)
        skips[name] = counters["inductor"]["cudagraph_skips"]
        calls[f"reduce-overhead: {name}"] = lambda compiled=compiled, arg=arg: compiled(arg)
    per_call = calls_us(calls, calls=CALLS, windows=WINDOWS)
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": f"{M}x{N} float32",
        "call_us": {name: round(us, 2) for name, us in per_call.items()},
        "cudagraph_skips": skips,
    }, indent=1))


if __name__ == "__main__":
    main()
