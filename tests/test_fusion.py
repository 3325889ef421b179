"""The compile-time residual-add rewrite (``fusion.py``) on unmodified model code.

On CPU under the Triton interpreter each op stays one opaque call in Inductor's output code, so
the code names the op that runs: ``torch.ops.rmsnorm.add_fwd`` where the rewrite fused an add,
``rmsnorm.fwd`` elsewhere. Without the interpreter (a CUDA machine's CPU tensors) each call site
decomposes into the reference while tracing and is counted in ``dispatch_stats()["compiled"]``
under the op's name instead (``_calls``).
"""

import copy
import operator

import pytest
import torch
from checks import compiling_afresh
from tolerances import MODEL, few_roundings
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck
from torch.utils import _pytree as pytree

import torch_rmsnorm_op as T
from torch_rmsnorm_op import _torch_compat, dispatch, fusion
from torch_rmsnorm_op import launch as launch_module

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
    T.reset_dispatch_stats()
    with compiling_afresh():  # traced, so that the call sites are counted (``_calls``)
        out, codes = run_and_get_code(f, *args)
    return out, "\n".join(codes)


def _calls(code: str, op: str) -> int:
    """How many ``rmsnorm.<op>`` calls the CPU graph compiled by ``_code`` holds: named in its
    output code under the interpreter, else counted per call site while tracing."""
    if dispatch.interpreted():
        return code.count(f"torch.ops.rmsnorm.{op}.default(")
    return sum(n for key, n in T.dispatch_stats()["compiled"].items() if key.startswith(f"rmsnorm.{op}: "))


def _assert_matches_stock(out, stock, patched, ids):
    """The compiled patched model's output ``out`` (with labels ``ids``) against the unpatched
    model's: logits, then every parameter's gradient of the loss (fp32 whole-model tolerance)."""
    want = stock(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits, **MODEL[torch.float32])
    out.loss.backward()
    want.loss.backward()
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **MODEL[torch.float32], msg=name)


@pytest.fixture(autouse=True)
def _fusion_on():
    fusion.install()
    fusion.set_residual_fusion(None)
    fusion.set_epilogue_decomposition(None)
    yield
    fusion.set_residual_fusion(None)
    fusion.set_epilogue_decomposition(None)


@pytest.mark.parametrize("family,fused,plain,joined", [("Llama", 4, 0, 0), ("Qwen3", 4, 0, 0), ("Olmo2", 0, 0, 1)])
def test_every_decoder_layer_fuses_its_residual_adds(family, fused, plain, joined):
    """A patched, compiled 2-layer decoder. Llama, Qwen3: every norm after a residual add (each
    layer's post-attention norm, the next layer's input norm, the final norm) runs as
    ``add_fwd``; the first layer's input norm, which reads the embeddings, and Qwen3's q/k
    norms, read only by RoPE, as Inductor's own kernels (``decompose_epilogue_norms``). OLMo2
    (norms after attention and MLP, q/k norms): the final norm takes the last residual add, and
    the last MLP norm, which feeds that add, joins them (``norm_add_fwd``); every other norm is
    read by RoPE or by a residual add alone and is Inductor's. Logits and every gradient match the unpatched
    model."""
    layers = 2
    stock = _tiny(family, layers)
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(patched, fullgraph=True)
    (out, code) = _code(lambda i: compiled(input_ids=i, labels=i), ids)
    assert (_calls(code, "add_fwd"), _calls(code, "fwd"), _calls(code, "norm_add_fwd")) == (fused, plain, joined)
    _assert_matches_stock(out, stock, patched, ids)


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
        assert (_calls(code, "add_fwd") > 0) is setting
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
ORDER = torch.tensor([3, 6, 0, 5, 1, 7, 2, 4])  # a mixture of experts' rows, back in token order


def _experts(b: torch.Tensor) -> torch.Tensor:
    """Mixtral's combine on b's rows: each row through 2 "experts", weighed, gathered back into
    token order and summed over the experts (``grouped_mm_experts_forward``)."""
    weighted = (torch.cat([b, b * 2.0]) * 0.5).masked_fill(torch.zeros(8, 1, dtype=torch.bool), 0.0)
    return weighted[ORDER].view(4, 2, 8).sum(dim=1)




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
    ("a scaled branch", lambda a, b: T.rms_norm(a + b * 0.5, (8,), W), False),  # Granite's residual add, for Inductor
    ("a scaled branch read again",
     lambda a, b: (lambda p: (T.rms_norm(a + p, (8,), W), p))(b * 0.5), True),
    ("two products", lambda a, b: T.rms_norm(a * 2.0 + b * 3.0, (8,), W), False),  # RoPE's sum, for Inductor
    ("two products, one read again",
     lambda a, b: (lambda p: (T.rms_norm(p + b * 3.0, (8,), W), p))(a * 2.0), False),
    ("two products, both read again",
     lambda a, b: (lambda p, q: (T.rms_norm(p + q, (8,), W), p, q))(a * 2.0, b * 3.0), True),
    ("experts' combined output", lambda a, b: T.rms_norm(a + _experts(b).to(torch.float32), (8,), W), False),
    ("experts' combined output read again",
     lambda a, b: (lambda c: (T.rms_norm(a + c, (8,), W), c))(_experts(b)), True),
    ("experts' combined output plus a shared expert's",  # Qwen2-MoE's
     lambda a, b: T.rms_norm(a + (_experts(b) + b * 0.25).reshape(4, 8), (8,), W), False),
    ("experts' combined output plus a shared expert's, no view after the add",  # DeepSeek V3's
     lambda a, b: T.rms_norm(a + (_experts(b) + b @ W.diag()), (8,), W), False),
    ("experts' output gathered, not summed", lambda a, b: T.rms_norm(a + (b * 0.5)[ORDER[:4] // 2], (8,), W), True),
    ("a sum over the row's own dim", lambda a, b: T.rms_norm(a + (b * 0.5).repeat(1, 2).view(4, 8, 2).sum(-1),
                                                             (8,), W), True),
    # NemotronH's and the Mamba family's norm(hidden_states.to(dtype=self.norm.weight.dtype))
    ("a cast to the sum's own dtype", lambda a, b: T.rms_norm((a + b).to(dtype=W.dtype), (8,), W), True),
    ("a cast to the sum's own dtype, read again",
     lambda a, b: (lambda c: (T.rms_norm(c, (8,), W), c * 2))((a + b).to(torch.float32)), True),
    ("float() of an fp32 sum", lambda a, b: T.rms_norm((a + b).float(), (8,), W), True),
    ("a cast to another dtype", lambda a, b: T.rms_norm((a + b).to(torch.bfloat16), (8,), W), False),
    ("a cast asked to copy", lambda a, b: T.rms_norm((a + b).to(torch.float32, copy=True), (8,), W), False),
    ("a term cast to its own dtype",  # Mamba's residual.to(torch.float32) with an fp32 residual
     lambda a, b: T.rms_norm(a.to(torch.float32) + b, (8,), W), True),
    ("a term cast to another dtype", lambda a, b: T.rms_norm(a.to(torch.bfloat16) + b.bfloat16(), (8,), W), False),
])
def test_what_is_rewritten(name, f, fused):
    """Only an out-of-place add of two tensors of one shape, in fp16/bf16/fp32, feeding the norm
    directly or through a cast that changes nothing, and not with a term that is an elementwise
    result nothing else reads; the rewritten graph computes what the original does."""
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


@pytest.mark.parametrize("combine", [
    _experts,  # Mixtral's, Qwen3-MoE's
    lambda b: _experts(b) + b @ W.diag(),  # DeepSeek V3's: a shared expert's output added, no view after it
    lambda b: (_experts(b) + b * 0.25).reshape(4, 8),  # Qwen2-MoE's
], ids=["experts", "experts plus a shared expert", "experts plus a shared expert, reshaped"])
def test_experts_combined_output_joins_the_fused_add_where_the_graph_is_differentiated(combine):
    """In a graph traced to be differentiated through the norm (a training step), the residual
    add after a mixture of experts becomes ``rmsnorm.add_fwd``; in one that is not (inference),
    the norm is left to Inductor with the experts' combine."""
    f = lambda a, b: T.rms_norm(a + combine(b), (8,), W)  # noqa: E731
    b = torch.randn(4, 8)
    gm, _ = _graph(f, torch.randn(4, 8, requires_grad=True), b)
    assert fusion.fuse_residual_adds(gm.graph) == 1
    with torch.no_grad():
        gm, _ = _graph(f, torch.randn(4, 8, requires_grad=True), b)
    assert fusion.fuse_residual_adds(gm.graph) == 0
    assert fusion.decompose_epilogue_norms(gm.graph) == 1


class _ResidualNorm(torch.nn.Module):
    """A norm of a residual sum whose eps is a module attribute, as the Hugging Face norms keep it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.eps = 1e-6

    def forward(self, a, b):
        return T.rms_norm(a + b, (8,), self.weight, self.eps)


def test_a_graph_with_dynamic_shapes_fuses_its_residual_adds():
    """Compiled with ``dynamic=True``, Dynamo (torch 2.13) computes the eps after the add, right
    before the norm (``item()`` of a tensor, then ``sym_float``): the rewrite moves those scalars
    up before the add, where the fused op stands, and the graph computes what it did."""
    graphs = []

    def backend(gm, inputs):
        graphs.append((gm, inputs))
        return gm.forward

    torch._dynamo.reset()
    module = _ResidualNorm()
    torch.compile(module, backend=backend, fullgraph=True, dynamic=True)(torch.randn(4, 8), torch.randn(4, 8))
    gm, inputs = graphs[0]
    want = gm(*inputs)
    assert fusion.fuse_residual_adds(gm.graph) == 1
    gm.recompile()
    assert torch.ops.rmsnorm.add_fwd.default in [n.target for n in gm.graph.nodes]
    torch.testing.assert_close(gm(*inputs), want)


def _gemma3_tiny(layers: int = 1):
    cfg = transformers.Gemma3TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def test_a_model_compiled_with_a_dynamic_batch_fuses_in_one_graph_for_every_batch_size():
    """A patched 1-layer Gemma 3 compiled with Inductor and its batch dim dynamic
    (``mark_dynamic``): one graph serves batch sizes 2, 3 and 5, and it holds both rewrites'
    ops (the residual adds fused, then the norms around them joined: 2 ``norm_add_fwd``) on a
    graph of symbolic sizes; each batch's logits and gradients match the unpatched model's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    stock = _gemma3_tiny()
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(patched, backend=counter, fullgraph=True)
    for batch in (2, 3, 5):
        ids = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(batch))
        torch._dynamo.mark_dynamic(ids, 0)
        if batch == 2:
            out, code = _code(lambda i: compiled(input_ids=i, labels=i), ids)
            assert (_calls(code, "norm_add_fwd"), _calls(code, "add_fwd")) == (2, 0)
        else:
            out = compiled(input_ids=ids, labels=ids)
        for p in (*stock.parameters(), *patched.parameters()):
            p.grad = None
        _assert_matches_stock(out, stock, patched, ids)
    assert counter.frame_count == 1


