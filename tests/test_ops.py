"""The ops themselves: opcheck over every kernel mode, output metadata, launch plans, edge
shapes, layouts, determinism, the dweight reduction, 64-bit offsets."""

import dataclasses
import itertools

import pytest
import torch
from tolerances import BF16_ONE_ROUNDING, DWEIGHT, MODEL, TOL, dweight_tol, few_roundings, grad_tol

import torch_rmsnorm_op as T
from torch_rmsnorm_op import _triton_compat, dispatch, launch, reference
from torch_rmsnorm_op.config import KernelConfig, next_power_of_2

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Small configurations that put the op's calls on each kernel mode (monkeypatched into the
# table for a test), so that opcheck, which calls the op many times, reaches them all cheaply.
MODES = {
    "rows": (KernelConfig(64, 2, 2), KernelConfig(64, 2, 2, programs_per_sm=1)),
    "looped": (KernelConfig(16, 1, 1, looped=True), KernelConfig(64, 1, 2, programs_per_sm=2, reload=True)),
    "split": (KernelConfig(16, 1, 1, split=4, programs_per_sm=1, stages=2, interleave=True),
              KernelConfig(16, 1, 1, split=4, stages=2, interleave=True)),
}


@pytest.fixture(params=["table", *MODES])
def mode(request, monkeypatch):
    if request.param == "table":
        return request.param
    fwd, bwd = MODES[request.param]
    monkeypatch.setattr(dispatch, "forward_config", lambda n, dtype, residual=False, m=None, weight_dtype=None: fwd)
    monkeypatch.setattr(dispatch, "backward_config", lambda n, dtype, m=None: bwd)
    monkeypatch.setattr(dispatch, "_PLANS", {})
    return request.param


def _sample(device, dtype, with_weight, layout, requires_grad):
    if layout == "transposed":  # a (B, H, S, D) view of (B, S, H, D): rows over three strides
        x = torch.randn(2, 3, 2, 33, device=device, dtype=dtype).transpose(1, 2)
    elif layout == "columns":  # a last dim that is not contiguous: the ops copy the rows
        x = torch.randn(5, 33, 3, device=device, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(5, 3, 40 if layout == "strided" else 33, device=device, dtype=dtype)[..., :33]
    x = x.detach().requires_grad_(requires_grad)
    w = torch.randn(33, device=device, dtype=dtype, requires_grad=requires_grad) if with_weight else None
    return x, w


def _samples(device, mode, requires_grad=False):
    """(x, weight) pairs. With the table's configurations: every dtype, weight present and
    absent, contiguous and row-strided rows, a transposed view per dtype, and rows whose last
    dim is not contiguous; with a forced mode, two of them (its code paths do not depend on the
    dtype)."""
    if mode == "table":
        grid = [(*c, "transposed") for c in itertools.product(DTYPES, (True,))] + [(torch.bfloat16, True, "columns")]
        grid += list(itertools.product(DTYPES, (True, False), ("contiguous", "strided")))
    else:
        grid = [(torch.bfloat16, True, "strided"), (torch.float32, False, "transposed")]
    for dtype, with_weight, layout in grid:
        yield _sample(device, dtype, with_weight, layout, requires_grad)


def test_opcheck_every_mode(device, mode):
    for x, w in _samples(device, mode, requires_grad=True):
        torch.library.opcheck(torch.ops.rmsnorm.fwd, (x, w, 1e-6))
        y, rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6)
        dy = torch.randn_like(y)
        torch.library.opcheck(torch.ops.rmsnorm.bwd, (dy, x.detach(), None if w is None else w.detach(), rstd))
    assert T.dispatch_stats()["fallback"] == {}


def test_opcheck_add_ops_and_keywords(device, mode):
    """The fused residual add (residual in x's dtype, or fp32 beside bf16 x), the weight offset,
    the rounding before the weight and the output dtype."""
    x, w = _sample(device, torch.bfloat16, True, "transposed" if mode == "split" else "strided", True)
    for r_dtype in ((torch.bfloat16, torch.float32) if mode == "table" else (torch.bfloat16,)):
        r = torch.randn(x.shape, device=device, dtype=r_dtype, requires_grad=True)
        torch.library.opcheck(torch.ops.rmsnorm.add_fwd, (x, r, w, 1e-6))
        y, s, rstd = torch.ops.rmsnorm.add_fwd(x, r, w, 1e-6)
        for dres in (None, torch.randn_like(s)):
            torch.library.opcheck(torch.ops.rmsnorm.add_bwd, (torch.randn_like(y), dres, s.detach(), w.detach(), rstd),
                                  {"weight_offset": 1.0})
    kw = {"weight_offset": 1.0, "norm_dtype": torch.bfloat16, "out_dtype": torch.float32}
    torch.library.opcheck(torch.ops.rmsnorm.fwd, (x, w, 1e-6), kw)
    assert T.dispatch_stats()["fallback"] == {}


def _plan(cfg: KernelConfig, x, w, backward=False, **kw):
    if backward:
        return dataclasses.replace(dispatch.backward_plan(x, w, x.dtype, **kw), cfg=cfg)
    return dataclasses.replace(dispatch.forward_plan(x, w, **kw), cfg=cfg, launcher=None)


def _forward(cfg, x, w, y, rstd):
    launch.forward(_plan(cfg, x, w), x, w, 1e-6, y, rstd)


def _backward(cfg, dy, x, w, rstd, dx, dw, workspace=None):
    launch.backward(_plan(cfg, x, w, backward=True), dy, x, w, rstd, dx, dw, workspace=workspace)


def _workspace(cfg, x, w):
    return launch.backward_workspace(_plan(cfg, x, w, backward=True), x.dtype, x.device)


def test_output_metadata(device):
    x = torch.randn(2, 3, 16, device=device, dtype=torch.bfloat16)
    w = torch.randn(16, device=device, dtype=torch.float32)  # mixed precision: fp32 weight
    y, rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6)
    assert (y.shape, y.dtype, y.is_contiguous()) == (x.shape, torch.bfloat16, True)
    assert (rstd.shape, rstd.dtype) == ((2, 3), torch.float32)
    dx, dw = torch.ops.rmsnorm.bwd(torch.randn_like(y), x, w, rstd)
    assert (dx.shape, dx.dtype, dw.shape, dw.dtype) == (x.shape, x.dtype, w.shape, torch.float32)
    y_ref, _ = reference.rms_norm_forward(x.double(), w.double(), 1e-6)
    torch.testing.assert_close(y.double(), y_ref, **BF16_ONE_ROUNDING)


