"""Command line: ``python -m torch_rmsnorm_op <command>``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch


class _Progress:
    """Case progress on stderr: a line rewritten in place on a terminal, else a line per tenth."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.live = enabled and sys.stderr.isatty()
        self.start = time.monotonic()
        self.next_line = 1

    def update(self, done: int, what: object) -> None:
        if not self.enabled:
            return
        text = f"{done}/{self.total} cases, {time.monotonic() - self.start:.0f} s: {what}"
        if self.live:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        elif done >= self.next_line or done == self.total:
            print(text, file=sys.stderr, flush=True)
            self.next_line = done + max(1, self.total // 10)

    def close(self) -> None:
        if self.live:
            print(file=sys.stderr)


def _range(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2e}" if lo == hi else f"{lo:.2e}..{hi:.2e}"


def _check(args: argparse.Namespace) -> int:
    from torch_rmsnorm_op.tools import campaign

    device, description = campaign.best_device()
    dtypes = tuple(getattr(torch, d) for d in args.dtype) if args.dtype else campaign.DTYPES
    large_n = args.large_n or (campaign.LARGE_N_GPU if device.type == "cuda" else campaign.LARGE_N_CPU)
    cases = campaign.cases(large_n=large_n, dtypes=dtypes)
    print(f"device: {description}")
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}; {len(cases)} cases "
          f"(M in {campaign.MS}, N in {campaign.NS + (large_n,)}, weight/no weight, contiguous/strided rows)",
          flush=True)
    table: dict[tuple[str, str], list] = defaultdict(list)
    failures = []
    progress = _Progress(len(cases), args.progress is not False)
    for i, case in enumerate(cases, 1):
        for comp in campaign.run_case(case, device):
            table[(str(case.dtype).removeprefix("torch."), comp.quantity)].append(comp)
            if not comp.passed:
                failures.append((case, comp))
        progress.update(i, case)
    progress.close()
    header = (f"{'dtype':<9} {'quantity':<8} {'cases':>5} {'max abs err':>12} {'max rel err':>12} "
              f"{'atol applied':>18} {'rtol':>9} {'worst err/allowed':>17}  pass")
    print(header)
    print("-" * len(header))
    for (dtype, quantity), comps in table.items():
        ok = all(c.passed for c in comps)
        print(f"{dtype:<9} {quantity:<8} {len(comps):>5} {max(c.max_abs for c in comps):>12.3e} "
              f"{max(c.max_rel for c in comps):>12.3e} {_range([c.atol for c in comps]):>18} "
              f"{_range([c.rtol for c in comps]):>9} {max(c.worst_ratio for c in comps):>17.3f}  "
              f"{'yes' if ok else 'NO'}")
    print("A comparison passes where |out - ref| <= atol + rtol * |ref| at every element (dweight: atol scaled "
          "by sqrt(M)), i.e. worst err/allowed <= 1. Max abs and max rel err are maxima over all elements taken "
          "separately, so either can exceed atol or rtol in a passing row.")
    for case, comp in failures:
        print(f"FAIL {case} {comp.quantity}: max abs {comp.max_abs:.3e}, max rel {comp.max_rel:.3e}, "
              f"worst err/allowed {comp.worst_ratio:.3f}")
    print("all cases pass" if not failures else f"{len(failures)} comparisons FAILED")
    return 0 if not failures else 1


def _demo(args: argparse.Namespace) -> int:
    from torch_rmsnorm_op.tools.demo import run_demo

    text = run_demo(args.logdir)
    print(text)
    print(f"Traces: {args.logdir}/stock and {args.logdir}/patched (*.pt.trace.json; open them in Perfetto too).")
    print(f"View:   tensorboard --logdir {args.logdir}   (PyTorch Profiler tab: runs 'stock' and 'patched')")
    return 0


NO_GPU = ("{command}: no CUDA GPU here, and it measures GPU time. `python -m torch_rmsnorm_op {command} --smoke` "
          "runs the machinery at a tiny size on CPU (its times are not GPU timings).")


def _bench(args: argparse.Namespace) -> int:
    from torch_rmsnorm_op.tools.benchmark import run

    if not args.smoke and not torch.cuda.is_available():
        print(NO_GPU.format(command="bench"), file=sys.stderr)
        return 2
    stem = run(args.out, args.iters, args.repeats, args.quick, args.smoke)
    print(open(stem + ".md").read())
    print(f"wrote {stem}.json, .md, .png")
    return 0


def _train_integration(args: argparse.Namespace) -> int:
    from torch_rmsnorm_op.tools.training import train_integration

    result = train_integration(steps=args.steps, out_dir=args.out)
    ok = (result["kernel_forwards"] == args.steps and result["kernel_backwards"] == args.steps
          and result["reload_max_abs_error"] == 0.0)
    print("integration run OK" if ok else "integration run FAILED: counters or reload error")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    # The kernels run on CPU tensors only through the Triton interpreter, which must be
    # chosen before triton is imported and any kernel defined: without CUDA, choose it.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    parser = argparse.ArgumentParser(prog="python -m torch_rmsnorm_op", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    check = sub.add_parser(
        "check",
        help="run the correctness campaign on the best device present (CUDA, else CPU via the Triton interpreter)",
    )
    check.add_argument("--dtype", action="append", choices=["float32", "float16", "bfloat16"],
                       help="restrict to this dtype (repeatable; default: all three)")
    check.add_argument("--large-n", type=int, default=None,
                       help="the large N of the grid (default: 262144 on CUDA, 32771 on CPU)")
    check.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress on stderr (default: on; a line rewritten in place on a terminal, a line per "
                            "tenth of the cases otherwise)")
    check.add_argument("--quiet", dest="progress", action="store_false", help="no progress (as --no-progress)")
    check.set_defaults(func=_check)
    demo = sub.add_parser(
        "demo",
        help="compile a model twice (Inductor's RMSNorm vs ours), check they agree, profile both, summarize",
    )
    demo.add_argument("--logdir", default="runs", help="where the runs and the summary go (default: runs)")
    demo.set_defaults(func=_demo)
    bench = sub.add_parser(
        "bench", help="time ours vs Inductor vs eager over a shape sweep, with the copy ceiling (GPU; --smoke on CPU)"
    )
    bench.add_argument("--out", default="profiling/results", help="output folder (default: profiling/results)")
    bench.add_argument("--iters", type=int, default=20, help="iterations per timed window")
    bench.add_argument("--repeats", type=int, default=5, help="timed windows; the median is reported")
    bench.add_argument("--quick", action="store_true", help="fewer shapes")
    bench.add_argument("--smoke", action="store_true", help="tiny shapes, runs on CPU too (timings not GPU timings)")
    bench.set_defaults(func=_bench)
    integ = sub.add_parser(
        "train-integration",
        help="the tutorial's integration run: Linear-RMSNorm-SiLU-Linear, reference vs kernel path, 100 Adam steps",
    )
    integ.add_argument("--steps", type=int, default=100)
    integ.add_argument("--out", default="outputs/integration", help="where the weights are saved and reloaded")
    integ.set_defaults(func=_train_integration)
    args = parser.parse_args(argv)
    return args.func(args)
