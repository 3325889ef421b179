"""The demo: one model compiled twice (stock Inductor RMSNorm vs our ops), checked and profiled.

Builds a Llama-style model, patches a copy, compiles both with Inductor, checks
their outputs agree within a tolerance declared below, says how many of the
patched model's norms run the library's kernels and how many the compiled graph
leaves to Inductor's fused kernels (``count_norms``), and profiles training
steps (forward + backward) of each with ``torch.profiler`` in alternating
rounds: stock then patched, then patched then stock, and so on, so that drift
over the run (GPU clocks, cuBLAS's matmuls, the host) weighs on both alike. The
last round's traces go to ``LOGDIR/stock`` and ``LOGDIR/patched``
(``tensorboard_trace_handler``; readable by TensorBoard's torch-tb-profiler
and by Perfetto), with the per-round RMSNorm and step times as TensorBoard
scalars; ``LOGDIR/summary.md`` reports each ratio by its median over the rounds
and its range, as resolved only where every round agrees, and
``LOGDIR/summary.png`` charts the step.

On CPU the times are CPU op times: the library's kernels run through the
Triton interpreter (Python), Inductor's as compiled C++ (recorded per kernel
while the demo compiles, ``_cpu_kernel_events``). The two are not comparable:
the chart draws each variant on its own axis and says so, and the summary
gives no ratio.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import tempfile
from dataclasses import dataclass

import torch

# ||patched - stock|| / ||stock|| on the logits, declared before comparing: fp32 differs
# only by summation order; bf16 by one rounding per norm through the whole model.
AGREEMENT_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
VARIANTS = ("stock", "patched")
ROUNDS = {"cuda": 5, "cpu": 2}  # default rounds per device type
WARMUP_STEPS = 1  # per variant and round, before its profiled steps (the profiler's own warm-up)
ACTIVE_STEPS = {"cuda": 3, "cpu": 1}  # profiled steps per variant and round
# The library's forward ops and how many norms each computes.
FORWARD_OPS = {"rmsnorm.fwd": 1, "rmsnorm.add_fwd": 1, "rmsnorm.norm_add_fwd": 2}


@dataclass(frozen=True)
class DemoShape:
    vocab: int
    dim: int
    depth: int
    heads: int
    batch: int
    seq: int
    dtype: torch.dtype

    @property
    def norms(self) -> int:
        return 2 * self.depth + 1


GPU_SHAPE = DemoShape(vocab=8192, dim=2048, depth=4, heads=16, batch=8, seq=512, dtype=torch.bfloat16)
CPU_SHAPE = DemoShape(vocab=128, dim=64, depth=1, heads=4, batch=2, seq=8, dtype=torch.float32)


@dataclass(frozen=True)
class NormCount:
    """Where a patched model's norms run in its compiled forward: ``norms`` swapped modules,
    ``kernels`` of them on the library's kernels, ``reference`` on the library's ops through
    the PyTorch reference (the fallback policy), the rest (``inductor``) left by the library's
    compile rule to Inductor's fused kernels."""

    norms: int
    kernels: int
    reference: int = 0

    @property
    def inductor(self) -> int:
        return self.norms - self.kernels - self.reference

    def __str__(self) -> str:
        text = (f"{self.norms} norms: {self.kernels} run the library's kernels, {self.inductor} left to "
                "Inductor's fused kernels")
        return text + (f", {self.reference} run the PyTorch reference (fallback)" if self.reference else "")


def count_norms(swapped: int, stats: dict[str, dict[str, int]]) -> NormCount:
    """Account for every one of ``swapped`` norm modules (each called once per forward) from
    ``stats``, ``dispatch_stats()`` taken over one compiled forward (and backward) whose graph was
    traced afresh: the forward ops' calls (``"kernel"``, ``"fallback"``: a graph run through the
    Triton interpreter calls each op) or call sites (``"compiled"``: a graph that launches the
    kernels itself), each op counted for the norms it computes (``FORWARD_OPS``: a
    ``norm_add_fwd`` computes two). The norms not counted are the ones the compiled graph
    computes with Inductor's own kernels. Raises ValueError where ``swapped`` is negative or the
    ops counted exceed it (a module called more than once per forward, or stats over more than
    one forward)."""
    if swapped < 0:
        raise ValueError(f"count_norms: swapped must be >= 0, got {swapped}")
    kernels = sum(FORWARD_OPS[op] * n for op, n in stats.get("kernel", {}).items() if op in FORWARD_OPS)
    reference = 0
    for key, n in stats.get("fallback", {}).items():
        reference += FORWARD_OPS.get(key.partition(":")[0], 0) * n
    for key, n in stats.get("compiled", {}).items():
        op, _, decision = key.partition(": ")
        if decision == "kernel":
            kernels += FORWARD_OPS.get(op, 0) * n
        else:
            reference += FORWARD_OPS.get(op, 0) * n
    if kernels + reference > swapped:
        raise ValueError(f"count_norms: the forward ops counted compute {kernels + reference} norms, more than the "
                         f"{swapped} swapped modules: stats must cover one forward of a model calling each once")
    return NormCount(swapped, kernels, reference)


