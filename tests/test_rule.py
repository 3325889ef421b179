"""The compile rule (``passes/rule.py``) and the pre-grad stage that applies it
(``passes/pre_grad.py``), and the one call that installs the library's Inductor passes.

The rule reads the graph Dynamo captured: ``_sites`` runs it on the graph a custom backend
receives (the graph Inductor's pre-grad passes receive). The pre-grad stage is checked on CPU
graphs compiled with Inductor under the Triton interpreter, where each op of ours stays one
opaque call in the output code (``torch.ops.rmsnorm.add_fwd`` where our forward runs a norm,
``add_bwd`` in the backward code where our backward does).
"""

import copy
import os
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from checks import compiling_afresh
from tolerances import MODEL
from torch._inductor.utils import run_and_get_code

import torch_rmsnorm_op as T
from torch_rmsnorm_op import dispatch, passes
from torch_rmsnorm_op.passes import pre_grad, rule

transformers = pytest.importorskip("transformers")

N = 32
interpreted = pytest.mark.skipif(not dispatch.interpreted(), reason="CPU graphs keep the ops whole only under the "
                                 "Triton interpreter (TRITON_INTERPRET=1, as the suite sets it)")


@pytest.fixture(autouse=True)
def _passes():
    T.install_inductor_passes()
    yield
    T.install_inductor_passes()


def _sites(f, *args, grad=True) -> list[tuple[str, str, str, str]]:
    """``(input, output, forward, backward)`` of every norm of ``f``'s graph, as the rule sees it."""
    found = []

    def backend(gm, _inputs):
        found.extend((d.input, d.output, d.forward, d.backward) for d in rule.decisions(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(f, backend=backend, fullgraph=True)(*args)
    return found


def _norm(t, w):
    return T.rms_norm(t, (N,), w, 1e-6)


def _inputs(grad=True):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 8, N, generator=g, requires_grad=grad) for _ in range(2))
    w = (torch.rand(N, generator=g) + 0.5).requires_grad_(grad)
    wq, wk = (torch.randn(N, N, generator=g, requires_grad=grad) for _ in range(2))
    return x, r, w, wq, wk


class _Scaled(torch.autograd.Function):
    """An autograd function that reads its input (as torchao's float8 linears do): scales it by
    its absolute maximum, then a matmul."""

    @staticmethod
    def forward(ctx, t, weight):
        ctx.save_for_backward(t, weight)
        scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
        return F.linear(t / scale * scale, weight)

    @staticmethod
    def backward(ctx, grad):
        t, weight = ctx.saved_tensors
        return grad @ weight, (grad.reshape(-1, grad.shape[-1]).t() @ t.reshape(-1, t.shape[-1]))


def _rope(q):
    half = q.shape[-1] // 2
    return q * 0.5 + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * 0.25


