"""``rms_norm`` and ``RMSNorm`` against ``torch.nn.functional.rms_norm`` / ``nn.RMSNorm``:
PyTorch's own OpInfo samples and error inputs, dtypes, gradients, and the module contract."""

import contextlib
import math
import sys
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tolerances import TOL, grad_tol
from torch import nn

import torch_rmsnorm_op as T
from torch_rmsnorm_op import functional, ops

# The samples of PyTorch's OpInfo for nn.functional.rms_norm (input shape,
# normalized_shape, kwargs), with and without weight.
OPINFO_CASES = [
    ((1, 2, 3), (1, 2, 3), {"eps": 0.5}),
    ((2, 2, 3), (2, 3), {"eps": -0.5}),
    ((1,), (1,), {}),
    ((1, 2), (2,), {}),
    ((0, 1), (1,), {}),
    ((4, 3, 33), (33,), {"eps": 1e-5}),
]


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("shape,normalized_shape,kwargs", OPINFO_CASES)
def test_matches_torch(device, dtype, with_weight, shape, normalized_shape, kwargs):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(shape, generator=g, dtype=torch.float64) * 20 - 10).to(device=device, dtype=dtype)
    w = (torch.rand(normalized_shape, generator=g, dtype=torch.float64) * 4 - 2).to(device=device, dtype=dtype) if with_weight else None
    leaves = [t.requires_grad_() for t in (x, w) if t is not None]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    with T.fallback_policy("reference"):
        y = T.rms_norm(x, normalized_shape, w, **kwargs)
    y_ref = F.rms_norm(copies[0], normalized_shape, copies[1] if w is not None else None, **kwargs)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **TOL[dtype], equal_nan=True)
    if y.numel() and not dtype.is_complex:
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, leaves, dy)
        grads_ref = torch.autograd.grad(y_ref, copies, dy)
        for a, b in zip(grads, grads_ref):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **grad_tol(dtype), equal_nan=True)
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert not any(k.startswith("rmsnorm.fwd") for k in T.dispatch_stats()["fallback"])


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.float16, torch.bfloat16), (torch.float32, torch.float64),
                                               (torch.float16, torch.int32)])
def test_mixed_weight_dtypes(device, x_dtype, w_dtype):
    x = torch.randn(5, 16, device=device).to(x_dtype)
    w = torch.randint(-3, 4, (16,), device=device).to(w_dtype)
    with T.fallback_policy("reference"):
        y = T.rms_norm(x, (16,), w)
    y_ref = F.rms_norm(x, (16,), w)
    assert y.dtype == y_ref.dtype == x_dtype
    torch.testing.assert_close(y, y_ref, **TOL[x_dtype])


def test_eps_none_and_multi_dim_weight_layouts(device):
    x = torch.randn(2, 3, 4, 5, device=device, dtype=torch.bfloat16) * 1e-3
    w = torch.randn(5, 4, device=device, dtype=torch.bfloat16).t()  # non-contiguous weight
    torch.testing.assert_close(T.rms_norm(x, (4, 5), w), F.rms_norm(x, (4, 5), w), **TOL[torch.bfloat16])
    torch.testing.assert_close(T.rms_norm(x, [5]), F.rms_norm(x, [5]), **TOL[torch.bfloat16])


# PyTorch's error inputs for rms_norm, with the regexes its OpInfo tests match.
ERROR_CASES = [
    (lambda d: (torch.randn(1, 2, 3, device=d), (), None), "Expected normalized_shape to be at least 1-dimensional"),
    (lambda d: (torch.randn(1, 2, 3, device=d), (1, 2, 3), torch.randn(1, 2, device=d)),
     "Expected weight to be of same shape as normalized_shape"),
    (lambda d: (torch.randn(2, 2, 3, device=d), (2, 2), None), "Given normalized_shape="),
    (lambda d: (torch.ones(2, 3, dtype=torch.int64, device=d), (3,), None), "not implemented for"),
]


@pytest.mark.parametrize("make,regex", ERROR_CASES)
def test_errors_like_torch(device, make, regex):
    x, shape, w = make(device)
    with pytest.raises(RuntimeError, match=regex):
        F.rms_norm(x, shape, w)
    with pytest.raises(RuntimeError, match=regex):
        T.rms_norm(x, shape, w)


def test_normalized_shape_longer_than_input(device):
    # torch raises ValueError here; ours is a ValueError and a RuntimeError.
    with pytest.raises(ValueError):
        F.rms_norm(torch.randn(3, device=device), (2, 3))
    with pytest.raises(ValueError, match="Given normalized_shape="):
        T.rms_norm(torch.randn(3, device=device), (2, 3))


def test_integer_input_raises_not_implemented(device):
    with pytest.raises(NotImplementedError, match="input must be a floating-point or complex"):
        T.rms_norm(torch.ones(2, 3, dtype=torch.int32, device=device), (3,))
    with pytest.raises(TypeError, match="normalized_shape"):
        T.rms_norm(torch.ones(2, 3, device=device), 3)
    with pytest.raises(TypeError, match="normalized_shape"):
        T.rms_norm(torch.ones(2, 3, device=device), (3.0,))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors", "ignore:Sparse CSR tensor support")