def _rope(q, cos, sin):
    half = q.shape[-1] // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin


W16 = torch.rand(16) + 0.5
PROJ = torch.randn(16, 16)
TABLE = torch.randn(10, 16)
IDS = torch.tensor([[1, 4, 9], [0, 4, 2]])


@pytest.mark.parametrize("name,f,left", [
    ("RoPE after a transpose", lambda x, c, s: _rope(T.rms_norm(x, (16,), W16).transpose(1, 2), c, s), True),
    ("cast and scale", lambda x, c, s: T.rms_norm(x, (16,), W16).float() * 2 + c[:, None], True),
    ("a projection", lambda x, c, s: torch.nn.functional.linear(T.rms_norm(x, (16,), W16), PROJ), False),
    ("a view, then a projection",
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(x, (16,), W16).reshape(-1, 16), PROJ), False),
    ("RoPE and a projection", lambda x, c, s: (lambda y: (_rope(y.transpose(1, 2), c, s),
                                                          torch.nn.functional.linear(y, PROJ)))(
        T.rms_norm(x, (16,), W16)), False),
    ("both from one norm", lambda x, c, s: (lambda y: (y * c[:, None], y @ PROJ))(T.rms_norm(x, (16,), W16)), False),
    ("the graph's output", lambda x, c, s: T.rms_norm(x, (16,), W16), False),
    ("a view as the output", lambda x, c, s: T.rms_norm(x, (16,), W16).transpose(1, 2), False),
    ("gathered rows", lambda x, c, s: T.rms_norm(x, (16,), W16)[:, torch.tensor([0, 2])] * 2, False),
    ("embeddings, then a projection",
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(torch.nn.functional.embedding(IDS, TABLE), (16,), W16),
                                                PROJ) + x.sum(), True),
    ("scaled embeddings, then a projection",
     lambda x, c, s: torch.nn.functional.linear(
         T.rms_norm(torch.nn.functional.embedding(IDS, TABLE).view(2, 3, 16) * 4.0, (16,), W16), PROJ) + x.sum(), True),
    ("scaled embeddings, the scale first", lambda x, c, s: torch.nn.functional.linear(
        T.rms_norm(torch.tensor(4.0) * torch.nn.functional.embedding(IDS, TABLE), (16,), W16), PROJ) + x.sum(), True),
    ("embeddings through a dropout, then a projection", lambda x, c, s: torch.nn.functional.linear(  # T5's
        T.rms_norm(torch.nn.functional.dropout(torch.nn.functional.embedding(IDS, TABLE), 0.0, True), (16,), W16),
        PROJ) + x.sum(), True),
    ("embeddings plus a residual", lambda x, c, s: torch.nn.functional.linear(
        T.rms_norm(torch.nn.functional.embedding(IDS, TABLE) + x[0, 0, :3], (16,), W16), PROJ), False),
    ("embeddings through a matmul", lambda x, c, s: torch.nn.functional.linear(
        T.rms_norm(torch.nn.functional.embedding(IDS, TABLE) @ PROJ, (16,), W16), PROJ) + x.sum(), False),
    ("after RoPE, then a projection",
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(_rope(x.transpose(1, 2), c, s), (16,), W16), PROJ), True),
    ("after a residual sum, then a projection",
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(x + x.flip(0), (16,), W16), PROJ), False),
    ("a sum cast to another dtype, then a projection",  # Mamba's fp32 residual stream, normalized in bf16
     lambda x, c, s: torch.nn.functional.linear(
         T.rms_norm((x + x.flip(0)).to(torch.bfloat16), (16,), W16.bfloat16()), PROJ.bfloat16()), True),
    ("a cast read again", lambda x, c, s: (lambda h: (torch.nn.functional.linear(
        T.rms_norm(h, (16,), W16.bfloat16()), PROJ.bfloat16()), h))(x.to(torch.bfloat16)), False),
    ("an MLP's product read once, then a projection",  # BitNet's ffn_sub_norm
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(torch.relu(x).square() * x.flip(0), (16,), W16), PROJ),
     True),
    ("a concatenation read once, then a projection",  # Zamba2's shared block: its input beside the embeddings
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(torch.concatenate([x, x.flip(0)], dim=-1), (32,),
                                                           W16.repeat(2)), PROJ.repeat(1, 2)), True),
    ("a product read again", lambda x, c, s: (lambda h: (torch.nn.functional.linear(
        T.rms_norm(h, (16,), W16), PROJ), h))(x * x.flip(0)), False),
    ("a cast to the input's own dtype, then a projection",
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(x.to(torch.float32), (16,), W16), PROJ), False),
    ("after a scaled residual branch, then a projection",  # Granite's
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(x.flip(0) + x * 0.25, (16,), W16), PROJ), True),
    ("after a gated residual sum cast to its own dtype, then a projection",  # MuseSpark's residual gate
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm((x.flip(0) * 0.5 + x * 0.25).to(x.dtype), (16,), W16),
                                                PROJ), True),
    ("a product cast to its own dtype, then a projection",  # MuseSpark's input-scaled norms
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm((x * W16).to(x.dtype), (16,)), PROJ), True),
    ("a product cast to its own dtype, read again", lambda x, c, s: (lambda h: (torch.nn.functional.linear(
        T.rms_norm(h, (16,)), PROJ), h))((x * W16).to(x.dtype)), False),
    ("after a mixture of experts, then a projection",  # Mixtral's, Qwen3-MoE's
     lambda x, c, s: torch.nn.functional.linear(T.rms_norm(
         x.flip(0) + (torch.cat([x, x * 2.0]) * 0.5)[torch.tensor([1, 2, 0, 3])].view(2, 2, 4, 3, 16).sum(1),
         (16,), W16), PROJ), True),
])
def test_which_norms_are_left_to_inductor(name, f, left):
    """Only a norm whose output nothing but elementwise ops (through views) reads, whose input
    is an embedding lookup (through views and elementwise ops), whose input is a sum with a
    term that is an elementwise result nothing else reads (RoPE's, Granite's scaled branch) or
    a mixture of experts' combined output, or whose input is another elementwise result (a
    cast to another dtype among them) nothing else reads, is replaced by torch ops; the graph
    computes what it computed before, within a few roundings: the norm's own rounding passes
    through a projection's sum."""
    x, cos, sin = torch.randn(2, 4, 3, 16), torch.randn(4, 16), torch.randn(4, 16)
    gm, inputs = _graph(f, x, cos, sin)
    want = gm(*inputs)
    norms = sum(n.target is torch.ops.rmsnorm.fwd for n in gm.graph.nodes)
    count = fusion.decompose_epilogue_norms(gm.graph)
    gm.recompile()
    assert count == (norms if left else 0), name
    assert any(n.target is torch.ops.rmsnorm.fwd for n in gm.graph.nodes) is not left
    got = gm(*inputs)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, **few_roundings(b.dtype))