def test_launch_key_is_at_least_as_fine_as_tritons():
    """``_triton_compat.specialization`` tells apart every pair of arguments Triton's JIT compiles
    apart (its own ``native_specialize_impl``), so a compiled kernel launched directly is the
    one the JIT would have picked."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton has no native_specialize_impl to compare with")
    t = torch.empty(64)
    samples = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 16, 2**31, 2**40, 2**63, 1e-6, 0.5, True, False,
               t, t[1:], t[4:], t[2:], t.half(), t.half()[1:], t.bfloat16(), t.double()]
    for a, b in itertools.product(samples, repeat=2):
        if _triton_compat.specialization([a]) == _triton_compat.specialization([b]):
            assert native_specialize_impl(BaseBackend, a, False, True, True) == \
                native_specialize_impl(BaseBackend, b, False, True, True), (a, b)


def test_launch_key_follows_a_parameters_dtype():
    """A Parameter keeps its identity when ``module.to`` changes its dtype: the launch key sees
    the dtype, not the object (keyed as an object, a patched module replayed a kernel compiled
    for its old weight dtype)."""
    p = torch.nn.Parameter(torch.randn(64))
    before = _triton_compat.specialization([p])
    p.data = p.data.half()
    assert _triton_compat.specialization([p]) != before
    assert _triton_compat.specialization([p]) == _triton_compat.specialization([torch.randn(64).half()])


class _CountingCache(dict):
    """``_triton_compat._COMPILED`` that counts its hits (launches through a compiled kernel's
    launcher) and its stores (launches through the JIT)."""

    hits = 0
    stores = 0

    def get(self, key, default=None):
        value = super().get(key, default)
        self.hits += value is not None
        return value

    def __setitem__(self, key, value):
        self.stores += 1
        super().__setitem__(key, value)


def _replaying_plans() -> dict:
    return {key: plan for key, plan in dispatch._PLANS.items() if not isinstance(plan, str) and plan.launcher}


@pytest.mark.cuda
def test_compiled_launches_match_the_jit(monkeypatch):
    """The second launch of a specialization goes through the compiled kernel's own launcher
    (``_triton_compat.run``), and a forward's third through the launch its plan kept
    (``launch.replay_forward``, aligned tensors only): the same bits as the JIT's first, for
    aligned rows then misaligned ones (the JIT compiles those apart; they share a plan with
    the aligned ones), M = 1 (Triton turns an int 1 into a constant) and odd N, forward and
    backward. On Triton 3.6 the launches after the JIT's skip the launcher's Python
    ``__call__``."""
    import triton

    base = torch.randn(70 * 64 + 8, device="cuda", dtype=torch.bfloat16)
    views = [base[:70 * 64].view(70, 64), base[1:1 + 70 * 64].view(70, 64), base[:64].view(1, 64),
             base[3:3 + 7 * 17].view(7, 17), base[:64].view(1, 64)]
    w = {n: torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (64, 17)}
    monkeypatch.setattr(_triton_compat, "_COMPILED", _CountingCache())
    monkeypatch.setattr(dispatch, "_PLANS", {})
    results, hits, jit = [], [], []
    for _ in range(3):  # first through the JIT (but the repeated view), then compiled, then replayed
        for x in views:
            y, rstd = torch.ops.rmsnorm.fwd(x, w[x.shape[1]], 1e-6)
            dy = torch.randn_like(y)
            results.append((x, y, rstd, dy, *torch.ops.rmsnorm.bwd(dy, x, w[x.shape[1]], rstd)))
            results[-1] += (T.rms_norm(x, (x.shape[1],), w[x.shape[1]], 1e-6),)  # y alone: no rstd stored
        hits.append(_triton_compat._COMPILED.hits)
        jit.append(_triton_compat._COMPILED.stores)
    assert jit[0] == jit[1] == jit[2]  # no JIT launch after the first pass
    # the first pass's repeated view, then the second pass: forwards and backwards (over these few
    # rows the backward's own launch writes dweight: no reduction launch)
    assert hits[1] >= 14
    assert hits[2] - hits[1] < hits[1] - hits[0]  # the third: aligned forwards from their plans
    assert {plan.m for plan in _replaying_plans().values()} == {70, 1}  # aligned shapes only
    if triton.__version__.startswith("3.6."):  # the C launcher called directly
        assert all(launcher.call is launcher.compiled.run.launch for launcher in _triton_compat._COMPILED.values())
    for x, y, _, dy, dx, dw, y_alone in results:
        want_y, want_rstd = reference.rms_norm_forward(x.double(), w[x.shape[1]].double(), 1e-6)
        torch.testing.assert_close(y.double(), want_y, **TOL[torch.bfloat16])
        assert torch.equal(y_alone, y)
        want_dx, want_dw = reference.rms_norm_backward(dy.double(), x.double(), w[x.shape[1]].double(), want_rstd)
        torch.testing.assert_close(dx.double(), want_dx, **grad_tol(torch.bfloat16))
        torch.testing.assert_close(dw.double(), want_dw, **DWEIGHT[torch.bfloat16])  # a sum of up to 70 rows
    for first, later in zip(results[:5] * 2, results[5:]):
        recomputed = torch.ops.rmsnorm.bwd(later[3], first[0], w[first[0].shape[1]], first[2])
        assert torch.equal(first[1], later[1]) and torch.equal(first[2], later[2])
        assert torch.equal(later[4], recomputed[0]) and torch.equal(later[5], recomputed[1])


def test_plans_are_bounded(device, monkeypatch):
    """Shapes that keep changing (M) do not grow the kept plans without bound."""
    monkeypatch.setattr(dispatch, "_PLANS", {})
    monkeypatch.setattr(dispatch, "MAX_PLANS", 4)
    w = torch.randn(64, device=device)
    for m in range(1, 12):
        x = torch.randn(m, 64, device=device)
        for _ in range(2):
            torch.testing.assert_close(T.rms_norm(x, (64,), w), torch.nn.functional.rms_norm(x, (64,), w),
                                       **TOL[torch.float32])
        assert 1 <= len(dispatch._PLANS) <= 4


def test_planned_calls_keep_the_fallback_policy(device, monkeypatch):
    """A call with a kept plan decides nothing again (its signature fixes the decision): it is
    counted as a kernel call; an input that differs only where the kernels do not serve it
    (float64) still falls back; a strided weight is read as its values (made contiguous)."""
    monkeypatch.setattr(dispatch, "_PLANS", {})
    x, w = torch.randn(16, 64, device=device), torch.randn(128, device=device)
    for _ in range(4):
        y = T.rms_norm(x, (64,), w[::2])
    assert len(dispatch._PLANS) == 1
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (64,), w[::2]), **TOL[torch.float32])
    assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 4} and T.dispatch_stats()["fallback"] == {}
    with T.fallback_policy("reference"):
        y64 = T.rms_norm(x.double(), (64,), w[::2].double())
    assert y64.dtype == torch.float64 and T.dispatch_stats()["fallback"]
    torch.testing.assert_close(y64, torch.nn.functional.rms_norm(x.double(), (64,), w[::2].double()))


def test_plans_are_kept_apart_by_what_a_kept_launch_was_compiled_for(device, monkeypatch):
    """A kept launch is compiled for its tensors' dtypes: calls that differ in y's dtype, the
    weight's, the residual's or whether rstd is stored do not share a plan."""
    monkeypatch.setattr(dispatch, "_PLANS", {})
    x, w = torch.randn(8, 64, device=device, dtype=torch.bfloat16), torch.randn(64, device=device)
    plans = [dispatch.forward_plan(x, w), dispatch.forward_plan(x, w, out_dtype=torch.float32),
             dispatch.forward_plan(x, w.bfloat16()), dispatch.forward_plan(x, w, store_rstd=False),
             dispatch.forward_plan(x, w, torch.randn_like(x)), dispatch.forward_plan(x, w, torch.randn_like(x).float())]
    assert len({id(p) for p in plans}) == len(plans)
    assert dispatch.forward_plan(x, w) is plans[0]
    for out_dtype in (torch.float32, None, torch.float32):
        y = T.rms_norm(x, (64,), w, 1e-6, out_dtype=out_dtype)
        assert y.dtype == (out_dtype or x.dtype)
        torch.testing.assert_close(y.float(), torch.nn.functional.rms_norm(x.float(), (64,), w, 1e-6),
                                   **TOL[torch.bfloat16])


@pytest.mark.cuda
def test_launch_hooks_see_compiled_launches():
    """With a Triton launch hook registered (as a profiler does), a launch of an already
    compiled kernel goes through Triton's own runner, which calls the hook."""
    import triton

    x, w = torch.randn(8, 64, device="cuda"), torch.randn(64, device="cuda")
    want = T.rms_norm(x, (64,), w)  # compiled (and launched) through the JIT
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    chain = triton.knobs.runtime.launch_enter_hook
    chain.add(hook)
    try:
        y = T.rms_norm(x, (64,), w)
        torch.cuda.synchronize()
    finally:
        chain.remove(hook)
    assert seen == ["_rms_norm_fwd_rows"] and torch.equal(y, want)
    T.rms_norm(x, (64,), w)
    assert len(seen) == 1