def test_tensors_without_strided_rows_are_refused_by_name(device):
    """Sparse, sparse-compressed and strided nested tensors (torch's own errors there name no
    argument) are refused, naming the argument and the layout, before anything runs; a jagged
    nested input is normalized."""
    x = torch.randn(3, 8, device=device)
    nested = torch.nested.nested_tensor([x[:1], x[1:]])  # layout=torch.strided
    cases = [
        (lambda: T.rms_norm(x.to_sparse(), (8,)), "rms_norm: input must be a strided tensor or a jagged nested "
                                                  "tensor .*, got layout torch.sparse_coo"),
        (lambda: T.rms_norm(x.to_sparse_csr(), (8,)), "input must be .*, got layout torch.sparse_csr"),
        (lambda: T.rms_norm(nested, (8,)), "input must be .*, got a nested tensor of layout torch.strided"),
        (lambda: T.rms_norm(x, (8,), torch.ones(8, device=device).to_sparse()),
         "rms_norm: weight must be a strided tensor, got layout torch.sparse_coo"),
        (lambda: T.add_rms_norm(x, x.to_sparse(), (8,)), "rmsnorm.add_fwd: residual must be a strided tensor"),
        (lambda: torch.ops.rmsnorm.fwd(x.to_sparse(), None, 1e-6), "rmsnorm.fwd: x must be a strided tensor"),
        (lambda: torch.ops.rmsnorm.bwd(x.to_sparse(), x, None, torch.ones(3, device=device)),
         "rmsnorm.bwd: dy must be a strided tensor"),
    ]
    T.rms_norm(x[:1].expand(3, 8), (8,))  # a strided x whose strides are a sparse one's: (0, 0) for [1, 8]
    T.reset_dispatch_stats()
    for call, regex in cases:
        with pytest.raises(T.RMSNormInputError, match=regex):
            call()
    assert T.dispatch_stats() == {"kernel": {}, "fallback": {}, "compiled": {}, "sites": {}}
    jagged = torch.nested.nested_tensor([x[:1], x[1:]], layout=torch.jagged)
    torch.testing.assert_close(T.rms_norm(jagged, (8,)).values(), F.rms_norm(x, (8,)), **TOL[torch.float32])


@pytest.mark.parametrize("eps", ["1e-6", [1e-6], object()])
def test_eps_of_another_type_raises_like_torch(device, eps):
    """``F.rms_norm`` refuses an eps that is not a number (``TypeError: ... must be float``)."""
    x = torch.randn(3, 8, device=device)
    for f in (T.rms_norm, torch.nn.functional.rms_norm):
        with pytest.raises(TypeError, match="eps"):
            f(x, (8,), None, eps)


@pytest.mark.parametrize("eps", [True, 1, torch.tensor(1e-6)])
def test_eps_torch_converts_is_accepted(device, eps):
    x = torch.randn(3, 8, device=device)
    torch.testing.assert_close(T.rms_norm(x, (8,), None, eps), torch.nn.functional.rms_norm(x, (8,), None, eps))


def test_op_contract_errors(device):
    x = torch.randn(4, 8, device=device)
    rstd = torch.ones(4, device=device)
    cases = [
        (lambda: torch.ops.rmsnorm.fwd(x, torch.ones(7, device=device), 1e-6), r"weight must have shape \[N\] = \[8\]"),
        (lambda: torch.ops.rmsnorm.fwd(x.to(torch.int32), None, 1e-6), "x must have a real floating-point dtype"),
        (lambda: torch.ops.rmsnorm.fwd(torch.tensor(1.0, device=device), None, 1e-6), "at least 1 dimension"),
        (lambda: torch.ops.rmsnorm.bwd(torch.randn(4, 7, device=device), x, None, rstd), "dy must have x's shape"),
        (lambda: torch.ops.rmsnorm.bwd(x.to(torch.int32), x, None, rstd), "dy must have a real floating-point dtype"),
        (lambda: torch.ops.rmsnorm.bwd(x, x, None, torch.ones(5, device=device)), r"rstd must have shape x.shape\[:-1\]"),
        (lambda: torch.ops.rmsnorm.bwd(x, x, None, rstd.double()), "rstd must be torch.float32"),
        (lambda: torch.ops.rmsnorm.fwd(x, torch.ones(8, dtype=torch.complex64, device=device), 1e-6), "weight must be real"),
    ]
    for call, regex in cases:
        with pytest.raises(T.RMSNormInputError, match=regex):
            call()
    assert T.dispatch_stats() == {"kernel": {}, "fallback": {}, "compiled": {}, "sites": {}}  # rejected before anything ran


