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

    text = run_demo(args.logdir, rounds=args.rounds)
    print(text)
    print(f"Traces: {args.logdir}/stock and {args.logdir}/patched (*.pt.trace.json; open them in Perfetto too).")
    print(f"View:   tensorboard --logdir {args.logdir}   (PyTorch Profiler tab: runs 'stock' and 'patched')")
    return 0


DESCRIPTION = ("Triton RMSNorm kernels as PyTorch custom ops (torch.ops.rmsnorm): check them against float64, "
               "profile a model compiled with and without them, benchmark them. Without a CUDA GPU the kernels run "
               "through the Triton interpreter (slow; times are not GPU timings).")
BENCH_OUT = os.path.join("runs", "bench")

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


def _list_of(name: str, allowed: tuple | None = None, convert=str):
    """An argparse type: a comma-separated list of ``convert``ed values, each in ``allowed``."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(convert(v.strip()) for v in text.split(",") if v.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{name}: {e}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name} must be a non-empty comma-separated list; got {text!r}")
        if allowed is not None and any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(f"{name} must be a comma-separated list of {', '.join(map(str, allowed))}"
                                             f"; got {text!r}")
        return values

    return parse


def _positive(name: str):
    """An argparse type: an integer of at least 1, else an error naming ``name``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer; got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer; got {value}")
        return value

    return parse


def _tokens(text: str) -> tuple[int, int]:
    batch, sep, seq = text.lower().partition("x")
    if not sep or not batch.isdigit() or not seq.isdigit() or int(batch) < 1 or int(seq) < 1:
        raise ValueError(f"each must be BATCHxSEQ with positive integers (e.g. 4x2048), got {text!r}")
    return int(batch), int(seq)


# bench-models options that belong to the run as a whole, not to one of its selections (--and)
RUN_OPTIONS = ("out", "fresh", "compile_jobs", "stop_after", "smoke", "plan", "compile_only", "rederive")


def _model_selections(args: argparse.Namespace) -> list:
    """The ``Selection`` of ``bench-models``' options, then one per ``--and`` (its options over
    the first selection's). The run's options (``RUN_OPTIONS``) may stand in any part; they are
    set on ``args``, and one given two different values is refused."""
    from torch_rmsnorm_op.tools import model_benchmark as mb

    namespaces = [args]
    while namespaces[-1].more:
        later = argparse.Namespace(**{**vars(args), "more": None})
        namespaces.append(args.parser.parse_args(namespaces[-1].more, namespace=later))
    run: dict = {}
    for ns in namespaces:
        for name in RUN_OPTIONS:
            value = getattr(ns, name)
            if value != args.parser.get_default(name):
                if run.setdefault(name, value) != value:
                    raise ValueError(f"--{name.replace('_', '-')} is the run's, given two values: "
                                     f"{run[name]!r} and {value!r}")
    for name, value in run.items():
        setattr(args, name, value)
    smoke = args.smoke
    return [mb.Selection(
        models=ns.models or (mb.SMOKE_MODELS if smoke else mb.DEFAULT_MODELS),
        hiddens=ns.hidden or mb.DEFAULT_HIDDENS,
        tokens=ns.tokens or (mb.SMOKE_TOKENS if smoke else mb.DEFAULT_TOKENS),
        modes=ns.modes or (("default",) if smoke else mb.DEFAULT_MODES),
        float8=tuple(None if r == "none" else r for r in ns.float8 or ("none",)),
        passes=ns.passes or mb.PASSES,
        impls=ns.impls or mb.IMPLS,
        layers=ns.layers,
        steps=ns.steps or (3 if smoke else 10),
        warmup=ns.warmup or (2 if smoke else 5),
        profile_steps=ns.profile_steps or (1 if smoke else 3),
        rounds=ns.rounds or (2 if smoke else 4),
        backend=ns.backend or ("aot_eager" if smoke else "inductor"),
        smoke=smoke,
        stop_after=args.stop_after,
    ) for ns in namespaces]


