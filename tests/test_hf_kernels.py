"""``torch_rmsnorm_op.hf_kernels``: this package's layers used by the Hugging Face ``kernels``
package's ``kernelize`` through ``use_kernel_mapping``, with repositories that load them from
the package (nothing downloaded), on transformers classes built from configs."""

import copy
import warnings

import pytest
import torch
from checks import tiny_llama
from tolerances import MODEL, few_roundings
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import torch_rmsnorm_op as T
from torch_rmsnorm_op import hf_kernels
from torch_rmsnorm_op.recognize import GEMMA, TORCH

kernels = pytest.importorskip("kernels", reason="the Hugging Face kernels package is not installed here")
transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
from kernels import Mode, kernelize, use_kernel_mapping  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated  # noqa: E402

# fp32 on CPU, the kernels reducing in another order than the modules: the loss a few
# roundings apart, the gradients as a whole model's.
OUTPUT_TOL = few_roundings(torch.float32)
GRAD_TOL = MODEL[torch.float32]


class DoubledRMSNorm(LlamaRMSNorm):
    """Marked "RMSNorm" like the others but computing twice that: keeps its own forward."""

    def forward(self, hidden_states):
        return 2 * super().forward(hidden_states)


@pytest.fixture
def mark(monkeypatch):
    """Mark classes as transformers does when a kernels release it supports is installed
    (``use_kernel_forward_from_hub``); the marks are removed after the test."""

    def mark(cls, layer_name):
        monkeypatch.setattr(cls, "kernel_layer_name", None, raising=False)
        monkeypatch.setattr(cls, "kernel_condition", None, raising=False)
        kernels.replace_kernel_forward_from_hub(cls, layer_name)

    return mark


@pytest.fixture
def fresh_probes(monkeypatch):
    monkeypatch.setattr(hf_kernels, "_class_semantics_cache", {})


def _llama():
    return tiny_llama((-1.0, 1.0))


def _loss_and_grads(loss_fn, model, tokens):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(got, want):
    torch.testing.assert_close(got[0], want[0], **OUTPUT_TOL)
    for name, grad in got[1].items():
        torch.testing.assert_close(grad, want[1][name], **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["training", "training+compile"])
def test_kernelize_llama(device, mark, fresh_probes, mode):
    """kernelize puts the layer's forward on every LlamaRMSNorm; a training step's loss and
    gradients equal the unkernelized model's, eager and compiled (fullgraph, aot_eager; the
    class is probed while the graph is traced, and the graph holds one call per norm)."""
    mark(LlamaRMSNorm, "RMSNorm")
    model = _llama().to(device)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    want = _loss_and_grads(lambda t: reference(input_ids=t, labels=t).loss, reference, tokens)

    kernel_mode = Mode.TRAINING | Mode.TORCH_COMPILE if mode == "training+compile" else Mode.TRAINING
    with use_kernel_mapping(hf_kernels.kernel_mapping(device_types=(device.type,)), inherit_mapping=False):
        kernelize(model, mode=kernel_mode, device=device.type)
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 3 and all(m.forward.__func__ is hf_kernels.RMSNorm.forward for m in norms)
    assert not any(isinstance(m, LlamaRMSNorm) for m in reference.modules() if "forward" in vars(m))

    def loss_fn(t):
        return model(input_ids=t, labels=t).loss

    graphs = []
    if mode == "training+compile":
        torch._dynamo.reset()

        def backend(gm, example_inputs):
            graphs.append(gm)
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

        loss_fn = torch.compile(loss_fn, fullgraph=True, backend=backend)
    T.reset_dispatch_stats()
    _assert_close(_loss_and_grads(loss_fn, model, tokens), want)
    assert T.dispatch_stats()["kernel"]["rmsnorm.bwd"] == 3
    if graphs:
        assert len(graphs) == 1 and sum("rmsnorm.fwd" in str(n.target) for n in graphs[0].graph.nodes) == 3


