"""The demo end to end on this machine's device, its trace summary, and TensorBoard over its runs."""

import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from checks import run_once

from torch_rmsnorm_op.tools.demo import plot_summary
from torch_rmsnorm_op.tools.trace_summary import RunSummary


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
        assert list((logdir / run).glob("*.pt.trace.json")), run
        assert list((logdir / run).glob("events.out.tfevents.*")), run
    summary = (logdir / "summary.md").read_text()
    # CPU: the ops as calls (the two norms after residual adds fused; the first, which reads the
    # embeddings, is Inductor's); GPU: our kernels.
    assert ("`rmsnorm::add_fwd` | 2 |" in summary and "`rmsnorm::fwd`" not in summary) or "_rms_norm_fwd" in summary
    # The diff lists device kernels on a GPU (ours: _rms_norm_*), CPU ops on CPU (rmsnorm::*).
    assert "## Per-kernel diff (patched − stock" in summary
    diff = summary.split("## Per-kernel diff")[1]
    assert "| `_rms_norm_" in diff or "| `rmsnorm::" in diff, diff
    assert (logdir / "summary.png").stat().st_size > 0
    if "CPU" in summary:
        assert "not GPU timings" in summary


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