@pytest.mark.parametrize("x_dtype,w_dtype,norm_dtype,offset,out_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0, None),  # Llama, Qwen3: w * n.to(x.dtype)
    (torch.float16, torch.float16, torch.float16, 0.0, None),
    (torch.bfloat16, torch.float32, torch.bfloat16, 0.0, None),  # an fp32 weight: the product in fp32
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0, torch.float32),  # a bf16 product would round twice
    (torch.bfloat16, torch.float16, torch.float16, 0.0, None),  # fp16 * fp16 would round to fp16, then bf16
    (torch.bfloat16, torch.bfloat16, None, 1.0, None),  # Gemma: n * (1 + w.float())
    (torch.float32, torch.bfloat16, None, 0.0, None),
    (torch.float64, torch.float32, torch.bfloat16, 0.0, None),
    (torch.bfloat16, None, torch.bfloat16, 0.0, None),
])
def test_the_norm_left_to_inductor_has_the_ops_bits(x_dtype, w_dtype, norm_dtype, offset, out_dtype):
    """``fusion._inductor_norm`` (the family's order of ops) gives the bits of the op's forward
    (``reference.rms_norm_forward``) for every mix of dtypes, rounding and offset."""
    from torch_rmsnorm_op import reference

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * 3).to(x_dtype)
    w = None if w_dtype is None else torch.randn(96, generator=g).to(w_dtype)
    got, _ = fusion._inductor_norm(x, w, 1e-6, weight_offset=offset, norm_dtype=norm_dtype, out_dtype=out_dtype)
    want, _ = reference.rms_norm_forward(x, w, 1e-6, offset, norm_dtype, out_dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_norm_left_to_inductor_differentiates_as_the_family_does():
    """In a Llama-style bf16 norm's order of ops, the gradients of ``_inductor_norm`` are those
    of the Hugging Face module, bit for bit: autograd sees the stock model's graph."""
    import transformers

    g = torch.Generator().manual_seed(0)
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    dy = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    grads = []
    for f in (hf, lambda t: fusion._inductor_norm(t, hf.weight, 1e-6, norm_dtype=torch.bfloat16)[0]):
        xi = x.clone().requires_grad_()
        grads.append(torch.autograd.grad(f(xi), (xi, hf.weight), dy))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_a_norm_read_by_a_fused_add_joins_it():
    """Gemma's post-attention norm: its output is added to the residual just before the next
    norm. The residual rewrite takes that add, then the norm joins it: one ``norm_add_fwd``,
    which computes what the graph did, bit for bit."""
    def f(x, r):
        return torch.nn.functional.linear(T.rms_norm(r + T.rms_norm(x, (16,), W16), (16,), W16), PROJ)

    x, r = torch.randn(4, 16), torch.randn(4, 16)
    gm, inputs = _graph(f, x, r)
    want = gm(*inputs)
    assert fusion.rewrite_pre_grad(gm.graph) == 2
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.rmsnorm.norm_add_fwd.default in targets
    assert not {torch.ops.rmsnorm.fwd, torch.ops.rmsnorm.fwd.default, torch.ops.rmsnorm.add_fwd.default} & set(targets)
    assert torch.equal(gm(*inputs)[0], want[0])
    fusion.set_residual_fusion(False)  # the residual rewrite's switch turns both off
    gm, _ = _graph(f, x, r)
    fusion.rewrite_pre_grad(gm.graph)  # the first norm, read by a plain add now, left to Inductor
    targets = {n.target for n in gm.graph.nodes}
    assert not {torch.ops.rmsnorm.norm_add_fwd.default, torch.ops.rmsnorm.add_fwd.default} & targets


def _gemma_norm(t, weight=W16, offset=1.0):
    return T.rms_norm(t, (16,), weight, 1e-6, weight_offset=offset)


@pytest.mark.parametrize("name,f,fused", [
    ("sandwich", lambda x, r: _gemma_norm(r + _gemma_norm(x)), True),
    ("the sum first", lambda x, r: _gemma_norm(_gemma_norm(x) + r), True),
    ("the first norm's output read too", lambda x, r: (lambda y: (_gemma_norm(r + y), y))(_gemma_norm(x)), False),
    ("other keywords", lambda x, r: _gemma_norm(r + _gemma_norm(x, offset=0.0)), False),
    ("another output dtype",
     lambda x, r: T.rms_norm(r + T.rms_norm(x, (16,), W16, out_dtype=torch.float32), (16,), W16), False),
    ("the norm of the sum with another output dtype",
     lambda x, r: T.rms_norm(r + _gemma_norm(x), (16,), W16, out_dtype=torch.float16), False),
    ("a norm's output added to itself", lambda x, r: (lambda y: _gemma_norm(y + y))(_gemma_norm(x)), False),
])
def test_what_joins_a_norm_add(name, f, fused):
    """Only a norm whose y nothing else reads, with the next norm's keywords (no output dtype),
    into a fused add of it and another tensor; the rewritten graph computes what the original
    does, bit for bit."""
    gm, inputs = _graph(f, torch.randn(4, 16), torch.randn(4, 16))
    want = gm(*inputs)
    assert fusion.fuse_residual_adds(gm.graph) == 1, name
    assert fusion.fuse_norm_add_norms(gm.graph) == int(fused), name
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (torch.ops.rmsnorm.norm_add_fwd.default in targets) is fused
    got = gm(*inputs)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b), name


def test_gemma3_norms_around_each_residual_add_run_as_one_op():
    """A patched, compiled 1-layer Gemma 3: the norm after attention joins the residual add and
    ``pre_feedforward_layernorm``, the norm after the MLP the last add and the final norm: 2
    ``norm_add_fwd``, no ``add_fwd`` left; logits and every gradient match the unpatched
    model. (Gemma 2, and 2 layers: ``test_families_leave_to_inductor_...``.)"""
    stock = _gemma3_tiny()
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out, code = _code(lambda i: torch.compile(patched, fullgraph=True)(input_ids=i, labels=i), ids)
    assert (_calls(code, "norm_add_fwd"), _calls(code, "add_fwd")) == (2, 0)
    _assert_matches_stock(out, stock, patched, ids)


@pytest.mark.parametrize("setting", ["function", "environment"])
def test_leaving_norms_to_inductor_can_be_turned_off(setting, monkeypatch):
    """Off (``set_epilogue_decomposition(False)`` or ``TORCH_RMSNORM_OP_INDUCTOR_EPILOGUES=0``),
    a compiled Qwen3 runs its q/k norms and its first input norm as ``rmsnorm.fwd`` too; logits and gradients stay
    within the tolerances of the model compiled with it on."""
    layers = 1
    model = _tiny("Qwen3", layers)
    T.patch_rmsnorm(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    results = {}
    for on in (True, False):
        if setting == "function":
            fusion.set_epilogue_decomposition(on)
        else:
            monkeypatch.setenv(fusion.EPILOGUE_ENV_VAR, "1" if on else "0")
        assert fusion.epilogue_decomposition_enabled() is on
        compiled = torch.compile(model, fullgraph=True)
        out, code = _code(lambda i, f=compiled: f(input_ids=i, labels=i), ids)
        assert _calls(code, "fwd") == (0 if on else 1 + 2 * layers)
        results[on] = (out.logits, torch.autograd.grad(out.loss, list(model.parameters())))
    torch.testing.assert_close(results[True][0], results[False][0], **MODEL[torch.float32])
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, **MODEL[torch.float32])