@pytest.mark.parametrize("path", ["direct", "dispatched"])
def test_keyword_dtypes_and_residual_errors_on_either_path(device, path):
    """``rms_norm`` and ``add_rms_norm`` raise the ops' own errors for a ``norm_dtype`` or
    ``out_dtype`` that is not a floating-point dtype and for a residual of another shape or an
    integer dtype, whether the call goes straight to the implementation (no gradient) or
    through the dispatcher (x requires grad); nothing runs before."""
    x, w = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    if path == "dispatched":
        x.requires_grad_()
    cases = [
        (lambda: T.rms_norm(x, (8,), w, norm_dtype=torch.int32), T.RMSNormDTypeError,
         "rmsnorm.fwd: norm_dtype must be None or a real floating-point dtype"),
        (lambda: T.rms_norm(x, (8,), w, out_dtype=torch.int64), T.RMSNormDTypeError,
         "rmsnorm.fwd: out_dtype must be None or a real floating-point dtype"),
        (lambda: T.add_rms_norm(x, torch.randn(4, 8, device=device), (8,), w, out_dtype=torch.bool),
         T.RMSNormDTypeError, "rmsnorm.add_fwd: out_dtype must be None"),
        (lambda: T.add_rms_norm(x, torch.randn(4, 7, device=device), (8,), w), T.RMSNormInputError,
         r"rmsnorm.add_fwd: residual must have x's shape \[4, 8\], got \[4, 7\]"),
        (lambda: T.add_rms_norm(x, torch.ones(4, 8, dtype=torch.int32, device=device), (8,), w), T.RMSNormDTypeError,
         "rmsnorm.add_fwd: residual must have a real floating-point dtype"),
    ]
    for call, error, regex in cases:
        with pytest.raises(error, match=regex):
            call()
    assert T.dispatch_stats() == {"kernel": {}, "fallback": {}, "compiled": {}, "sites": {}}


def test_input_made_under_inference_mode_trains_the_weight(device):
    """Features made under ``torch.inference_mode`` (inference tensors, which autograd cannot
    save) normalized outside it with a weight that is trained: the weight's gradient is
    ``F.rms_norm``'s of a normal copy of the features (torch's own CUDA ``rms_norm`` refuses an
    inference tensor), through ``rms_norm`` and ``add_rms_norm``."""
    with torch.inference_mode():
        x, r = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    w = torch.rand(8, device=device, requires_grad=True)
    g = torch.randn(4, 8, device=device)
    xc, rc = x.clone(), r.clone()
    for ours, torchs in ((lambda: T.rms_norm(x, (8,), w), lambda: F.rms_norm(xc, (8,), w)),
                         (lambda: T.add_rms_norm(x, r, (8,), w)[0], lambda: F.rms_norm(xc + rc, (8,), w))):
        (want,) = torch.autograd.grad(torchs(), w, g)
        (got,) = torch.autograd.grad(ours(), w, g)
        torch.testing.assert_close(got, want, **grad_tol(torch.float32))


@pytest.mark.cuda
def test_weight_on_another_device():
    with pytest.raises(T.RMSNormInputError, match="weight must be on the same device"):
        T.rms_norm(torch.randn(2, 4, device="cuda"), (4,), torch.ones(4))
    with pytest.raises(T.RMSNormInputError, match="dy must be on x's device"):
        torch.ops.rmsnorm.bwd(torch.randn(2, 4), torch.randn(2, 4, device="cuda"), None, torch.ones(2, device="cuda"))


def test_module_is_a_drop_in(device):
    ref = nn.RMSNorm([3, 8], eps=1e-5, device=device)
    ours = T.RMSNorm([3, 8], eps=1e-5, device=device)
    assert isinstance(ours, nn.RMSNorm)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert repr(ours).replace("RMSNorm", "") == repr(ref).replace("RMSNorm", "")
    with torch.no_grad():
        ref.weight.copy_(torch.randn(3, 8))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 3, 8, device=device)
    torch.testing.assert_close(ours(x), ref(x), **TOL[torch.float32])
    bare_ref, bare = nn.RMSNorm(8, elementwise_affine=False), T.RMSNorm(8, elementwise_affine=False)
    assert bare.weight is None and list(bare.state_dict()) == list(bare_ref.state_dict()) == []
    x = torch.randn(4, 8)
    with T.fallback_policy("reference"):
        torch.testing.assert_close(bare.to(device)(x.to(device)).cpu(), bare_ref(x), **TOL[torch.float32])


def test_forward_mode_ad_is_served_not_dropped(device):
    import torch.autograd.forward_ad as fwAD

    x, w = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    with fwAD.dual_level(), T.fallback_policy("reference"):
        y = T.rms_norm(fwAD.make_dual(x, tx), (8,), fwAD.make_dual(w, tw))
        y_ref = F.rms_norm(fwAD.make_dual(x, tx), (8,), fwAD.make_dual(w, tw))
        tangent, tangent_ref = fwAD.unpack_dual(y).tangent, fwAD.unpack_dual(y_ref).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, tangent_ref, **TOL[torch.float32])
    assert "rms_norm: forward-mode AD" in T.dispatch_stats()["fallback"]