CASES = {
    # name: (function of (x, r, w, wq, wk), the sites' (input, output) in graph order)
    "residual add, projections": (
        lambda x, r, w, wq, wk: (lambda y: (F.linear(y, wq), F.linear(y, wk)))(_norm(x + r, w)),
        [("sum", "matmuls")]),
    "a matmul's output, read by the norm alone": (
        lambda x, r, w, wq, wk: F.linear(_norm(F.linear(x, wq), w), wk),
        [("read by the norm alone", "matmuls")]),
    "a matmul's output, read elsewhere too": (
        lambda x, r, w, wq, wk: (lambda p: F.linear(_norm(p, w), wk) + p)(F.linear(x, wq)),
        [("stored, read elsewhere too", "matmuls")]),
    "an embedding lookup": (
        lambda x, r, w, wq, wk: F.linear(_norm(F.embedding(torch.arange(8).view(1, 8).expand(2, 8), wq), w), wk),
        [("fused", "matmuls")]),
    "an elementwise input read once": (
        lambda x, r, w, wq, wk: F.linear(_norm(x.float() * 2, w), wk),
        [("fused", "matmuls")]),
    "q/k heads before RoPE": (
        lambda x, r, w, wq, wk: _rope(_norm(F.linear(x, wq).view(2, 8, 2, 16).transpose(1, 2).reshape(2, 2, 8, 16)
                                            .reshape(2, 2, 8, 16).transpose(1, 2).reshape(2, 8, N), w)),
        [("read by the norm alone", "other ops")]),
    "a scaled residual branch": (
        lambda x, r, w, wq, wk: F.linear(_norm(r + F.linear(x, wq) * 0.25, w), wk),
        [("fused", "matmuls")]),
    "an autograd function reads the output": (
        lambda x, r, w, wq, wk: _Scaled.apply(_norm(x + r, w), wk),
        [("sum", "other ops")]),
    "a gather beside a matmul": (
        lambda x, r, w, wq, wk: (lambda y: (F.linear(y, wq), y.view(-1, N)[torch.tensor([3, 1])]))(_norm(x + r, w)),
        [("sum", "matmuls")]),
    "gathers alone": (
        lambda x, r, w, wq, wk: F.linear(_norm(x + r, w).view(-1, N)[torch.tensor([3, 1])], wq),
        [("sum", "other ops")]),
    "a norm, an add, a norm": (
        lambda x, r, w, wq, wk: F.linear(_norm(r + _norm(F.linear(x, wq), w), w), wk),
        [("read by the norm alone", "other ops"), ("fused", "matmuls")]),
    "experts' rows summed over the chosen experts": (
        lambda x, r, w, wq, wk: F.linear(_norm(r + (F.linear(x, wq).view(16, N) * 0.5)[
            torch.arange(32).view(16, 2) % 16].sum(1).view(2, 8, N), w), wk),
        [("fused", "matmuls")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_rule_sorts_each_site_by_its_neighbours(name):
    """Each site's input and output class, in a graph traced for training."""
    f, want = CASES[name]
    got = [(i, o) for i, o, _, _ in _sites(f, *_inputs())]
    assert got == want


# The rule's table: (input, output) -> (forward, backward) where the graph differentiates the
# norm, and the forward where it does not. Declared here, checked against rule.decide.
TABLE = {
    ("sum", "matmuls"): (("ours", "ours"), "ours"),
    ("sum", "other ops"): (("inductor", "inductor"), "inductor"),
    ("read by the norm alone", "matmuls"): (("ours", "ours"), "ours"),
    ("read by the norm alone", "other ops"): (("inductor", "inductor"), "inductor"),
    ("stored, read elsewhere too", "matmuls"): (("inductor", "inductor"), "ours"),
    ("stored, read elsewhere too", "other ops"): (("inductor", "inductor"), "inductor"),
    ("fused", "matmuls"): (("inductor", "inductor"), "inductor"),
    ("fused", "other ops"): (("inductor", "inductor"), "inductor"),
}


def test_the_rule_table():
    assert set(TABLE) == {(i, o) for i in rule.INPUTS for o in rule.OUTPUTS}
    for (i, o), (training, inference) in TABLE.items():
        assert rule.decide(i, o, True) == training, (i, o)
        assert rule.decide(i, o, False) == (inference, "none"), (i, o)


@pytest.mark.parametrize("name", ["residual add, projections", "a scaled residual branch",
                                  "a matmul's output, read elsewhere too"])
def test_a_graph_not_differentiated_decides_the_forward_alone(name):
    f, want = CASES[name]
    with torch.no_grad():
        got = _sites(f, *_inputs(grad=False), grad=False)
    assert [(i, o) for i, o, _, _ in got] == want
    assert [(fwd, bwd) for i, o, fwd, bwd in got] == [(TABLE[i, o][1], "none") for i, o, _, _ in got]


# --- the pre-grad stage, on CPU graphs under the interpreter -----------------------------------


def _compiled_code(f, *args) -> tuple[object, str, str]:
    """``f`` compiled with Inductor, run forward and backward: its output, forward code, backward code."""
    def step(*a):
        out = torch.compile(f, fullgraph=True)(*a)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.float().square().sum() for o in outs).backward()
        return out

    T.reset_dispatch_stats()
    with compiling_afresh():
        out, codes = run_and_get_code(step, *args)
    assert len(codes) == 2, len(codes)
    return out, codes[0], codes[1]


@interpreted
@pytest.mark.parametrize("name,fwd_ops,bwd_ops", [
    ("residual add, projections", {"add_fwd": 1}, {"add_bwd": 1}),
    ("a scaled residual branch", {}, {}),
    ("an autograd function reads the output", {}, {}),
    ("a matmul's output, read by the norm alone", {"fwd": 1}, {"bwd": 1}),
    ("q/k heads before RoPE", {}, {}),
    ("an embedding lookup", {}, {}),
])
def test_each_direction_runs_where_the_rule_puts_it(name, fwd_ops, bwd_ops):
    """Our ops appear in the forward and backward code exactly where the rule gives us the
    norm; where it gives Inductor the norm, Inductor's kernel computes it (``rsqrt``); the
    values and gradients are those of the same function run eagerly."""
    f, _ = CASES[name]
    inputs = _inputs()
    out, fwd_code, bwd_code = _compiled_code(f, *inputs)
    for code, want in ((fwd_code, fwd_ops), (bwd_code, bwd_ops)):
        for op in ("fwd", "add_fwd", "bwd", "add_bwd"):
            assert code.count(f"torch.ops.rmsnorm.{op}.default(") == want.get(op, 0), (op, code)
    if not fwd_ops:
        assert "rsqrt" in fwd_code
    grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    want_out = f(*inputs)
    want_outs = want_out if isinstance(want_out, tuple) else (want_out,)
    sum(o.float().square().sum() for o in want_outs).backward()
    for a, b in zip(out if isinstance(out, tuple) else (out,), want_outs):
        torch.testing.assert_close(a, b, **MODEL[torch.float32])
    for a, b in zip(grads, [t.grad for t in inputs]):
        torch.testing.assert_close(a, b, **MODEL[torch.float32])


@interpreted
def test_the_sites_are_counted_by_choice():
    f, _ = CASES["a norm, an add, a norm"]
    _compiled_code(f, *_inputs())
    assert T.dispatch_stats()["sites"] == {"forward inductor, backward inductor": 2}
    T.reset_dispatch_stats()
    f, _ = CASES["residual add, projections"]
    _compiled_code(f, *_inputs())
    assert T.dispatch_stats()["sites"] == {"forward ours, backward ours": 1}


@interpreted
def test_with_the_rule_off_every_norm_keeps_its_op():
    T.install_inductor_passes(rule=False)
    f, _ = CASES["a scaled residual branch"]
    _, fwd_code, bwd_code = _compiled_code(f, *_inputs())
    assert fwd_code.count("torch.ops.rmsnorm.fwd.default(") == 1 and "add_fwd" not in fwd_code
    assert bwd_code.count("torch.ops.rmsnorm.bwd.default(") == 1
    assert T.dispatch_stats()["sites"] == {}


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
def test_inductors_forward_has_the_ops_bits(x_dtype, w_dtype, norm_dtype, offset, out_dtype):
    """``pre_grad.inductor_norm`` (the Hugging Face norms' order of ops) gives the bits of the
    op's forward (``reference.rms_norm_forward``) for every mix of dtypes, rounding and offset."""
    from torch_rmsnorm_op import reference

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=g) * 3).to(x_dtype)
    w = None if w_dtype is None else torch.randn(96, generator=g).to(w_dtype)
    kw = dict(weight_offset=offset, norm_dtype=norm_dtype, out_dtype=out_dtype)
    got = pre_grad.inductor_norm(x, w, 1e-6, **kw)
    want = reference.rms_norm_forward(x, w, 1e-6, offset, norm_dtype, out_dtype)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_inductors_forward_differentiates_as_the_family_does():
    """In a Llama-style bf16 norm's order of ops, the gradients of ``inductor_norm`` are those
    of the Hugging Face module, bit for bit: where Inductor keeps both directions, autograd sees
    the stock model's graph."""
    g = torch.Generator().manual_seed(0)
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    dy = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    grads = []
    for f in (hf, lambda t: pre_grad.inductor_norm(t, hf.weight, 1e-6, norm_dtype=torch.bfloat16)[0]):
        xi = x.clone().requires_grad_()
        grads.append(torch.autograd.grad(f(xi), (xi, hf.weight), dy))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _tiny(family: str, layers: int = 2, **more):
    config = getattr(transformers, f"{family}Config")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, max_position_embeddings=32, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, **more)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