@pytest.mark.parametrize("stage", ["pre_grad", "post_grad"])
def test_the_pass_pickles_into_inductors_cache_key(stage):
    """Inductor pickles its config into the graph cache's key: each stage's pass pickles (by
    reference to a module-level rebuild), and its pickled bytes follow its rewrite's on/off state."""
    import pickle

    p = fusion.fusion_pass_class()(stage)
    on = pickle.dumps(p)
    rebuilt = pickle.loads(on)
    assert type(rebuilt).__name__ == "FusionPass" and rebuilt.stage == stage
    settings = ((fusion.set_residual_fusion, fusion.set_epilogue_decomposition) if stage == "pre_grad"
                else (fusion.set_gradient_fusion,))
    for setting in settings:
        setting(False)
        try:
            assert pickle.dumps(p) != on
        finally:
            setting(None)


def test_the_pass_uuid_follows_the_librarys_source(tmp_path):
    """The passes' uuid (in the compile caches' keys) changes with any module of the library,
    the configuration table or a kernel as much as the rewrites, and with nothing else."""
    import pathlib
    import shutil

    root = pathlib.Path(fusion.__file__).parent
    copy = tmp_path / "torch_rmsnorm_op"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert fusion.source_digest(copy) == fusion.library_digest()
    (copy / "tools" / "demo.py").write_text("# a tool is not compiled into graphs\n")
    assert fusion.source_digest(copy) == fusion.library_digest()
    for name in ("config.py", "kernels/rows.py"):
        edited = copy / name
        original = edited.read_text()
        edited.write_text(original + "\n# edited\n")
        assert fusion.source_digest(copy) != fusion.library_digest(), name
        edited.write_text(original)


def test_install_sets_both_passes_once():
    from torch._inductor import config

    fusion.install()
    fusion.install()
    for option, stage in (("pre_grad_custom_pass", "pre_grad"), ("post_grad_custom_post_pass", "post_grad")):
        current = getattr(config, option)
        assert isinstance(current, fusion.fusion_pass_class()) and current.stage == stage
        assert not isinstance(current.then, fusion.fusion_pass_class())


# --- the gradient-sum rewrite, on backward graphs as AOTAutograd records CUDA launches --------


class _BackwardGraph:
    """A post-grad graph: placeholders with fake values, adds, and a functional launch of one of
    our backward kernels whose ``DY`` is ``dy``; its unread ``DY2`` ... ``DY5`` are None, in the
    kernel side table, where tracing puts a None argument."""

    def __init__(self):
        from torch._subclasses import FakeTensorMode

        self.mode = FakeTensorMode()
        self.graph = torch.fx.Graph()

    def tensor(self, name, shape=(4, 8), dtype=torch.bfloat16, stride=None):
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty_strided(shape, stride or torch.empty(shape).stride(), dtype=dtype)
        return node

    def add(self, a, b, **kwargs):
        node = self.graph.call_function(torch.ops.aten.add.Tensor, (a, b), kwargs)
        with self.mode:
            node.meta["val"] = torch.ops.aten.add.Tensor(a.meta["val"], b.meta["val"], **kwargs)
        return node

    def call(self, op, *args, **kwargs):
        node = self.graph.call_function(op, args, kwargs)
        with self.mode:
            node.meta["val"] = op(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args), **kwargs)
        return node

    def addmm(self, inp, k=3, **kwargs):
        """``inp + a @ b`` as Inductor writes it (``aten.addmm``), a [4, k] and b [k, 8] new inputs."""
        a, b = self.tensor(f"a{len(self.graph.nodes)}", (4, k)), self.tensor(f"b{len(self.graph.nodes)}", (k, 8))
        return self.call(torch.ops.aten.addmm.default, inp, a, b, **kwargs)

    def launch(self, dy, kernel="_rms_norm_bwd_rows", **more):
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        from torch_rmsnorm_op import kernels

        x = self.tensor("x")
        node = self.graph.call_function(_torch_compat.triton_kernel_wrapper_functional(), (), dict(
            kernel_idx=kernel_side_table.add_kernel(getattr(kernels, kernel)),
            constant_args_idx=kernel_side_table.add_constant_args(dict.fromkeys(("DY2", "DY3", "DY4", "DY5"))),
            grid=[(1, 1, 1)],
            tma_descriptor_metadata={}, kwargs={"DY": dy, "X": x, "DY_TERMS": 1, **more}, tensors_to_clone=["DX"]))
        self.graph.output(node)
        return node


def _adds(graph):
    return [n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor]


@pytest.mark.parametrize("kernel", ["_rms_norm_bwd_rows", "_rms_norm_bwd_split"])
def test_gradient_sums_move_into_the_backward_kernel(kernel):
    """``(a + b) + c`` and ``c + (a + b)`` (q, k, v projections' gradients), ``a + b`` (gate and
    up), ``(((a + b) + c) + d) + e`` and ``e + (d + (c + (a + b)))`` (the five of a mixture of
    experts with a shared expert): the launch reads the terms, in the order torch added them,
    and the adds are gone."""
    keys = ("DY", "DY2", "DY3", "DY4", "DY5")
    for shape in ("chain", "nested", "pair", "five", "five nested"):
        g = _BackwardGraph()
        a, b, c, d, e = (g.tensor(n) for n in "abcde")
        if shape == "chain":
            dy, want = g.add(g.add(a, b), c), [a, b, c]
        elif shape == "nested":
            dy, want = g.add(c, g.add(a, b)), [a, b, c]
        elif shape == "pair":
            dy, want = g.add(a, b), [a, b]
        elif shape == "five":
            dy, want = g.add(g.add(g.add(g.add(a, b), c), d), e), [a, b, c, d, e]
        else:
            dy, want = g.add(e, g.add(d, g.add(c, g.add(a, b)))), [a, b, c, d, e]
        launch = g.launch(dy, kernel)
        assert fusion.fuse_gradient_sums(g.graph) == 1
        args = fusion._constexprs(launch)
        assert [args[k] for k in keys] == want + [None] * (5 - len(want)), shape
        assert args["DY_TERMS"] == len(want), shape
        # a term is a graph argument only: the side table's entries override the graph's at launch
        table = _torch_compat.constant_args(launch.kwargs["constant_args_idx"])
        assert table == dict.fromkeys(keys[len(want):]), shape
        assert not _adds(g.graph)
        g.graph.lint()


def test_gradient_sums_take_three_terms_of_fp32_gradients():
    """fp32 gradients: the launch takes three terms of a chain of five (its tiles hold twice a
    2-byte launch's bytes); the inner sum ``(a + b) + c`` stays in the graph."""
    g = _BackwardGraph()
    a, b, c, d, e = (g.tensor(n, dtype=torch.float32) for n in "abcde")
    inner = g.add(g.add(a, b), c)
    launch = g.launch(g.add(g.add(inner, d), e))
    assert fusion.fuse_gradient_sums(g.graph) == 1
    args = fusion._constexprs(launch)
    assert [args[k] for k in ("DY", "DY2", "DY3", "DY4")] == [inner, d, e, None] and args["DY_TERMS"] == 3
    assert len(_adds(g.graph)) == 2
    g.graph.lint()


def test_gradient_sums_take_five_terms_of_a_longer_chain():
    """Of a chain of six gradients the launch takes five: the inner sum ``a + b`` and the four
    added after it; ``a + b`` stays in the graph, where Inductor computes it."""
    g = _BackwardGraph()
    a, b, c, d, e, f = (g.tensor(n) for n in "abcdef")
    inner = g.add(a, b)
    launch = g.launch(g.add(g.add(g.add(g.add(inner, c), d), e), f))
    assert fusion.fuse_gradient_sums(g.graph) == 1
    args = fusion._constexprs(launch)
    assert [args[k] for k in ("DY", "DY2", "DY3", "DY4", "DY5")] == [inner, c, d, e, f]
    assert args["DY_TERMS"] == 5 and _adds(g.graph) == [inner]
    g.graph.lint()


