"""The compile-time residual-add rewrite (``fusion.py``) on unmodified model code.

On CPU each op stays one opaque call in Inductor's output code, so the code names the op that
runs: ``torch.ops.rmsnorm.add_fwd`` where the rewrite fused an add, ``rmsnorm.fwd`` elsewhere.
"""

import copy
import operator

import pytest
import torch
from tolerances import MODEL
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import torch_rmsnorm_op as T
from torch_rmsnorm_op import fusion

transformers = pytest.importorskip("transformers")


def _tiny(family: str, layers: int = 2):
    config = getattr(transformers, f"{family}Config")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _code(f, *args):
    torch._dynamo.reset()
    out, codes = run_and_get_code(f, *args)
    return out, "\n".join(codes)


@pytest.fixture(autouse=True)
def _fusion_on():
    fusion.install()
    fusion.set_residual_fusion(None)
    yield
    fusion.set_residual_fusion(None)


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_every_decoder_layer_fuses_its_residual_adds(family):
    """A patched, compiled decoder: every norm after a residual add (each layer's
    post-attention norm, the next layer's input norm, the final norm) runs as ``add_fwd``; the
    first layer's input norm (after the embedding) and Qwen3's q/k norms as ``fwd``. Logits and
    every gradient match the unpatched model."""
    layers = 2
    stock = _tiny(family, layers)
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(patched, fullgraph=True)
    (out, code) = _code(lambda i: compiled(input_ids=i, labels=i), ids)
    fused, plain = 2 * layers, 1 + (2 * layers if family == "Qwen3" else 0)
    FileCheck().check_count("torch.ops.rmsnorm.add_fwd.default(", fused, exactly=True).run(code)
    FileCheck().check_count("torch.ops.rmsnorm.fwd.default(", plain, exactly=True).run(code)
    want = stock(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits, **MODEL[torch.float32])
    out.loss.backward()
    want.loss.backward()
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **MODEL[torch.float32], msg=name)


def test_the_rewrite_keeps_the_bits_and_can_be_turned_off():
    """fp32 Llama: compiled with the rewrite and without it (``set_residual_fusion(False)``, or
    ``TORCH_RMSNORM_OP_FUSE_ADD=0``), the same logits and gradients, bit for bit."""
    model = _tiny("Llama")
    T.patch_rmsnorm(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    results = {}
    for setting in (True, False):
        fusion.set_residual_fusion(setting)
        compiled = torch.compile(model, fullgraph=True)
        out, code = _code(lambda i, f=compiled: f(input_ids=i, labels=i), ids)
        assert ("torch.ops.rmsnorm.add_fwd.default(" in code) is setting
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        results[setting] = (out.logits, grads)
    assert torch.equal(results[True][0], results[False][0])
    for a, b in zip(results[True][1], results[False][1]):
        assert torch.equal(a, b)
    fusion.set_residual_fusion(None)
    assert fusion.residual_fusion_enabled()


def test_the_environment_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv(fusion.ENV_VAR, "0")
    assert not fusion.residual_fusion_enabled()
    fusion.set_residual_fusion(True)  # an explicit setting wins
    assert fusion.residual_fusion_enabled()


def _graph(f, *args):
    """The graph Dynamo captures for ``f`` (with the fake values on its nodes) and its inputs."""
    graphs = []

    def backend(gm, inputs):
        graphs.append((gm, inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(*args)
    return graphs[0]


W = torch.rand(8) + 0.5


@pytest.mark.parametrize("name,f,fused", [
    ("a + b", lambda a, b: T.rms_norm(a + b, (8,), W), True),
    ("torch.add", lambda a, b: T.rms_norm(torch.add(a, b), (8,), W), True),
    ("Tensor.add", lambda a, b: T.rms_norm(a.add(b), (8,), W), True),
    ("add used twice", lambda a, b: (lambda s: (T.rms_norm(s, (8,), W), s * 2))(a + b), True),
    ("broadcast", lambda a, b: T.rms_norm(a + b[0], (8,), W), False),
    ("alpha", lambda a, b: T.rms_norm(torch.add(a, b, alpha=2), (8,), W), False),
    ("scalar", lambda a, b: T.rms_norm(a + 1.5, (8,), W), False),
    ("in place", lambda a, b: T.rms_norm(a.clone().add_(b), (8,), W), False),
    ("a view of the sum", lambda a, b: T.rms_norm((a + b)[:, :4].reshape(-1, 8), (8,), W), False),
    ("float64", lambda a, b: T.rms_norm(a.double() + b.double(), (8,), W.double()), False),
])
def test_what_is_rewritten(name, f, fused):
    """Only an out-of-place add of two tensors of one shape, in fp16/bf16/fp32, feeding the norm
    directly; the rewritten graph computes what the original does."""
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    gm, inputs = _graph(f, a, b)
    want = gm(*inputs)
    count = fusion.fuse_residual_adds(gm.graph)
    gm.recompile()
    assert count == int(fused), name
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (torch.ops.rmsnorm.add_fwd.default in targets) is fused
    if fused:
        assert operator.add not in targets and torch.add not in targets
    with T.fallback_policy("reference"):
        got = gm(*inputs)
    torch.testing.assert_close(got, want)


def test_the_pass_pickles_into_inductors_cache_key():
    """Inductor pickles its config into the graph cache's key: the pass pickles (by reference to
    a module-level rebuild), and its pickled bytes follow the rewrite's on/off state."""
    import pickle

    p = fusion.residual_fusion_pass_class()(None)
    on = pickle.dumps(p)
    assert type(pickle.loads(on)).__name__ == "ResidualFusionPass"
    fusion.set_residual_fusion(False)
    try:
        assert pickle.dumps(p) != on
    finally:
        fusion.set_residual_fusion(None)