@contextlib.contextmanager
def _cpu_kernel_events():
    """Graphs compiled in this block record each of Inductor's C++ kernels as a profiler event
    (``cpp_fused_*``); the option is restored after. ``torch._inductor.config.cpp.
    enable_kernel_profile`` is a private Inductor option with no public equivalent, checked on
    torch 2.11 and 2.13; where a release lacks it, this does nothing and the CPU summary lists
    only the ops."""
    from torch._inductor import config

    if not hasattr(config.cpp, "enable_kernel_profile"):
        yield
        return
    with config.patch({"cpp.enable_kernel_profile": True}):
        yield


def _fresh_trace(counted: bool):
    """Compile afresh (no on-disk graph caches) where the counts come from tracing the graph: a
    graph from a cache is not traced, and its call sites go uncounted."""
    return torch.compiler.config.patch(force_disable_caches=True) if counted else contextlib.nullcontext()


def round_orders(rounds: int, variants: tuple[str, ...] = VARIANTS) -> list[tuple[str, ...]]:
    """The variants' order in each round: as given in the first, reversed in the second, and so on."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [tuple(variants) if i % 2 == 0 else tuple(reversed(variants)) for i in range(rounds)]


def _clear_run(run_dir: str) -> None:
    """Remove the traces and scalars an earlier demo wrote into ``run_dir`` (TensorBoard would show
    them beside this run's)."""
    for path in glob.glob(os.path.join(run_dir, "*.pt.trace.json")) + glob.glob(
            os.path.join(run_dir, "events.out.tfevents.*")):
        os.remove(path)


def run_demo(logdir: str = "runs", device: str | None = None, shape: DemoShape | None = None,
             rounds: int | None = None) -> str:
    """Run the demo; returns the summary's Markdown (also printed by the CLI). ``rounds``: how many
    alternating rounds to profile (default: ``ROUNDS`` of the device type)."""
    import torch_rmsnorm_op as T
    from torch_rmsnorm_op.tools.toy_models import TinyLlama
    from torch_rmsnorm_op.tools.trace_summary import median_summary, summarize_run, write_summary

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    rounds = ROUNDS[kind] if rounds is None else rounds
    orders = round_orders(rounds)
    shape = shape or (GPU_SHAPE if kind == "cuda" else CPU_SHAPE)
    torch.manual_seed(0)
    stock = TinyLlama(shape.vocab, shape.dim, shape.depth, shape.heads).to(device, shape.dtype)
    with torch.no_grad():
        for m in stock.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    patched = copy.deepcopy(stock)
    report = T.patch_rmsnorm(patched)
    print(report, flush=True)
    models = dict(zip(VARIANTS, (stock, patched)))
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), device=device)

    def step(name):
        for p in models[name].parameters():
            p.grad = None
        logits = compiled[name](tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return logits

    compiled = {name: torch.compile(m, fullgraph=True) for name, m in models.items()}
    interpreted = kind == "cpu"
    with _cpu_kernel_events() if interpreted else contextlib.nullcontext():
        with torch.no_grad():
            out = {name: fn(tokens[:, :-1]).float() for name, fn in compiled.items()}
        rel = ((out["patched"] - out["stock"]).norm() / out["stock"].norm()).item()
        tol = AGREEMENT_TOL[shape.dtype]
        print(f"outputs agree: ||patched - stock|| / ||stock|| = {rel:.2e} (declared tolerance {tol:.0e})", flush=True)
        if not rel <= tol:
            raise RuntimeError(f"patched and stock models disagree: relative error {rel:.3e} > {tol:.0e}")
        step("stock")  # compile the training graphs too, outside the profile
        T.reset_dispatch_stats()
        with _fresh_trace(counted=not interpreted):
            step("patched")
        norms = count_norms(len(report.swapped), T.dispatch_stats())
    print(f"patched model: {norms}", flush=True)

    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    from torch.utils.tensorboard import SummaryWriter

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
    # The run (directory) names the variant; the worker names where it ran, not the variant again.
    worker = f"cuda{torch.cuda.current_device()}" if kind == "cuda" else "cpu"
    active = ACTIVE_STEPS[kind]
    per_round: dict[str, list] = {name: [] for name in VARIANTS}
    os.makedirs(logdir, exist_ok=True)
    for name in VARIANTS:
        os.makedirs(os.path.join(logdir, name), exist_ok=True)
        _clear_run(os.path.join(logdir, name))
    with tempfile.TemporaryDirectory(prefix="rmsnorm-demo-") as scratch:
        for i, order in enumerate(orders):
            for name in order:
                # The last round's traces are the ones TensorBoard shows; the others are read and dropped.
                last = i == len(orders) - 1
                run_dir = os.path.join(logdir if last else os.path.join(scratch, f"round{i + 1}"), name)
                with profile(activities=activities, record_shapes=True,
                             schedule=schedule(wait=0, warmup=WARMUP_STEPS, active=active),
                             on_trace_ready=tensorboard_trace_handler(run_dir, worker_name=worker)) as prof:
                    for _ in range(WARMUP_STEPS + active):
                        step(name)
                        prof.step()
                if kind == "cuda":
                    torch.cuda.synchronize()
                per_round[name].append(summarize_run(run_dir))
    summaries = [median_summary(per_round[name]) for name in VARIANTS]
    m, n = shape.batch * shape.seq, shape.dim
    norm_bytes = shape.norms * 5 * m * n * torch.tensor([], dtype=shape.dtype).element_size()
    note = (f"Model: TinyLlama dim={shape.dim} depth={shape.depth} ({shape.norms} RMSNorms), "
            f"batch {shape.batch} x seq {shape.seq}, {str(shape.dtype).removeprefix('torch.')}, "
            f"{torch.cuda.get_device_name() if kind == 'cuda' else 'CPU'}; torch {torch.__version__}. "
            f"Patched model: {norms}.")
    if norms.inductor:
        note += (" The library's compile rule leaves a norm to Inductor where Inductor fuses it with its neighbours"
                 + (" (in this model the first layer's input norm, whose input is the embedding lookup)."
                    if norms.inductor == 1 else "."))
    if interpreted:
        note += (" **CPU run: these are not GPU timings.** The library's kernels run through the Triton "
                 "interpreter (Python), Inductor's as compiled C++: their times are not comparable, so no ratio "
                 "of the two variants is given.")
    text = write_summary(logdir, summaries, norm_bytes, note, rounds=per_round, orders=orders)
    for name in VARIANTS:
        with SummaryWriter(os.path.join(logdir, name)) as writer:
            for i, s in enumerate(per_round[name]):
                writer.add_scalar("rmsnorm/us_per_step", s.norm_us, i + 1)
                writer.add_scalar("step/us_per_step", s.total_us, i + 1)
    plot_summary(summaries, os.path.join(logdir, "summary.png"), kind)
    return text


def timing_label(device: str) -> str:
    """What the demo's times are on ``device``: GPU kernel time, or CPU op time through the interpreter."""
    if device == "cuda":
        return "GPU kernel time per step (µs)"
    return ("CPU op time per step (µs): the library's kernels through the Triton interpreter, Inductor's as "
            "compiled C++; not comparable, not GPU timings")


def chart(summaries: list, device: str):
    """The chart of ``plot_summary`` as a matplotlib Figure. On a GPU every run's bar on one
    axis; on CPU each run on an axis of its own, none shared: the interpreted kernels' times
    and Inductor's compiled C++ are not comparable, and one axis would draw them as if they were."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torch_rmsnorm_op.tools.trace_summary import is_library

    gpu = device == "cuda"
    parts = [("RMSNorm: the library's kernels" + ("" if gpu else " (Triton interpreter)"), "tab:orange",
              lambda s: sum(us for k, (_, us) in s.norm.items() if is_library(k))),
             ("RMSNorm: Inductor's kernels" + ("" if gpu else " (compiled C++)"), "tab:olive",
              lambda s: sum(us for k, (_, us) in s.norm.items() if not is_library(k))),
             ("rest of the step", "tab:gray", lambda s: s.total_us - s.norm_us)]
    if gpu:
        fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
        groups = [(ax, summaries)]
    else:
        fig, axes = plt.subplots(len(summaries), 1, figsize=(8, 1.7 * len(summaries) + 1.6), squeeze=False,
                                 layout="constrained")
        groups = [(ax, [s]) for ax, s in zip(axes[:, 0], summaries)]
    for ax, group in groups:
        names = [s.name for s in group]
        left = [0.0] * len(group)
        for label, color, value in parts:
            widths = [value(s) for s in group]
            ax.barh(names, widths, left=left, label=label, color=color)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel("GPU kernel time per step (µs)" if gpu else "CPU op time per step (µs)")
    fig.legend(*groups[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=len(parts) if gpu else 2,
               fontsize="small")
    if gpu:
        fig.suptitle("RMSNorm share of a training step")
    else:
        fig.suptitle("RMSNorm share of a training step, CPU: each run on its own axis\n(interpreted kernels and "
                     "compiled C++ are not comparable; not GPU timings)", fontsize="medium")
    return fig


def plot_summary(summaries: list, path: str, device: str) -> bool:
    """The RMSNorm share of each run's step as a bar chart at ``path`` (``chart``), its axes and
    title saying what the times are (``timing_label``, also the PNG's Description); False where
    matplotlib is missing."""
    try:
        import matplotlib.pyplot as plt

        fig = chart(summaries, device)
    except ImportError:
        return False
    fig.savefig(path, dpi=110, metadata={"Description": timing_label(device)})
    plt.close(fig)
    return True