# family (config, attention), the sites' choices in a training graph
FAMILIES = {
    "Llama": (dict(attn_implementation="sdpa"),
              {"forward inductor, backward inductor": 2, "forward ours, backward ours": 3}),
    "Qwen3": (dict(attn_implementation="sdpa"),
              {"forward inductor, backward inductor": 6, "forward ours, backward ours": 3}),
    "Gemma2": (dict(attn_implementation="eager"), {"forward inductor, backward inductor": 9}),
    "Mixtral": (dict(attn_implementation="sdpa", num_local_experts=4, num_experts_per_tok=2),
                {"forward inductor, backward inductor": 4, "forward ours, backward ours": 1}),
}


@interpreted
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoders_compile_as_the_rule_decides_and_match_the_unpatched_model(family):
    """A patched 2-layer decoder compiled with Inductor (fp32): the sites take the choices the
    rule gives their neighbours (a norm of the embeddings, or of a sum with them, with a norm's
    output or a mixture of experts' rows: Inductor's; a norm before RoPE or before a residual add:
    Inductor's; a norm of a residual sum read by projections: ours), and logits and every
    gradient match the unpatched model's."""
    more, want = FAMILIES[family]
    stock = _tiny(family, **more)
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    T.reset_dispatch_stats()
    with compiling_afresh(), T.fallback_policy("error"):
        out = torch.compile(patched, fullgraph=True)(input_ids=ids, labels=ids)
        out.loss.backward()
    assert T.dispatch_stats()["sites"] == want
    ref = stock(input_ids=ids, labels=ids)
    ref.loss.backward()
    torch.testing.assert_close(out.logits, ref.logits, **MODEL[torch.float32])
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **MODEL[torch.float32], msg=name)