def test_unread_pointers_go_to_the_kernels_as_none(device, monkeypatch):
    """A pointer that a launch's constexprs leave unread is None, and its stride, like the
    unused strides of x's row layout, 1: Triton takes both as constexprs, so the launch does not
    pass them. A forward without weight, residual or rstd (no grad) passes x and y only; a
    backward with one gradient term and no residual gradient passes no term, residual gradient
    or merge flags; and each computes what the reference does."""
    seen = {}
    real = launch._launch

    def spy(kernel, grid, args, consts, *rest):
        fn = getattr(kernel, "fn", kernel)
        seen[fn.__name__] = dict(zip(fn.__code__.co_varnames, args))
        return real(kernel, grid, args, consts, *rest)

    monkeypatch.setattr(launch, "_launch", spy)
    x, dy = torch.randn(3, 256, device=device), torch.randn(3, 256, device=device)
    eps = reference.default_eps(x.dtype)
    with torch.no_grad():
        y = T.rms_norm(x, (256,))
    fwd = seen.pop("_rms_norm_fwd_rows")
    assert [k for k in ("X", "R", "W", "Y", "H", "RSTD") if fwd[k] is not None] == ["X", "Y"]
    assert [fwd[k] for k in ("x_stride1", "x_stride2", "r_stride", "h_stride")] == [1, 1, 1, 1]
    torch.testing.assert_close(y, reference.rms_norm_forward(x, None, eps)[0], **TOL[torch.float32])
    w = torch.randn(256, device=device, requires_grad=True)
    x.requires_grad_(True)
    T.rms_norm(x, (256,), w).backward(dy)
    bwd = seen.pop("_rms_norm_bwd_rows")
    assert all(bwd[k] is None for k in ("DY2", "DY3", "DRES", "DW_FLAGS")) and bwd["dres_stride"] == 1
    assert all(isinstance(bwd[k], torch.Tensor) for k in ("DY", "X", "W", "RSTD", "DX", "DW_PARTIAL"))
    rstd = reference.rms_norm_forward(x.detach(), w.detach(), eps)[1]
    want_dx, want_dw = reference.rms_norm_backward(dy, x.detach(), w.detach(), rstd)
    torch.testing.assert_close(x.grad, want_dx, **grad_tol(torch.float32))
    torch.testing.assert_close(w.grad, want_dw, **dweight_tol(torch.float32, 3))


@pytest.mark.parametrize("mode", ["single-pass", "looped", "split"])
def test_forward_without_rstd_writes_the_same_y(device, mode):
    """``launch.forward`` with ``rstd=None`` (``rms_norm`` without a gradient to record) writes
    the same y, bit for bit, in each of the forward's three modes."""
    cfg = {"single-pass": KernelConfig(block_n=256, rows=2, num_warps=2),
           "looped": KernelConfig(block_n=64, rows=1, num_warps=1, looped=True),
           "split": KernelConfig(block_n=64, rows=1, num_warps=1, split=4, programs_per_sm=4)}[mode]
    x, w = torch.randn(9, 250, device=device), torch.randn(250, device=device)
    y, rstd = torch.full_like(x, float("nan")), torch.full((9,), float("nan"), device=device)
    _forward(cfg, x, w, y, rstd)
    y_alone = torch.full_like(x, float("nan"))
    _forward(cfg, x, w, y_alone, None)
    assert torch.equal(y, y_alone) and not rstd.isnan().any()
    torch.testing.assert_close(y.double(), reference.rms_norm_forward(x.double(), w.double(), 1e-6)[0],
                               **TOL[torch.float32])


@pytest.mark.parametrize("shape", [(0, 8), (3, 1), (1, 1), (0, 1), (4, 0), (8,), (2, 0, 5)])
def test_edge_shapes(device, shape):
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.randn(shape[-1], device=device, requires_grad=True)
    y = T.rms_norm(x, (shape[-1],), w, 1e-6)
    ref = reference.rms_norm_reference(x.detach(), (shape[-1],), w.detach(), 1e-6)
    torch.testing.assert_close(y, ref, **TOL[torch.float32], equal_nan=True)
    y.backward(torch.ones_like(y))  # an expanded-looking upstream gradient still works
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    reference.rms_norm_reference(x2, (shape[-1],), w2, 1e-6).backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, x2.grad, **TOL[torch.float32], equal_nan=True)
    torch.testing.assert_close(w.grad, w2.grad, **TOL[torch.float32], equal_nan=True)
    assert T.dispatch_stats()["fallback"] == {}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_width_rows_match_the_fake(device, dtype):
    x = torch.randn(3, 0, device=device, dtype=dtype)
    with T.fallback_policy("reference"):
        # rstd is NaN here (the mean of an empty row, as in torch), which opcheck's value
        # comparisons cannot equate; the fake-versus-real metadata check is what matters.
        torch.library.opcheck(torch.ops.rmsnorm.fwd, (x, None, 1e-6), test_utils=("test_schema", "test_faketensor"))
        y, rstd = torch.ops.rmsnorm.fwd(x, None, 1e-6)
    assert y.shape == (3, 0) and rstd.dtype == reference.computation_dtype(dtype) and rstd.isnan().all()


def test_expanded_and_strided_gradients(device):
    base = torch.randn(6, 48, device=device)
    x = base[::2, 8:40].detach().requires_grad_()  # row stride 96, offset 8
    w = torch.randn(32, device=device, requires_grad=True)
    T.rms_norm(x, (32,), w).sum().backward()  # dy is an expanded scalar
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.nn.functional.rms_norm(x2, (32,), w2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **TOL[torch.float32])
    torch.testing.assert_close(w.grad, w2.grad, **TOL[torch.float32])
    assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 1, "rmsnorm.bwd": 1}


def test_large_row(device):
    n = 262144 + 5
    x = torch.randn(2, n, device=device, requires_grad=True)
    w = torch.rand(n, device=device, requires_grad=True)
    y = T.rms_norm(x, (n,), w, 1e-6)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref, rstd = reference.rms_norm_forward(x.detach().double(), w.detach().double(), 1e-6)
    dx_ref, dw_ref = reference.rms_norm_backward(dy.double(), x.detach().double(), w.detach().double(), rstd)
    torch.testing.assert_close(y.double(), y_ref, **TOL[torch.float32])
    torch.testing.assert_close(dx.double(), dx_ref, **TOL[torch.float32])
    torch.testing.assert_close(dw.double(), dw_ref, **TOL[torch.float32])


