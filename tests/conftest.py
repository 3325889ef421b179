"""Test setup: where the kernels run, the ``cuda`` marker, and a clean policy per test.

Without CUDA the kernels run on CPU tensors through the Triton interpreter,
which must be chosen before any kernel is defined, hence before the package
is imported anywhere.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch_rmsnorm_op  # noqa: E402
from torch_rmsnorm_op import fallback  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run here: CUDA, else CPU through the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _clean_policy(monkeypatch):
    monkeypatch.delenv(fallback.ENV_VAR, raising=False)
    torch_rmsnorm_op.set_fallback_policy(None)
    torch_rmsnorm_op.reset_dispatch_stats()
    yield
    torch_rmsnorm_op.set_fallback_policy(None)
