"""The demo end to end on this machine's device, its trace summary, and TensorBoard over its runs."""

import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from checks import run_once

from torch_rmsnorm_op.tools import demo
from torch_rmsnorm_op.tools.demo import NormCount, chart, count_norms, plot_summary, round_orders
from torch_rmsnorm_op.tools.trace_summary import RunSummary, compare_rounds, kernel_name, median_summary, write_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNT = re.compile(r"(\d+) norms: (\d+) run the library's kernels, (\d+) left to Inductor's fused kernels")


def _run_demo(logdir):
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "demo", "--logdir", str(logdir)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture
def demo_logdir(tmp_path_factory):
    """One demo run, read by every test here: its log folder and what it printed."""
    return run_once(tmp_path_factory, "demo", _run_demo)


def test_demo_writes_runs_summary_and_says_how_to_view(demo_logdir):
    logdir, stdout = demo_logdir
    assert "outputs agree" in stdout and "tensorboard --logdir" in stdout
    for run in ("stock", "patched"):
        # one trace per run (the last round's), so TensorBoard shows one profile of each
        assert len(list((logdir / run).glob("*.pt.trace.json"))) == 1, run
        assert list((logdir / run).glob("events.out.tfevents.*")), run
    summary = (logdir / "summary.md").read_text()
    # CPU: the ops as calls (the final norm, of a residual sum of stored tensors, takes its add;
    # the first two, of the embeddings and of a sum with them, are Inductor's); GPU: our kernels.
    assert ("`rmsnorm::add_fwd` | 1 |" in summary and "`rmsnorm::fwd`" not in summary) or "_rms_norm_fwd" in summary
    # The diff lists device kernels on a GPU (ours: _rms_norm_*), CPU ops on CPU (rmsnorm::*).
    assert "## Per-kernel diff (patched − stock" in summary
    diff = summary.split("## Per-kernel diff")[1]
    assert "| `_rms_norm_" in diff or "| `rmsnorm::" in diff, diff
    assert (logdir / "summary.png").stat().st_size > 0
    if "CPU" in summary:
        assert "not GPU timings" in summary


def test_demo_accounts_for_every_norm(demo_logdir):
    """Printed and in the summary: every swapped norm, on the library's kernels or left to
    Inductor's (the first layer's two norms, of the embeddings and of a sum with them)."""
    logdir, stdout = demo_logdir
    shape = demo.GPU_SHAPE if torch.cuda.is_available() else demo.CPU_SHAPE
    want = f"{shape.norms} norms: {shape.norms - 2} run the library's kernels, 2 left to Inductor's fused kernels"
    assert f"patched model: {want}" in stdout, stdout
    assert want in (logdir / "summary.md").read_text()


def _section(summary: str, name: str) -> str:
    return summary.split(f"## {name}\n")[1].split("\n## ")[0]


def test_demo_profiles_the_variants_in_alternating_rounds(demo_logdir):
    logdir, _ = demo_logdir
    summary = (logdir / "summary.md").read_text()
    rows = [line for line in _section(summary, "Rounds").splitlines() if re.match(r"\| \d+ \|", line)]
    on_gpu = torch.cuda.is_available()
    assert len(rows) == demo.ROUNDS["cuda" if on_gpu else "cpu"], summary
    assert [row.split("|")[2].strip() for row in rows[:2]] == ["stock, patched", "patched, stock"], rows
    for row in rows:  # every round timed both variants
        assert all(float(cell) > 0 for cell in row.split("|")[3:7]), row
    if on_gpu:  # the ratios by their median and range over the rounds
        assert "stock / patched whole step: " in summary and "(median; " in summary
    else:  # interpreted kernels against compiled C++: no ratio
        assert "×" not in summary and "no ratio" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU summary's contents (a GPU run lists device kernels)")
def test_cpu_demo_lists_inductors_norm_kernels_for_both_variants(demo_logdir):
    """On CPU Inductor's C++ kernels are recorded as events: the stock run's norms are its
    kernels (forward and backward), the patched run's the library's ops beside the kernel of the
    norm left to Inductor."""
    logdir, _ = demo_logdir
    summary = (logdir / "summary.md").read_text()
    stock, patched = _section(summary, "stock"), _section(summary, "patched")
    assert "(none found)" not in stock
    stock_kernels = re.findall(r"\| `(cpp_fused\w+)` \| (\d+) \|", stock)
    assert any("rsqrt" in k for k, _ in stock_kernels) and any("rsqrt" not in k for k, _ in stock_kernels), stock
    assert "`rmsnorm::add_fwd`" in patched and "`rmsnorm::add_bwd`" in patched, patched
    assert re.search(r"`cpp_fused_\w*embedding\w*rsqrt\w*`", patched), patched
    assert not re.search(r"`graph_\d+_", summary), "kernel names keep Inductor's graph number"


def _png_description(path) -> str:
    data, pos = path.read_bytes(), 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        if data[pos + 4:pos + 8] == b"tEXt":
            key, _, value = data[pos + 8:pos + 8 + length].partition(b"\0")
            if key == b"Description":
                return value.decode("latin-1")
        pos += 12 + length
    raise AssertionError(f"{path} has no Description")