@pytest.mark.parametrize("n", [257, 5000, 20000])
def test_deterministic_bitwise(device, n):
    """Same inputs, same outputs, bit for bit: y, dx and dweight (no float atomics)."""
    x = torch.randn(67, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def run():
        y, rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6)
        dx, dw = torch.ops.rmsnorm.bwd(dy, x, w, rstd)
        return y, rstd, dx, dw

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def test_gradcheck_through_the_op_in_float64():
    """float64 is served by the reference (a fallback), through the same op and autograd formula."""
    x = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    with T.fallback_policy("reference"):
        assert torch.autograd.gradcheck(lambda a, b: T.rms_norm(a, (9,), b, 1e-5), (x, w))
        assert torch.autograd.gradgradcheck(lambda a, b: T.rms_norm(a, (9,), b, 1e-5), (x, w))


@pytest.mark.parametrize("fused", [False, True])
def test_double_backward_is_a_counted_fallback(device, fused):
    """``create_graph=True``: the backward takes the differentiable reference formula, counted
    as a fallback like any other, and refused under the "error" policy; the second-order
    gradients are torch's."""
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    r = torch.zeros(4, 16, device=device)

    def norm(a, b):
        return T.add_rms_norm(a, r, (16,), b)[0] if fused else T.rms_norm(a, (16,), b)

    op = "rmsnorm.add_bwd" if fused else "rmsnorm.bwd"
    with T.fallback_policy("error"), pytest.raises(T.FallbackError, match="create_graph=True"):
        torch.autograd.grad(norm(x, w).pow(2).sum(), x, create_graph=True)
    with T.fallback_policy("reference"):
        (gx,) = torch.autograd.grad(norm(x, w).pow(2).sum(), x, create_graph=True)
    assert T.dispatch_stats()["fallback"] == {f"{op}: create_graph=True: the gradient is differentiated again": 1}
    gx.sum().backward()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (gx2,) = torch.autograd.grad(torch.nn.functional.rms_norm(x2, (16,), w2).pow(2).sum(), x2, create_graph=True)
    gx2.sum().backward()
    torch.testing.assert_close(x.grad.double(), x2.grad, **MODEL[torch.float32])
    torch.testing.assert_close(w.grad.double(), w2.grad, **MODEL[torch.float32])


def test_backward_does_not_zero_fill_a_gradient_for_rstd(device):
    """rstd is not differentiable: the backward node must not materialize a zero gradient for it
    (an [M] fp32 fill kernel on every backward), and y's gradient still flows."""
    x = torch.randn(6, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    y, _ = torch.ops.rmsnorm.fwd(x, w, 1e-6)
    dy = torch.ones_like(y)
    with torch.profiler.profile() as prof:
        y.backward(dy)
    names = [e.name for e in prof.events()]
    assert "rmsnorm::bwd" in names
    assert not {"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_"} & set(names), names
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("k, e", [(0, 1), (1, 1), (1, 2), (2, 2), (4, 3)])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("interleave", [False, True])
def test_split_mode_row_groups(device, k, e, with_weight, stages, interleave):
    """Split mode's row pipeline, forward and backward, at its edges, M = k * G + e rows for a
    grid of G row groups: one row; groups of one, two and more rows; groups that walk phantom
    rows past M (the last one, or with ``interleave`` the groups whose last row would be past
    M); loads in the loop (``stages`` 1) and prefetched two rows ahead into shared memory (3)."""
    from torch_rmsnorm_op.config import KernelConfig, sm_count

    cfg = KernelConfig(block_n=1024, rows=1, num_warps=4, split=4, programs_per_sm=2, stages=stages,
                       interleave=interleave)
    m, n = k * (cfg.programs_per_sm * sm_count(torch.device(device)) // cfg.split) + e, 3000
    x, dy = torch.randn(m, n, device=device), torch.randn(m, n, device=device)
    w = torch.randn(n, device=device) if with_weight else None
    w64 = None if w is None else w.double()
    y, rstd = torch.full_like(x, float("nan")), torch.full((m,), float("nan"), device=device)
    _forward(cfg, x, w, y, rstd)
    y_ref, rstd_ref = reference.rms_norm_forward(x.double(), w64, 1e-6)
    torch.testing.assert_close(y.double(), y_ref, **TOL[torch.float32])
    torch.testing.assert_close(rstd.double(), rstd_ref, **TOL[torch.float32])
    dx = torch.full_like(x, float("nan"))
    dw = torch.full((n,), float("nan"), device=device) if with_weight else None
    ws = _workspace(cfg, x, w) if with_weight else None
    _backward(cfg, dy, x, w, rstd, dx, dw, ws)
    dx_ref, dw_ref = reference.rms_norm_backward(dy.double(), x.double(), w64, rstd.double())
    torch.testing.assert_close(dx.double(), dx_ref, **TOL[torch.float32])
    if with_weight:  # M follows the device's row groups
        torch.testing.assert_close(dw.double(), dw_ref, **DWEIGHT[torch.float32])


def test_single_pass_backward_forms_agree(device):
    """Both row-loop forms of the single-pass backward (``KernelConfig.counted_loop``), each
    with and without the second read of x and dy (``reload``), with a ragged last group and a
    ragged last tile: the reference's values; the same bits from both loop forms. (With and
    without the reload, the compiler fuses multiply-adds differently: on the H200 the bits
    differed, within the tolerance.)"""
    from torch_rmsnorm_op.config import KernelConfig, row_groups

    m, n = 23, 40
    x, dy, w = torch.randn(m, n, device=device), torch.randn(m, n, device=device), torch.randn(n, device=device)
    _, rstd = reference.rms_norm_forward(x, None, 1e-6)
    dx_ref, dw_ref = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd.double())
    outs = {}
    for counted, reload, stages in itertools.product((False, True), (False, True), (1, 3)):
        cfg = KernelConfig(block_n=64, rows=2, num_warps=1, programs_per_sm=1, counted_loop=counted, reload=reload,
                           stages=stages)
        groups, per_group = row_groups(m, n, torch.device(device), cfg)
        assert groups >= 2 and m % per_group % cfg.rows != 0, (groups, per_group)  # last group, tile ragged
        dx, dw = torch.full_like(x, float("nan")), torch.full_like(w, float("nan"))
        _backward(cfg, dy, x, w, rstd, dx, dw, _workspace(cfg, x, w))
        torch.testing.assert_close(dx.double(), dx_ref, **TOL[torch.float32])
        torch.testing.assert_close(dw.double(), dw_ref, **dweight_tol(torch.float32, m))
        outs[counted, reload, stages] = dx, dw
    for reload, stages in itertools.product((False, True), (1, 3)):
        (dx, dw), (dx_counted, dw_counted) = outs[False, reload, stages], outs[True, reload, stages]
        assert torch.equal(dx, dx_counted) and torch.equal(dw, dw_counted)


@pytest.mark.parametrize("n, block, warps, acc_rows", [(40, 64, 1, 2), (100, 128, 1, 1), (256, 256, 2, 1)])
def test_dweight_accumulator_forms(device, n, block, warps, acc_rows):
    """The rows backward's dweight accumulator: one row per tile row where a tile's rows lie in
    different threads, one row (each tile summed as it goes) where each thread holds whole
    columns (``launch.dweight_acc_rows``); either form gives the reference's dx and dweight."""
    from torch_rmsnorm_op.config import KernelConfig

    cfg = KernelConfig(block_n=block, rows=2, num_warps=warps, programs_per_sm=1)
    assert launch.dweight_acc_rows(cfg, 4) == acc_rows
    m = 23
    x, dy, w = torch.randn(m, n, device=device), torch.randn(m, n, device=device), torch.randn(n, device=device)
    _, rstd = reference.rms_norm_forward(x, None, 1e-6)
    dx_ref, dw_ref = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd.double())
    dx, dw = torch.full_like(x, float("nan")), torch.full_like(w, float("nan"))
    _backward(cfg, dy, x, w, rstd, dx, dw, _workspace(cfg, x, w))
    torch.testing.assert_close(dx.double(), dx_ref, **TOL[torch.float32])
    torch.testing.assert_close(dw.double(), dw_ref, **dweight_tol(torch.float32, m))