def test_torch_func_transforms(device):
    x, w = torch.randn(4, 3, 8, device=device), torch.randn(8, device=device)
    with T.fallback_policy("reference"):
        g = torch.func.grad(lambda a: T.rms_norm(a, (8,), w).pow(2).sum())(x)
        jac = torch.func.jacrev(lambda a: T.rms_norm(a, (8,), w))(x[0, 0])
    g_ref = torch.func.grad(lambda a: F.rms_norm(a, (8,), w).pow(2).sum())(x)
    torch.testing.assert_close(g, g_ref, **TOL[torch.float32])
    torch.testing.assert_close(jac, torch.func.jacrev(lambda a: F.rms_norm(a, (8,), w))(x[0, 0]), **TOL[torch.float32])
    T.reset_dispatch_stats()
    with T.fallback_policy("error"):  # vmap stays on the kernels
        out = torch.func.vmap(lambda a: T.rms_norm(a, (8,), w))(x)
    torch.testing.assert_close(out, F.rms_norm(x, (8,), w), **TOL[torch.float32])
    assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 1}  # one call for the whole batch
    ws = torch.randn(4, 8, device=device)  # per-sample weights: a counted fallback, never silent
    with T.fallback_policy("error"), pytest.raises(T.FallbackError, match="per-sample weights under vmap"):
        torch.func.vmap(lambda a, b: T.rms_norm(a, (8,), b))(x, ws)
    T.set_fallback_policy("reference")
    out = torch.func.vmap(lambda a, b: T.rms_norm(a, (8,), b))(x, ws)
    torch.testing.assert_close(out, F.rms_norm(x, (8,), None) * ws[:, None, :], **TOL[torch.float32])
    out = torch.func.vmap(lambda a: T.rms_norm(x[0], (8,), a))(ws)  # only the weight batched
    torch.testing.assert_close(out, F.rms_norm(x[0], (8,), None) * ws[:, None, :], **TOL[torch.float32])


def test_module_info_inputs_of_nn_rmsnorm(device):
    """PyTorch's own ModuleInfo inputs for nn.RMSNorm (no public API holds them), through ours."""
    from torch.testing._internal.common_modules import module_db

    info = next(m for m in module_db if m.module_cls is nn.RMSNorm)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for sample in info.module_inputs_func(info, device=device, dtype=dtype, requires_grad=True, training=True):
            ref = nn.RMSNorm(*sample.constructor_input.args, **sample.constructor_input.kwargs).to(device, dtype)
            ours = T.RMSNorm(*sample.constructor_input.args, **sample.constructor_input.kwargs).to(device, dtype)
            ours.load_state_dict(ref.state_dict())
            x = sample.forward_input.args[0]
            x2 = x.detach().clone().requires_grad_()
            with T.fallback_policy("reference"):
                y = ours(x2)
            y_ref = ref(x)
            torch.testing.assert_close(y, y_ref, **TOL[dtype], msg=sample.desc)
            if y.numel():
                dy = torch.randn_like(y)
                for a, b in zip(torch.autograd.grad(y, [x2, *ours.parameters()], dy),
                                torch.autograd.grad(y_ref, [x, *ref.parameters()], dy)):
                    torch.testing.assert_close(a, b, **grad_tol(dtype), msg=sample.desc)


@pytest.mark.cuda
def test_cuda_autocast_matches_torch():
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x @ torch.eye(64, device="cuda")  # bf16 under autocast
        y, y_ref = T.rms_norm(h, (64,), w), F.rms_norm(h, (64,), w)
    assert h.dtype == torch.bfloat16 and y.dtype == y_ref.dtype, (y.dtype, y_ref.dtype)
    if torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA"):
        assert y.dtype == torch.float32  # aten's rms_norm is on this torch's CUDA fp32 list
    torch.testing.assert_close(y, y_ref, **TOL[y.dtype])
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_cpu_autocast_matches_torch():
    x = torch.randn(4, 64)
    w = torch.randn(64)
    with torch.autocast("cpu", dtype=torch.bfloat16), T.fallback_policy("reference"):
        h = x @ torch.eye(64)
        y, y_ref = T.rms_norm(h, (64,), w), F.rms_norm(h, (64,), w)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, **TOL[torch.bfloat16])


def _dispatched(monkeypatch) -> list:
    """Record, for each forward ``rms_norm`` makes, whether it went through the dispatcher:
    ``True`` when the op's registered implementation ran it, ``False`` when ``rms_norm`` did
    (through ``ops.forward``, or in one step for a kept call signature)."""
    calls, forward, record_kernel = [], ops.forward, functional.record_kernel

    def spy(*args, **kwargs):
        calls.append(sys._getframe(1).f_code is ops._fwd.__code__)
        return forward(*args, **kwargs)

    def lane_spy(op):  # rms_norm counts a call itself only when it launches it
        calls.append(False)
        return record_kernel(op)

    monkeypatch.setattr(ops, "forward", spy)
    monkeypatch.setattr(functional, "record_kernel", lane_spy)
    return calls


class _Subclass(torch.Tensor):
    pass


