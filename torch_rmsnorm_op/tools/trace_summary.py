"""Summarize profiler traces: the RMSNorm kernels of each run beside the rest of the step.

Reads the ``*.pt.trace.json`` files that ``tensorboard_trace_handler`` wrote,
one run directory per variant and round. RMSNorm-related kernels are, by name,
the library's (``_rms_norm_*`` on a GPU, the ``rmsnorm::`` ops on CPU) and
Inductor's fused kernels that contain the norm's ops (``rsqrt`` or ``pow`` in
the fused name: nothing else in the demo model computes either). Inductor may
fuse neighbours (a residual add) into them; their time counts as the norm's.
GB/s divides the norm's byte floor (forward 2·M·N·elem, backward 3·M·N·elem
per norm call) by that time. On a CPU run there are no device kernels: the
summary reports CPU ops, Inductor's C++ kernels among them where the graph was
compiled to record them (``cpp_fused_*`` events), and says that the library's
kernels ran through the Triton interpreter.

Variants profiled in alternating rounds are compared round by round
(``compare_rounds``): a ratio is reported with its range over the rounds, and
as resolved only where every round finds the same variant faster.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

NORM_MARKERS = ("_rms_norm_", "rsqrt", "pow")
LIBRARY_PREFIXES = ("_rms_norm", "_add_rms_norm", "rmsnorm::")  # the library's kernels (GPU) and ops (CPU)
CPU_KERNEL = "cpp_fused"  # Inductor's C++ kernels, recorded with config.cpp.enable_kernel_profile
_GRAPH_PREFIX = re.compile(r"^graph_\d+_")  # Inductor numbers the C++ kernels' events by graph


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

    @property
    def library_norm_us(self) -> float:
        """The part of ``norm_us`` in the library's kernels (or ops); the rest is Inductor's."""
        return sum(us for name, (_, us) in self.norm.items() if is_library(name))


def is_library(name: str) -> bool:
    """Whether a kernel or op of a trace is the library's (its kernels, or its ``rmsnorm::`` ops)."""
    return name.startswith(LIBRARY_PREFIXES)


def _is_norm(name: str) -> bool:
    return any(marker in name for marker in NORM_MARKERS)


def _is_cpu_norm(name: str) -> bool:
    return name.startswith("rmsnorm::") or (CPU_KERNEL in name and _is_norm(name))


