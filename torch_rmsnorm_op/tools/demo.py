"""The demo: one model compiled twice (stock Inductor RMSNorm vs our ops), checked and profiled.

Builds a Llama-style model, patches a copy, compiles both with Inductor, checks
their outputs agree within a tolerance declared below, profiles a training
step (forward + backward) of each with ``torch.profiler`` into
``LOGDIR/stock`` and ``LOGDIR/patched`` (``tensorboard_trace_handler``;
readable by TensorBoard's torch-tb-profiler and by Perfetto), writes the
per-step RMSNorm time as TensorBoard scalars into the same run directories, and
summarizes the traces into ``LOGDIR/summary.md`` and ``summary.png``. On CPU
the times are CPU op times with the kernels run through the Triton
interpreter, and the chart says so.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

# ||patched - stock|| / ||stock|| on the logits, declared before comparing: fp32 differs
# only by summation order; bf16 by one rounding per norm through the whole model.
AGREEMENT_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
VARIANTS = ("stock", "patched")


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


def run_demo(logdir: str = "runs", device: str | None = None, shape: DemoShape | None = None) -> str:
    """Run the demo; returns the summary's Markdown (also printed by the CLI)."""
    import torch_rmsnorm_op as T
    from torch_rmsnorm_op.tools.toy_models import TinyLlama
    from torch_rmsnorm_op.tools.trace_summary import write_summary

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = shape or (GPU_SHAPE if device == "cuda" else CPU_SHAPE)
    torch.manual_seed(0)
    stock = TinyLlama(shape.vocab, shape.dim, shape.depth, shape.heads).to(device, shape.dtype)
    with torch.no_grad():
        for m in stock.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    patched = copy.deepcopy(stock)
    report = T.patch_rmsnorm(patched)
    print(report, flush=True)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), device=device)

    def step(model):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return logits

    compiled = {name: torch.compile(m, fullgraph=True) for name, m in zip(VARIANTS, (stock, patched))}
    with torch.no_grad():
        out = {name: fn(tokens[:, :-1]).float() for name, fn in compiled.items()}
    rel = ((out["patched"] - out["stock"]).norm() / out["stock"].norm()).item()
    tol = AGREEMENT_TOL[shape.dtype]
    print(f"outputs agree: ||patched - stock|| / ||stock|| = {rel:.2e} (declared tolerance {tol:.0e})", flush=True)
    if not rel <= tol:
        raise RuntimeError(f"patched and stock models disagree: relative error {rel:.3e} > {tol:.0e}")

    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    from torch.utils.tensorboard import SummaryWriter

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    # The run (directory) names the variant; the worker names where it ran, not the variant again.
    worker = f"cuda{torch.cuda.current_device()}" if device == "cuda" else "cpu"
    os.makedirs(logdir, exist_ok=True)
    for name, fn in compiled.items():
        step(fn)  # compile the backward too, outside the profile
        run_dir = os.path.join(logdir, name)
        with profile(activities=activities, record_shapes=True,
                     schedule=schedule(wait=1, warmup=2, active=3),
                     on_trace_ready=tensorboard_trace_handler(run_dir, worker_name=worker)) as prof:
            for _ in range(6):
                for p in (stock if name == "stock" else patched).parameters():
                    p.grad = None
                step(fn)
                prof.step()
        if device == "cuda":
            torch.cuda.synchronize()
    m, n = shape.batch * shape.seq, shape.dim
    norm_bytes = shape.norms * 5 * m * n * torch.tensor([], dtype=shape.dtype).element_size()
    note = (f"Model: TinyLlama dim={shape.dim} depth={shape.depth} ({shape.norms} RMSNorms), "
            f"batch {shape.batch} x seq {shape.seq}, {str(shape.dtype).removeprefix('torch.')}, "
            f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; torch {torch.__version__}.")
    if device != "cuda":
        note += (" **CPU run through the Triton interpreter: these are not GPU timings**, and Inductor's "
                 "CPU code has no per-kernel events, so only our ops are identified.")
    text = write_summary(logdir, list(VARIANTS), norm_bytes, note)
    from torch_rmsnorm_op.tools.trace_summary import summarize_run

    summaries = [summarize_run(os.path.join(logdir, name)) for name in VARIANTS]
    for s in summaries:
        with SummaryWriter(os.path.join(logdir, s.name)) as writer:
            writer.add_scalar("rmsnorm/us_per_step", s.norm_us, 0)
            writer.add_scalar("step/us_per_step", s.total_us, 0)
    plot_summary(summaries, os.path.join(logdir, "summary.png"), device)
    return text


def timing_label(device: str) -> str:
    """What the demo's times are on ``device``: GPU kernel time, or CPU op time through the interpreter."""
    if device == "cuda":
        return "GPU kernel time per step (µs)"
    return "CPU op time per step (µs), kernels through the Triton interpreter: not GPU timings"


def plot_summary(summaries: list, path: str, device: str) -> bool:
    """The RMSNorm share of each run's step as a bar chart at ``path``, its axis and title saying what
    the times are (``timing_label``; also the PNG's Description); False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    label = timing_label(device)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    names = [s.name for s in summaries]
    norm = [s.norm_us for s in summaries]
    ax.barh(names, norm, label="RMSNorm " + ("kernels" if device == "cuda" else "ops (ours only)"),
            color="tab:orange")
    ax.barh(names, [s.total_us - s.norm_us for s in summaries], left=norm, label="rest of the step",
            color="tab:gray")
    ax.set_xlabel(label)
    ax.legend(loc="lower right")
    ax.set_title("RMSNorm share of a training step" + ("" if device == "cuda" else "\n(CPU interpreter times)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": label})
    plt.close(fig)
    return True