@pytest.mark.parametrize("m, n, columns, lead, terms, dres, wdtype", [
    (23, 40, 32, 1, 1, False, torch.float32),  # a ragged column block; 23 rows in one step
    (100, 300, 32, 1, 3, True, torch.float32),  # two row steps of 64, the second ragged; dy of 3 terms
    (12, 64, 16, 3, 2, False, torch.float32),  # the (B, H, S, D) view of a (B, S, H, D) tensor
    (9, 96, 64, 1, 1, True, torch.bfloat16),  # dweight written in the weight's dtype
])
def test_backward_dweight_from_column_programs(device, m, n, columns, lead, terms, dres, wdtype):
    """The backward whose launch writes dweight from column programs (``KernelConfig.dw_columns``):
    the reference's dx and dweight, the same dx bits as with partial rows and the reduction, the
    same bits on a second run, and nothing in the workspace to allocate."""
    cfg = KernelConfig(block_n=next_power_of_2(n), rows=2, num_warps=1, programs_per_sm=1)
    if lead == 3:
        x = torch.randn(2, m // 2, 3, n, device=device).transpose(1, 2)  # rows of the view, not of memory
    else:
        x = torch.randn(m, n, device=device)
    dy = torch.randn(x.shape, device=device).contiguous()
    dy_terms = tuple(torch.randn_like(dy) for _ in range(terms - 1))
    dr = torch.randn_like(dy) if dres else None
    w = (torch.rand(n, device=device) + 0.5).to(wdtype)
    _, rstd = reference.rms_norm_forward(x, None, 1e-6)  # rstd of x's leading shape
    total = sum(dy_terms, dy).double()
    if dres:
        dx_ref, dw_ref = reference.add_rms_norm_backward(total, dr.double(), x.double(), w.double(), rstd.double())
    else:
        dx_ref, dw_ref = reference.rms_norm_backward(total, x.double(), w.double(), rstd.double())
    outs = []
    for c in (0, columns, columns):
        plan = _plan(dataclasses.replace(cfg, dw_columns=c), x, w, backward=True)
        if c:
            assert launch.backward_workspace(plan, x.dtype, x.device).numel() == 0
        dx, dw = torch.full(x.shape, float("nan"), device=device), torch.full_like(w, float("nan"))
        launch.backward(plan, dy, x, w, rstd.reshape(-1), dx, dw, dr, dy_terms=dy_terms)
        torch.testing.assert_close(dx.double(), dx_ref, **TOL[torch.float32])
        tol = dweight_tol(torch.float32, m) if wdtype == torch.float32 else DWEIGHT[wdtype]
        torch.testing.assert_close(dw.double(), dw_ref, **tol)
        outs.append((dx, dw))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[1][0], outs[2][0]) and torch.equal(outs[1][1], outs[2][1])


def test_kernel_config_refuses_shapes_the_kernels_cannot_run():
    from torch_rmsnorm_op.config import KernelConfig

    with pytest.raises(ValueError, match="looped needs rows == 1 and split == 1"):
        KernelConfig(block_n=4096, rows=1, num_warps=16, split=2, looped=True)
    with pytest.raises(ValueError, match="looped needs rows == 1"):
        KernelConfig(block_n=4096, rows=2, num_warps=16, looped=True)
    with pytest.raises(ValueError, match="reload is single-pass only"):
        KernelConfig(block_n=8192, rows=1, num_warps=16, split=4, reload=True)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        KernelConfig(block_n=8192, rows=1, num_warps=16, split=4, stages=0)
    with pytest.raises(ValueError, match="interleave is for split mode"):
        KernelConfig(block_n=8192, rows=1, num_warps=16, interleave=True)
    with pytest.raises(ValueError, match="mask_free is for single-pass and looped"):
        KernelConfig(block_n=8192, rows=1, num_warps=16, split=4, mask_free=True)
    with pytest.raises(ValueError, match="dw_columns is a power of two, for the single-pass backward"):
        KernelConfig(block_n=8192, rows=1, num_warps=16, split=4, dw_columns=32)
    with pytest.raises(ValueError, match="dw_columns is a power of two"):
        KernelConfig(block_n=2048, rows=1, num_warps=4, dw_columns=48)


@pytest.mark.parametrize("has_weight", [True, False])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("mask_free", [False, True])
@pytest.mark.parametrize("n", [300, 256])
def test_looped_forward(device, has_weight, stages, mask_free, n):
    """The looped forward (``KernelConfig.looped``: one row per program, x read twice in
    ``block_n`` steps), a ragged last step (N = 300: 128, 128, 44; ``mask_free`` must keep its
    masks there) or whole steps (256, where ``mask_free`` drops them and the loops have a
    constant length), strided rows: the reference's values, and nothing written past the row."""
    m = 5
    x = torch.randn(m, n + 20, device=device)[:, :n]
    w = torch.randn(n, device=device) if has_weight else None
    out = torch.full((m, n + 20), float("nan"), device=device)
    y, rstd = out[:, :n], torch.full((m,), float("nan"), device=device)
    cfg = KernelConfig(block_n=128, rows=1, num_warps=1, looped=True, stages=stages, mask_free=mask_free)
    _forward(cfg, x, w, y, rstd)
    y_ref, rstd_ref = reference.rms_norm_forward(x.double(), None if w is None else w.double(), 1e-6)
    torch.testing.assert_close(y.double(), y_ref, **TOL[torch.float32])
    torch.testing.assert_close(rstd.double(), rstd_ref, **TOL[torch.float32])
    assert out[:, n:].isnan().all()
    assert (cfg.mask_free and launch.exact_tiles(cfg, m, n)) == (mask_free and n == 256)  # no masks
    assert launch.loop_steps(cfg, m, n) == (2 if mask_free and n == 256 else 0)  # loops of known length


@pytest.mark.parametrize("has_weight", [True, False])
@pytest.mark.parametrize("m, n", [(8, 64), (7, 64), (8, 60)])
def test_single_pass_forward_without_masks(device, has_weight, m, n):
    """A ``mask_free`` single-pass forward: without masks only where its tiles cover x exactly
    (M a multiple of its rows, N of its block); ragged rows or columns keep them. Strided rows:
    the reference's values, nothing written past a row."""
    x = torch.randn(m, n + 20, device=device)[:, :n]
    w = torch.randn(n, device=device) if has_weight else None
    out = torch.full((m, n + 20), float("nan"), device=device)
    y, rstd = out[:, :n], torch.full((m,), float("nan"), device=device)
    cfg = KernelConfig(block_n=64, rows=4, num_warps=1, mask_free=True)
    _forward(cfg, x, w, y, rstd)
    y_ref, rstd_ref = reference.rms_norm_forward(x.double(), None if w is None else w.double(), 1e-6)
    torch.testing.assert_close(y.double(), y_ref, **TOL[torch.float32])
    torch.testing.assert_close(rstd.double(), rstd_ref, **TOL[torch.float32])
    assert out[:, n:].isnan().all()
    assert launch.exact_tiles(cfg, m, n) == (m % 4 == 0 and n == 64)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_off_the_current_device():
    """Triton launches on the current device: the launchers must switch to the tensors' own."""
    x = torch.randn(64, 1024, device="cuda:1", requires_grad=True)
    w = torch.randn(1024, device="cuda:1", requires_grad=True)
    with torch.cuda.device(0):
        y = T.rms_norm(x, (1024,), w)
        y.square().sum().backward()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    torch.nn.functional.rms_norm(x2, (1024,), w2).square().sum().backward()
    torch.testing.assert_close(y.double(), torch.nn.functional.rms_norm(x2, (1024,), w2), **TOL[torch.float32])
    torch.testing.assert_close(x.grad.double(), x2.grad, **TOL[torch.float32])
    torch.testing.assert_close(w.grad.double(), w2.grad, **dweight_tol(torch.float32, x.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2])