def kernel_name(name: str) -> str:
    """A trace event's name, less the graph number Inductor puts before its C++ kernels' names
    (``graph_3_cpp_fused_...``), so that one kernel has one name in both variants."""
    return _GRAPH_PREFIX.sub("", name)


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
    else:  # CPU: the ops themselves, Inductor's C++ kernels among them where they were recorded
        chosen, norm_of = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e], _is_cpu_norm
    calls: dict[str, int] = defaultdict(int)
    time: dict[str, float] = defaultdict(float)
    every: dict[str, float] = defaultdict(float)
    for e in chosen:
        name = kernel_name(e["name"])
        every[name] += e["dur"] / steps
        if norm_of(name):
            calls[name] += 1
            time[name] += e["dur"]
    summary.norm = {n: (calls[n] // steps, time[n] / steps) for n in sorted(time, key=lambda n: -time[n])}
    summary.per_kernel = dict(every)
    if kernels:
        summary.total_us = sum(e["dur"] for e in kernels) / steps
    else:
        summary.total_us = sum(e["dur"] for e in step_events if e.get("cat") == "user_annotation") / steps
    return summary


def median_summary(rounds: list[RunSummary]) -> RunSummary:
    """One run's rounds as one summary: each kernel's time per step the median over the rounds
    (0 in a round that did not launch it), its calls per step those of the rounds' most, the
    total the median of the rounds' totals."""
    if not rounds:
        raise ValueError("median_summary: rounds must hold at least one RunSummary")
    first = rounds[0]
    names = {n for r in rounds for n in r.per_kernel}
    norm_names = {n for r in rounds for n in r.norm}
    per_kernel = {n: statistics.median(r.per_kernel.get(n, 0.0) for r in rounds) for n in names}
    norm = {n: (max(r.norm.get(n, (0, 0.0))[0] for r in rounds),
                statistics.median(r.norm.get(n, (0, 0.0))[1] for r in rounds)) for n in norm_names}
    return RunSummary(first.name, first.steps, all(r.device_kernels for r in rounds),
                      dict(sorted(norm.items(), key=lambda kv: -kv[1][1])),
                      statistics.median(r.total_us for r in rounds), per_kernel)


@dataclass(frozen=True)
class RoundComparison:
    """``a / b`` of one quantity, round by round (each ratio from the two variants' steps of one
    round): the median ratio and the lowest and highest. ``resolved``: every round's ratio lies
    on one side of 1, so every round found the same variant faster."""

    what: str
    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    @property
    def resolved(self) -> bool:
        return self.low > 1.0 or self.high < 1.0

    def describe(self, a: str, b: str) -> str:
        """One sentence: the median and range, and what they resolve."""
        spread = f"{self.low:.2f}–{self.high:.2f} over {len(self.ratios)} rounds"
        if self.resolved:
            faster = b if self.low > 1.0 else a
            verdict = f"{faster} faster in every round"
        elif len(self.ratios) == 1:
            verdict = "one round: nothing to tell drift from a difference"
        else:
            verdict = "not resolved: the rounds disagree on which is faster"
        return f"{self.what}: {self.median:.2f}× (median; {spread}; {verdict})"


def compare_rounds(what: str, a: list[float], b: list[float]) -> RoundComparison:
    """``a[i] / b[i]`` for each round ``i``: the times of variants a and b profiled in round i.
    Raises ValueError where the lists differ in length, are empty, or b holds a time that is
    not positive."""
    if len(a) != len(b) or not a:
        raise ValueError(f"compare_rounds: a and b must hold one time per round each, alike; got {len(a)} and "
                         f"{len(b)}")
    if any(not t > 0 for t in b):
        raise ValueError(f"compare_rounds: b's times must be positive to divide by; got {b}")
    return RoundComparison(what, tuple(x / y for x, y in zip(a, b)))


def diff_table(a: RunSummary, b: RunSummary, rows: int = 12,
               rounds: tuple[list[RunSummary], list[RunSummary]] | None = None) -> list[str]:
    """Per-kernel diff of two runs (what HTA's TraceDiff reports): the ``rows`` kernels whose time
    per step changed most, then the norm kernels of either run not among them (on a busy GPU the
    matmuls' swings can fill the first rows), with each run's time and the difference. With
    ``rounds`` (each run's rounds, in order) each difference is the median of the rounds'
    differences, beside its range over the rounds: a range across zero is drift, not a
    difference the comparison resolves."""
    unit = "device" if a.device_kernels and b.device_kernels else "CPU op"
    names = set(a.per_kernel) | set(b.per_kernel)
    per_round: dict[str, list[float]] = {}
    if rounds is not None:
        per_round = {n: [rb.per_kernel.get(n, 0.0) - ra.per_kernel.get(n, 0.0) for ra, rb in zip(*rounds)]
                     for n in names}
        delta = {n: statistics.median(d) for n, d in per_round.items()}
    else:
        delta = {n: b.per_kernel.get(n, 0.0) - a.per_kernel.get(n, 0.0) for n in names}
    top = sorted(names, key=lambda n: -abs(delta[n]))[:rows]
    top += sorted((n for n in {*a.norm, *b.norm} & names if n not in top), key=lambda n: -abs(delta[n]))
    nested = "" if unit == "device" else " CPU ops nest, so these are inclusive times."
    head = f"| kernel | {a.name} | {b.name} | difference |"
    rule = "|---|---|---|---|"
    if rounds is not None:
        nested += (f" Times are medians over {len(rounds[0])} rounds; a difference whose range over the rounds "
                   "spans zero is drift between rounds, not resolved.")
        head, rule = head + " range over rounds |", rule + "---|"
    lines = [f"## Per-kernel diff ({b.name} − {a.name}, {unit} µs/step, largest changes first, then the other "
             "norm kernels)", "",
             f"What HTA's TraceDiff reports, computed from the same trace files.{nested}", "", head, rule]
    for n in top:
        line = f"| `{n[:90]}` | {a.per_kernel.get(n, 0.0):.1f} | {b.per_kernel.get(n, 0.0):.1f} | {delta[n]:+.1f} |"
        if rounds is not None:
            line += f" {min(per_round[n]):+.1f} … {max(per_round[n]):+.1f} |"
        lines.append(line)
    return lines + [""]


def rounds_table(rounds: dict[str, list[RunSummary]], orders: list[tuple[str, ...]], unit: str) -> list[str]:
    """Each round's order and each variant's RMSNorm and step time per step."""
    names = list(rounds)
    head = "| round | order | " + " | ".join(f"{n} RMSNorm | {n} step" for n in names) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(names))]
    for i, order in enumerate(orders):
        cells = " | ".join(f"{rounds[n][i].norm_us:.1f} | {rounds[n][i].total_us:.1f}" for n in names)
        lines.append(f"| {i + 1} | {', '.join(order)} | {cells} |")
    return lines + ["", f"({unit} µs per step.)", ""]


