"""A cProfile of compiled steps at 1x16 tokens, default mode: stock, then patched, in one process.

Each impl compiles after ``torch.compiler.reset()``, runs 50 warm-up steps, then 100 steps under
cProfile, written to ``OUT/host-<family>-<hidden>-<pass>-<impl>.txt`` (top 45 by own time, then by
cumulative time). Stock compiles first, so Inductor's compile workers start before patching turns
on the static launch of user-defined Triton kernels: the patched graph here launches our kernels
through Triton's launcher (the process prints a warning saying so).

Run from the repository root on a CUDA machine:
``python profiling/results/models/2026-12-02-h200-models-liger-mistral-1x16/host_profile.py OUT mistral 4096 infer``
(output folder, family, hidden size, pass).
"""

import cProfile
import io
import pstats
import sys

import torch

sys.path.insert(0, ".")
from torch_rmsnorm_op.tools import model_benchmark as mb  # noqa: E402


def main() -> None:
    out, family, hidden, pass_ = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    device = torch.device("cuda")
    spec = mb.ModelSpec.of(family, hidden)
    model = mb.build_model(spec, device)
    ids = torch.randint(0, spec.vocab, (1, 16), device=device)
    weights = [m.weight for m in mb.norm_modules(model)]
    for impl in ("stock", "patched"):
        torch.compiler.reset()
        with mb.implementation(model, impl) as (_, step_context), step_context():
            steps = mb.Steps(mb._compile(model, "default", "inductor"), model, ids, False, weights)
            steps.first(pass_)
            step = steps.train if pass_ == "train" else steps.infer
            for _ in range(50):
                steps.clear_grads()
                step()
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(100):
                steps.clear_grads()
                step()
            profiler.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
        with open(f"{out}/host-{family}-{hidden}-{pass_}-{impl}.txt", "w") as f:
            f.write(text.getvalue())
        print(impl, "done", flush=True)


if __name__ == "__main__":
    main()
