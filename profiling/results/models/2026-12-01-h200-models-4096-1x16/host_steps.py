"""Host time of compiled steps at 1x16 tokens: stock, patched, and patched with
``torch._inductor.config.static_launch_user_defined_triton_kernels`` set in this process
before compiling. Each variant compiles after ``torch.compiler.reset()``, runs 20 warm-up
steps, 9 windows of 30 steps (wall time per step, printed), and in the first repeat a cProfile
of 10 steps, written to ``OUT/host-<model>-<pass>-<mode>-<variant>.txt`` (top 30 by own time).

Run from the repository root on a CUDA machine:
``python profiling/results/models/2026-12-01-h200-models-4096-1x16/host_steps.py OUT llama infer,train default 2``
(output folder, family, passes, compile mode, repeats of the three variants).
"""

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, ".")
from torch_rmsnorm_op.tools import model_benchmark as mb  # noqa: E402


def main() -> None:
    out_dir, family, passes, mode, repeats = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4], int(
        sys.argv[5])
    device = torch.device("cuda")
    spec = mb.ModelSpec.of(family, 2048)
    model = mb.build_model(spec, device)
    ids = torch.randint(0, spec.vocab, (1, 16), device=device)
    weights = [m.weight for m in mb.norm_modules(model)]
    walls_of: dict[tuple[str, str], list[float]] = {}
    for pass_ in passes:
        for rep in range(repeats):
            for variant in ("stock", "patched", "patched-static"):
                inductor_config.static_launch_user_defined_triton_kernels = variant.endswith("static")
                torch.compiler.reset()
                with mb.implementation(model, variant.split("-")[0]) as (_, ctx):
                    steps = mb.Steps(mb._compile(model, mode, "inductor"), model, ids, mode != "default", weights)
                    with ctx():
                        steps.first(pass_)
                    step = steps.train if pass_ == "train" else steps.infer

                    def one(steps=steps, step=step, ctx=ctx) -> None:
                        with ctx():
                            steps.clear_grads()
                            step()

                    for _ in range(20):
                        one()
                    torch.cuda.synchronize()
                    walls = []
                    for _ in range(9):
                        t = time.perf_counter()
                        for _ in range(30):
                            one()
                        torch.cuda.synchronize()
                        walls.append((time.perf_counter() - t) / 30 * 1e3)
                    if rep == 0:
                        profiler = cProfile.Profile()
                        profiler.enable()
                        for _ in range(10):
                            one()
                        torch.cuda.synchronize()
                        profiler.disable()
                        text = io.StringIO()
                        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
                        with open(os.path.join(out_dir, f"host-{family}-{pass_}-{mode}-{variant}.txt"), "w") as f:
                            f.write(text.getvalue())
                walls_of.setdefault((pass_, variant), []).extend(walls)
                print(f"{family} {pass_} {mode} {variant} repeat {rep}: median {statistics.median(walls):.3f} ms, "
                      f"min {min(walls):.3f}", flush=True)
    for key, walls in walls_of.items():
        print(key, f"median {statistics.median(walls):.3f} ms, min {min(walls):.3f}, {len(walls)} windows")


if __name__ == "__main__":
    main()