def _code_lines(codes: list[str]) -> list[str]:
    """Inductor's output code without its comments, blank lines, paths and hashed names."""
    lines = []
    for code in codes:
        code = re.sub(r"#.*", "", code)
        code = re.sub(r"/tmp/\S+|\b[0-9a-z]{20,}\b", "_", code)
        lines.extend(line for line in code.splitlines() if line.strip())
    return lines


class _SumNormScaled(torch.nn.Module):
    """A residual add, Hugging Face's Llama norm, and linears that scale their input by its
    absolute maximum first (``_Scaled``, as torchao's float8 linears do; ``float8``: torchao's
    own float8 training linears, rowwise)."""

    def __init__(self, float8: bool):
        super().__init__()
        torch.manual_seed(0)
        self.norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-6)
        self.q, self.k = (torch.nn.Linear(64, 32, bias=False) for _ in range(2))
        self.float8 = float8
        if float8:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(self, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                       module_filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))

    def forward(self, x, r):
        y = self.norm(x + r)
        if self.float8:
            return sum(p(y).float().square().mean() for p in (self.q, self.k))
        return sum(_Scaled.apply(y, p.weight).float().square().mean() for p in (self.q, self.k))


def _decoder_where_inductor_keeps_every_norm():
    model = _tiny("Gemma2", attn_implementation="eager").to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model, dict(input_ids=ids, labels=ids), {"forward inductor, backward inductor": 9}