class _PassThroughMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _RecordingFunctionMode(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _needing_grad(t: torch.Tensor) -> contextlib.AbstractContextManager:
    t.requires_grad_()
    return contextlib.nullcontext()


# Contexts in which the dispatcher has work to do (or must see the call), given x and w.
DISPATCHING = {
    "grad needed": lambda x, w: _needing_grad(x),
    "weight grad needed": lambda x, w: _needing_grad(w),
    "dispatch mode": lambda x, w: _PassThroughMode(),
    "autocast": lambda x, w: torch.autocast(x.device.type, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("case", list(DISPATCHING))
def test_eager_calls_skip_the_dispatcher_only_when_it_has_nothing_to_do(device, monkeypatch, case):
    """Eager, without a gradient, mode or autocast, ``rms_norm`` calls the op's
    implementation without the dispatcher (the same code, bit for bit); in each of those
    contexts it goes through ``torch.ops.rmsnorm.fwd``."""
    x, w = torch.randn(6, 40, device=device), torch.randn(40, device=device)
    want = torch.ops.rmsnorm.fwd(x, w, 1e-6)[0]
    calls = _dispatched(monkeypatch)
    assert torch.equal(T.rms_norm(x, (40,), w, 1e-6), want)
    with torch.no_grad():
        y = T.rms_norm(x.detach().requires_grad_(), (40,), nn.Parameter(w), 1e-6)
    assert torch.equal(y, want)
    assert calls == [False, False]
    with DISPATCHING[case](x, w):
        y = T.rms_norm(x, (40,), w, 1e-6)
    assert calls[2:] == [True], case
    if y.dtype == want.dtype:
        assert torch.equal(y.detach(), want)


def test_torch_function_modes_see_the_call_as_they_see_f_rms_norm(device, monkeypatch):
    """A torch function mode sees ``rms_norm`` and ``add_rms_norm`` themselves, as it sees
    ``F.rms_norm`` (``__torch_function__``), with the arguments given (the keywords left at
    their defaults left out); the call it runs has nothing left for the dispatcher to do."""
    x, r, w = torch.randn(6, 40, device=device), torch.randn(6, 40, device=device), torch.randn(40, device=device)
    want = torch.ops.rmsnorm.fwd(x, w, 1e-6, weight_offset=1.0)[0]
    calls = _dispatched(monkeypatch)
    with _RecordingFunctionMode() as mode:
        y = T.rms_norm(x, (40,), w, 1e-6, weight_offset=1.0)
        y2, h = T.add_rms_norm(x, r, (40,), w)
        F.rms_norm(x, (40,), w)
    assert torch.equal(y, want) and torch.equal(h, x + r)
    assert mode.seen[:2] == [T.rms_norm, T.add_rms_norm] and F.rms_norm in mode.seen
    assert calls == [False, False]


def _op_forward(x, normalized_shape, w, eps=None, **keywords):
    """``rms_norm``'s output computed through the dispatcher, over one normalized dim."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return torch.ops.rmsnorm.fwd(x.detach().requires_grad_(), w, eps, **keywords)[0].detach()


def test_a_kept_call_signature_serves_only_calls_that_match_it(device, monkeypatch):
    """An eager call's signature (x's sizes, strides, dtype and device, ``normalized_shape``, the
    weight's, eps, the keywords) is kept with what its calls launch with. Called after a first
    call of each, every variant that differs in one of them gives the dispatched op's output bit
    for bit, or raises what the contract raises; none goes through the dispatcher."""
    x, w = torch.randn(6, 40, device=device), torch.randn(40, device=device)
    wide = torch.randn(6, 48, device=device)
    variants = {
        "the first call": (x, (40,), w, 1e-6, {}),
        "the same signature again": (x.clone(), (40,), w.clone(), 1e-6, {}),
        "a list as normalized_shape": (x, [40], w, 1e-6, {}),
        "rows 48 apart": (wide[:, :40], (40,), w, 1e-6, {}),
        "columns 6 apart": (x.t().contiguous().t(), (40,), w, 1e-6, {}),
        "one row repeated": (x[:1].expand(6, 40), (40,), w, 1e-6, {}),
        "a misaligned view": (wide.flatten()[1:241].view(6, 40), (40,), w, 1e-6, {}),
        "three dims": (x.view(2, 3, 40), (40,), w, 1e-6, {}),
        "no weight": (x, (40,), None, 1e-6, {}),
        "a bfloat16 weight": (x, (40,), w.bfloat16(), 1e-6, {}),
        "a float16 x": (x.half(), (40,), w, 1e-6, {}),
        "another eps": (x, (40,), w, 1e-2, {}),
        "the default eps": (x, (40,), w, None, {}),
        "an out_dtype": (x, (40,), w, 1e-6, {"out_dtype": torch.bfloat16}),
        "a norm_dtype": (x, (40,), w, 1e-6, {"norm_dtype": torch.bfloat16}),
        "a weight_offset": (x, (40,), w, 1e-6, {"weight_offset": 1.0}),
    }
    wants = {name: _op_forward(a.reshape(-1, 40), (40,), weight, eps, **keywords).view(a.shape)
             for name, (a, shape, weight, eps, keywords) in variants.items()}
    T.reset_dispatch_stats()
    calls = _dispatched(monkeypatch)
    for name, (a, shape, weight, eps, keywords) in variants.items():
        for _ in range(2):  # the signature's first call keeps it; the second is served by it
            y = T.rms_norm(a, shape, weight, eps, **keywords)
            assert torch.equal(y, wants[name]), name
            assert y.is_contiguous(), name
    assert calls == [False] * 2 * len(variants)
    assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 2 * len(variants)}
    with pytest.raises(T.RMSNormInputError, match="Expected weight to be of same shape"):
        T.rms_norm(x, (40,), torch.randn(41, device=device), 1e-6)
    with pytest.raises(T.RMSNormInputError, match="expected input with shape"):
        T.rms_norm(torch.randn(6, 41, device=device), (40,), w, 1e-6)
    with pytest.raises(T.RMSNormDTypeError, match="norm_dtype must be None or a real floating-point dtype"):
        T.rms_norm(x, (40,), w, 1e-6, norm_dtype=torch.int32)
    with pytest.raises(T.RMSNormInputError, match="input must be a strided tensor"):  # its strides: (0, 0)
        T.rms_norm(x.to_sparse(), (40,), None, 1e-6)
    assert calls == [False] * 2 * len(variants)


def test_calls_the_kernels_do_not_serve_keep_their_own_path(device, monkeypatch):
    """Signatures no kernel plan serves (complex, float64, several normalized dims, an empty
    row) and arguments a signature does not keep (a tensor eps, a non-finite eps) are served as
    before, each call: by the reference, counted as a fallback, or through the direct path."""
    T.set_fallback_policy("reference")
    x, w = torch.randn(3, 2, 8, device=device), torch.randn(2, 8, device=device)
    cases = [
        (lambda: T.rms_norm(x.double(), (8,), None, 1e-6), lambda: F.rms_norm(x.double(), (8,), None, 1e-6)),
        (lambda: T.rms_norm(x.to(torch.complex64), (8,), None, 1e-6),
         lambda: F.rms_norm(x.to(torch.complex64), (8,), None, 1e-6)),
        (lambda: T.rms_norm(x, (2, 8), w, 1e-6), lambda: F.rms_norm(x, (2, 8), w, 1e-6)),
        (lambda: T.rms_norm(x, (8,), w[0], torch.tensor(1e-6)), lambda: F.rms_norm(x, (8,), w[0], 1e-6)),
        (lambda: T.rms_norm(x, (8,), w[0], math.inf), lambda: F.rms_norm(x, (8,), w[0], math.inf)),
        (lambda: T.rms_norm(x[:, :, :0], (0,), None, 1e-6), lambda: F.rms_norm(x[:, :, :0], (0,), None, 1e-6)),
    ]
    for ours, torchs in cases:
        for _ in range(2):
            torch.testing.assert_close(ours(), torchs(), equal_nan=True, **TOL[torch.float32])
    assert T.dispatch_stats()["fallback"] == {
        "rmsnorm.fwd: x dtype torch.float64 (kernels serve float16, bfloat16, float32)": 2,
        "rms_norm: complex dtype torch.complex64": 2}
    assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 6}


def test_profiler_sees_the_direct_call_as_the_op(device, monkeypatch):
    """A profiler does not change the path (it times what runs without it): the call stays
    direct, and the trace still names it ``rmsnorm::fwd``, its kernel inside."""
    x, w = torch.randn(6, 40, device=device), torch.randn(40, device=device)
    want = torch.ops.rmsnorm.fwd(x, w, 1e-6)[0]
    calls = _dispatched(monkeypatch)
    with torch.profiler.profile() as prof:
        y = T.rms_norm(x, (40,), w, 1e-6)
    assert calls == [False]
    assert torch.equal(y, want)
    names = [e.name for e in prof.events()]
    assert "rmsnorm::fwd" in names, names
    if device.type == "cuda":
        assert any("_rms_norm_fwd" in e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_subclass_meta_negative_and_vmapped_inputs_are_dispatched(device, monkeypatch):
    """Tensors the dispatcher treats specially (subclasses, meta tensors, negative views,
    vmap's batched tensors) go through it, and come out as torch's own."""
    x, w = torch.randn(3, 16, device=device), torch.randn(16, device=device)
    calls = _dispatched(monkeypatch)
    torch.testing.assert_close(T.rms_norm(x.as_subclass(_Subclass), (16,), w).as_subclass(torch.Tensor),
                               F.rms_norm(x, (16,), w), **TOL[torch.float32])
    assert T.rms_norm(torch.empty(3, 16, device="meta"), (16,), None).device.type == "meta"
    negative = torch._neg_view(x)
    torch.testing.assert_close(T.rms_norm(negative, (16,), w), F.rms_norm(-x, (16,), w), **TOL[torch.float32])
    batch = torch.stack([x, 2 * x])
    torch.testing.assert_close(torch.func.vmap(lambda a: T.rms_norm(a, (16,), w))(batch),
                               F.rms_norm(batch, (16,), w), **TOL[torch.float32])
    assert calls == [True, True, True]  # meta tensors take the fake implementation: no forward at all


def test_jit_trace_records_the_op(device):
    """``torch.jit.trace`` records ``rmsnorm::fwd`` (a direct call would leave the kernel out of
    the trace), and the traced function computes new inputs."""
    x, w = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    with torch.no_grad():
        traced = torch.jit.trace(lambda a: T.rms_norm(a, (8,), w), x)
    assert "rmsnorm::fwd" in str(traced.graph)
    x2 = torch.randn(4, 8, device=device)
    torch.testing.assert_close(traced(x2), F.rms_norm(x2, (8,), w), **TOL[torch.float32])


class _Index:
    """An int by ``__index__``, as torch's argument parser takes it."""

    def __index__(self):
        return 8


class _BadIndex:
    def __index__(self):
        raise ValueError("not an index")


# Arguments torch's rms_norm accepts (first) or refuses (after None), with x of shape [3, 2, 8].
EPS_VALUES = [None, 1e-5, 1, True, 2**70, np.float32(1e-5), np.float64(1e-5), np.float16(1e-3), np.int64(1),
              np.bool_(True), np.complex128(1e-5 + 1j), torch.tensor(1e-5), torch.tensor(3), torch.tensor(True),
              torch.tensor(1e-5, dtype=torch.float64), torch.tensor(1e-5 + 0j),
              torch.tensor([1e-5]), torch.tensor(1e-5, requires_grad=True), torch.tensor(1e-5 + 1j),
              np.array(1e-5), np.array([1e-5]), "1e-5", [1e-5], Fraction(1, 2), Decimal("0.5"), 1j, object()]
SHAPE_VALUES = [(8,), [8], torch.Size([8]), (2, 8), [2, np.int32(8)], (np.int64(8),), (np.uint8(8),),
                (torch.tensor(8),), (torch.tensor([8]),), (torch.tensor([[8]], dtype=torch.int32),), (_Index(),),
                8, np.int64(8), torch.tensor([8]), np.array([8]), range(8, 9), "8", None, (), (-8,), (0,), (4,),
                (3, 2, 8, 1), (8.0,), (True,), (np.float64(8),), (np.bool_(True),), (torch.tensor(8.0),),
                (torch.tensor(True),), ("8",), (None,), ([8],), (_BadIndex(),), (2**64,), (2, 8.0), (Fraction(8),)]
WEIGHT_VALUES = [torch.ones(8), torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.int32), torch.ones(7),
                 torch.ones(1), np.ones(8, dtype=np.float32), [1.0] * 8, 1.0]
INPUT_VALUES = [np.ones((3, 8), dtype=np.float32), [[1.0] * 8], 3.0, torch.tensor(1.0), torch.ones(3, 8, dtype=torch.int64)]
# Values that compare and hash equal, accepted or refused apart: a kept call signature must not
# serve the second after the first.
EQUAL_PAIRS = [("normalized_shape", (8,), (8.0,)), ("normalized_shape", (8,), (np.float64(8),)),
               ("normalized_shape", (8,), (Fraction(8),)), ("normalized_shape", (1,), (True,)),
               ("normalized_shape", (8,), (np.int64(8),)), ("eps", 0.5, Fraction(1, 2)), ("eps", 0.5, Decimal("0.5")),
               ("eps", 1, True), ("eps", 0.5, np.float64(0.5)), ("eps", 1.0, np.int64(1))]


def _outcome(call):
    """``("value", y)`` or ``("raises", the exception)``."""
    try:
        return "value", call()
    except Exception as e:  # the outcome compared
        return "raises", e


def _assert_same_outcome(ours, torchs, what):
    """``ours`` (called twice: a first call and a later one, which a kept signature may serve)
    returns what ``torchs`` returns, or raises an instance of the exception's class."""
    kind, want = _outcome(torchs)
    for attempt in ("first", "second"):
        got_kind, got = _outcome(ours)
        assert got_kind == kind, f"{what}, {attempt} call: ours {got_kind} {got!r}, torch's {kind} {want!r}"
        if kind == "raises":
            assert isinstance(got, type(want)), f"{what}, {attempt} call: {type(got)} for torch's {type(want)}"
        else:
            torch.testing.assert_close(got, want, **TOL[want.dtype], msg=lambda m: f"{what}: {m}")


@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")
def test_arguments_are_accepted_and_refused_as_by_torch(device):
    """``rms_norm``, ``add_rms_norm`` and ``RMSNorm`` accept every argument that ``F.rms_norm``
    and ``nn.RMSNorm`` accept (numpy scalars, 0-dim tensors, ``__index__`` objects, one-element
    integer tensors in ``normalized_shape``) with the same result, and refuse what they refuse
    with the same exception class, on a first call and a later one."""
    T.set_fallback_policy("reference")  # a float64 or integer weight
    x = torch.randn(3, 2, 8, device=device)
    r = torch.randn(3, 2, 8, device=device)
    w = torch.rand(8, device=device) + 0.5
    for eps in EPS_VALUES:
        _assert_same_outcome(lambda eps=eps: T.rms_norm(x, (8,), w, eps), lambda eps=eps: F.rms_norm(x, (8,), w, eps),
                             f"eps={eps!r}")
        _assert_same_outcome(lambda eps=eps: T.add_rms_norm(x, r, (8,), None, eps)[0],
                             lambda eps=eps: F.rms_norm(x + r, (8,), None, eps), f"add_rms_norm, eps={eps!r}")
        _assert_same_outcome(lambda eps=eps: T.RMSNorm(8, eps=eps, device=device)(x),
                             lambda eps=eps: nn.RMSNorm(8, eps=eps, device=device)(x), f"RMSNorm, eps={eps!r}")
    for shape in SHAPE_VALUES:
        _assert_same_outcome(lambda shape=shape: T.rms_norm(x, shape), lambda shape=shape: F.rms_norm(x, shape),
                             f"normalized_shape={shape!r}")
        _assert_same_outcome(lambda shape=shape: T.add_rms_norm(x, r, shape)[0],
                             lambda shape=shape: F.rms_norm(x + r, shape), f"add_rms_norm, normalized_shape={shape!r}")
        _assert_same_outcome(lambda shape=shape: T.RMSNorm(shape, device=device)(x),
                             lambda shape=shape: nn.RMSNorm(shape, device=device)(x), f"RMSNorm, {shape!r}")
    for weight in WEIGHT_VALUES:
        weight = weight.to(device) if isinstance(weight, torch.Tensor) else weight
        _assert_same_outcome(lambda weight=weight: T.rms_norm(x, (8,), weight),
                             lambda weight=weight: F.rms_norm(x, (8,), weight),
                             f"weight={type(weight).__name__} {getattr(weight, 'dtype', '')}")
    for input in INPUT_VALUES:
        input = input.to(device) if isinstance(input, torch.Tensor) else input
        _assert_same_outcome(lambda input=input: T.rms_norm(input, (8,)), lambda input=input: F.rms_norm(input, (8,)),
                             f"input={type(input).__name__}")
    with pytest.raises(TypeError, match="residual"):
        T.add_rms_norm(x, [1.0], (8,))


@pytest.mark.parametrize("argument, first, second", EQUAL_PAIRS, ids=lambda v: repr(v))
@pytest.mark.parametrize("order", ["first then second", "second then first"])
def test_equal_values_of_other_types_are_told_apart(device, argument, first, second, order):
    """Values that compare and hash equal but differ in type (40 and 40.0, 0.5 and
    ``Fraction(1, 2)``) are separate call signatures: after a call with one, a call with the
    other still gets what ``F.rms_norm`` gives it."""
    n = first[0] if argument == "normalized_shape" else 8
    x = torch.randn(3, n, device=device)

    def call(fn, value):
        return fn(x, value) if argument == "normalized_shape" else fn(x, (n,), None, value)

    values = (first, second) if order == "first then second" else (second, first)
    for value in values:
        _assert_same_outcome(lambda value=value: call(T.rms_norm, value), lambda value=value: call(F.rms_norm, value),
                             f"{argument}={value!r}")


@pytest.mark.parametrize("offset", [1, 1.0, True, np.float32(1.0), torch.tensor(1.0)])
def test_weight_offset_takes_what_eps_takes(device, offset):
    """``weight_offset`` takes the numbers ``eps`` takes (Gemma's ``1 + weight``) and refuses
    the rest with ``TypeError``, after a call with an equal float as before it."""
    x, w = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    want = F.rms_norm(x, (8,), w + 1.0)
    for value in (offset, 1.0, offset):
        torch.testing.assert_close(T.rms_norm(x, (8,), w, weight_offset=value), want, **TOL[torch.float32])
    for refused in (Fraction(1), Decimal(1), "1", torch.tensor([1.0])):
        for _ in range(2):
            with pytest.raises(TypeError, match="weight_offset"):
                T.rms_norm(x, (8,), w, weight_offset=refused)


class _Normalize(nn.Module):
    """Code calling ``rms_norm`` and ``add_rms_norm``, keywords and unpacked results included."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x, residual):
        y, h = T.add_rms_norm(x, residual, (8,), self.weight, 1e-5)
        return T.rms_norm(h, (2, 8), None, weight_offset=1.0) + y


def test_symbolic_trace_records_the_calls(device):
    """``torch.fx.symbolic_trace`` of ``RMSNorm`` records its call of ``rms_norm`` (as it
    records ``nn.RMSNorm``'s of ``F.rms_norm``), and of code calling ``rms_norm`` and
    ``add_rms_norm`` each call, with the arguments given; the traced modules compute what the
    eager ones do, bit for bit."""
    norm = T.RMSNorm((2, 8), eps=1e-5, device=device)
    traced = torch.fx.symbolic_trace(norm)
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert targets == [T.rms_norm], traced.code
    x, r = torch.randn(3, 2, 8, device=device), torch.randn(3, 2, 8, device=device)
    assert torch.equal(traced(x), norm(x))
    module = _Normalize().to(device)
    traced = torch.fx.symbolic_trace(module)
    calls = [(n.target, n.kwargs) for n in traced.graph.nodes if n.op == "call_function"
             and n.target in (T.rms_norm, T.add_rms_norm)]
    assert calls == [(T.add_rms_norm, {}), (T.rms_norm, {"weight_offset": 1.0})], traced.code
    assert torch.equal(traced(x, r), module(x, r))


def test_torchscript_compiles_rms_norm_module(device):
    """``torch.jit.script`` of ``RMSNorm`` compiles a forward that calls ``torch.ops.rmsnorm.fwd``
    on the normalized dims as one row: the same outputs and gradients as eager; an input of
    another shape raises."""
    norm = T.RMSNorm((2, 8), eps=1e-5, device=device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    scripted = torch.jit.script(norm)
    assert "rmsnorm::fwd" in str(scripted.inlined_graph)
    x = torch.randn(3, 2, 8, device=device, requires_grad=True)
    want = norm(x)
    got = scripted(x)
    assert torch.equal(got, want)
    dy = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (x, norm.weight), dy), torch.autograd.grad(want, (x, norm.weight), dy)):
        assert torch.equal(a, b)
    bare = T.RMSNorm(8, elementwise_affine=False).to(device)
    x64 = torch.randn(3, 8, device=device, dtype=torch.float64)
    with T.fallback_policy("reference"):
        torch.testing.assert_close(torch.jit.script(bare)(x64), F.rms_norm(x64, (8,)), **TOL[torch.float64])
    with pytest.raises(Exception, match="expected input with shape"):
        scripted(torch.randn(3, 8, device=device))
