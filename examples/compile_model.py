"""A small Llama-style model, patched and compiled: the graph calls torch.ops.rmsnorm.

Prints the patch report, the ops Dynamo's graph calls, what the Inductor-compiled forward and
backward dispatched, and where each of the model's norms runs: on the library's kernels, or left
by the library's compile rule to Inductor's fused kernels (the first layer's input norm, whose
input is the embedding lookup, which Inductor gathers in the norm's own kernel).

Run: python examples/compile_model.py   (CUDA if present, else CPU via the Triton interpreter)
"""

import contextlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel launch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_rmsnorm_op as T  # noqa: E402
from torch_rmsnorm_op.tools.demo import count_norms  # noqa: E402
from torch_rmsnorm_op.tools.toy_models import TinyLlama  # noqa: E402


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyLlama().to(device)
    report = T.patch_rmsnorm(model)
    print(report)

    graphs = []

    def show_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    tokens = torch.randint(0, 256, (2, 16), device=device)
    torch.compile(model, backend=show_graph, fullgraph=True)(tokens)
    calls = [n.target for n in graphs[0].graph.nodes if "rmsnorm" in str(n.target)]
    print(f"Dynamo graph: {len(calls)} calls to {sorted(set(map(str, calls)))}")

    compiled = torch.compile(model, fullgraph=True)  # Inductor
    T.reset_dispatch_stats()
    # On a GPU the graph's op call sites are counted while Inductor traces it, and a graph loaded
    # from Inductor's on-disk cache is not traced: compile afresh there. Through the interpreter
    # the graph calls each op, counted per call.
    fresh = torch.compiler.config.patch(force_disable_caches=True) if device == "cuda" else contextlib.nullcontext()
    with fresh:
        logits = compiled(tokens)
        logits.float().logsumexp(-1).mean().backward()
    stats = T.dispatch_stats()
    print("compiled forward+backward dispatch:", stats)
    print(f"compiled model: {count_norms(len(report.swapped), stats)}")


if __name__ == "__main__":
    main()
