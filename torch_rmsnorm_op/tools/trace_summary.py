"""Summarize profiler traces: the RMSNorm kernels of each run beside the rest of the step.

Reads the ``*.pt.trace.json`` files that ``tensorboard_trace_handler`` wrote,
one run directory per variant. RMSNorm-related GPU kernels are, by name, ours
(``_rms_norm_*``) and Inductor's fused kernels that contain the norm's ops
(``rsqrt`` or ``pow`` in the fused name: nothing else in the demo model
computes either). Inductor may fuse neighbours (a residual add) into them;
their time counts as the norm's. GB/s divides the norm's byte floor
(forward 2·M·N·elem, backward 3·M·N·elem per norm call) by that time. On a
CPU run there are no device kernels: the summary then reports the
``rmsnorm::`` CPU ops and says so.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

NORM_MARKERS = ("_rms_norm_", "rsqrt", "pow")


@dataclass
class RunSummary:
    name: str
    steps: int
    device_kernels: bool
    norm: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (calls/step, us/step)
    total_us: float = 0.0  # all device (or CPU op) time per step
    per_kernel: dict[str, float] = field(default_factory=dict)  # every kernel (or op) -> us/step

    @property
    def norm_us(self) -> float:
        return sum(us for _, us in self.norm.values())


def _is_norm(name: str) -> bool:
    return any(marker in name for marker in NORM_MARKERS)


def summarize_run(run_dir: str) -> RunSummary:
    """Per-step norm kernels and total device time from the newest trace in ``run_dir``."""
    files = sorted(glob.glob(os.path.join(run_dir, "*.pt.trace.json")), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.pt.trace.json under {run_dir}")
    with open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    step_events = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and "dur" in e]
    steps = max(1, len({e["name"] for e in step_events}))
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
    summary = RunSummary(os.path.basename(run_dir.rstrip("/")), steps, bool(kernels))
    if kernels:
        chosen, norm_of = kernels, _is_norm
    else:  # CPU: the ops themselves; only ours are identifiable
        chosen = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
        norm_of = lambda name: name.startswith("rmsnorm::")  # noqa: E731
    calls: dict[str, int] = defaultdict(int)
    time: dict[str, float] = defaultdict(float)
    every: dict[str, float] = defaultdict(float)
    for e in chosen:
        every[e["name"]] += e["dur"] / steps
        if norm_of(e["name"]):
            calls[e["name"]] += 1
            time[e["name"]] += e["dur"]
    summary.norm = {n: (calls[n] // steps, time[n] / steps) for n in sorted(time, key=lambda n: -time[n])}
    summary.per_kernel = dict(every)
    if kernels:
        summary.total_us = sum(e["dur"] for e in kernels) / steps
    else:
        summary.total_us = sum(e["dur"] for e in step_events if e.get("cat") == "user_annotation") / steps
    return summary


def diff_table(a: RunSummary, b: RunSummary, rows: int = 12) -> list[str]:
    """Per-kernel diff of two runs (what HTA's TraceDiff reports): the ``rows`` kernels whose time
    per step changed most, then the norm kernels of either run not among them (on a busy GPU the
    matmuls' swings can fill the first rows), with each run's time and the difference."""
    unit = "device" if a.device_kernels and b.device_kernels else "CPU op"
    names = set(a.per_kernel) | set(b.per_kernel)
    delta = {n: b.per_kernel.get(n, 0.0) - a.per_kernel.get(n, 0.0) for n in names}
    top = sorted(names, key=lambda n: -abs(delta[n]))[:rows]
    top += sorted((n for n in {*a.norm, *b.norm} & names if n not in top), key=lambda n: -abs(delta[n]))
    nested = "" if unit == "device" else " CPU ops nest, so these are inclusive times."
    lines = [f"## Per-kernel diff ({b.name} − {a.name}, {unit} µs/step, largest changes first, then the other "
             "norm kernels)", "",
             f"What HTA's TraceDiff reports, computed from the same trace files.{nested}", "",
             f"| kernel | {a.name} | {b.name} | difference |", "|---|---|---|---|"]
    lines += [f"| `{n[:90]}` | {a.per_kernel.get(n, 0.0):.1f} | {b.per_kernel.get(n, 0.0):.1f} | {delta[n]:+.1f} |"
              for n in top]
    return lines + [""]


def write_summary(logdir: str, runs: list[str], norm_bytes_per_step: float, note: str = "") -> str:
    """Write ``summary.md`` and ``summary.png`` into ``logdir``; return the Markdown."""
    summaries = [summarize_run(os.path.join(logdir, r)) for r in runs]
    lines = ["# RMSNorm in the profiled training step", ""]
    if note:
        lines += [note, ""]
    unit = "device" if all(s.device_kernels for s in summaries) else "CPU op"
    for s in summaries:
        lines += [f"## {s.name}", "", f"| RMSNorm-related kernel | calls/step | {unit} µs/step |", "|---|---|---|"]
        lines += [f"| `{name[:90]}` | {c} | {us:.1f} |" for name, (c, us) in s.norm.items()] or ["| (none found) | | |"]
        share = 100 * s.norm_us / s.total_us if s.total_us else 0.0
        line = f"RMSNorm {s.norm_us:.1f} µs of {s.total_us:.1f} µs {unit} time per step ({share:.1f}%)"
        if s.device_kernels and s.norm_us:
            line += f"; {norm_bytes_per_step / (s.norm_us * 1e-6) / 1e9:.0f} GB/s at the norm's byte floor"
        lines += ["", line + ".", ""]
    if len(summaries) == 2 and all(s.norm_us and s.device_kernels for s in summaries):
        a, b = summaries
        lines += [f"**{a.name} / {b.name} RMSNorm time: {a.norm_us / b.norm_us:.2f}×**; "
                  f"whole step: {a.total_us / b.total_us:.2f}×.", ""]
    if len(summaries) == 2:
        lines += diff_table(*summaries)
    text = "\n".join(lines)
    with open(os.path.join(logdir, "summary.md"), "w") as f:
        f.write(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        names = [s.name for s in summaries]
        norm = [s.norm_us for s in summaries]
        rest = [s.total_us - s.norm_us for s in summaries]
        ax.barh(names, norm, label="RMSNorm kernels", color="tab:orange")
        ax.barh(names, rest, left=norm, label="rest of the step", color="tab:gray")
        ax.set_xlabel(f"{unit} time per step (µs)")
        ax.legend(loc="lower right")
        ax.set_title("RMSNorm share of a training step")
        fig.tight_layout()
        fig.savefig(os.path.join(logdir, "summary.png"), dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    return text