def _sum_read_by_scaling_linears(float8: bool):
    if float8:
        pytest.importorskip("torchao.float8", reason="torchao's float8 linears need torchao (the float8 extra)")
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 8, 64, generator=g, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    model = _SumNormScaled(float8).to(torch.bfloat16)
    return model, dict(x=x, r=r), {"forward inductor, backward inductor": 1}


STOCK_CODE_CASES = {
    "a decoder whose norms all read fused inputs or feed other ops (Gemma 2)": _decoder_where_inductor_keeps_every_norm,
    "a sum read by linears that scale their input": lambda: _sum_read_by_scaling_linears(False),
    "a sum read by torchao's float8 linears": lambda: _sum_read_by_scaling_linears(True),
}


@pytest.mark.parametrize("name", list(STOCK_CODE_CASES))
def test_where_inductor_keeps_the_norms_it_writes_the_stock_models_code(name):
    """Where the rule leaves every norm to Inductor, the patched model's training step compiles
    to the stock model's code, kernel for kernel: ``inductor_norm`` gives AOTAutograd and
    Inductor the graph the Hugging Face norm gives them (bf16, forward and backward)."""
    stock, inputs, want = STOCK_CODE_CASES[name]()
    patched = copy.deepcopy(stock)
    T.patch_rmsnorm(patched)
    codes = []
    T.reset_dispatch_stats()
    for model in (stock, patched):
        compiled = torch.compile(model, fullgraph=True)

        def step(compiled=compiled):
            out = compiled(**inputs)
            (out if isinstance(out, torch.Tensor) else out.loss).backward()

        with compiling_afresh():
            _, code = run_and_get_code(step)
        codes.append(code)
    assert T.dispatch_stats()["sites"] == want
    stock_code, patched_code = (_code_lines(c) for c in codes)
    assert len(codes[0]) == len(codes[1]) == 2  # the forward and the backward
    assert patched_code == stock_code


# --- installing the passes ----------------------------------------------------------------------

_OPTIONS = ("pre_grad_custom_pass", "post_grad_custom_post_pass", "static_launch_user_defined_triton_kernels")


def _options():
    from torch._inductor import config

    return {option: getattr(config, option) for option in _OPTIONS}


def test_uninstall_puts_back_what_install_found():
    from torch._inductor import config

    T.uninstall_inductor_passes()
    assert T.inductor_passes_installed() is None
    mine = object()
    config.pre_grad_custom_pass = mine
    try:
        before, env = _options(), dict(os.environ)
        T.install_inductor_passes()
        T.install_inductor_passes(gradient_sums=False)  # again: new settings, the same values found
        assert T.inductor_passes_installed() == passes.Settings(gradient_sums=False)
        now = _options()
        assert isinstance(now["pre_grad_custom_pass"], passes.pass_class())
        assert now["pre_grad_custom_pass"].then is mine  # chained, not dropped
        assert now["static_launch_user_defined_triton_kernels"] is True
        T.uninstall_inductor_passes()
        assert _options() == before and dict(os.environ) == env
        T.uninstall_inductor_passes()  # nothing installed: nothing happens
        assert _options() == before
    finally:
        config.pre_grad_custom_pass = None


def test_uninstall_leaves_an_option_set_since_by_someone_else():
    from torch._inductor import config

    T.install_inductor_passes()
    mine = object()
    config.post_grad_custom_post_pass = mine
    try:
        T.uninstall_inductor_passes()
        assert config.post_grad_custom_post_pass is mine
        assert not isinstance(config.pre_grad_custom_pass, passes.pass_class())
    finally:
        config.post_grad_custom_post_pass = None