def test_demo_chart_says_what_its_times_are(demo_logdir):
    logdir, _ = demo_logdir
    on_cpu = "CPU" in (logdir / "summary.md").read_text()
    description = _png_description(logdir / "summary.png")
    if on_cpu:
        assert "Triton interpreter" in description and "not GPU timings" in description
    else:
        assert description.startswith("GPU kernel time")


@pytest.mark.parametrize("where", ["cpu", "cuda"], ids=["interpreter-times", "gpu-times"])
def test_chart_labels_follow_the_device(tmp_path, where):
    gpu = where == "cuda"
    runs = [RunSummary("stock", 3, gpu, total_us=100.0), RunSummary("patched", 3, gpu, {"k": (5, 20.0)}, 90.0)]
    assert plot_summary(runs, str(tmp_path / "chart.png"), where)
    description = _png_description(tmp_path / "chart.png")
    assert ("not GPU timings" in description) == (not gpu)


def test_cpu_chart_draws_each_run_on_its_own_axis():
    """On CPU the interpreted kernels and Inductor's compiled C++ are not comparable: one axis per
    run, none shared, so a 40x longer interpreted bar is not drawn beside the stock one. On a
    GPU both runs share one axis."""
    runs = [RunSummary("stock", 1, False, {"cpp_fused_mean_pow_rsqrt_0": (1, 10.0)}, 100.0),
            RunSummary("patched", 1, False, {"rmsnorm::add_fwd": (2, 3000.0), "cpp_fused_embedding_rsqrt_0": (1, 5.0)},
                       4000.0)]
    fig = chart(runs, "cpu")
    axes = fig.axes
    assert len(axes) == 2 and not axes[0].get_shared_x_axes().joined(axes[0], axes[1])
    assert axes[0].get_xlim()[1] < 200 < 3000 < axes[1].get_xlim()[1]
    assert "not comparable" in fig.get_suptitle()
    # the patched bar splits the library's ops from Inductor's kernel of the norm it was left
    labels = axes[0].get_legend_handles_labels()[1]
    assert any("interpreter" in label for label in labels) and any("compiled C++" in label for label in labels)
    fig = chart([RunSummary(r.name, 1, True, r.norm, r.total_us) for r in runs], "cuda")
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) == 6  # two runs x three parts


def test_kernel_names_lose_inductors_graph_number():
    assert kernel_name("graph_12_cpp_fused_add_mean_mul_pow_rsqrt_1") == "cpp_fused_add_mean_mul_pow_rsqrt_1"
    assert kernel_name("rmsnorm::add_fwd") == "rmsnorm::add_fwd"
    assert kernel_name("triton_red_fused_mean_pow_rsqrt_0") == "triton_red_fused_mean_pow_rsqrt_0"


@pytest.mark.parametrize("stats, want", [
    # through the interpreter a compiled graph calls each op: one forward and its backward
    ({"kernel": {"rmsnorm.add_fwd": 2, "rmsnorm.add_bwd": 2}, "fallback": {}, "compiled": {}}, (3, 2, 0, 1)),
    # a graph launching the kernels itself: its call sites, counted while traced
    ({"kernel": {}, "fallback": {}, "compiled": {"rmsnorm.add_fwd: kernel": 8, "rmsnorm.add_bwd: kernel": 8}},
     (9, 8, 0, 1)),
    # a norm_add_fwd computes two norms; a site decided for the reference is the library's op all the same
    ({"kernel": {}, "fallback": {}, "compiled": {"rmsnorm.norm_add_fwd: kernel": 2, "rmsnorm.fwd: reference (N)": 1}},
     (6, 4, 1, 1)),
    ({"kernel": {"rmsnorm.fwd": 1}, "fallback": {"rmsnorm.add_fwd: dtype float64": 1}, "compiled": {}}, (2, 1, 1, 0)),
    # nothing counted: every norm left to Inductor
    ({"kernel": {}, "fallback": {}, "compiled": {}}, (3, 0, 0, 3)),
])
def test_count_norms_accounts_for_every_swapped_norm(stats, want):
    count = count_norms(want[0], stats)
    assert (count.norms, count.kernels, count.reference, count.inductor) == want
    assert count.kernels + count.reference + count.inductor == count.norms
    text = str(count)
    assert COUNT.match(text).groups() == tuple(map(str, (want[0], want[1], want[3]))), text
    assert ("run the PyTorch reference" in text) == bool(want[2])


def test_count_norms_refuses_more_ops_than_norms():
    with pytest.raises(ValueError, match="more than the 2 swapped modules"):
        count_norms(2, {"kernel": {"rmsnorm.fwd": 3}})
    with pytest.raises(ValueError, match="swapped must be >= 0"):
        count_norms(-1, {})
    assert str(NormCount(1, 1)) == "1 norms: 1 run the library's kernels, 0 left to Inductor's fused kernels"


