"""``rms_norm`` and ``RMSNorm`` on PyTorch's own test inputs for ``F.rms_norm`` and
``nn.RMSNorm``: the OpInfo's samples (outputs and gradients against ``F.rms_norm``), its error
inputs (an error of the same type and message, raised before any output), its samples of jagged
nested tensors, and the ModuleInfo's constructor and forward inputs. The inputs come from
``torch.testing._internal``, PyTorch's test material rather than a public API: the tests skip
where it does not import or no longer names the op."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import TOL, grad_tol

import torch_rmsnorm_op as T

common_methods = pytest.importorskip("torch.testing._internal.common_methods_invocations")
common_modules = pytest.importorskip("torch.testing._internal.common_modules")

# fp64 takes the reference (the kernels serve fp16, bf16 and fp32), a counted fallback; the
# other dtypes run under the "error" policy, so that every sample runs the kernels.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _op_info():
    infos = [op for op in common_methods.op_db if op.name == "nn.functional.rms_norm"]
    if not infos:
        pytest.skip("this torch's OpInfo database has no nn.functional.rms_norm")
    return infos[0]


def _module_info():
    infos = [m for m in common_modules.module_db if m.module_cls is torch.nn.RMSNorm]
    if not infos:
        pytest.skip("this torch's ModuleInfo database has no nn.RMSNorm")
    return infos[0]


def _leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def _grads(out, inputs, grad_out):
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.autograd.grad(out, wanted, grad_out) if wanted and out.numel() else ()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_f_rms_norm_on_the_opinfo_samples(device, dtype):
    """Every sample (shapes, ``normalized_shape`` over one or more dims, with and without a
    weight, eps given or not): the output's dtype, shape and values, and the gradients of the
    input and the weight, against ``F.rms_norm`` on copies of the same tensors."""
    samples = list(_op_info().sample_inputs(device, dtype, requires_grad=True))
    assert samples
    with T.fallback_policy("reference" if dtype == torch.float64 else "error"):
        for sample in samples:
            want_in = [sample.input, *sample.args, *sample.kwargs.values()]
            want = F.rms_norm(sample.input, *sample.args, **sample.kwargs)
            x, args = _leaf(sample.input), [_leaf(a) for a in sample.args]
            kwargs = {k: _leaf(v) for k, v in sample.kwargs.items()}
            got = T.rms_norm(x, *args, **kwargs)
            assert (got.dtype, got.shape) == (want.dtype, want.shape), sample
            torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, s=sample: f"{s}: {m}")
            grad_out = torch.randn_like(want)
            for g, w in zip(_grads(got, [x, *args, *kwargs.values()], grad_out), _grads(want, want_in, grad_out),
                            strict=True):
                torch.testing.assert_close(g, w, **grad_tol(dtype), msg=lambda m, s=sample: f"{s} (grad): {m}")


def test_rms_norm_raises_as_f_rms_norm_on_the_opinfo_error_inputs(device):
    """Each error input (an empty ``normalized_shape``, a weight of another shape, an input
    whose trailing dims are not ``normalized_shape``) raises the error type PyTorch's test
    expects, with its message."""
    errors = list(_op_info().error_inputs(torch.device(device)))
    assert errors
    for error in errors:
        sample = error.sample_input
        with pytest.raises(error.error_type, match=error.error_regex):
            T.rms_norm(sample.input, *sample.args, **sample.kwargs)


def _njt_op_info():
    nested = pytest.importorskip("torch.testing._internal.opinfo.definitions.nested")
    infos = [op for op in nested.njt_op_db if op.name == "nn.functional.rms_norm"]
    if not infos:
        pytest.skip("this torch's nested OpInfo database has no nn.functional.rms_norm")
    return infos[0]


def _values(t):
    return t.values() if t.is_nested else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_f_rms_norm_on_the_nested_opinfo_samples(device, dtype):
    """Jagged nested tensors (3-D and 4-D, with and without cached sequence lengths, with holes
    between sequences, normalized over one or two trailing dims): the output is a nested tensor
    of ``F.rms_norm``'s shape, dtype and values, and the gradients of the input and the weight
    are its. Contiguous ones run the kernels on their values (the "error" policy); those with
    holes take the reference, counted, whose backward raises as ``F.rms_norm``'s does."""
    samples = list(_njt_op_info().sample_inputs(device, dtype, requires_grad=True))
    assert samples
    for sample in samples:
        x, holes = sample.input, sample.input.lengths() is not None
        want = F.rms_norm(x, **sample.kwargs)
        got_x = _leaf(x)
        kwargs = {k: _leaf(v) for k, v in sample.kwargs.items()}
        with T.fallback_policy("reference" if holes else "error"):
            got = T.rms_norm(got_x, **kwargs)
        assert got.is_nested and (got.dtype, got.shape) == (want.dtype, want.shape), sample.name
        torch.testing.assert_close(got.values(), want.values(), **TOL[dtype], msg=lambda m, s=sample: f"{s.name}: {m}")
        grad_out = torch.randn_like(want.values())
        wanted = [x, sample.kwargs["weight"]]
        try:
            want_grads = torch.autograd.grad(want.values(), wanted, grad_out)
        except RuntimeError as stock_error:  # torch's nested sum over the ragged dim, with holes
            with pytest.raises(type(stock_error)):
                torch.autograd.grad(got.values(), [got_x, kwargs["weight"]], grad_out)
            continue
        for g, w in zip(torch.autograd.grad(got.values(), [got_x, kwargs["weight"]], grad_out), want_grads,
                        strict=True):
            torch.testing.assert_close(_values(g), _values(w), **grad_tol(dtype),
                                       msg=lambda m, s=sample: f"{s.name} (grad): {m}")
    stats = T.dispatch_stats()
    assert stats["kernel"]["rmsnorm.fwd"] > 0
    assert all("holes" in reason for reason in stats["fallback"]), stats