def _bench_models(args: argparse.Namespace) -> int:
    from torch_rmsnorm_op.tools import model_benchmark as mb

    if args.rederive:
        stem = mb.rederive(args.rederive)
        print(f"wrote {stem}.json, .md, .png")
        return 0
    selections = _model_selections(args)
    if args.plan:
        for i, sel in enumerate(selections):
            print(("" if i == 0 else "and:\n") + "\n".join(sel.plan()))
        if len(selections) > 1:
            print(f"{sum(sel.compiles() for sel in selections)} compiles in all")
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print(NO_GPU.format(command="bench-models"), file=sys.stderr)
        return 2
    # Before anything imports Inductor's config (building a model does): its option and its compile
    # workers read the variable.
    mb.use_static_launch()
    if args.compile_only:
        for sel in selections:
            mb.compile_only(sel)
        return 0
    stem = mb.run(selections, args.out, fresh=args.fresh, compile_jobs=args.compile_jobs)
    print(open(stem + ".md").read())
    print(f"wrote {stem}.json, .md, .png")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: each subcommand's arguments, its function in ``func``."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_rmsnorm_op", description=DESCRIPTION,
        epilog="python -m torch_rmsnorm_op COMMAND --help describes a command's options.")
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
    demo.add_argument("--rounds", type=_positive("--rounds"), default=None,
                      help="rounds of profiling, stock and patched in alternating order; ratios are reported by "
                           "their median and range over the rounds (default: 5 on a GPU, 2 on CPU)")
    demo.set_defaults(func=_demo)
    bench = sub.add_parser(
        "bench", help="time ours vs Inductor vs eager over a shape sweep, with the copy ceiling (GPU; --smoke on CPU)"
    )
    bench.add_argument("--out", default=BENCH_OUT,
                       help=f"output folder (default: {BENCH_OUT}, which git ignores; results meant to be kept go "
                            "under profiling/results/)")
    bench.add_argument("--iters", type=_positive("--iters"), default=20,
                       help="iterations per timed window (default: 20)")
    bench.add_argument("--repeats", type=_positive("--repeats"), default=5,
                       help="timed windows; the median is reported (default: 5)")
    bench.add_argument("--quick", action="store_true", help="fewer shapes")
    bench.add_argument("--smoke", action="store_true", help="tiny shapes, runs on CPU too (timings not GPU timings)")
    bench.set_defaults(func=_bench)
    integ = sub.add_parser(
        "train-integration",
        help="the tutorial's integration run: Linear-RMSNorm-SiLU-Linear, reference vs kernel path, Adam steps "
             "(100 by default), saved and reloaded",
    )
    integ.add_argument("--steps", type=_positive("--steps"), default=100,
                       help="Adam steps of each path, reference and kernel (default: 100)")
    integ.add_argument("--out", default="outputs/integration",
                       help="where the weights are saved and reloaded (default: outputs/integration)")
    integ.set_defaults(func=_train_integration)
    models = sub.add_parser(
        "bench-models",
        help="time any transformers causal LM eager or compiled: stock vs patched vs Liger, float8 too (train step, "
             "inference forward; GPU; --smoke on CPU)",
        description="Time Hugging Face causal LMs of any model type, built from their config class shrunk to one "
                    "size (bf16, sdpa, vocab 32000), eager or compiled: stock, patched with torch_rmsnorm_op and "
                    "with Liger's RMSNorm, optionally with torchao's float8 Linears: median step time (CUDA events), "
                    "GPU time per step and the norm kernels (torch.profiler), peak memory per step, checked against "
                    "stock. Lists are comma-separated. Compiling dominates the run time: select what you need, see "
                    "--plan. The run sets TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1 for its own "
                    "process when it starts, unless it is set (Inductor launches user-defined Triton kernels, ours and "
                    "Liger's, statically in every impl alike; set it to 0 to measure without).",
    )
    from torch_rmsnorm_op.tools import model_benchmark as mb

    models.add_argument("--models", type=_list_of("models"),
                        help="transformers model types with a causal-LM class, e.g. llama,qwen3,gemma2,qwen3_moe,"
                             f"nemotron_h (default: {','.join(mb.DEFAULT_MODELS)}; {','.join(mb.SMOKE_MODELS)} with "
                             "--smoke)")
    models.add_argument("--hidden", type=_list_of("hidden", tuple(mb.SIZES), int),
                        help="hidden sizes, each with its layer shape (head_dim 128): "
                             + "; ".join(f"{h} ({s.layers} layers, MLP {s.intermediate}, {s.heads} heads, "
                                         f"{s.kv_heads} kv)" for h, s in mb.SIZES.items())
                             + f" (default: {','.join(map(str, mb.DEFAULT_HIDDENS))})")
    models.add_argument("--tokens", type=_list_of("tokens", None, _tokens),
                        help="BATCHxSEQ list (default: 4x2048,1x16)")
    models.add_argument("--modes", type=_list_of("modes", mb.MODES),
                        help="eager (uncompiled), default, reduce-overhead (torch.compile's modes) (default: "
                             f"{','.join(mb.DEFAULT_MODES)})")
    models.add_argument("--float8", type=_list_of("float8", ("none", *mb.FLOAT8_RECIPES)),
                        help="none and/or torchao float8 training recipes (" + ",".join(mb.FLOAT8_RECIPES) + "): "
                             "every Linear but the LM head converted with convert_to_float8_training; needs torchao "
                             "and a GPU of compute capability 8.9+ (default: none)")
    models.add_argument("--passes", type=_list_of("passes", mb.PASSES),
                        help="train (forward with labels + backward) and/or infer (forward, no grad) (default: both)")
    models.add_argument("--impls", type=_list_of("impls", mb.IMPLS),
                        help="stock, patched, liger (default: all three; liger only where liger_kernel imports, on a "
                             "GPU, and for models whose every RMSNorm LigerRMSNorm expresses)")
    models.add_argument("--layers", type=int, help="decoder layers, overriding the size's count")
    models.add_argument("--steps", type=int,
                        help="timed steps per impl and round; the median over all rounds is reported (default: 10)")
    models.add_argument("--rounds", type=int,
                        help="rounds of the impls timed in turn, so that drift over the run weighs on each alike "
                             "(default: 4)")
    models.add_argument("--warmup", type=int, help="steps before timing, the first compiles (default: 5)")
    models.add_argument("--profile-steps", type=int,
                        help="profiled steps per impl and round, for GPU time (default: 3)")
    models.add_argument("--stop-after", type=float, metavar="SECONDS",
                        help="start no new configuration after this many seconds; the results list what was left "
                             "(default: no limit)")
    models.add_argument("--backend", help="torch.compile backend (default: inductor; aot_eager with --smoke)")
    models.add_argument("--compile-jobs", type=int, default=0,
                        help="first compile every compiled model in this many parallel worker processes, filling "
                             "Inductor's on-disk caches, then time serially loading from them; the timing process "
                             "autotunes Inductor's kernels itself (default: 0, compile while timing)")
    models.add_argument("--compile-only", action="store_true",
                        help="compile the selected configurations (one step each) and time nothing")
    models.add_argument("--plan", action="store_true",
                        help="print the configurations and compile count, run nothing")
    models.add_argument("--out", default=mb.DEFAULT_OUT,
                        help=f"output folder (default: {mb.DEFAULT_OUT}, which git ignores; name a folder under "
                             "profiling/results/ to commit results)")
    models.add_argument("--fresh", action="store_true",
                        help="replace the results file of this date and GPU instead of merging into it")
    models.add_argument("--rederive", metavar="FILE",
                        help="recompute the derived fields of a results file's rows (the GPU-time ratio with "
                             "library kernels at stock's time, the paired step ratio, the library's own norm "
                             "kernels against their floor) and write its .json, .md and .png again; runs nothing")
    models.add_argument("--smoke", action="store_true",
                        help="tiny model (hidden 64, 2 layers, tokens 1x8, aot_eager; llama unless --models): the "
                             "machinery in seconds, on CPU too (timings not GPU timings)")
    models.add_argument("--and", dest="more", nargs=argparse.REMAINDER, metavar="OPTION",
                        help="another selection measured by the same run, into the same file, after the first: "
                             "the options after --and (up to the next --and) replace the first selection's, the "
                             "others carry over; --out, --fresh, --compile-jobs, --stop-after, --smoke and --plan are "
                             "the run's, wherever they stand (e.g. --models A,B,C --modes default --impls "
                             "stock,patched --and --modes eager --impls stock,patched,liger --and --models A "
                             "--float8 rowwise)")
    models.set_defaults(func=_bench_models, parser=models)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: ``sys.argv[1:]``); returns the exit status."""
    # The kernels run on CPU tensors only through the Triton interpreter, which must be
    # chosen before triton is imported and any kernel defined: without CUDA, choose it.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input found past argparse (a Selection rule, a results file of other versions)
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
