"""Host time of compiled steps at 1x16 tokens, default mode, in paired windows: stock, patched
(our kernels through Triton's launcher) and patched with Inductor's static launcher for
user-defined Triton kernels ("static"). Every arm is its own copy of the model, of a class of its
own (so that Dynamo compiles a graph per arm), compiled in this process (``compile_threads = 1``,
so that the option set around the static arm's first step is the one its kernels are compiled
under; the output-code cache is cleared before each arm's compile so its kernels compile anew).
After two warm-up windows each, ``windows`` rounds time ``per`` steps of each arm in turn (the
order rotating), wall time and this thread's CPU time per step; each arm's ratio to the stock
window of the same round, median over rounds, is printed with the launchers its compile made.

Run from the repository root on a CUDA machine, with the library at the commit given in the
README: ``python profiling/results/host/2026-12-01-h200-static-launch-1x16/paired_steps.py llama 2048
infer,train 40 15`` (family, hidden size, passes, rounds, steps per window).
"""

import collections
import contextlib
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch._inductor.codecache import PyCodeCache
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

sys.path.insert(0, ".")
from torch_rmsnorm_op.tools import model_benchmark as mb  # noqa: E402

try:  # where patching sets the static launch itself, the patched arm keeps Triton's launcher
    from torch_rmsnorm_op import static_launch

    static_launch.set_static_launch(False)
except ImportError:
    pass

VARIANTS = ("stock", "patched", "static")


def kernels() -> dict[int, tuple[str, tuple[str, ...]]]:
    """Every kernel of the loaded output code: (name, its compile results' types)."""
    out = {}
    for mod in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        for name, obj in vars(mod).items():
            if isinstance(obj, CachingAutotuner):
                out[id(obj)] = (name, tuple(type(r).__name__ for r in obj.compile_results))
    return out


def main() -> None:
    family, hidden, passes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    windows, per = int(sys.argv[4]), int(sys.argv[5])
    inductor_config.compile_threads = 1
    inductor_config.fx_graph_cache = False
    device = torch.device("cuda")
    spec = mb.ModelSpec.of(family, hidden)
    ids = torch.randint(0, spec.vocab, (1, 16), device=device)
    stack = contextlib.ExitStack()
    arms = {}
    for v in VARIANTS:
        model = mb.build_model(spec, device)
        model.__class__ = type(f"{type(model).__name__}_{v}", (type(model),), {})  # a graph of its own per arm
        weights = [m.weight for m in mb.norm_modules(model)]
        _, ctx = stack.enter_context(mb.implementation(model, "stock" if v == "stock" else "patched"))
        arms[v] = (mb.Steps(torch.compile(model), model, ids, False, weights), ctx)
    for pass_ in passes:
        for v in VARIANTS:
            steps, ctx = arms[v]
            before = kernels()
            PyCodeCache.modules_no_attr.clear()  # the same output code loads afresh, its kernels compiled anew
            t = time.perf_counter()
            with inductor_config.patch(static_launch_user_defined_triton_kernels=(v == "static")), ctx():
                steps.first(pass_)
            torch.cuda.synchronize()
            new = [k for i, k in kernels().items() if i not in before]
            kinds = collections.Counter(("user" if k[0].startswith("_rms") else "inductor", r)
                                        for k in new for r in k[1])
            print(f"{family} {hidden} {pass_} {v}: compiled in {time.perf_counter() - t:.1f} s, "
                  f"kernels {dict(kinds)}", flush=True)

        def window(v: str, pass_: str = pass_) -> None:
            steps, ctx = arms[v]
            step = steps.train if pass_ == "train" else steps.infer
            with ctx():
                for _ in range(per):
                    steps.clear_grads()
                    step()

        for _ in range(2):
            for v in VARIANTS:
                window(v)
        torch.cuda.synchronize()
        wall = {v: [] for v in VARIANTS}
        cpu = {v: [] for v in VARIANTS}
        for w in range(windows):
            for v in VARIANTS[w % 3:] + VARIANTS[:w % 3]:
                torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.thread_time()
                window(v)
                c1 = time.thread_time()
                torch.cuda.synchronize()
                wall[v].append((time.perf_counter() - t0) / per * 1e3)
                cpu[v].append((c1 - c0) / per * 1e3)
        for v in VARIANTS:
            rw = [a / b for a, b in zip(wall[v], wall["stock"])]
            rc = [a / b for a, b in zip(cpu[v], cpu["stock"])]
            print(f"RESULT {family} {hidden} {pass_} {v}: wall median {statistics.median(wall[v]):.3f} ms "
                  f"min {min(wall[v]):.3f}; host cpu median {statistics.median(cpu[v]):.3f} ms; "
                  f"paired wall ratio median {statistics.median(rw):.4f}, "
                  f"paired cpu ratio median {statistics.median(rc):.4f} ({windows} windows x {per} steps)",
                  flush=True)


if __name__ == "__main__":
    main()
