"""Training with the ops: the tutorial's integration run, and bit-exact resume after signals."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_tiny_gpt.py")
# A GPU runs a step in milliseconds: enough steps that the signals land mid-run.
STEPS = 1500 if torch.cuda.is_available() else 8


def test_integration_run(tmp_path):
    """``train-integration`` trains the reference and kernel paths side by side: every step's
    forward and backward runs on the kernels (no fallback), and the saved weights reload exactly."""
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "train-integration", "--steps", "25", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kernel path ran 25 forwards and 25 backwards (fallbacks: none)" in out.stdout
    assert "reload max |error| 0.0" in out.stdout


def _start(out_dir, *extra):
    return subprocess.Popen([sys.executable, SCRIPT, "--steps", str(STEPS), "--out", str(out_dir), "--logdir", "",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lines(out_dir):
    path = out_dir / "loss.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def _wait_for_lines(proc, out_dir, n, timeout=300):
    deadline = time.monotonic() + timeout
    while len(_lines(out_dir)) < n:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.05)


def test_resume_after_sigterm_is_bit_exact(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    proc = _start(straight)
    assert proc.wait(timeout=600) == 0, proc.stdout.read()

    proc = _start(interrupted)
    _wait_for_lines(proc, interrupted, 2)
    proc.send_signal(signal.SIGUSR1)  # save and continue
    deadline = time.monotonic() + 300
    while not (interrupted / "checkpoint.pt").exists():  # handled at the end of the step in flight
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    _wait_for_lines(proc, interrupted, len(_lines(interrupted)) + 1)  # past the SIGUSR1 step
    proc.send_signal(signal.SIGTERM)  # save and exit
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, f"exit status {proc.returncode} after {len(_lines(interrupted))} steps; log:\n{log}"
    assert "SIGUSR1: checkpoint" in log and "SIGTERM: checkpoint" in log
    stopped_at = len(_lines(interrupted))
    assert stopped_at < STEPS, "the run finished before the signal: nothing was resumed"

    proc = _start(interrupted, "--resume")
    assert proc.wait(timeout=600) == 0, proc.stdout.read()

    want = [json.loads(line) for line in _lines(straight)]
    got = [json.loads(line) for line in _lines(interrupted)]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got == want  # every loss bit for bit (JSON keeps the float's exact repr)
    a = torch.load(straight / "checkpoint.pt", weights_only=False)
    b = torch.load(interrupted / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == STEPS
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert (interrupted / "loss.png").exists()
