"""The suite's own setup (``conftest.py``), run on a small suite of its own."""

import os
import shutil
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

SUITE = '''
import pytest


def test_skipped_for_a_reason_of_its_own():
    pytest.skip("no such backend here")


@pytest.mark.cuda
def test_needing_a_gpu():
    pass


def test_running():
    pass
'''


def test_skips_other_than_the_cuda_markers_are_listed_with_their_reasons(tmp_path):
    """Under ``-q`` (the README's command) a skip is one letter in a count: the run ends by listing
    each skip that is not the ``cuda`` marker's, with its reason."""
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path)
    (tmp_path / "test_small.py").write_text(SUITE)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                          "markers=cuda: needs a CUDA GPU", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    listed = out.stdout.split("skipped here, not for want of a GPU")[1]
    assert "test_small.py::test_skipped_for_a_reason_of_its_own: no such backend here" in listed, out.stdout
    cuda_skips = 0 if torch.cuda.is_available() else 1
    assert "test_needing_a_gpu" not in listed and f"{1 + cuda_skips} skipped" in out.stdout, out.stdout