@pytest.mark.parametrize("block_n,terms,rows,acc_rows,stages,want", [
    (256, 2, 4, 4, 2, (2, 2, 2)),  # half the rows, the accumulator's with them where it has a row per tile row
    (256, 3, 4, 1, 2, (2, 1, 2)),  # and the launch's stages
    (2048, 2, 2, 1, 1, (2, 1, 1)),  # config.BWD_SUMMED: N=2048 keeps its 2 rows for 2 terms
    (2048, 3, 2, 1, 1, (1, 1, 2)),  # and takes 1, prefetched a row ahead, for 3
    (4096, 2, 2, 1, 1, (2, 1, 1)),  # N=4096 likewise
    (4096, 3, 2, 1, 1, (1, 1, 2)),
    (4096, 5, 2, 1, 1, (1, 1, 2)),  # more terms take the entry of 3
    (8192, 2, 2, 1, 1, (1, 1, 1)),  # N=8192 halves
    (256, 5, 4, 4, 2, (2, 2, 2)),  # and elsewhere more terms halve as well
    (2048, 2, 1, 1, 1, (1, 1, 1)),  # never more rows than the launch's own (a small M's fewer rows)
])
def test_a_summing_launch_takes_fewer_rows_per_tile(block_n, terms, rows, acc_rows, stages, want):
    """``launch.summed_gradient_consts``: the rows kernel's tile takes the rows per tile and the
    row loop the stages that ``config.BWD_SUMMED`` gives its BLOCK_N, else half its rows and its
    own stages (registers for the terms)."""
    g = _BackwardGraph()
    dy = g.add(g.tensor("a"), g.tensor("b"))
    for name in "cde"[:terms - 2]:
        dy = g.add(dy, g.tensor(name))
    launch = g.launch(dy, ROWS=rows, ACC_ROWS=acc_rows, BLOCK_N=block_n, STAGES=stages)
    assert fusion.fuse_gradient_sums(g.graph) == 1
    kw = launch.kwargs["kwargs"]
    assert (kw["DY_TERMS"], kw["ROWS"], kw["ACC_ROWS"], kw["STAGES"]) == (terms, *want)


def test_a_summing_launch_changes_constexprs_where_they_are():
    """Constexprs the kernel side table holds change there, not in the launch's arguments."""
    g = _BackwardGraph()  # constexprs the side table holds change there
    launch = g.launch(g.add(g.tensor("a"), g.tensor("b")))
    kwargs = {k: v for k, v in launch.kwargs["kwargs"].items() if k != "DY_TERMS"}
    launch.kwargs = dict(launch.kwargs, kwargs=kwargs, constant_args_idx=_torch_compat.with_constant_args(
        launch.kwargs["constant_args_idx"], DY_TERMS=1))
    assert fusion.fuse_gradient_sums(g.graph) == 1
    assert _torch_compat.constant_args(launch.kwargs["constant_args_idx"])["DY_TERMS"] == 2
    assert "DY_TERMS" not in launch.kwargs["kwargs"]


def test_gradient_sums_stay_where_the_kernel_would_add_differently():
    """Nothing moves where the kernel's sum could differ from torch's or the sum is needed
    elsewhere: mixed dtypes, a broadcast, other strides, an alpha, a second user, another launch
    argument, a launch that already sums. Of ``(a + b) + (c + d)`` the kernel takes a, b and the
    sum ``c + d`` (the same bits as torch's)."""
    cases = {}
    g = _BackwardGraph()
    cases["dtype"] = g, g.launch(g.add(g.tensor("a"), g.tensor("b", dtype=torch.float32)))
    g = _BackwardGraph()
    cases["broadcast"] = g, g.launch(g.add(g.tensor("a"), g.tensor("b", shape=(8,))))
    g = _BackwardGraph()
    cases["strides"] = g, g.launch(g.add(g.tensor("a"), g.tensor("b", stride=(1, 4))))
    g = _BackwardGraph()
    cases["alpha"] = g, g.launch(g.add(g.tensor("a"), g.tensor("b"), alpha=2))
    g = _BackwardGraph()
    dy = g.add(g.tensor("a"), g.tensor("b"))
    g.graph.call_function(torch.ops.aten.neg.default, (dy,))
    cases["second user"] = g, g.launch(dy)
    g = _BackwardGraph()
    a, b, c, d = (g.tensor(n) for n in "abcd")
    cases["four terms"] = g, g.launch(g.add(g.add(a, b), g.add(c, d)))
    four = c, d
    g = _BackwardGraph()
    dy = g.add(g.tensor("a"), g.tensor("b"))
    cases["another argument"] = g, g.launch(dy, DRES=dy)
    g = _BackwardGraph()
    cases["already summed"] = g, g.launch(g.add(g.tensor("a"), g.tensor("b")), DY_TERMS=2)
    for name, (g, launch) in cases.items():
        adds = len(_adds(g.graph))
        fused = fusion.fuse_gradient_sums(g.graph)
        if name == "four terms":  # (a + b) + (c + d): a, b and the sum c + d, which stays in the graph
            assert fused == 1 and launch.kwargs["kwargs"]["DY_TERMS"] == 3, name
            assert [n.args for n in _adds(g.graph)] == [four], name
            continue
        assert fused == 0 and len(_adds(g.graph)) == adds, name


def _targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_gradient_sums_inductor_made_addmms_move_into_the_backward_kernel():
    """A mixture of experts sums its gradients over [tokens, hidden] and Inductor makes ``inp +
    a @ b`` an ``addmm`` (the router's, the shared expert's projections): the launch reads
    ``inp`` and ``aten.mm(a, b)``, through the views to [batch, seq, hidden], and the addmms and
    views are gone (an addmm copies ``inp`` into its output and its product reads it again)."""
    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    for shape in ("addmm", "viewed sum", "chain", "chain of four"):
        g = _BackwardGraph()
        e, f = g.tensor("e"), g.tensor("f")
        if shape == "addmm":
            dy, want_terms = g.addmm(e), 2
        elif shape == "viewed sum":
            dy, want_terms = g.call(torch.ops.aten.view.default, g.addmm(g.add(e, f)), [1, 4, 8]), 3
        elif shape == "chain":
            dy, want_terms = g.addmm(g.addmm(e)), 3
        else:  # a shared expert's: router, gate and up projections, its gate (k = 1)
            dy, want_terms = g.addmm(g.addmm(g.addmm(g.addmm(e, k=1)))), 5
        launch = g.launch(dy)
        assert fusion.fuse_gradient_sums(g.graph) == 1, shape
        args = fusion._constexprs(launch)
        terms = [args[k] for k in ("DY", "DY2", "DY3", "DY4", "DY5")[:want_terms]]
        assert args["DY_TERMS"] == want_terms and terms[0] is e, shape
        if shape == "viewed sum":
            assert terms[1] is f
        products = terms[1:] if shape.startswith("chain") else terms[-1:]
        assert all(t.target is mm and tuple(t.meta["val"].shape) == (4, 8) for t in products), shape
        assert addmm not in _targets(g.graph) and torch.ops.aten.view.default not in _targets(g.graph), shape
        assert not _adds(g.graph), shape
        g.graph.lint()


def test_gradient_sums_leave_addmms_that_are_not_plain_sums():
    """An addmm stays where its sum is not ``inp + a @ b`` in dy's rows: a beta or alpha, a
    broadcast ``inp`` (a bias), a transpose of it, an ``inp`` of other strides, a view something
    else reads."""
    cases = {}
    g = _BackwardGraph()
    cases["beta"] = g, g.launch(g.addmm(g.tensor("e"), beta=2))
    g = _BackwardGraph()
    cases["alpha"] = g, g.launch(g.addmm(g.tensor("e"), alpha=2))
    g = _BackwardGraph()
    cases["bias"] = g, g.launch(g.call(torch.ops.aten.expand.default, g.addmm(g.tensor("e", shape=(8,))), [4, 8]))
    g = _BackwardGraph()
    cases["transposed"] = g, g.launch(g.call(torch.ops.aten.permute.default, g.addmm(g.tensor("e")), [1, 0]))
    g = _BackwardGraph()
    cases["strided inp"] = g, g.launch(g.addmm(g.tensor("e", stride=(1, 4))))
    g = _BackwardGraph()
    view = g.call(torch.ops.aten.view.default, g.addmm(g.tensor("e")), [1, 4, 8])
    g.call(torch.ops.aten.neg.default, view)
    cases["second user"] = g, g.launch(view)
    for name, (g, _) in cases.items():
        before = _targets(g.graph)
        assert fusion.fuse_gradient_sums(g.graph) == 0, name
        assert _targets(g.graph) == before, name