def test_nested_tensors_raise_as_f_rms_norm_and_compile(device):
    """Normalizing over the ragged dim raises F.rms_norm's error; a compiled call on a jagged
    nested tensor (fullgraph) gives F.rms_norm's values and gradients; ``add_rms_norm`` adds
    nested tensors as torch does."""
    x = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)], layout=torch.jagged, device=device,
                                   requires_grad=True)
    w = torch.rand(8, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="Normalization over the ragged dim not supported for nested tensors"):
        T.rms_norm(x, x.shape[1:])
    with T.fallback_policy("error"):
        got = torch.compile(lambda x, w: T.rms_norm(x, (8,), w), backend="aot_eager", fullgraph=True)(x, w)
        y, s = T.add_rms_norm(x, x, (8,), w)
    want = F.rms_norm(x, (8,), w)
    torch.testing.assert_close(got.values(), want.values(), **TOL[torch.float32])
    grad_out = torch.randn_like(want.values())
    for g, w_ in zip(torch.autograd.grad(got.values(), (x, w), grad_out),
                     torch.autograd.grad(want.values(), (x, w), grad_out), strict=True):
        torch.testing.assert_close(_values(g), _values(w_), **grad_tol(torch.float32))
    torch.testing.assert_close(s.values(), 2 * x.values())
    torch.testing.assert_close(y.values(), F.rms_norm(2 * x, (8,), w).values(), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_rmsnorm_module_matches_nn_rmsnorm_on_the_moduleinfo_inputs(device, dtype):
    """Each constructor (``normalized_shape`` as an int or a tuple, eps, ``elementwise_affine``)
    and forward input: ``torch_rmsnorm_op.RMSNorm`` built alike, holding ``nn.RMSNorm``'s state,
    gives its output and the gradients of the input and the weight."""
    info = _module_info()
    inputs = [i for i in info.module_inputs_func(info, device=device, dtype=dtype, requires_grad=True, training=True)
              if i.forward_input is not None]
    assert inputs
    with T.fallback_policy("reference" if dtype == torch.float64 else "error"):
        for module_input in inputs:
            ctor = module_input.constructor_input
            want_module = torch.nn.RMSNorm(*ctor.args, **ctor.kwargs, device=device, dtype=dtype)
            for p in want_module.parameters():
                torch.nn.init.uniform_(p, 0.5, 1.5)
            module = T.RMSNorm(*ctor.args, **ctor.kwargs, device=device, dtype=dtype)
            module.load_state_dict(want_module.state_dict())
            x = module_input.forward_input.args[0]
            want, got = want_module(x), module(x)
            torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m, c=ctor: f"{c}: {m}")
            grad_out = torch.randn_like(want)
            for g, w in zip(torch.autograd.grad(got, [x, *module.parameters()], grad_out),
                            torch.autograd.grad(want, [x, *want_module.parameters()], grad_out), strict=True):
                torch.testing.assert_close(g, w, **grad_tol(dtype), msg=lambda m, c=ctor: f"{c} (grad): {m}")