def test_one_row_group_writes_dweight_without_a_reduction(device, monkeypatch, dtype, split):
    """A grid of one row group (here 3 rows in one group) has one partial row, which is dweight:
    the kernel writes it in dweight's dtype, rounded once from fp32, and no reduction runs."""
    from torch_rmsnorm_op.config import row_groups

    m, n = 3, 96
    cfg = KernelConfig(block_n=128 // split, rows=4, num_warps=1, split=split)
    assert row_groups(m, n, torch.device(device), cfg) == (1, 4)
    monkeypatch.setattr(launch, "reduce_dweight", lambda *a, **k: pytest.fail("a reduction ran"))
    x, dy = torch.randn(m, n, device=device, dtype=dtype), torch.randn(m, n, device=device, dtype=dtype)
    w = torch.randn(n, device=device, dtype=dtype)
    _, rstd = reference.rms_norm_forward(x, None, 1e-6)
    dx, dw = torch.empty_like(x), torch.full_like(w, float("nan"))
    _backward(cfg, dy, x, w, rstd.float(), dx, dw)
    want_dx, want_dw = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd.double())
    torch.testing.assert_close(dw.double(), want_dw, **(BF16_ONE_ROUNDING if dtype == torch.bfloat16
                                                      else few_roundings(torch.float32)))
    torch.testing.assert_close(dx.double(), want_dx, **TOL[dtype])


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("m", [5, 8])
@pytest.mark.parametrize("split", [1, 2])
def test_dweight_partials_merge_in_pairs(device, monkeypatch, m, split, merge):
    """Above ``MERGE_SCRATCH_BYTES`` (and share) of scratch two row groups share one row of it
    (``kernels.common._merge_partial``): row j holds the sum of groups 2j and 2j + 1 (a lone last group
    when their count is odd); below, row j is group j's. Every row is written, and the scratch
    has no rows beyond the partials (one reduce stage)."""
    from torch_rmsnorm_op.config import cdiv, row_groups

    n = 96
    monkeypatch.setattr(launch, "MERGE_SCRATCH_BYTES", 0 if merge else m * n * 4)
    monkeypatch.setattr(launch, "MERGE_SCRATCH_SHARE", 0)
    cfg = KernelConfig(block_n=128 // split, rows=1, num_warps=1, split=split, programs_per_sm=2 * split)
    groups, per_group = row_groups(m, n, torch.device(device), cfg)
    assert (groups, per_group) == (m, 1)
    x, dy, w = torch.randn(m, n, device=device), torch.randn(m, n, device=device), torch.randn(n, device=device)
    _, rstd = reference.rms_norm_forward(x, None, 1e-6)
    ws = _workspace(cfg, x, w).fill_(float("nan"))
    per_row = dy.double() * x.double() * rstd.double()[:, None]  # each group is one row here
    want = torch.stack([per_row[2 * j:2 * j + 2].sum(0) for j in range(cdiv(m, 2))]) if merge else per_row
    assert ws.shape == want.shape
    dx, dw = torch.empty_like(x), torch.full_like(w, float("nan"))
    _backward(cfg, dy, x, w, rstd, dx, dw, ws)
    torch.testing.assert_close(ws.double(), want, **few_roundings(torch.float32))
    torch.testing.assert_close(dw.double(), per_row.sum(0), **few_roundings(torch.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,merge", [(16384, 1024, False), (8192, 16384, True), (96, 65536, True)])
def test_dweight_bits_do_not_depend_on_which_group_finishes_first(monkeypatch, m, n, merge):
    """A thousand row groups (single-pass) or split-mode groups finish in whatever order, and
    with merged partials (``launch.merged_partials``; forced for split mode, whose scratch stays
    below the size) pair up in that order: dweight has the same bits on every run."""
    from torch_rmsnorm_op.config import backward_config, row_groups

    if merge and backward_config(n, torch.bfloat16).split > 1:
        monkeypatch.setattr(launch, "MERGE_SCRATCH_BYTES", 0)
    groups, _ = row_groups(m, n, torch.device("cuda"), backward_config(n, torch.bfloat16))
    assert launch.merged_partials(groups, m, n, torch.bfloat16) == merge
    x, dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16), torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    _, rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6)
    first = torch.ops.rmsnorm.bwd(dy, x, w, rstd)[1]
    for _ in range(20):
        assert torch.equal(torch.ops.rmsnorm.bwd(dy, x, w, rstd)[1].view(torch.int16), first.view(torch.int16))
    _, want = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd.double())
    torch.testing.assert_close(first.double(), want, **DWEIGHT[torch.bfloat16])


@pytest.mark.parametrize("n", [37, 131])
@pytest.mark.parametrize("p", [5, 64, 65, 261])
def test_dweight_reduction(device, p, n):
    """The dweight reduction over few partial rows (one step) and many (tiles of rows in turn, a
    ragged last one), N past a whole number of tiles of any width they take (8 to 4096 columns;
    on the interpreter's 4 multiprocessors 37 columns take the narrow tiles of many rows, 131
    the wide ones): every partial row counted once, and the same bits on a second run."""
    partial = torch.randn(p, n, device=device)
    outs = []
    for _ in range(2):
        dw = torch.full((n,), float("nan"), device=device, dtype=torch.bfloat16)
        launch.reduce_dweight(partial, dw)
        outs.append(dw)
    torch.testing.assert_close(outs[0].double(), partial.double().sum(0), **BF16_ONE_ROUNDING)
    assert torch.equal(outs[0], outs[1])


def test_reduce_tile_sizes_the_tile_to_the_partial_rows_and_the_grid():
    from torch_rmsnorm_op.config import REDUCE_BLOCK_P, REDUCE_COLUMNS, REDUCE_TILE, REDUCE_TILE_MANY, cdiv, reduce_tile

    cpu = torch.device("cpu")  # the interpreter's 4 multiprocessors
    for p in (1, 2, 31, 33, 64, 65, 100, 528, 4096):
        for n in (1, 37, 96, 256, 1024, 16384, 262144):
            block_p, block_n = reduce_tile(p, n, cpu)
            if p <= REDUCE_BLOCK_P // 2:
                # Few rows: summed in one step, no tile rows to spare past the next power of
                # two; tiles of REDUCE_TILE elements.
                assert block_p * block_n == REDUCE_TILE and p <= block_p < 2 * p, (p, block_p)
            else:  # many: tiles of REDUCE_TILE_MANY elements, wide where the grid stays full
                assert block_p * block_n == REDUCE_TILE_MANY, (p, n, block_p, block_n)
                assert block_n == REDUCE_COLUMNS[cdiv(n, REDUCE_COLUMNS[1]) >= 6], (n, block_n)