def test_a_pass_of_ours_put_back_by_a_config_patch_is_replaced_not_chained():
    """``config.patch`` entered while the passes are installed puts them back on exit, after an
    uninstall: the next install replaces them (chained, the stale rule would run after ours)."""
    from torch._inductor import config

    T.install_inductor_passes()
    with config.patch(pre_grad_custom_pass=None, post_grad_custom_post_pass=None):
        T.uninstall_inductor_passes()
    stale = config.pre_grad_custom_pass
    assert isinstance(stale, passes.pass_class()) and T.inductor_passes_installed() is None
    T.install_inductor_passes(rule=False)
    assert config.pre_grad_custom_pass.then is None and config.post_grad_custom_post_pass.then is None
    T.uninstall_inductor_passes()
    assert config.pre_grad_custom_pass is None


def test_importing_and_calling_the_ops_change_no_inductor_option_and_no_environment():
    """Only ``install_inductor_passes`` (or patching) sets Inductor's options: an eager call and
    a compiled call of the ops, unpatched, leave them and the environment as they were."""
    import subprocess
    import sys

    code = """
import os, torch
from torch._inductor import config
names = ("pre_grad_custom_pass", "post_grad_custom_post_pass", "static_launch_user_defined_triton_kernels")
before, env = [getattr(config, n) for n in names], dict(os.environ)
import torch_rmsnorm_op as T
x = torch.randn(4, 16, requires_grad=True)
T.rms_norm(x, (16,)).sum().backward()
torch.compile(lambda t: T.rms_norm(t, (16,)), fullgraph=True)(x).sum().backward()
assert [getattr(config, n) for n in names] == before and dict(os.environ) == env, "changed"
print("unchanged")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and "unchanged" in out.stdout, out.stderr[-2000:]


def test_patching_installs_the_passes_where_they_are_not():
    T.uninstall_inductor_passes()
    model = torch.nn.Sequential(torch.nn.RMSNorm(8))
    model.append(torch.nn.RMSNorm(8))
    T.patch_rmsnorm(model)
    assert T.inductor_passes_installed() == passes.Settings()
    T.install_inductor_passes(rule=False)
    T.patch_rmsnorm(copy.deepcopy(model))  # installed already: the settings stay
    assert T.inductor_passes_installed() == passes.Settings(rule=False)


@pytest.mark.parametrize("stage", ["pre_grad", "post_grad"])
def test_the_pass_pickles_into_inductors_cache_key(stage):
    """Inductor pickles its config into the graph cache's key: each stage's pass pickles (by
    reference to a module-level rebuild), and its pickled bytes follow its settings."""
    p = passes.pass_class()(stage, passes.Settings())
    on = pickle.dumps(p)
    rebuilt = pickle.loads(on)
    assert type(rebuilt).__name__ == "RMSNormPass" and rebuilt.stage == stage
    assert rebuilt.settings == passes.Settings()
    for off in (passes.Settings(rule=False), passes.Settings(gradient_sums=False)):
        assert pickle.dumps(passes.pass_class()(stage, off)) != on


def test_the_pass_uuid_follows_the_librarys_source(tmp_path):
    """The passes' uuid (in the compile caches' keys) changes with any module of the library,
    its passes, the configuration table or a kernel, and with nothing else."""
    import pathlib
    import shutil

    root = pathlib.Path(T.__file__).parent
    copy_ = tmp_path / "torch_rmsnorm_op"
    shutil.copytree(root, copy_, ignore=shutil.ignore_patterns("__pycache__"))
    assert passes.source_digest(copy_) == passes.library_digest()
    (copy_ / "tools" / "demo.py").write_text("# a tool is not compiled into graphs\n")
    assert passes.source_digest(copy_) == passes.library_digest()
    for name in ("config.py", "kernels/rows.py", "passes/rule.py"):
        edited = copy_ / name
        original = edited.read_text()
        edited.write_text(original + "\n# edited\n")
        assert passes.source_digest(copy_) != passes.library_digest(), name
        edited.write_text(original)
