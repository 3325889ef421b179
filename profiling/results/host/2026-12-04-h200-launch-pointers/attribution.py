"""Where the host time of a compiled step at 1x16 tokens goes: stock against patched.

Every arm is its own copy of the model, of a class of its own (a graph per arm), compiled in
this process. While timing, each compiled graph's call (``CompiledFxGraph.__call__``) and each
kernel launch (``CachingAutotuner.run``) is wrapped with a clock, in every arm alike; the
launches are told apart as ours (``_rms_norm*``) and Inductor's. After two warm-up windows
each, ``windows`` rounds time ``per`` steps of each arm in turn (the order alternating). Per
step, medians over windows: wall time, time inside graph calls, inside launches (count and
mean per launch, ours and Inductor's), and each arm's paired ratio to stock's window; then
the host time per launch of each kernel, with the launcher Inductor gave it (static or Triton's).

Run from the repository root on a CUDA machine: ``python .../attribution.py llama 2048
infer,train 30 15`` (family, hidden size, passes, rounds, steps per window).
"""

import collections
import contextlib
import statistics
import sys
import time

import torch
from torch._inductor.output_code import CompiledFxGraph
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

sys.path.insert(0, ".")
from torch_rmsnorm_op.tools import model_benchmark as mb  # noqa: E402

ARMS = ("stock", "patched")
clock = time.perf_counter_ns
acc = collections.defaultdict(int)
per_kernel = collections.defaultdict(lambda: [0, 0])  # (name, static launcher): [ns, launches], whole run


def _timed_run(run):
    def wrapper(self, *args, **kwargs):
        t = clock()
        try:
            return run(self, *args, **kwargs)
        finally:
            name = getattr(self.fn, "__name__", "") or self.inductor_meta.get("kernel_name", "")
            kind = "ours" if name.startswith("_rms_norm") else "inductor"
            dt = clock() - t
            acc[kind + "_ns"] += dt
            acc[kind + "_n"] += 1
            static = all(getattr(launcher, "_is_static", False) for launcher in self.launchers)
            per_kernel[(name, static)][0] += dt
            per_kernel[(name, static)][1] += 1
    return wrapper


def _timed_call(call):
    def wrapper(self, *args, **kwargs):
        t = clock()
        try:
            return call(self, *args, **kwargs)
        finally:
            acc["graph_ns"] += clock() - t
            acc["graph_n"] += 1
    return wrapper


def main() -> None:
    family, hidden, passes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    windows, per = int(sys.argv[4]), int(sys.argv[5])
    device = torch.device("cuda")
    spec = mb.ModelSpec.of(family, hidden)
    ids = torch.randint(0, spec.vocab, (1, 16), device=device)
    stack = contextlib.ExitStack()
    arms = {}
    for v in ARMS:
        model = mb.build_model(spec, device)
        model.__class__ = type(f"{type(model).__name__}_{v}", (type(model),), {})
        weights = [m.weight for m in mb.norm_modules(model)]
        _, ctx = stack.enter_context(mb.implementation(model, v))
        arms[v] = (mb.Steps(torch.compile(model), model, ids, False, weights), ctx)
    CachingAutotuner.run = _timed_run(CachingAutotuner.run)
    CompiledFxGraph.__call__ = _timed_call(CompiledFxGraph.__call__)
    for pass_ in passes:
        for v in ARMS:
            steps, ctx = arms[v]
            with ctx():
                steps.first(pass_)
        torch.cuda.synchronize()

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
        per_kernel.clear()
        rows = {v: [] for v in ARMS}
        for w in range(windows):
            for v in ARMS if w % 2 == 0 else ARMS[::-1]:
                rows[v].append(window(v))
        for v in ARMS:
            def med(key, got=rows[v]):
                return statistics.median(r.get(key, 0.0) for r in got)
            ratio = statistics.median(a["wall_ns"] / b["wall_ns"] for a, b in zip(rows[v], rows["stock"]))
            line = (f"RESULT {family} {hidden} {pass_} {v}: wall {med('wall_ns') / 1e3:.1f} us/step "
                    f"(paired ratio {ratio:.4f}); graph calls {med('graph_n'):.0f} "
                    f"taking {med('graph_ns') / 1e3:.1f} us; "
                    f"outside graph calls {(med('wall_ns') - med('graph_ns')) / 1e3:.1f} us")
            for kind in ("ours", "inductor"):
                n = med(kind + "_n")
                if n:
                    line += (f"; {kind} launches {n:.0f} taking {med(kind + '_ns') / 1e3:.1f} us "
                             f"({med(kind + '_ns') / n / 1e3:.2f} us each)")
            print(line, flush=True)
            diffs = [(a["graph_ns"] - b["graph_ns"]) / 1e3 for a, b in zip(rows[v], rows["stock"])]
            outs = [((a["wall_ns"] - a["graph_ns"]) - (b["wall_ns"] - b["graph_ns"])) / 1e3
                    for a, b in zip(rows[v], rows["stock"])]
            print(f"PAIRED {family} {hidden} {pass_} {v} - stock: "
                  f"inside graph calls {statistics.median(diffs):+.1f} us, "
                  f"outside {statistics.median(outs):+.1f} us (medians over {windows} windows of {per} steps)",
                  flush=True)
        print(f"KERNELS {family} {hidden} {pass_}: host time per launch, every timed window (name, launcher, launches)")
        for (name, static), (ns, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0] / kv[1][1]):
            print(f"  {ns / n / 1e3:7.2f} us  {'static' if static else 'triton'}  {n:6d}  {name}")
        per_kernel.clear()


if __name__ == "__main__":
    main()