def test_gradient_sums_leave_other_launches_alone():
    g = _BackwardGraph()
    dy = g.add(g.tensor("a"), g.tensor("b"))
    g.launch(dy, "_rms_norm_fwd_rows")
    assert fusion.fuse_gradient_sums(g.graph) == 0 and len(_adds(g.graph)) == 1


def test_gradient_fusion_switch(monkeypatch):
    fusion.set_gradient_fusion(None)
    monkeypatch.setenv(fusion.GRAD_ENV_VAR, "0")
    assert not fusion.gradient_fusion_enabled()
    fusion.set_gradient_fusion(True)
    try:
        assert fusion.gradient_fusion_enabled()
    finally:
        fusion.set_gradient_fusion(None)
    g = _BackwardGraph()
    g.launch(g.add(g.tensor("a"), g.tensor("b")))
    fusion.fusion_pass_class()("post_grad")(g.graph)  # off by the environment: nothing moves
    assert len(_adds(g.graph)) == 1


# --- unread rstd, on forward graphs as AOTAutograd records CUDA launches ----------------------


def _forward_launch(g, kernel="_rms_norm_fwd_rows", read=(), constants=None):
    """A functional launch of forward ``kernel`` in ``g`` (a ``_BackwardGraph``) writing y, the
    residual sum and its rstd outputs into fresh buffers, with ``STORE_RSTD`` in its arguments
    (or in ``constants``, the side table); the graph returns y and the outputs named in ``read``.
    Returns the launch and its rstd buffers."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from torch_rmsnorm_op import kernels

    outputs = fusion._RSTD_OUTPUTS[kernel]
    x, r = g.tensor("x"), g.tensor("r")

    def empty(shape, dtype):
        node = g.graph.call_function(torch.ops.aten.empty.memory_format, (shape,), {"dtype": dtype})
        with g.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    y, h = empty([4, 8], torch.bfloat16), empty([4, 8], torch.bfloat16)
    buffers = {name: empty([4], torch.float32) for name in outputs}
    kwargs = {"X": x, "R": r, "Y": y, "H": h, **buffers}
    if constants is None:
        kwargs["STORE_RSTD"] = True
    node = g.graph.call_function(_torch_compat.triton_kernel_wrapper_functional(), (), dict(
        kernel_idx=kernel_side_table.add_kernel(getattr(kernels, kernel)),
        constant_args_idx=kernel_side_table.add_constant_args(constants or {}), grid=[(1, 1, 1)],
        tma_descriptor_metadata={}, kwargs=kwargs, tensors_to_clone=["Y", "H", *outputs]))
    node.meta["eager_input_vals"] = ((), torch.fx.node.map_aggregate(  # as make_fx records them
        node.kwargs, lambda v: v.meta["val"] if isinstance(v, torch.fx.Node) else v))
    results = [g.graph.call_function(operator.getitem, (node, name)) for name in ("Y", "H", *outputs)]
    g.graph.output((results[0], *(results[2 + outputs.index(name)] for name in read)))
    return node, list(buffers.values())


def _stores_rstd(launch) -> bool:
    return fusion._constexprs(launch)["STORE_RSTD"]


@pytest.mark.parametrize("kernel", ["_rms_norm_fwd_rows", "_rms_norm_fwd_looped", "_rms_norm_fwd_split",
                                    "_rms_norm_fwd_norm_add_rows"])
@pytest.mark.parametrize("where", ["kwargs", "side table"])
def test_a_forward_whose_rstd_nothing_reads_does_not_store_it(kernel, where):
    """An inference graph's forward launch: ``STORE_RSTD`` turns off where the launch holds it,
    the rstd pointers become None (in the kernel side table, where tracing puts a None), the
    launch clones no rstd, and the rstd buffers and their unread results leave the graph."""
    g = _BackwardGraph()
    launch, buffers = _forward_launch(g, kernel, constants={"STORE_RSTD": True} if where == "side table" else None)
    assert fusion.drop_unread_rstd(g.graph) == 1
    kw = launch.kwargs["kwargs"]
    outputs = fusion._RSTD_OUTPUTS[kernel]
    assert not _stores_rstd(launch)
    assert ("STORE_RSTD" in kw) == (where == "kwargs")
    table = _torch_compat.constant_args(launch.kwargs["constant_args_idx"])
    assert all(name not in kw and table[name] is None for name in outputs)
    assert launch.kwargs["tensors_to_clone"] == ["Y", "H"]
    _, eager = launch.meta["eager_input_vals"]  # the values Inductor gives the buffers' strides from
    assert pytree.tree_structure(eager) == pytree.tree_structure(launch.kwargs)
    assert eager["tensors_to_clone"] == ["Y", "H"] and eager["constant_args_idx"] == launch.kwargs["constant_args_idx"]
    assert all(name not in eager["kwargs"] for name in outputs)
    assert ("STORE_RSTD" in eager["kwargs"]) == (where == "kwargs") and not eager["kwargs"].get("STORE_RSTD")
    assert all(b not in g.graph.nodes for b in buffers)
    assert sorted(u.args[1] for u in launch.users) == ["H", "Y"]
    g.graph.lint()
    assert fusion.drop_unread_rstd(g.graph) == 0  # nothing more to drop


@pytest.mark.parametrize("kernel,read", [("_rms_norm_fwd_rows", ("RSTD",)),
                                         ("_rms_norm_fwd_norm_add_rows", ("X_RSTD",)),
                                         ("_rms_norm_fwd_norm_add_rows", ("RSTD",))])
def test_a_forward_whose_rstd_is_read_keeps_it(kernel, read):
    """A training forward (the graph returns rstd, saved for the backward): the launch keeps
    every rstd store, its buffers and its clones; so does one of the norm-add kernel whose either
    rstd is read."""
    g = _BackwardGraph()
    launch, buffers = _forward_launch(g, kernel, read=read)
    before = dict(launch.kwargs)
    assert fusion.drop_unread_rstd(g.graph) == 0
    assert launch.kwargs == before and _stores_rstd(launch)
    assert all(b in g.graph.nodes for b in buffers)


def test_unread_rstd_leaves_other_launches_alone():
    """A backward launch, and a forward launch whose stores are already off, stay as they are."""
    g = _BackwardGraph()
    launch = g.launch(g.tensor("dy"))
    before = dict(launch.kwargs)
    assert fusion.drop_unread_rstd(g.graph) == 0 and launch.kwargs == before
    g = _BackwardGraph()
    launch, buffers = _forward_launch(g, constants={"STORE_RSTD": False})
    assert fusion.drop_unread_rstd(g.graph) == 0 and all(b in g.graph.nodes for b in buffers)


def test_the_post_grad_pass_drops_unread_rstd_with_gradient_fusion_off():
    """``rewrite_post_grad`` drops unread rstd whatever the gradient-sum switch says."""
    fusion.set_gradient_fusion(False)
    try:
        g = _BackwardGraph()
        launch, _ = _forward_launch(g)
        fusion.fusion_pass_class()("post_grad")(g.graph)
        assert not _stores_rstd(launch)
    finally:
        fusion.set_gradient_fusion(None)


# --- view arguments, on graphs as AOTAutograd records CUDA launches ---------------------------


def _view(g, op, source, *args):
    node = g.graph.call_function(op, (source, *args))
    with g.mode:
        node.meta["val"] = op(source.meta["val"], *args)
    return node


def test_a_launch_reads_the_tensor_its_view_arguments_view():
    """A matmul's [tokens, hidden] output read as [batch, seq, hidden] (``view``, ``_unsafe_view``,
    ``unsqueeze``, chained): the launch takes the viewed tensor itself, the value Inductor
    gives its buffer's strides from is that tensor's, and views nothing else reads leave the
    graph; a second pass changes nothing."""
    for chain in ((torch.ops.aten.view.default, [1, 4, 8]), (torch.ops.aten._unsafe_view.default, [1, 4, 8]),
                  (torch.ops.aten.unsqueeze.default, 0), "chained"):
        g = _BackwardGraph()
        base = g.tensor("mm")
        if chain == "chained":
            view = _view(g, torch.ops.aten.view.default, _view(g, torch.ops.aten.unsqueeze.default, base, 0), [1, 4, 8])
        else:
            view = _view(g, chain[0], base, chain[1])
        launch = g.launch(view)
        launch.meta["eager_input_vals"] = ((), torch.fx.node.map_aggregate(
            launch.kwargs, lambda v: v.meta["val"] if isinstance(v, torch.fx.Node) else v))
        assert fusion.launch_view_bases(g.graph) == 1
        assert launch.kwargs["kwargs"]["DY"] is base, chain
        _, eager = launch.meta["eager_input_vals"]
        assert eager["kwargs"]["DY"].shape == (4, 8)
        assert [n.op for n in g.graph.nodes if n.op == "call_function"] == ["call_function"], chain  # the launch
        g.graph.lint()
        assert fusion.launch_view_bases(g.graph) == 0


def test_views_that_start_elsewhere_or_read_otherwise_stay():
    """A view that starts past its tensor's start (a slice from row 1), one of another dtype and
    a tensor the launch writes stay the launch's arguments; a view another node also reads
    stays in the graph while the launch takes its tensor."""
    g = _BackwardGraph()
    base = g.tensor("mm", shape=(5, 8))
    launch = g.launch(_view(g, torch.ops.aten.slice.Tensor, base, 0, 1, 5))
    assert fusion.launch_view_bases(g.graph) == 0
    g = _BackwardGraph()
    launch = g.launch(_view(g, torch.ops.aten.view.dtype, g.tensor("mm"), torch.float16))
    assert fusion.launch_view_bases(g.graph) == 0
    g = _BackwardGraph()
    written = _view(g, torch.ops.aten.view.default, g.tensor("dx"), [1, 4, 8])
    launch = g.launch(g.tensor("dy"), DX=written)
    assert fusion.launch_view_bases(g.graph) == 0 and launch.kwargs["kwargs"]["DX"] is written
    g = _BackwardGraph()
    base = g.tensor("mm")
    view = _view(g, torch.ops.aten.view.default, base, [1, 4, 8])
    other = g.graph.call_function(torch.ops.aten.neg.default, (view,))
    launch = g.launch(view)
    assert fusion.launch_view_bases(g.graph) == 1
    assert launch.kwargs["kwargs"]["DY"] is base and view in g.graph.nodes and other.args == (view,)


@pytest.mark.cuda
def test_cuda_launches_read_matmul_outputs_without_reinterpreting_them(monkeypatch):
    """A residual a matmul writes as [tokens, hidden] and adds as [batch, seq, hidden], and a
    norm's gradient summed from two projections' matmuls: compiled for training on CUDA, no
    launch of ours in the output code, forward or backward, takes a ``reinterpret_tensor``;
    the loss and every gradient are the bits of the same graph compiled without the rewrite."""
    import re

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16).requires_grad_()

    x, a, b = rand(1, 16, 2048), rand(16, 256), rand(256, 2048, scale=0.05)
    w, wq, wk = rand(2048), rand(512, 2048, scale=0.02), rand(256, 2048, scale=0.02)

    def f(x, a, b, w, wq, wk):  # as a decoder layer's input norm and its q and k projections
        y, h = T.add_rms_norm(x, (a @ b).view(1, 16, 2048), (2048,), w, 1e-6)
        q, k = torch.nn.functional.linear(y, wq), torch.nn.functional.linear(y, wk)
        return q.float().square().sum() + k.float().square().sum() + h.float().square().sum()

    def run():
        loss = torch.compile(f, fullgraph=True)(x, a, b, w, wq, wk)
        loss.backward()
        grads = [t.grad.clone() for t in (x, a, b, w, wq, wk)]
        for t in (x, a, b, w, wq, wk):
            t.grad = None
        return loss.detach(), grads

    with T.fallback_policy("error"), compiling_afresh():
        (loss, grads), codes = run_and_get_code(run)
    launches = [line for code in codes for line in code.splitlines() if re.search(r"_rms_norm_\w+\.run\(", line)]
    assert any("_rms_norm_fwd" in line for line in launches) and any("_rms_norm_bwd" in line for line in launches)
    assert not [line for line in launches if "reinterpret_tensor" in line], launches
    monkeypatch.setattr(fusion, "launch_view_bases", lambda graph: 0)
    with T.fallback_policy("error"), compiling_afresh():
        (want_loss, want_grads), codes = run_and_get_code(run)
    assert any("reinterpret_tensor" in line for code in codes for line in code.splitlines()
               if re.search(r"_rms_norm_\w+\.run\(", line))  # the views the rewrite takes away
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("residual", [False, True])
def test_cuda_compiled_inference_allocates_no_rstd(residual):
    """Compiled with Inductor on CUDA without grad, a norm (and a norm with its residual add)
    allocates its outputs only: no rstd buffer in the output code, the launch's unread pointers
    constexprs (None), y (and the sum) the bits of the eager call; compiled for training, the
    forward still saves rstd."""
    x, r = (torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5

    def f(x, r, w):
        return T.add_rms_norm(x, r, (2048,), w, 1e-6) if residual else (T.rms_norm(x, (2048,), w, 1e-6),)

    with torch.no_grad(), T.fallback_policy("error"):
        out, code = _code(torch.compile(f, fullgraph=True), x, r, w)
        want = f(x, r, w)
    assert code.count("empty_strided_cuda((16, 2048)") == len(want), code
    assert "empty_strided_cuda((16, )" not in code, code
    for name in ("RSTD",) if residual else ("R", "H", "RSTD"):  # the launch's signature, as Inductor compiled it
        assert f"'{name}': 'constexpr'" in code, name
    for a, b in zip(out, want):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    w.requires_grad_(True)
    with T.fallback_policy("error"):
        out, code = _code(torch.compile(f, fullgraph=True), x, r, w)
    FileCheck().check("empty_strided_cuda((16, ), (1, ), torch.float32)").run(code)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["Qwen3Moe", "Qwen2Moe"])
def test_cuda_mixture_of_experts_gradients_sum_in_the_backward_kernel(family, monkeypatch):
    """A patched mixture of experts compiled with Inductor on CUDA: the router's gradient (and
    Qwen2-MoE's shared expert's gate and up projections' and its gate's) reaches the MLP norm
    as Inductor's chain of ``addmm``s onto the experts' gradient, each of which copies its input
    into its output first; with the rewrite on, every layer's MLP norm backward sums the
    experts' gradient and the products (2 terms in Qwen3-MoE, 5 in Qwen2-MoE), and none of those
    addmms is left. The loss is the same bits as with the rewrite off, the gradients within a
    bf16 model's tolerance (an addmm rounds its sum once, the kernel sums the rounded product)."""
    layers = 2
    shared = dict(shared_expert_intermediate_size=32) if family == "Qwen2Moe" else dict(head_dim=16)
    config = getattr(transformers, f"{family}Config")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa",
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **shared)
    torch.manual_seed(0)
    base = getattr(transformers, f"{family}ForCausalLM")(config).cuda().to(torch.bfloat16).train()  # grouped_mm: 2-byte
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    counts, terms = [], []
    real, real_consts = fusion.fuse_gradient_sums, launch_module.summed_gradient_consts
    monkeypatch.setattr(fusion, "fuse_gradient_sums", lambda graph: counts.append(real(graph)) or counts[-1])
    monkeypatch.setattr(launch_module, "summed_gradient_consts",
                        lambda consts, n, elem: terms.append(n) or real_consts(consts, n, elem))
    results, codes = [], []
    for enabled in (True, False):
        fusion.set_gradient_fusion(enabled)
        counts.clear()
        model = copy.deepcopy(base)
        T.patch_rmsnorm(model)
        compiled = torch.compile(model, fullgraph=True)

        def step(compiled=compiled):
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()

        try:
            with T.fallback_policy("error"):
                loss, code = _code(step)
        finally:
            fusion.set_gradient_fusion(None)
        results.append((loss, [p.grad for p in model.parameters()]))
        codes.append(code)
        # the attention norms' q, k, v sums (but the first layer's, Inductor's) and every MLP norm's
        assert sum(counts) == (2 * layers - 1 if enabled else 0), counts
    assert sorted(terms) == sorted([3] * (layers - 1) + [5 if family == "Qwen2Moe" else 2] * layers), terms
    on, off = (code.count("extern_kernels.addmm(") for code in codes)
    # Qwen2-MoE's q, k and v projections have biases: addmms of the forward, in both graphs
    assert (on == 0 if family == "Qwen3Moe" else on > 0) and off > on, (on, off)
    (loss_on, grads_on), (loss_off, grads_off) = results
    assert torch.equal(loss_on, loss_off)
    for (name, _), a, b in zip(base.named_parameters(), grads_on, grads_off):
        torch.testing.assert_close(a, b, **MODEL[torch.bfloat16], msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_cuda_backward_kernels_sum_the_projections_gradients(family, monkeypatch):
    """A patched bf16 decoder compiled with Inductor on CUDA: in each layer the attention norm's
    backward sums the q, k and v projections' gradients and the MLP norm's the gate and up
    projections' (two launches a layer take their sums, but in the first layer, whose attention
    norm reads the embeddings and is Inductor's); the loss and every gradient but the norms'
    weights are the bits of the same model compiled with the rewrite off, and those within their
    last place (a summing launch whose tiles hold fewer rows adds dweight's rows in another
    order)."""
    layers = 2
    base = _tiny(family, layers).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    counts = []
    real = fusion.fuse_gradient_sums
    monkeypatch.setattr(fusion, "fuse_gradient_sums", lambda graph: counts.append(real(graph)) or counts[-1])
    results = []
    for enabled in (True, False):
        fusion.set_gradient_fusion(enabled)
        counts.clear()
        model = copy.deepcopy(base)
        T.patch_rmsnorm(model)
        try:
            with compiling_afresh(), T.fallback_policy("error"):
                loss = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids).loss
                loss.backward()
        finally:
            fusion.set_gradient_fusion(None)
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
        assert sum(counts) == (2 * layers - 1 if enabled else 0), counts
    (loss_on, grads_on), (loss_off, grads_off) = results
    assert torch.equal(loss_on, loss_off)
    for (name, _), a, b in zip(base.named_parameters(), grads_on, grads_off):
        if "norm" in name:
            torch.testing.assert_close(a, b, **few_roundings(a.dtype), msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.cuda
def test_cuda_gemma3_launches_the_norm_add_kernel():
    """A patched bf16 Gemma 3 compiled with Inductor on CUDA, training: the output code launches
    the norm-add kernel (twice a layer: ``norm_add_fwd`` decomposes into its launch, where both
    norms share a single-pass configuration, as they do here) and calls no ``torch.ops.rmsnorm``;
    loss and gradients are within the tolerance of the stock compiled model's."""
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=64, max_position_embeddings=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    stock = transformers.Gemma3ForCausalLM(cfg).cuda().to(torch.bfloat16).train()
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    with T.fallback_policy("error"):
        out, code = _code(lambda i: torch.compile(patched, fullgraph=True)(input_ids=i, labels=i), ids)
    assert T.dispatch_stats()["compiled"].get("rmsnorm.norm_add_fwd: kernel", 0) == 4, T.dispatch_stats()
    FileCheck().check("_rms_norm_fwd_norm_add_rows").check_not("torch.ops.rmsnorm").run(code)
    torch._dynamo.reset()
    want = torch.compile(stock, fullgraph=True)(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, want.loss, **MODEL[torch.bfloat16])
    out.loss.backward()
    want.loss.backward()
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **MODEL[torch.bfloat16], msg=name)


