"""Inductor's generated code and every device kernel's time for one model benchmark configuration,
stock and patched side by side: what to read when a patched model's other kernels move.

For each impl, in turn in one process, it builds the model as ``bench-models`` does
(``torch_rmsnorm_op.tools.model_benchmark``), compiles it (``--mode``), runs the pass once under
``torch._inductor.utils.run_and_get_code`` and writes the generated sources to
``DIR/<model>-<hidden>-<tokens>-<pass>-<impl>.py`` (``-<mode>`` before ``-<impl>`` unless default);
then profiles ``--steps`` steps and writes every device kernel's time per step (µs, largest first)
to ``...-<impl>-kernels.txt``.

Run on a CUDA machine: ``python profiling/model_code.py --out DIR [--model llama] [--hidden 2048]
[--tokens 4x2048] [--pass infer] [--mode default] [--impls stock,patched]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_rmsnorm_op.tools import model_benchmark as mb  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--model", default="llama", help="a transformers model type with a causal-LM class")
    p.add_argument("--hidden", type=int, default=2048, choices=tuple(mb.SIZES))
    p.add_argument("--tokens", default="4x2048")
    p.add_argument("--pass", dest="pass_", default="infer", choices=mb.PASSES)
    p.add_argument("--mode", default="default", choices=mb.MODES)
    p.add_argument("--impls", default="stock,patched")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.device("cuda")
    batch, seq = (int(v) for v in args.tokens.split("x"))
    spec = mb.ModelSpec.of(args.model, args.hidden)
    model = mb.build_model(spec, device)
    ids = torch.randint(0, spec.vocab, (batch, seq), device=device)
    weights = [m.weight for m in mb.norm_modules(model)]  # before a patch swaps the modules
    os.makedirs(args.out, exist_ok=True)
    for impl in args.impls.split(","):
        mode = "" if args.mode == "default" else f"-{args.mode}"
        stem = os.path.join(args.out, f"{args.model}-{args.hidden}-{args.tokens}-{args.pass_}{mode}-{impl}")
        torch.compiler.reset()
        with mb.implementation(model, impl) as (_, step_context), step_context():
            steps = mb.Steps(mb._compile(model, args.mode, "inductor"), model, ids, args.mode == "reduce-overhead",
                             weights)
            _, codes = run_and_get_code(steps.first, args.pass_)
            with open(stem + ".py", "w") as f:
                f.write(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}\n")
                for i, code in enumerate(codes):
                    f.write(f"\n# ===== source {i} =====\n{code}")
            step = steps.train if args.pass_ == "train" else steps.infer
            for _ in range(3):
                steps.clear_grads()
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    steps.clear_grads()
                    step()
                torch.cuda.synchronize()
        totals: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                slot = totals.setdefault(e.name, [0.0, 0])
                slot[0] += e.time_range.elapsed_us() / args.steps
                slot[1] += 1 / args.steps
        with open(stem + "-kernels.txt", "w") as f:
            f.write(f"# µs per step, launches per step; total {sum(v[0] for v in totals.values()):.1f} µs\n")
            for name, (us, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
                f.write(f"{us:10.2f} {calls:6.1f}  {name}\n")
        print(f"wrote {stem}.py, -kernels.txt", flush=True)


if __name__ == "__main__":
    main()