def write_summary(logdir: str, summaries: list[RunSummary], norm_bytes_per_step: float, note: str = "",
                  rounds: dict[str, list[RunSummary]] | None = None,
                  orders: list[tuple[str, ...]] | None = None) -> str:
    """Write ``summary.md`` into ``logdir`` from ``summaries`` (one per variant) and return the
    Markdown. With ``rounds`` (each variant's summary per round, variants named as in
    ``summaries``) and ``orders`` (the variants' order in each round), add the rounds' table; on
    device kernels, for two variants, the ratio of their RMSNorm and step times round by round
    (``compare_rounds``), and the per-kernel diff as medians over the rounds."""
    lines = ["# RMSNorm in the profiled training step", ""]
    if note:
        lines += [note, ""]
    unit = "device" if all(s.device_kernels for s in summaries) else "CPU op"
    if rounds is not None:
        if orders is None or any(len(r) != len(orders) for r in rounds.values()):
            raise ValueError("write_summary: orders must give the variants' order for each of the rounds")
        lines += ["## Rounds", "",
                  f"Each variant profiled in each of {len(orders)} rounds, the order alternating, so that drift "
                  "over the run (clocks, the host, other work on the machine) weighs on both alike:", ""]
        lines += rounds_table(rounds, orders, unit)
    for s in summaries:
        lines += [f"## {s.name}", ""]
        if rounds is not None:
            lines += [f"Medians over the {len(orders)} rounds.", ""]
        lines += [f"| RMSNorm-related kernel | calls/step | {unit} µs/step |", "|---|---|---|"]
        lines += [f"| `{name[:90]}` | {c} | {us:.1f} |" for name, (c, us) in s.norm.items()] or ["| (none found) | | |"]
        share = 100 * s.norm_us / s.total_us if s.total_us else 0.0
        line = f"RMSNorm {s.norm_us:.1f} µs of {s.total_us:.1f} µs {unit} time per step ({share:.1f}%)"
        if s.device_kernels and s.norm_us:
            line += f"; {norm_bytes_per_step / (s.norm_us * 1e-6) / 1e9:.0f} GB/s at the norm's byte floor"
        lines += ["", line + ".", ""]
    if len(summaries) == 2 and all(s.norm_us and s.device_kernels for s in summaries):
        a, b = summaries
        if rounds is not None:
            ra, rb = rounds[a.name], rounds[b.name]
            for what, attr in (("RMSNorm time", "norm_us"), ("whole step", "total_us")):
                comparison = compare_rounds(f"{a.name} / {b.name} {what}", [getattr(r, attr) for r in ra],
                                            [getattr(r, attr) for r in rb])
                lines += [f"**{comparison.describe(a.name, b.name)}.**", ""]
        else:
            lines += [f"**{a.name} / {b.name} RMSNorm time: {a.norm_us / b.norm_us:.2f}×**; "
                      f"whole step: {a.total_us / b.total_us:.2f}× (one profile each: drift between them is not "
                      "told apart from a difference).", ""]
    if len(summaries) == 2:
        pair = None if rounds is None else (rounds[summaries[0].name], rounds[summaries[1].name])
        lines += diff_table(*summaries, rounds=pair)
    text = "\n".join(lines)
    with open(os.path.join(logdir, "summary.md"), "w") as f:
        f.write(text + "\n")
    return text