def test_row_stride_past_2_to_the_31(device):
    """Rows 2**31 elements apart (a strided view into a lazily allocated 4 GiB buffer): a row
    offset truncated to 32 bits would wrap onto other memory."""
    n, stride = 64, 2**31
    try:
        buffer = torch.empty(stride + n, dtype=torch.bfloat16, device=device)
    except (RuntimeError, MemoryError):
        pytest.skip("cannot reserve a 4 GiB buffer here")
    x = buffer.as_strided((2, n), (stride, 1))
    x.copy_(torch.randn(2, n, device=device).to(torch.bfloat16))
    w = torch.randn(n, device=device, dtype=torch.bfloat16)
    with T.fallback_policy("error"):
        y, rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6)
        dy = torch.randn_like(y)
        dx, dw = torch.ops.rmsnorm.bwd(dy, x, w, rstd)
    y_ref, rstd_ref = reference.rms_norm_forward(x.double(), w.double(), 1e-6)
    dx_ref, dw_ref = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd_ref)
    torch.testing.assert_close(y.double(), y_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(dx.double(), dx_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(dw.double(), dw_ref, **TOL[torch.bfloat16])


@pytest.mark.cuda
def test_contiguous_tensor_past_2_to_the_31_elements():
    """M * N > 2**31 with contiguous rows: row index times N overflows 32 bits in the last rows."""
    m, n = 2**19 + 8, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    with T.fallback_policy("error"):
        y, rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6)
        dy = torch.randn_like(y)
        dx, _ = torch.ops.rmsnorm.bwd(dy, x, w, rstd)
    tail = slice(m - 16, m)  # the rows past 2**31 elements
    y_ref, rstd_ref = reference.rms_norm_forward(x[tail].double(), w.double(), 1e-6)
    dx_ref, _ = reference.rms_norm_backward(dy[tail].double(), x[tail].double(), w.double(), rstd_ref)
    torch.testing.assert_close(y[tail].double(), y_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(dx[tail].double(), dx_ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("n", [1536, 5120, 6144])
def test_forward_rungs_of_hidden_sizes_that_are_not_powers_of_two(device, n):
    """The table's forward at such N (``config.FWD_LADDER``: 5,120 single-pass at these 3 rows,
    the few-rows rung, looped from 1,025 rows without a residual; 6,144 looped in steps of 2,048),
    through the public functions: the reference's values, with and without the residual add,
    and the plan says which rung ran."""
    x, r = (torch.randn(3, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5
    y = T.rms_norm(x, (n,), w, 1e-6)
    y2, s = T.add_rms_norm(x, r, (n,), w, 1e-6)
    y_ref, _ = reference.rms_norm_forward(x, w, 1e-6)
    y2_ref, s_ref, _ = reference.add_rms_norm_forward(x, r, w, 1e-6)
    torch.testing.assert_close(y, y_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(y2, y2_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(s, s_ref, **TOL[torch.bfloat16])
    plain, summed = dispatch.forward_plan(x, w).cfg, dispatch.forward_plan(x, w, r).cfg
    assert (plain.looped, summed.looped) == {1536: (False, False), 5120: (False, False), 6144: (True, True)}[n]
    assert dispatch.forward_plan(x[:1].expand(2049, n), w).cfg.looped == (n != 1536)


def _norm_add_inputs(device, r_dtype=torch.bfloat16, weights=True, layout="contiguous"):
    x, w = _sample(device, torch.bfloat16, weights, layout, True)
    r = torch.randn(x.shape, device=device, dtype=r_dtype, requires_grad=True)
    w2 = None if w is None else (torch.rand_like(w) + 0.5).requires_grad_()
    return x, r, w, w2


def _norm_add_fuses(x, r, w, w2):
    return launch.norm_add_fuses(dispatch.forward_plan(x, w), dispatch.forward_plan(r, w2, x), x, r)


@pytest.mark.parametrize("mode", ["table", "rows", "looped"], indirect=True)
def test_opcheck_norm_add(device, mode):
    """``norm_add_fwd``: one kernel where both norms take the same single-pass configuration and
    the rows are contiguous (the table's at this N for a bf16 sum, "rows"), the two ops' launches
    elsewhere (strided rows, an fp32 sum, looped; split mode takes the same path); Gemma's weight
    offset."""
    cases = [(torch.bfloat16, "contiguous")]
    if mode == "table":
        cases += [(torch.bfloat16, "strided"), (torch.float32, "contiguous")]
    fuses = []
    for r_dtype, layout in cases:
        x, r, w, w2 = _norm_add_inputs(device, r_dtype, layout=layout)
        torch.library.opcheck(torch.ops.rmsnorm.norm_add_fwd, (x, r, w, 1e-6, w2, 1e-5), {"weight_offset": 1.0})
        fuses.append(_norm_add_fuses(x, r, w, w2))
    assert fuses == {"table": [True, False, False], "rows": [True], "looped": [False]}[mode]
    assert T.dispatch_stats()["kernel"].get("rmsnorm.norm_add_fwd", 0) > 0
    assert "rmsnorm.fwd" not in T.dispatch_stats()["kernel"]
    assert T.dispatch_stats()["fallback"] == {}


@pytest.mark.parametrize("mode,kw,weights,layout", [
    ("table", {}, True, "contiguous"), ("table", {"weight_offset": 1.0}, True, "contiguous"),
    ("table", {"norm_dtype": torch.bfloat16}, True, "contiguous"), ("table", {}, False, "contiguous"),
    ("table", {"norm_dtype": torch.bfloat16}, True, "strided"), ("rows", {}, True, "contiguous"),
    ("looped", {"weight_offset": 1.0}, True, "contiguous")], indirect=["mode"])
def test_norm_add_is_the_two_ops_bit_for_bit(device, mode, kw, weights, layout):
    """``norm_add_fwd(x, r, ...)`` against ``fwd(x)`` then ``add_fwd(r, that)``, the graph it
    replaces: the same y, sum and rstds, and the same gradients of x, r and both weights."""
    x, r, w, w2 = _norm_add_inputs(device, weights=weights, layout=layout)
    y, h, rstd, x_rstd = torch.ops.rmsnorm.norm_add_fwd(x, r, w, 1e-6, w2, 1e-5, **kw)
    y1, x_rstd1 = torch.ops.rmsnorm.fwd(x, w, 1e-6, **kw)
    want = (*torch.ops.rmsnorm.add_fwd(r, y1, w2, 1e-5, **kw), x_rstd1)
    for name, a, b in zip(("y", "residual_out", "rstd", "x_rstd"), (y, h, rstd, x_rstd), want):
        assert torch.equal(a, b), name
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    inputs = [t for t in (x, r, w, w2) if t is not None]
    got = torch.autograd.grad((y * dy).sum() + (h * dh).sum(), inputs)
    expected = torch.autograd.grad((want[0] * dy).sum() + (want[1] * dh).sum(), inputs)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    ref = reference.norm_add_rms_norm_forward(x, r, w, 1e-6, w2, 1e-5, **kw)
    torch.testing.assert_close(y, ref[0], **few_roundings(torch.bfloat16))
    assert T.dispatch_stats()["fallback"] == {}


@pytest.mark.parametrize("kw", [{"weight_offset": 1.0}, {"norm_dtype": torch.bfloat16}])
def test_norm_add_runs_a_looped_configuration_of_one_step_as_one_row_per_program(device, monkeypatch, kw):
    """Where both norms take a looped configuration whose one step holds the whole row, the
    norm-add kernel runs one row per program of that block and warps: the two ops' bits."""
    monkeypatch.setattr(dispatch, "forward_config", lambda *a, **k: KernelConfig(64, 1, 2, looped=True))
    monkeypatch.setattr(dispatch, "_PLANS", {})
    x, r, w, w2 = _norm_add_inputs(device)
    assert _norm_add_fuses(x, r, w, w2)
    got = torch.ops.rmsnorm.norm_add_fwd(x, r, w, 1e-6, w2, 1e-5, **kw)
    y1, x_rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6, **kw)
    for a, b in zip(got, (*torch.ops.rmsnorm.add_fwd(r, y1, w2, 1e-5, **kw), x_rstd)):
        assert torch.equal(a, b)
    monkeypatch.setattr(dispatch, "forward_config", lambda *a, **k: KernelConfig(16, 1, 1, looped=True))
    monkeypatch.setattr(dispatch, "_PLANS", {})
    assert not _norm_add_fuses(x, r, w, w2)  # 33 columns in three steps


def test_norm_add_runs_one_kernel_where_both_norms_share_a_single_pass_configuration(device):
    """``launch.norm_add_fuses`` on the table's plans: N = 2,048 and 5,120 up to 1,024 rows
    (the few-rows rungs, single-pass with and without a residual), 4,096 at 8,192 (looped both,
    in one step of the whole row), not 5,120 at 2,048 rows (looped without a residual,
    single-pass with one) nor 6,144 (looped in three steps); nor
    rows that are not contiguous, nor a tensor that does not start 16-byte aligned, nor fp16
    rows rounded before their weight, nor fp32 rows; bf16 rows rounded before their weight do."""
    bf16 = torch.bfloat16

    def fuses(m, n):
        x, r = (torch.empty(m, n, dtype=bf16, device=device) for _ in range(2))
        w = torch.ones(n, dtype=bf16, device=device)
        return _norm_add_fuses(x, r, w, w)

    assert [fuses(m, n) for m, n in ((2048, 2048), (1024, 5120), (2048, 5120), (8192, 4096), (16, 6144))] == [
        True, True, False, True, False]
    x, r = (torch.empty(2048, 2049, dtype=bf16, device=device) for _ in range(2))
    w = torch.ones(2048, dtype=bf16, device=device)
    assert not _norm_add_fuses(x[:, 1:], r[:, 1:], w, w)  # rows 2,049 apart
    assert not _norm_add_fuses(x.view(-1)[1:2048 * 2048 + 1].view(2048, 2048), r[:, :2048].contiguous(), w, w)
    x, r = (torch.empty(16, 2048, dtype=bf16, device=device) for _ in range(2))
    assert _norm_add_fuses(x, r, w, w)
    # rounded before the weight: bf16 by the kernel's integer rounding; fp16, or fp32 rows, could contract
    assert launch.norm_add_fuses(dispatch.forward_plan(x, w, norm_dtype=bf16),
                                 dispatch.forward_plan(r, w, x, norm_dtype=bf16), x, r)
    assert not launch.norm_add_fuses(dispatch.forward_plan(x, w, norm_dtype=torch.float16),
                                     dispatch.forward_plan(r, w, x, norm_dtype=torch.float16), x, r)
    h, hr, hw = x.half(), r.half(), w.half()
    assert not launch.norm_add_fuses(dispatch.forward_plan(h, hw, norm_dtype=torch.float16),
                                     dispatch.forward_plan(hr, hw, h, norm_dtype=torch.float16), h, hr)
    x, r = x.float(), r.float()
    assert not _norm_add_fuses(x, r, w.float(), w.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_add_of_zero_width_rows_matches_the_fake(device, dtype):
    x, r = torch.randn(3, 0, device=device, dtype=dtype), torch.randn(3, 0, device=device, dtype=dtype)
    torch.library.opcheck(torch.ops.rmsnorm.norm_add_fwd, (x, r, None, 1e-6, None, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))
    y, h, rstd, x_rstd = torch.ops.rmsnorm.norm_add_fwd(x, r, None, 1e-6, None, 1e-6)
    assert y.shape == h.shape == (3, 0) and rstd.isnan().all() and x_rstd.isnan().all()
    assert T.dispatch_stats()["fallback"] == {}


def test_norm_add_checks_its_arguments(device):
    x, r = torch.randn(2, 8, device=device), torch.randn(2, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"rmsnorm.norm_add_fwd: x_weight must have shape \[N\] = \[8\]"):
        torch.ops.rmsnorm.norm_add_fwd(x, r, torch.ones(4, device=device), 1e-6, w, 1e-6)
    with pytest.raises(ValueError, match=r"rmsnorm.norm_add_fwd: residual must have x's shape \[2, 8\]"):
        torch.ops.rmsnorm.norm_add_fwd(x, r[:1], w, 1e-6, w, 1e-6)
    with pytest.raises(ValueError, match=r"rmsnorm.norm_add_fwd: weight must have shape"):
        torch.ops.rmsnorm.norm_add_fwd(x, r, w, 1e-6, w[:4], 1e-6)


def test_norm_add_in_float64_is_the_counted_reference(device):
    """float64: the reference, counted as the op's fallback (and its gradient as ``add_bwd``'s
    and ``bwd``'s), refused under "error"; the gradient passes gradcheck."""
    x, r = (torch.randn(3, 9, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2))
    w1, w2 = (torch.rand(9, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2))

    def f(*a):
        return torch.ops.rmsnorm.norm_add_fwd(a[0], a[1], a[2], 1e-6, a[3], 1e-5)[:2]

    with T.fallback_policy("error"), pytest.raises(T.FallbackError):
        f(x, r, w1, w2)
    with T.fallback_policy("reference"):
        assert torch.autograd.gradcheck(f, (x, r, w1, w2))
    reasons = T.dispatch_stats()["fallback"]
    assert {k.split(":")[0] for k in reasons} == {"rmsnorm.norm_add_fwd", "rmsnorm.bwd", "rmsnorm.add_bwd"}


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["gemma", "glm4"])
@pytest.mark.parametrize("m,n", [(16, 2048), (2048, 2048), (8192, 1152), (8192, 4096), (1024, 5120), (2048, 5120),
                                 (4096, 5376), (2048, 6144)])
def test_cuda_norm_add_is_the_two_ops_bit_for_bit_at_model_shapes(m, n, family):
    """Gemma's and GLM 4's widths and token counts, bf16, with Gemma's weight offset or GLM 4's
    rounding before the weight: one kernel where both norms take one single-pass configuration
    or one looped in a single step (8,192 x 4,096; not 2,048 x 5,120, nor 6,144, looped in three
    steps), with the two ops' values, bit for bit."""
    kw = {"weight_offset": 1.0} if family == "gemma" else {"norm_dtype": torch.bfloat16}
    x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w1, w2 = (torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 + (family == "glm4") for _ in range(2))
    got = torch.ops.rmsnorm.norm_add_fwd(x, r, w1, 1e-6, w2, 1e-6, **kw)
    y1, x_rstd = torch.ops.rmsnorm.fwd(x, w1, 1e-6, **kw)
    want = (*torch.ops.rmsnorm.add_fwd(r, y1, w2, 1e-6, **kw), x_rstd)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    fuses = launch.norm_add_fuses(dispatch.forward_plan(x, w1, **kw), dispatch.forward_plan(r, w2, x, **kw), x, r)
    assert fuses == ((m, n) not in ((2048, 5120), (2048, 6144)))
