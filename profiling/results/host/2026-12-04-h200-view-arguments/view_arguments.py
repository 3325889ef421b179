"""A compiled step at 1x16 tokens with and without ``fusion.launch_view_bases``, against stock.

Three arms, each its own copy of the model, of a class of its own, compiled in this process with
Inductor's and AOTAutograd's graph caches off: ``stock``; ``views``, patched, compiled with the
rewrite turned into a no-op (our launches take the views they read, as before the rewrite);
``bases``, patched as the package compiles it. For each arm: the ``reinterpret_tensor`` calls in
its output code, in all and in our launches' lines (the code collected as ``run_and_get_code``
does, without its reset of Dynamo, which would drop the arms compiled before). Then ``windows``
rounds time ``per`` steps of each arm in turn (order rotating), with the clocks of the
``attribution.py`` beside
``../2026-12-04-h200-launch-pointers/``: wall time per step, time inside the compiled graphs'
calls, inside launches; medians over windows, and each arm's paired ratio and differences to
stock and to ``views``.

Run from the repository root on a CUDA machine: ``python .../view_arguments.py llama 2048
infer,train 20 10`` (family, hidden size, passes, rounds, steps per window).
"""

import contextlib
import importlib.util
import os
import re
import statistics
import sys
import unittest.mock

import torch
from torch._inductor.graph import GraphLowering
from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

sys.path.insert(0, ".")
from torch_rmsnorm_op import fusion  # noqa: E402
from torch_rmsnorm_op.tools import model_benchmark as mb  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "attribution", os.path.join(_HERE, "..", "2026-12-04-h200-launch-pointers", "attribution.py"))
attribution = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attribution)

ARMS = ("stock", "views", "bases")
OURS = re.compile(r"_rms_norm_\w+\.run\(")


@contextlib.contextmanager
def _no_view_bases():
    rewrite = fusion.launch_view_bases
    fusion.launch_view_bases = lambda graph: 0
    try:
        yield
    finally:
        fusion.launch_view_bases = rewrite


def main() -> None:
    family, hidden, passes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    windows, per = int(sys.argv[4]), int(sys.argv[5])
    device = torch.device("cuda")
    spec = mb.ModelSpec.of(family, hidden)
    ids = torch.randint(0, spec.vocab, (1, 16), device=device)
    stack = contextlib.ExitStack()
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    arms = {}
    for v in ARMS:
        model = mb.build_model(spec, device)
        model.__class__ = type(f"{type(model).__name__}_{v}", (type(model),), {})
        weights = [m.weight for m in mb.norm_modules(model)]
        _, ctx = stack.enter_context(mb.implementation(model, "stock" if v == "stock" else "patched"))
        arms[v] = (mb.Steps(torch.compile(model), model, ids, False, weights), ctx)
    CachingAutotuner.run = attribution._timed_run(CachingAutotuner.run)
    CompiledFxGraph.__call__ = attribution._timed_call(CompiledFxGraph.__call__)
    acc, clock = attribution.acc, attribution.clock
    for pass_ in passes:
        for v in ARMS:
            steps, ctx = arms[v]
            codes = []  # as run_and_get_code collects them, without its reset of Dynamo
            with ctx(), _no_view_bases() if v == "views" else contextlib.nullcontext(), \
                    unittest.mock.patch.object(GraphLowering, "save_output_code", codes.append):
                steps.first(pass_)
            lines = [line for code in codes for line in code.splitlines()]
            ours = [line for line in lines if OURS.search(line)]
            every, in_ours = (sum(line.count("reinterpret_tensor(") for line in got) for got in (lines, ours))
            print(f"CODE {family} {hidden} {pass_} {v}: reinterpret_tensor calls {every}, "
                  f"in {len(ours)} launches of ours {in_ours}", flush=True)

        def window(v: str, pass_: str = pass_) -> dict:
            steps, ctx = arms[v]
            step = steps.train if pass_ == "train" else steps.infer
            acc.clear()
            torch.cuda.synchronize()
            t0 = clock()
            with ctx():
                for _ in range(per):
                    steps.clear_grads()
                    step()
            torch.cuda.synchronize()
            out = {k: val / per for k, val in acc.items()}
            out["wall_ns"] = (clock() - t0) / per
            return out

        for _ in range(2):
            for v in ARMS:
                window(v)
        rows = {v: [] for v in ARMS}
        for w in range(windows):
            order = ARMS[w % 3:] + ARMS[:w % 3]
            for v in order:
                rows[v].append(window(v))
        for v in ARMS:
            def med(key, got=rows[v]):
                return statistics.median(r.get(key, 0.0) for r in got)
            line = (f"RESULT {family} {hidden} {pass_} {v}: wall {med('wall_ns') / 1e3:.1f} us/step; graph calls "
                    f"{med('graph_ns') / 1e3:.1f} us")
            for kind in ("ours", "inductor"):
                n = med(kind + "_n")
                if n:
                    line += f"; {kind} launches {n:.0f} taking {med(kind + '_ns') / 1e3:.1f} us"
            print(line, flush=True)
            for ref in ("stock", "views"):
                if v == ref or (ref == "views" and v != "bases"):
                    continue
                ratio = statistics.median(a["wall_ns"] / b["wall_ns"] for a, b in zip(rows[v], rows[ref]))
                inside = statistics.median((a.get("graph_ns", 0) - b.get("graph_ns", 0)) / 1e3
                                           for a, b in zip(rows[v], rows[ref]))
                wall = statistics.median((a["wall_ns"] - b["wall_ns"]) / 1e3 for a, b in zip(rows[v], rows[ref]))
                print(f"PAIRED {family} {hidden} {pass_} {v} / {ref}: wall ratio {ratio:.4f}, wall {wall:+.1f} us, "
                      f"inside graph calls {inside:+.1f} us (medians over {windows} windows of {per} steps)",
                      flush=True)


if __name__ == "__main__":
    main()
