"""The command line, run as a user would."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from torch_rmsnorm_op.cli import build_parser, main
from torch_rmsnorm_op.tools import campaign


def _run(*args):
    return subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", *args], capture_output=True, text=True)


def _table(stdout: str) -> list[list[str]]:
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] in (["float32"], ["float16"],
                                                                                  ["bfloat16"])]
    assert rows, stdout
    return rows


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_lists_commands_in_plain_text():
    out = _run("--help")
    assert out.returncode == 0
    assert all(command in out.stdout for command in ("check", "demo", "bench", "bench-models", "train-integration"))
    # what a terminal shows: no reStructuredText or Markdown markup
    assert not re.search(r"``|`|:(func|class|mod|meth):", out.stdout), out.stdout


def test_train_integration_help_shows_what_steps_is_and_its_default():
    out = _run("train-integration", "--help")
    assert out.returncode == 0, out.stderr
    steps = out.stdout[out.stdout.index("--steps STEPS"):]
    assert "Adam steps" in steps and "(default: 100)" in " ".join(steps.split()), out.stdout


@pytest.mark.parametrize("argv", [["train-integration", "--steps", "0"], ["bench", "--iters", "-1"],
                                  ["bench", "--repeats", "two"]])
def test_counts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"{argv[1]} must be a positive integer" in capsys.readouterr().err


def test_bench_writes_outside_the_committed_results_by_default():
    """``bench`` and ``bench --smoke`` default to a folder git ignores, not ``profiling/results/``."""
    for argv in (["bench"], ["bench", "--smoke"]):
        out = build_parser().parse_args(argv).out
        assert not os.path.isabs(out) and not out.startswith("profiling"), out
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: no ignore rules to check the folder against")
    ignored = subprocess.run(["git", "check-ignore", "-q", os.path.join(out, "x.json")], cwd=ROOT)
    assert ignored.returncode == 0, f"{out} is not ignored by git"


def test_check_prints_table_progress_and_passes():
    out = _run("check", "--dtype", "float16", "--large-n", "20000")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "device: " in out.stdout and "float16   dweight     32" in out.stdout
    assert "all cases pass" in out.stdout
    # Progress by default, on stderr (a line per tenth when stderr is not a terminal).
    lines = [line for line in out.stderr.splitlines() if re.match(r"\d+/64 cases, \d+ s: float16-", line)]
    assert 10 <= len(lines) <= 12 and lines[-1].startswith("64/64 cases"), out.stderr


def test_check_table_shows_the_applied_tolerance(monkeypatch, capsys):
    """Each row shows the atol applied (dweight's grows with sqrt(M)), the rtol, and the worst ratio of
    error to allowed error, which is <= 1 exactly where the row passes, whatever max abs err shows."""
    every = campaign.cases
    monkeypatch.setattr(campaign, "cases", lambda **kw: [c for c in every(**kw) if c.n in (257, 4097)])
    assert main(["check", "--dtype", "bfloat16", "--quiet"]) == 0
    out = capsys.readouterr()
    assert "worst err/allowed" in out.out and "atol applied" in out.out
    rows = {row[1]: row for row in _table(out.out)}
    atol, rtol = campaign.TOLERANCES[torch.bfloat16]
    assert rows["dweight"][5] == f"{atol:.2e}..{atol * 17 ** 0.5:.2e}"  # M in (1, 17)
    assert rows["y"][5] == f"{atol:.2e}" and rows["y"][6] == f"{rtol:.2e}"
    for row in rows.values():
        assert row[-1] == "yes" and float(row[-2]) <= 1.0, row


def test_check_quiet_and_no_progress_are_silent(monkeypatch, capsys):
    every = campaign.cases
    monkeypatch.setattr(campaign, "cases", lambda **kw: every(**kw)[:3])
    for flag in ("--quiet", "--no-progress"):
        assert main(["check", "--dtype", "float32", flag]) == 0
        out = capsys.readouterr()
        assert out.err == "" and "all cases pass" in out.out, flag
    assert main(["check", "--dtype", "float32"]) == 0
    assert "3/3 cases" in capsys.readouterr().err


def test_a_failing_comparison_shows_a_ratio_above_one():
    ref = torch.tensor([1.0, 100.0], dtype=torch.float64)
    out = ref + torch.tensor([0.5e-3, 2e-2], dtype=torch.float64)  # allowed: 1e-3 + 1e-4 * |ref|
    comp = campaign.compare("y", out, ref, 1e-3, 1e-4)
    assert not comp.passed and comp.worst_ratio == pytest.approx(2e-2 / (1e-3 + 1e-2))
    assert campaign.compare("y", ref.clone(), ref, 1e-3, 1e-4).worst_ratio == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a GPU")
@pytest.mark.parametrize("command", ["bench", "bench-models"])
def test_benchmarks_without_a_gpu_say_so(command):
    out = _run(command, "--out", "/nonexistent")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{command}: no CUDA GPU here" in out.stderr and f"{command} --smoke" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
