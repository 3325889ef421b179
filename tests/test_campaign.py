"""The correctness campaign, one test per case, plus the N-vs-BLOCK mutation test."""

import importlib.util
import inspect
import sys
import types
from collections import Counter

import pytest
import torch
from tolerances import TOL

from torch_rmsnorm_op.tools import campaign

CASES = campaign.cases(large_n=campaign.LARGE_N_GPU if torch.cuda.is_available() else campaign.LARGE_N_CPU)


def test_campaign_size():
    counts = Counter()
    for case in CASES:
        counts["y"] += 1
        counts["dx"] += 1
        counts["dweight"] += case.has_weight
    assert min(counts.values()) >= 72, counts


@pytest.mark.parametrize("case", CASES, ids=str)
def test_case(case, device):
    results = campaign.run_case(case, device)
    failed = [r for r in results if not r.passed]
    assert not failed, failed


def test_poisoned_output_is_caught(device):
    """The comparison itself fails on an unwritten (NaN) element and on a wrong one."""
    ref = torch.randn(4, 8, dtype=torch.float64)
    out = ref.clone().float()
    assert campaign.compare("y", out, ref, 1e-5, 1e-4).passed
    out[1, 3] = float("nan")
    assert not campaign.compare("y", out, ref, 1e-5, 1e-4).passed
    out = ref.clone().float()
    out[0, 0] += 1e-2
    assert not campaign.compare("y", out, ref, 1e-5, 1e-4).passed


def _mutant(tmp_path):
    """The tutorial's bug planted in a copy of the row kernels: the mean divides by BLOCK_N, not N.
    Returns the package's kernels with the mutant's forward in place of its own."""
    from torch_rmsnorm_op import kernels
    from torch_rmsnorm_op.kernels import rows

    source = inspect.getsource(rows)
    correct = "rstd = _rstd(tl.sum(x * x, axis=1), N, eps)"
    assert source.count(correct) == 1, "the mutation site moved: update the test"
    path = tmp_path / "mutant_rows.py"
    path.write_text(source.replace(correct, "rstd = _rstd(tl.sum(x * x, axis=1), BLOCK_N, eps)"))
    spec = importlib.util.spec_from_file_location("mutant_rows", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutant_rows"] = module
    spec.loader.exec_module(module)
    return types.SimpleNamespace(**{name: getattr(kernels, name) for name in kernels.__all__}
                                 | {"_rms_norm_fwd_rows": module._rms_norm_fwd_rows})


@pytest.mark.parametrize("n,caught", [(257, True), (256, False)])
def test_mutation_n_vs_block(tmp_path, device, n, caught):
    mutant = _mutant(tmp_path)
    for dtype in campaign.DTYPES:
        results = campaign.run_case(campaign.Case(dtype, 17, n, True, False), device, kernels=mutant)
        y = next(r for r in results if r.quantity == "y")
        assert y.passed is not caught, (dtype, n, y)


def test_campaign_tolerances_are_no_looser_than_the_tests():
    """The tests declare their own table (``tests/tolerances.py``); a case the campaign passes
    is within it, so ``python -m torch_rmsnorm_op check`` passing says what the tests accept."""
    for dtype, (atol, rtol) in campaign.TOLERANCES.items():
        assert atol <= TOL[dtype]["atol"] and rtol <= TOL[dtype]["rtol"], dtype
