"""A small Llama-style model, patched and compiled: the graph calls torch.ops.rmsnorm.

Run: python examples/compile_model.py   (CUDA if present, else CPU via the Triton interpreter)
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel launch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_rmsnorm_op as T  # noqa: E402
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
    logits = compiled(tokens)
    logits.float().logsumexp(-1).mean().backward()
    print("compiled forward+backward dispatch:", T.dispatch_stats())


if __name__ == "__main__":
    main()