@pytest.mark.cuda
def test_cuda_qwen3_head_norms_fuse_with_rope():
    """A patched bf16 Qwen3 compiled with Inductor on CUDA: its q/k norms compile into
    Inductor kernels that also apply RoPE (one kernel names both ``rsqrt`` and RoPE's ``cat``,
    as in the stock model's code), while the other norms launch our kernels; the loss is within
    the tolerance of the stock compiled model's."""
    import re

    layers = 2
    stock = _tiny("Qwen3", layers).cuda().to(torch.bfloat16).train()
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
    with T.fallback_policy("error"):
        out, code = _code(lambda i: torch.compile(patched, fullgraph=True)(input_ids=i, labels=i), ids)
    assert re.search(r"def triton_\w*cat\w*rsqrt\w*\(", code), "no Inductor kernel fuses a norm with RoPE"
    FileCheck().check("_rms_norm_fwd_rows").check_not("torch.ops.rmsnorm").run(code)
    torch._dynamo.reset()
    want = torch.compile(stock, fullgraph=True)(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, want.loss, **MODEL[torch.bfloat16])


@pytest.mark.parametrize("config,model,left,joined", [
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 7, 0),  # q/k norms of 2 layers, the first input norm (embeddings),
    # the norms after the experts (layer 1's input norm, the final norm)
    ("MixtralConfig", "MixtralForCausalLM", 3, 0),  # the first input norm, the norms after the experts
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", 3, 0),  # the same, the experts' output with a shared expert's
    ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", 5, 0),  # q/k norms after RoPE, the first input norm
    ("Gemma3TextConfig", "Gemma3ForCausalLM", 5, 4),  # q/k norms, the first input norm (scaled embeddings); the
    # norms after attention and MLP join the residual add and the norm after it
    ("Gemma2Config", "Gemma2ForCausalLM", 1, 4),  # the first input norm; every other norm feeds a projection or
    # joins a fused residual add
    ("Olmo2Config", "Olmo2ForCausalLM", 7, 1),  # q/k norms, and the norms read only by a residual add (the first
    # norm reads attention's output, not the embeddings); the last MLP norm joins the last add and the final norm
    ("GraniteConfig", "GraniteForCausalLM", 5, 0),  # the first input norm (scaled embeddings), and every norm
    # after a scaled residual branch
])
def test_families_leave_to_inductor_the_norms_only_elementwise_ops_read(config, model, left, joined, monkeypatch):
    """A patched, compiled 2-layer decoder of each family: as many norms left to Inductor as
    its code gives norms whose output only elementwise ops read, whose input is the embeddings
    or whose input is RoPE's sum, Granite's scaled branch or the experts' combined output, and
    as many ``norm_add_fwd`` as it has norms read only by a residual add that a norm reads;
    logits match the unpatched model."""
    cfg = getattr(transformers, config)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, max_position_embeddings=32, attn_implementation="eager",
        residual_multiplier=0.5, embedding_multiplier=2.0)  # Granite's; the other configs keep them as attributes
    torch.manual_seed(0)
    stock = getattr(transformers, model)(cfg).eval()
    counts, out, want = _rewritten_in_inference(monkeypatch, stock, "fuse_norm_add_norms", "decompose_epilogue_norms")
    assert counts == {"fuse_norm_add_norms": joined, "decompose_epilogue_norms": left}
    torch.testing.assert_close(out, want, **MODEL[torch.float32])


