"""The oracle itself: gradcheck in float64, the manual backward against autograd, and F.rms_norm."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import TOL

from torch_rmsnorm_op import reference


def _inputs(m, n, with_weight, dtype=torch.float64):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, n, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(n, generator=g, dtype=dtype) + 1).requires_grad_() if with_weight else None
    return x, w


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("m,n", [(1, 1), (3, 7), (4, 33)])
def test_gradcheck_reference(m, n, with_weight):
    x, w = _inputs(m, n, with_weight)
    inputs = (x, w) if w is not None else (x,)
    assert torch.autograd.gradcheck(lambda *a: reference.rms_norm_forward(a[0], a[1] if len(a) > 1 else None, 1e-5)[0], inputs)
    assert torch.autograd.gradgradcheck(
        lambda *a: reference.rms_norm_forward(a[0], a[1] if len(a) > 1 else None, 1e-5)[0], inputs
    )


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("m,n", [(1, 1), (5, 7), (3, 257)])
def test_manual_backward_matches_autograd(m, n, with_weight):
    x, w = _inputs(m, n, with_weight)
    y, rstd = reference.rms_norm_forward(x, w, 1e-6)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [t for t in (x, w) if t is not None], dy)
    dx, dw = reference.rms_norm_backward(dy, x.detach(), None if w is None else w.detach(), rstd.detach())
    torch.testing.assert_close(dx, grads[0], **TOL[torch.float64])
    if w is not None:
        torch.testing.assert_close(dw, grads[1], **TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("eps", [None, 1e-6, 0.5])
def test_reference_matches_torch(dtype, eps):
    x = torch.randn(4, 3, 8).to(dtype)
    w = torch.randn(3, 8).to(dtype)
    assert torch.equal(reference.rms_norm_reference(x, (3, 8), w, eps), F.rms_norm(x, (3, 8), w, eps))


def test_default_eps_is_the_computation_dtypes():
    # torch uses float32's epsilon for fp16/bf16 inputs, not finfo(input.dtype).eps.
    assert reference.default_eps(torch.bfloat16) == torch.finfo(torch.float32).eps
    assert reference.default_eps(torch.float64) == torch.finfo(torch.float64).eps