def test_layers_decide_per_class(device, mark, fresh_probes):
    """One layer name, classes of different semantics: OLMo2's single rounding is served as
    such (a Llama-style layer would round twice); Qwen3.5's zero-centered norm as Gemma's;
    a class computing something else keeps its own forward, with a warning."""
    mark(Olmo2RMSNorm, "RMSNorm")
    mark(DoubledRMSNorm, "RMSNorm")
    mark(Qwen3_5RMSNorm, "RMSNormZeroCentered")
    model = nn.ModuleList([Olmo2RMSNorm(64), DoubledRMSNorm(64), Qwen3_5RMSNorm(64)]).to(device=device,
                                                                                        dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    original = copy.deepcopy(model)
    with use_kernel_mapping(hf_kernels.kernel_mapping(device_types=(device.type,)), inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device=device.type)
    x = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [m(x) for m in model]
    messages = [str(w.message) for w in caught if "hf_kernels" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith(
        f"torch_rmsnorm_op.hf_kernels: {__name__}.DoubledRMSNorm keeps its own forward (its forward, given weight "
        "and variance_epsilon: computes none of torch, llama, gemma, t5, centered, input_scaled"), messages
    assert hf_kernels._class_semantics(Olmo2RMSNorm, "variance_epsilon") == TORCH.name
    assert hf_kernels._class_semantics(Qwen3_5RMSNorm, "eps") == GEMMA.name
    for semantics, module, ref_module, y in zip((TORCH, None, GEMMA), model, original, got):
        want = ref_module(x)
        assert y.dtype == want.dtype
        if semantics is None:
            assert torch.equal(y, want)
            continue
        # within one bf16 unit (the kernels sum a row in another order); the semantics chosen, by
        # the reference, agrees on all but a few elements (a wrong rounding moves a quarter)
        torch.testing.assert_close(y, want, **few_roundings(want.dtype))
        ref = semantics.reference(x, (64,), module.weight, module.variance_epsilon if semantics is TORCH
                                  else module.eps)
        assert (ref != want).float().mean().item() <= 0.05


class SigmoidGatedRMSNorm(Qwen3_5RMSNormGated):
    """Qwen 3.5's gated norm with the activation Kimi Linear's has (an attribute its forward reads)."""

    def __init__(self, hidden_size):
        super().__init__(hidden_size)
        self.activation = "sigmoid"


def test_gated_layer(device, mark, fresh_probes):
    """The ``"RMSNormGated"`` layer probes each class with the module's plain attributes (the
    activation's name): Qwen 3.5's gated norm is served as Llama's norm then silu(gate), the
    same class with sigmoid as such; eager and compiled (aot_eager, one ``rmsnorm.fwd`` per
    norm), outputs and gradients as the original's; no gate, no call, as the module's own."""
    mark(Qwen3_5RMSNormGated, "RMSNormGated")
    model = nn.ModuleList([Qwen3_5RMSNormGated(64), SigmoidGatedRMSNorm(64)]).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    original = copy.deepcopy(model)
    with use_kernel_mapping(hf_kernels.kernel_mapping(device_types=(device.type,)), inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device=device.type)
    assert all(m.forward.__func__ is hf_kernels.RMSNormGated.forward for m in model)
    gen = torch.Generator().manual_seed(0)
    x, gate = (torch.randn(8, 64, generator=gen).to(device) for _ in range(2))

    def outputs(modules):
        return sum(m(x, gate) * (i + 1) for i, m in enumerate(modules))

    want = outputs(original)
    want_grads = torch.autograd.grad(want.sum(), list(original.parameters()))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    for run in (lambda: outputs(model), torch.compile(lambda: outputs(model), backend=counter, fullgraph=True)):
        T.reset_dispatch_stats()
        got = run()
        torch.testing.assert_close(got, want, **OUTPUT_TOL)
        for a, b in zip(torch.autograd.grad(got.sum(), list(model.parameters())), want_grads):
            torch.testing.assert_close(a, b, **GRAD_TOL)
        assert T.dispatch_stats()["kernel"]["rmsnorm.bwd"] == 2
    assert sum("rmsnorm.fwd" in str(n.target) for n in counter.graphs[0].graph.nodes) == 2
    names = sorted(hf_kernels._class_semantics_cache.values())
    assert names == ["llama*sigmoid(gate)", "llama*silu(gate)"], names
    with pytest.raises(TypeError, match="gate is required"):  # as the module's own forward needs one
        model[0](x)


def test_repository_and_mapping():
    repo = hf_kernels.Repository("RMSNorm")
    assert repo.load() is hf_kernels.RMSNorm and repo == hf_kernels.Repository("RMSNorm")
    assert hash(repo) == hash(hf_kernels.Repository("RMSNorm")) and repo != hf_kernels.Repository("RMSNormZeroCentered")
    with pytest.raises(ValueError, match="layer_name must be one of"):
        hf_kernels.Repository("LayerNorm")
    mapping = hf_kernels.kernel_mapping()
    assert set(mapping) == {"RMSNorm", "RMSNormZeroCentered", "RMSNormGated"}
    assert set(mapping["RMSNorm"]) == {"cuda", "rocm"}
    assert set(mapping["RMSNorm"]["cuda"]) == {Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE,
                                               Mode.TRAINING | Mode.TORCH_COMPILE}
    assert all(layer.has_backward and layer.can_torch_compile for layer in hf_kernels.LAYERS.values())
