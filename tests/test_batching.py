"""Batched gradients and vmap through the ops: ``is_grads_batched``, vectorized jacobians,
``gradcheck``'s batched check, and ``torch.vmap`` over every op with batch dims anywhere."""

import pytest
import torch
from tolerances import few_roundings

import torch_rmsnorm_op as T

# What a batched computation is compared with: the same op per sample. dx comes from the same
# kernel over the same rows; the per-sample dweight is a torch sum against the kernel's own,
# one rounding apart (bf16: one unit in the last place).
BATCHED = {dtype: few_roundings(dtype) for dtype in (torch.float32, torch.bfloat16)}
N = 24  # not a power of 2


def _per_sample_grads(outputs, inputs, grads):
    """``autograd.grad`` once per sample of the batched grads, stacked: what the batched call must give."""
    per_sample = [torch.autograd.grad(outputs, inputs, [g[b] for g in grads], retain_graph=True)
                  for b in range(grads[0].shape[0])]
    return [torch.stack(s) for s in zip(*per_sample)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_is_grads_batched_matches_per_sample_grads_with_one_kernel_call(device, dtype, with_weight):
    x = torch.randn(3, 5, N, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(N, device=device, dtype=dtype, requires_grad=True) if with_weight else None
    inputs = (x, w) if with_weight else (x,)
    y = T.rms_norm(x, (N,), w)
    v = torch.randn(4, *y.shape, device=device, dtype=dtype)
    with T.fallback_policy("error"):
        T.reset_dispatch_stats()
        got = torch.autograd.grad(y, inputs, v, retain_graph=True, is_grads_batched=True)
        assert T.dispatch_stats()["kernel"] == {"rmsnorm.bwd": 1}  # one call for all 4 samples' rows
        want = _per_sample_grads(y, inputs, [v])
    for name, g, e in zip(("dx", "dweight"), got, want):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        torch.testing.assert_close(g, e, **BATCHED[dtype], msg=name)


def test_is_grads_batched_through_add_rms_norm(device):
    x = torch.randn(2, 3, N, device=device, requires_grad=True)
    r = torch.randn(2, 3, N, device=device, requires_grad=True)
    w = torch.randn(N, device=device, requires_grad=True)
    y, s = T.add_rms_norm(x, r, (N,), w)
    vy, vs = torch.randn(5, *y.shape, device=device), torch.randn(5, *s.shape, device=device)
    got = torch.autograd.grad((y, s), (x, r, w), (vy, vs), retain_graph=True, is_grads_batched=True)
    want = _per_sample_grads((y, s), (x, r, w), [vy, vs])
    for name, g, e in zip(("dx", "dresidual", "dweight"), got, want):
        torch.testing.assert_close(g, e, **BATCHED[torch.float32], msg=name)


def test_vectorized_jacobian_matches_the_loop(device):
    x = torch.randn(2, 3, 7, device=device)
    w = torch.randn(7, device=device)

    def f(x, w):
        return T.rms_norm(x, (7,), w)

    with T.fallback_policy("error"):
        vectorized = torch.autograd.functional.jacobian(f, (x, w), vectorize=True)
        looped = torch.autograd.functional.jacobian(f, (x, w))
    for name, a, b in zip(("d/dx", "d/dweight"), vectorized, looped):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, **BATCHED[torch.float32], msg=name)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_gradcheck_with_batched_grad_in_float64(weight_offset):
    x = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def norm(x, w):
        return T.rms_norm(x, (6,), w, weight_offset=weight_offset)

    def add_norm(x, r, w):
        return T.add_rms_norm(x, r, (6,), w, weight_offset=weight_offset)

    with T.fallback_policy("reference"):  # float64 is the reference path
        assert torch.autograd.gradcheck(norm, (x, w), check_batched_grad=True)
        assert torch.autograd.gradgradcheck(norm, (x, w), check_batched_grad=True)
        assert torch.autograd.gradcheck(add_norm, (x, r, w), check_batched_grad=True)


# torch's module test for nn.RMSNorm (test/test_modules.py, test_grad / test_gradgrad over
# torch.testing._internal.common_modules.module_inputs_torch_nn_RMSNorm): the same constructor
# and forward inputs, gradcheck and gradgradcheck with check_batched_grad and fast_mode as its
# gradcheck wrappers set them, on the total derivative and on each parameter's partial one.
MODULE_INPUTS = [
    ([5], 1e-3, True, (4, 5, 5)),
    ([5], 1e-3, True, (128, 5, 5)),
    ([5], 1e-3, False, (4, 5, 5)),
    ([2, 2, 5], 1e-3, True, (4, 2, 2, 5)),
    ([2, 2, 5], 1e-3, False, (4, 2, 2, 5)),
    ([5], 1e-3, True, (0, 5)),
]


@pytest.mark.parametrize("check", ["gradcheck", "gradgradcheck"])
@pytest.mark.parametrize("normalized_shape, eps, affine, shape", MODULE_INPUTS)
def test_module_grad_as_torchs_module_test(check, normalized_shape, eps, affine, shape):
    checker = getattr(torch.autograd, check)
    m = T.RMSNorm(normalized_shape, eps, affine).to(torch.float64)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    params = tuple(m.parameters())

    def fn(x, *flat_params):
        return m(x)

    with T.fallback_policy("reference"):
        assert checker(fn, (x, *params), check_batched_grad=True, fast_mode=True)
        for p in params:  # partial derivatives: one parameter at a time
            for q in params:
                q.requires_grad_(q is p)
            assert checker(fn, (x, *params), check_batched_grad=True, fast_mode=True)
            p.requires_grad_(True)


@pytest.mark.parametrize("in_dim", [0, 1, 2])
def test_vmap_rms_norm_over_any_dim(device, in_dim):
    base = torch.randn(4, 3, N, device=device)
    x = base.movedim(0, in_dim)  # the batch of 4 at in_dim
    w = torch.randn(N, device=device)
    with T.fallback_policy("error"):
        got = torch.vmap(lambda a: T.rms_norm(a, (N,), w), in_dims=in_dim, out_dims=in_dim)(x)
    want = torch.stack([T.rms_norm(base[b], (N,), w) for b in range(4)]).movedim(0, in_dim)
    torch.testing.assert_close(got, want, **BATCHED[torch.float32])


def test_vmap_nested_and_empty_batches(device):
    x = torch.randn(2, 3, 4, N, device=device)
    w = torch.randn(N, device=device)
    with T.fallback_policy("error"):
        got = torch.vmap(torch.vmap(lambda a: T.rms_norm(a, (N,), w), in_dims=1), in_dims=2)(x)
        empty = torch.vmap(lambda a: T.rms_norm(a, (N,), w))(x[:0])
    torch.testing.assert_close(got, T.rms_norm(x, (N,), w).permute(2, 1, 0, 3), **BATCHED[torch.float32])
    assert empty.shape == (0, 3, 4, N)


def test_vmap_passes_the_keyword_arguments(device):
    x = torch.randn(3, 2, N, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, device=device)
    kw = {"weight_offset": 1.0, "norm_dtype": torch.bfloat16, "out_dtype": torch.float32}
    got = torch.vmap(lambda a: T.rms_norm(a, (N,), w, **kw), in_dims=1)(x)
    want = torch.stack([T.rms_norm(x[:, b], (N,), w, **kw) for b in range(2)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **BATCHED[torch.bfloat16])  # rounded to bf16 before the weight
    y, s = torch.vmap(lambda a, r: T.add_rms_norm(a, r, (N,), w, **kw), in_dims=(1, None))(x, x[:, 0])
    for b in range(2):
        yb, sb = T.add_rms_norm(x[:, b], x[:, 0], (N,), w, **kw)
        torch.testing.assert_close((y[b], s[b]), (yb, sb), **BATCHED[torch.bfloat16])


@pytest.mark.parametrize("op", ["bwd", "add_bwd"])
@pytest.mark.parametrize("batched", ["dy", "x", "weight", "all"])
def test_vmap_backward_ops_give_per_sample_dweight(device, op, batched):
    """Each operand batched or not, the weight too (per-sample weights take the reference)."""
    B, shape = 3, (2, 5, N)
    full = {
        "dy": torch.randn(B, *shape, device=device),
        "x": torch.randn(B, *shape, device=device),
        "weight": torch.randn(B, N, device=device),
    }
    names = ("dy", "x", "weight") if batched == "all" else (batched,)
    args = {k: (v if k in names else v[0]) for k, v in full.items()}
    rstd = torch.vmap(lambda a: torch.ops.rmsnorm.fwd(a, None, 1e-6)[1])(args["x"]) if "x" in names else \
        torch.ops.rmsnorm.fwd(args["x"], None, 1e-6)[1]
    in_dims = tuple(0 if k in names else None for k in ("dy", "x", "weight")) + ((0 if "x" in names else None),)

    def call(dy, x, w, r):
        if op == "bwd":
            return torch.ops.rmsnorm.bwd(dy, x, w, r)
        return torch.ops.rmsnorm.add_bwd(dy, dy, x, w, r)  # dresidual_out: dy again

    policy = "reference" if "weight" in names else "error"
    with T.fallback_policy(policy):
        T.reset_dispatch_stats()
        dx, dw = torch.vmap(call, in_dims=in_dims)(args["dy"], args["x"], args["weight"], rstd)
        if "weight" in names:
            assert T.dispatch_stats()["fallback"] == {f"rmsnorm.{op}: per-sample weights under vmap": 1}
    for b in range(B):
        pick = {k: (v[b] if k in names else v) for k, v in args.items()}
        r = rstd[b] if "x" in names else rstd
        want_dx, want_dw = call(pick["dy"], pick["x"], pick["weight"], r)
        torch.testing.assert_close(dx[b], want_dx, **BATCHED[torch.float32], msg=f"dx[{b}]")
        torch.testing.assert_close(dw[b], want_dw, **BATCHED[torch.float32], msg=f"dweight[{b}]")


def test_vmap_per_sample_weights_forward_and_the_policy(device):
    x = torch.randn(3, 2, N, device=device)
    ws = torch.randn(3, N, device=device)

    def f(a, w):
        return T.rms_norm(a, (N,), w)

    with T.fallback_policy("reference"):
        got = torch.vmap(f)(x, ws)
        assert T.dispatch_stats()["fallback"] == {"rmsnorm.fwd: per-sample weights under vmap": 1}
    torch.testing.assert_close(got, torch.stack([f(x[b], ws[b]) for b in range(3)]), **BATCHED[torch.float32])
    with T.fallback_policy("error"), pytest.raises(T.FallbackError, match="per-sample weights under vmap"):
        torch.vmap(f)(x, ws)
    with pytest.raises(T.RMSNormInputError, match=r"rmsnorm.fwd: weight must have shape \[N\] = \[24\]"):
        torch.vmap(lambda a, w: torch.ops.rmsnorm.fwd(a, w, 1e-6))(x, ws[:, :-1])


@pytest.mark.parametrize("per_sample", [None, "x_weight", "weight"])
def test_vmap_norm_add(device, per_sample):
    """``norm_add_fwd`` under vmap, the batch at dim 1 of x, the residual unbatched: one call on
    all rows, the same values as a call per sample; a per-sample weight takes the reference,
    counted."""
    x, r = torch.randn(3, 4, N, device=device), torch.randn(3, N, device=device)
    weights = {"x_weight": torch.rand(N, device=device) + 0.5, "weight": torch.rand(N, device=device) + 0.5}
    if per_sample:
        weights[per_sample] = torch.rand(4, N, device=device) + 0.5
    in_dims = (1, None, 0 if per_sample == "x_weight" else None, 0 if per_sample == "weight" else None)

    def f(a, res, xw, w):
        return torch.ops.rmsnorm.norm_add_fwd(a, res, xw, 1e-6, w, 1e-5, weight_offset=1.0)

    with T.fallback_policy("reference" if per_sample else "error"):
        got = torch.vmap(f, in_dims=in_dims)(x, r, weights["x_weight"], weights["weight"])
    reasons = {"rmsnorm.norm_add_fwd: per-sample weights under vmap": 1} if per_sample else {}
    assert T.dispatch_stats()["fallback"] == reasons
    for b in range(4):
        pick = {k: (v[b] if k == per_sample else v) for k, v in weights.items()}
        want = f(x[:, b], r, pick["x_weight"], pick["weight"])
        for a, w in zip(got, want):
            torch.testing.assert_close(a[b], w, **BATCHED[torch.float32])


def test_backward_of_a_vmapped_forward(device):
    x = torch.randn(3, 2, N, device=device, requires_grad=True)
    w = torch.randn(N, device=device, requires_grad=True)
    g = torch.randn(3, 2, N, device=device)
    with T.fallback_policy("error"):
        y = torch.vmap(lambda a: T.rms_norm(a, (N,), w), in_dims=1, out_dims=1)(x)
        got = torch.autograd.grad(y, (x, w), g)
        want = torch.autograd.grad(T.rms_norm(x, (N,), w), (x, w), g)
    for g_, e in zip(got, want):
        torch.testing.assert_close(g_, e, **BATCHED[torch.float32])


def test_batched_backward_on_another_thread(device):
    """The autograd engine runs a CUDA backward on its device thread, where vmap's (thread-local)
    nesting count reads 0: the batched kernel finds its tensors' level all the same."""
    import threading

    from torch_rmsnorm_op.batching import _innermost_level

    found = []

    def probe(t):
        worker = threading.Thread(target=lambda: found.append(_innermost_level([t])))
        worker.start()
        worker.join()
        return t * 1

    torch._vmap_internals._vmap(probe, 0, 0)(torch.randn(3, 4, 8, device=device))
    assert found == [(1, 3)]