def _rewritten_in_inference(monkeypatch, stock, *passes: str):
    """A patched copy of ``stock`` compiled afresh with Inductor, and both run without gradients
    on the same token ids: ``(what each of the rewrites named in passes changed, the patched
    model's logits, the stock model's)``."""
    counts = {}
    for name in passes:
        real = getattr(fusion, name)
        monkeypatch.setattr(fusion, name, lambda graph, real=real, name=name: counts.setdefault(name, real(graph)))
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with compiling_afresh(), torch.no_grad():  # a cached graph would skip the passes
        out = torch.compile(patched, fullgraph=True)(input_ids=ids).logits
        want = stock(input_ids=ids).logits
    return counts, out, want


def test_mamba_norms_over_an_fp32_residual_stream_are_left_to_inductor(monkeypatch):
    """Mamba in bf16 keeps its residual stream in fp32 and normalizes it cast to the weight's
    bf16: Inductor adds, casts and normalizes in one kernel, so those norms are left to it (and
    the first, whose input is the embeddings); the final norm, which reads the fp32 sum itself,
    takes its add. Logits as the stock model's."""
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, state_size=8, use_mambapy=False)
    torch.manual_seed(0)
    stock = transformers.MambaForCausalLM(cfg).to(torch.bfloat16).eval()
    counts, out, want = _rewritten_in_inference(monkeypatch, stock, "fuse_residual_adds", "decompose_epilogue_norms")
    assert counts == {"fuse_residual_adds": 1, "decompose_epilogue_norms": 3}
    torch.testing.assert_close(out, want, **MODEL[torch.bfloat16])