def test_rounds_alternate_the_order():
    assert round_orders(3) == [("stock", "patched"), ("patched", "stock"), ("stock", "patched")]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        round_orders(0)


def test_round_comparison_reports_only_what_every_round_agrees_on():
    norm = compare_rounds("norm", [105.0, 106.0, 104.0], [100.0, 100.0, 100.0])
    assert norm.resolved and norm.median == pytest.approx(1.05)
    assert "patched faster in every round" in norm.describe("stock", "patched")
    step = compare_rounds("step", [96.0, 102.0, 99.0], [100.0, 100.0, 100.0])
    assert not step.resolved and (step.low, step.high) == (pytest.approx(0.96), pytest.approx(1.02))
    assert "not resolved" in step.describe("stock", "patched")
    assert "stock faster" in compare_rounds("x", [90.0, 95.0], [100.0, 100.0]).describe("stock", "patched")
    assert "one round" in compare_rounds("x", [100.0], [100.0]).describe("stock", "patched")
    with pytest.raises(ValueError, match="one time per round"):
        compare_rounds("x", [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        compare_rounds("x", [1.0], [0.0])


def _gpu_round(name, norm_us, matmul_us):
    kernels = {"_rms_norm_fwd_rows": norm_us} if name == "patched" else {"triton_red_fused_pow_rsqrt_0": norm_us}
    per_kernel = dict(kernels, sm90_xmma_gemm=matmul_us)
    return RunSummary(name, 3, True, {k: (9, us) for k, us in kernels.items()}, sum(per_kernel.values()), per_kernel)


def test_summary_of_gpu_rounds_resolves_the_norm_and_not_the_drifting_matmuls(tmp_path):
    """The norm kernels faster in every round, the matmuls drifting by more than that between the
    variants' rounds: the summary gives the norm's ratio as resolved and the step's as not, and
    the diff shows the matmuls' range across zero."""
    stock = [_gpu_round("stock", 105.0, 1000.0), _gpu_round("stock", 105.0, 1200.0), _gpu_round("stock", 105.0, 990.0)]
    patched = [_gpu_round("patched", 100.0, 1210.0), _gpu_round("patched", 100.0, 1000.0),
               _gpu_round("patched", 100.0, 1000.0)]
    rounds = {"stock": stock, "patched": patched}
    summaries = [median_summary(stock), median_summary(patched)]
    text = write_summary(str(tmp_path), summaries, 1e6, rounds=rounds, orders=round_orders(3))
    assert (tmp_path / "summary.md").read_text().strip() == text.strip()
    assert "**stock / patched RMSNorm time: 1.05× (median; 1.05–1.05 over 3 rounds; patched faster in every round).**" \
        in text, text
    assert "stock / patched whole step: " in text and "not resolved: the rounds disagree" in text
    matmul = next(line for line in text.splitlines() if line.startswith("| `sm90_xmma_gemm`"))
    assert matmul.endswith("| -200.0 … +210.0 |") and "| +10.0 |" in matmul, matmul
    assert len([line for line in _section(text, "Rounds").splitlines() if re.match(r"\| \d \|", line)]) == 3
    with pytest.raises(ValueError, match="orders must give"):
        write_summary(str(tmp_path), summaries, 1e6, rounds=rounds, orders=round_orders(2))


def test_compile_model_example_accounts_for_every_norm():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "compile_model.py")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Dynamo graph: 5 calls" in out.stdout, out.stdout
    # TinyLlama of two layers: five norms, the first layer's input norm (of the embeddings) Inductor's
    assert "compiled model: 5 norms: 3 run the library's kernels, 2 left to Inductor's fused kernels" in out.stdout


def _get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/{path}", timeout=10) as r:
        return json.loads(r.read())


def test_tensorboard_profiler_plugin_serves_both_runs(demo_logdir):
    pytest.importorskip("torch_tb_profiler", reason="torch-tb-profiler is not installed here")
    logdir, _ = demo_logdir
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        deadline = time.monotonic() + 120
        runs = None
        while time.monotonic() < deadline:
            try:
                runs = _get(port, "runs")
                if not runs["loading"] and len(runs["runs"]) == 2:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert runs and sorted(runs["runs"]) == ["patched", "stock"], runs
        views = _get(port, "views?run=patched")
        assert "Operator" in views, views
        (worker,) = _get(port, "workers?run=patched&view=Operator")
        (span,) = _get(port, f"spans?run=patched&worker={worker}")
        table = _get(port, f"operation/table?run=patched&worker={worker}&span={span}&view=Operator&group_by=Operation")
        names = {row["name"] for row in table["data"]}
        if torch.cuda.is_available():  # the compiled graphs launch our kernels: kernels, not ops
            kernels = json.dumps(_get(port, f"kernel/table?run=patched&worker={worker}&span={span}&group_by=Kernel"))
            assert "_rms_norm_fwd" in kernels and "_rms_norm_bwd" in kernels, kernels[:2000]
        else:
            assert "rmsnorm::add_fwd" in names and "rmsnorm::add_bwd" in names, sorted(names)[:20]
    finally:
        tb.terminate()
        tb.wait(timeout=30)
