"""The command line, run as a user would."""

import subprocess
import sys


def _run(*args):
    return subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", *args], capture_output=True, text=True)


def test_help_lists_commands():
    out = _run("--help")
    assert out.returncode == 0 and "check" in out.stdout


def test_check_prints_table_and_passes():
    out = _run("check", "--dtype", "float16", "--large-n", "20000")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "device: " in out.stdout and "float16   dweight     32" in out.stdout
    assert "all cases pass" in out.stdout
