"""torch.compile: no graph breaks, what the AOT graphs hold, Inductor's generated code.

On CUDA the ops decompose while AOTAutograd traces the graph, so the graphs hold our kernels'
launches (``triton_kernel_wrapper_functional`` naming ``_rms_norm_*``) and Inductor's output
code launches them itself: no ``torch.ops.rmsnorm`` call is left. On CPU under the Triton
interpreter a compiled graph keeps each op as one opaque call, which runs the kernels interpreted
at run time (``TestGraphs``); without it (a CUDA machine's CPU tensors) the graph holds the
reference's operations.
"""

import unittest

import pytest
import torch
import torch.nn.functional as F
from checks import compiling_afresh
from functorch.compile import make_boxed_func
from tolerances import TOL, dweight_tol
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import torch_rmsnorm_op as T
from torch_rmsnorm_op import dispatch

# A machine without a package index may lack it (the README's second command installs it).
expecttest = pytest.importorskip("expecttest", reason="expecttest is not installed here")


def _norm(x, w):
    return T.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _add_norm(x, r, w):
    return T.add_rms_norm(x, r, (x.shape[-1],), w, 1e-6)


def _aot_graphs(f, *inputs):
    graphs = {}

    def capture(name):
        def compiler(gm, _inputs):
            graphs[name] = gm.code.strip()
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    out = torch.compile(f, backend=backend, fullgraph=True, dynamic=False)(*inputs)
    sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    return graphs


@unittest.skipUnless(dispatch.interpreted(), "CPU graphs keep the ops whole under the Triton interpreter only; without "
                     "it they compile the reference (test_cpu_graph_without_the_interpreter_compiles_the_reference)")
class TestGraphs(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_cpu_aot_graphs_call_the_ops(self):
        x = torch.randn(4, 16, requires_grad=True)
        w = torch.randn(16, requires_grad=True)
        graphs = _aot_graphs(_norm, x, w)
        self.assertExpectedInline(graphs["forward"], """\
def forward(self, primals_1, primals_2):
    fwd = torch.ops.rmsnorm.fwd.default(primals_1, primals_2, 1e-06)
    getitem = fwd[0]
    getitem_1 = fwd[1];  fwd = None
    return (getitem, primals_1, primals_2, getitem_1)""")
        self.assertExpectedInline(graphs["backward"], """\
def forward(self, primals_1, primals_2, getitem_1, tangents_1):
    bwd = torch.ops.rmsnorm.bwd.default(tangents_1, primals_1, primals_2, getitem_1);  tangents_1 = primals_1 = primals_2 = getitem_1 = None
    getitem_2 = bwd[0]
    getitem_3 = bwd[1];  bwd = None
    return (getitem_2, getitem_3)""")

    def test_cpu_aot_graphs_call_the_add_ops(self):
        x, r = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
        w = torch.randn(16, requires_grad=True)
        graphs = _aot_graphs(_add_norm, x, r, w)
        FileCheck().check("torch.ops.rmsnorm.add_fwd.default(primals_1, primals_3, primals_2, 1e-06)").run(
            graphs["forward"])
        FileCheck().check("torch.ops.rmsnorm.add_bwd.default(tangents_1, tangents_2,").run(graphs["backward"])


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_aot_graphs_hold_our_kernels(fused):
    torch._dynamo.reset()
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    w = torch.randn(16, device="cuda", requires_grad=True)
    if fused:
        graphs = _aot_graphs(_add_norm, x, torch.randn_like(x, requires_grad=True), w)
    else:
        graphs = _aot_graphs(_norm, x, w)
    for name in ("forward", "backward"):  # the launches themselves (Inductor's code names the kernels)
        FileCheck().check("triton_kernel_wrapper_functional").check_not("torch.ops.rmsnorm").run(graphs[name])
    assert T.dispatch_stats()["compiled"] == {
        ("rmsnorm.add_fwd: kernel" if fused else "rmsnorm.fwd: kernel"): 1,
        ("rmsnorm.add_bwd: kernel" if fused else "rmsnorm.bwd: kernel"): 1,
    }


def test_no_graph_breaks(device):
    x = torch.randn(4, 16, device=device)
    w = torch.randn(16, device=device)
    for f, args in ((_norm, (x, w)), (_add_norm, (x, torch.randn_like(x), w))):
        explanation = torch._dynamo.explain(f)(*args)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    module = T.RMSNorm(16).to(device)
    assert torch._dynamo.explain(module)(x).graph_break_count == 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_code_and_results(device, dynamic):
    """On CUDA Inductor's code launches our kernels and calls no op; on CPU with the Triton
    interpreter it calls the op, which runs the kernels interpreted."""
    torch._dynamo.reset()
    f = torch.compile(_norm, fullgraph=True, dynamic=dynamic)
    x = torch.randn(6, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    y, (code, *_) = run_and_get_code(f, x, w)
    if device.type == "cuda":
        FileCheck().check("_rms_norm_fwd_rows").check_not("torch.ops.rmsnorm").run(code)
    else:
        FileCheck().check("torch.ops.rmsnorm.fwd.default(").run(code)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (32,), w, 1e-6), **TOL[torch.float32])
    T.reset_dispatch_stats()
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    want = torch.autograd.grad(torch.nn.functional.rms_norm(x2, (32,), w2, 1e-6).sum(), (x2, w2))
    torch.testing.assert_close(dx, want[0], **TOL[torch.float32])
    torch.testing.assert_close(dw, want[1], **dweight_tol(torch.float32, x.shape[0]))
    if device.type == "cpu":
        assert T.dispatch_stats()["kernel"] == {"rmsnorm.bwd": 1}


def _run_python(code: str, *args: str, **env: str) -> str:
    """``code`` in a fresh interpreter with ``args`` and ``env`` added; its last line of output."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_the_kernels_are_in_the_cache_key_before_the_first_graph_is_keyed():
    """AOTAutograd keys its cache on the graph Dynamo captured, before it traces the ops'
    launches: the kernels must be registered by then (Dynamo's fake propagation), or a graph
    compiled first in a process could be served from a cache entry of other kernels' code
    (another version of the package). Kernels that compile, so no interpreter: a subprocess."""
    code = (
        "import os; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import torch, torch_rmsnorm_op as T\n"
        "from torch._library.triton import get_triton_kernels_for_op\n"
        "x, w = torch.randn(4, 32), torch.randn(32)\n"
        "T.set_fallback_policy('reference')\n"
        "assert get_triton_kernels_for_op('rmsnorm::fwd') == []\n"
        "torch._dynamo.explain(lambda x, w: T.rms_norm(x, (32,), w))(x, w)\n"
        "torch._dynamo.explain(lambda x, w: T.add_rms_norm(x, x, (32,), w))(x, w)\n"
        "names = [sorted(k.fn.__name__ for k in get_triton_kernels_for_op(op)) for op in ('rmsnorm::fwd', "
        "'rmsnorm::add_fwd')]\n"
        "print(names)\n"
    )
    kernels = ["_rms_norm_bwd_rows", "_rms_norm_bwd_split", "_rms_norm_dw_reduce", "_rms_norm_fwd_looped",
               "_rms_norm_fwd_norm_add_rows", "_rms_norm_fwd_rows", "_rms_norm_fwd_split"]
    assert _run_python(code) == str([kernels, kernels])


_CPU_WITHOUT_INTERPRETER = """
import os; os.environ.pop("TRITON_INTERPRET", None)
import copy, json, torch, torch_rmsnorm_op as T
from torch._inductor.utils import run_and_get_code
from torch_rmsnorm_op.tools.toy_models import TinyLlama
torch.manual_seed(0)
stock = TinyLlama()
patched = copy.deepcopy(stock)
T.patch_rmsnorm(patched)  # its probes call the ops
tokens = torch.randint(0, 256, (2, 16))
T.set_fallback_policy("reference")
T.reset_dispatch_stats()
out, code = run_and_get_code(torch.compile(patched, fullgraph=True), tokens)
out.sum().backward()
want = stock(tokens)
want.sum().backward()
torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
# A gradient element is an fp32 sum over every token: one that cancels to near zero is off by a
# few units of the terms it summed, not of itself, hence atol in units of the largest element.
for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-6 * a.grad.abs().max().item(), msg=name)
print(json.dumps(dict(stats=T.dispatch_stats(), calls_an_op=any("rmsnorm" in c for c in code))))
"""


_CPU_REASON = "reference (cpu tensor without the Triton interpreter (set TRITON_INTERPRET=1 before the first call))"


def test_cpu_graph_without_the_interpreter_compiles_the_reference():
    """Without ``TRITON_INTERPRET`` every CPU call would take the reference: a compiled graph
    decides that while tracing, once per call site, and Inductor compiles the reference's
    operations with the graph's own (no op call per step); logits and gradients match stock."""
    import json

    result = json.loads(_run_python(_CPU_WITHOUT_INTERPRETER, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1"))
    # Three norms after a residual add of stored tensors take add_fwd and add_bwd; the first two,
    # of the embeddings and of a sum with them, are Inductor's.
    assert result["stats"] == {"kernel": {}, "fallback": {}, "compiled": {f"rmsnorm.add_fwd: {_CPU_REASON}": 3,
                                                                         f"rmsnorm.add_bwd: {_CPU_REASON}": 3},
                               "sites": {"forward inductor, backward inductor": 2, "forward ours, backward ours": 3}}
    assert not result["calls_an_op"]


_CACHED_NORM = """
import os, sys
if sys.argv[1] == "plain":
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"
import json, torch, torch_rmsnorm_op as T
from torch._dynamo.utils import counters
T.set_fallback_policy("reference")
x, w = torch.randn(4, 32, requires_grad=True), torch.randn(32, requires_grad=True)
torch.compile(lambda x, w: T.rms_norm(x, (32,), w), fullgraph=True)(x, w).sum().backward()
print(json.dumps(dict(stats=T.dispatch_stats(), hits=counters["aot_autograd"]["autograd_cache_hit"])))
"""


def test_cpu_graphs_with_and_without_the_interpreter_are_cached_apart(tmp_path):
    """A graph compiled without the interpreter (the reference, inlined) is not served to a
    process with it (an op call that runs the kernels), though the graphs Dynamo captures are
    the same: the kernels are in the key only without the interpreter. A second process
    without it is served from the cache, so the cache was in use."""
    import json

    def run(mode: str) -> dict:
        return json.loads(_run_python(_CACHED_NORM, mode, TORCHINDUCTOR_CACHE_DIR=str(tmp_path)))

    first = run("plain")
    assert first["stats"]["compiled"] == {f"rmsnorm.fwd: {_CPU_REASON}": 1, f"rmsnorm.bwd: {_CPU_REASON}": 1}
    interpreted = run("interpreted")
    assert interpreted["stats"] == {"kernel": {"rmsnorm.fwd": 1, "rmsnorm.bwd": 1}, "fallback": {}, "compiled": {}, "sites": {}}
    assert interpreted["hits"] == 0
    assert run("plain")["hits"] == 1


@pytest.mark.cuda
def test_inductor_launches_the_fused_kernels_and_matches_eager():
    torch._dynamo.reset()
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.rand(64, device="cuda", requires_grad=True)
    (y, s), codes = run_and_get_code(torch.compile(_add_norm, fullgraph=True), x, r, w)
    FileCheck().check("_rms_norm_fwd_rows").check_not("torch.ops.rmsnorm").run(codes[0])
    y_eager, s_eager = _add_norm(x, r, w)
    assert torch.equal(s, s_eager) and torch.equal(y, y_eager)  # the same kernels, bit for bit


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["norm", "add_norm", "norm_add"])
@pytest.mark.parametrize("n, dtype, norm_dtype", [
    (2048, torch.bfloat16, None),  # rows kernel
    (2048, torch.bfloat16, torch.bfloat16),  # rows, rounded before the weight (Llama's order)
    (1000, torch.float32, None),  # rows, masked
    (8192, torch.bfloat16, None),  # looped
    (262144, torch.bfloat16, None),  # split: one opaque call
])
def test_compiled_graphs_give_the_eager_kernels_bits(op, n, dtype, norm_dtype):
    """A compiled graph launches the eager call's kernels with the same arguments, so its
    outputs have their bits, at every forward strategy. (Inductor's generated code passes eps as
    fp64, Triton's launcher as fp32: ``kernels.common._rstd`` computes in fp32 either way.) Rows
    the kernels serve in split mode stay one call of the op, which launches them as eager
    calls do."""
    torch._dynamo.reset()
    m = 4 if n == 262144 else 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(m, n, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    w, xw = (torch.rand(n, device="cuda", dtype=dtype, generator=gen) + 0.5 for _ in range(2))
    eps = 1e-5
    kw = dict(norm_dtype=norm_dtype)
    fns = {
        "norm": lambda x, r: T.rms_norm(x, (n,), w, eps, **kw),
        "add_norm": lambda x, r: T.add_rms_norm(x, r, (n,), w, eps, **kw),
        "norm_add": lambda x, r: torch.ops.rmsnorm.norm_add_fwd(x, r, xw, eps, w, eps, **kw),
    }
    fn = fns[op]
    with torch.no_grad():
        eager = fn(x, r)
        compiled, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False), x, r)
    if n == 262144:
        FileCheck().check("torch.ops.rmsnorm.").check_not("_rms_norm_fwd_split").run(code)
    else:
        FileCheck().check("_rms_norm_fwd_").check_not("torch.ops.rmsnorm").run(code)
    for a, b in zip(torch.utils._pytree.tree_leaves(compiled), torch.utils._pytree.tree_leaves(eager)):
        assert torch.equal(a, b), (a - b).abs().max()


def test_ops_on_split_mode_rows_stay_one_call_in_compiled_cuda_graphs(monkeypatch):
    """Decided while tracing, from x's N and dtype: a CUDA graph holds the kernels' launches, but
    keeps the op whole where the kernels serve the rows in split mode, and decomposes into the
    reference's operations where they do not serve them at all."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_rmsnorm_op import ops

    monkeypatch.setattr(dispatch, "sm_count", lambda device: 132)  # the H200's
    dispatch.split_mode_reason.cache_clear()
    try:
        with FakeTensorMode():
            def decomposes(n, dtype=torch.bfloat16):
                return ops._decomposes(torch.empty(4, n, device="cuda", dtype=dtype))

            assert decomposes(2048) and decomposes(16384) and decomposes(16384, torch.float32)
            assert not decomposes(32768) and not decomposes(65536, torch.float32) and not decomposes(262144)
            assert decomposes(262144, torch.float64)  # the reference serves it
    finally:
        dispatch.split_mode_reason.cache_clear()


def test_a_row_count_the_graph_learns_when_it_runs_keeps_the_op_whole_on_cuda(monkeypatch):
    """Rows whose count is data-dependent (an unbacked size, as ``x[mask]`` gives under
    ``capture_dynamic_output_shape_ops``): a CUDA graph keeps the op whole, since its launch
    would need the count while tracing; the same rows with a known count decompose."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torch_rmsnorm_op import ops

    monkeypatch.setattr(dispatch, "split_mode_serves", lambda x: False)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        rows = mode.shape_env.create_unbacked_symint()
        torch._check(rows >= 0)
        unbacked = torch.empty(rows, 2048, device="cuda", dtype=torch.bfloat16)
        known = torch.empty(8, 2048, device="cuda", dtype=torch.bfloat16)
        assert ops._decomposes(known) and not ops._decomposes(unbacked)


@pytest.mark.parametrize("selected", ["some", "none", "all"])
def test_rows_selected_by_a_mask_compile_and_train(device, selected):
    """``rms_norm`` and ``add_rms_norm`` of ``x[mask]`` compiled with the mask's row count left
    to run time (``capture_dynamic_output_shape_ops``, ``fullgraph``): outputs and gradients as
    ``F.rms_norm``'s in eager, with some, none or all of the rows selected."""
    torch._dynamo.reset()
    gen = torch.Generator(device=device).manual_seed(0)
    x, r = (torch.randn(8, 64, device=device, generator=gen) for _ in range(2))
    w = torch.rand(64, device=device, generator=gen) + 0.5
    mask = {"some": torch.arange(8, device=device) % 3 == 0, "none": torch.zeros(8, dtype=torch.bool, device=device),
            "all": torch.ones(8, dtype=torch.bool, device=device)}[selected]

    def ours(x, r, w, mask):
        y, h = T.add_rms_norm(x[mask], r[mask], (64,), w, 1e-6)
        return T.rms_norm(y, (64,), w, 1e-6) * h

    def torchs(x, r, w, mask):
        h = x[mask] + r[mask]
        return F.rms_norm(F.rms_norm(h, (64,), w, 1e-6), (64,), w, 1e-6) * h

    def run(f):
        xs = [t.clone().requires_grad_() for t in (x, r, w)]
        out = f(*xs, mask)
        return [out, *torch.autograd.grad(out.sum(), xs, allow_unused=True)]

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = run(torch.compile(ours, fullgraph=True))
    for a, b in zip(got, run(torchs)):
        torch.testing.assert_close(a, b, **dweight_tol(torch.float32, 8))


@pytest.mark.cuda
@pytest.mark.parametrize("n, dtype", [(32768, torch.bfloat16), (65536, torch.float32)])
def test_split_mode_rows_train_in_a_compiled_graph_as_eager(n, dtype):
    """Rows the kernels serve in split mode (the backward from N = 32,768, the forward from
    65,536) compile: the graphs call the ops, no split kernel of theirs is in the generated
    code, and the step gives eager's outputs and gradients bit for bit."""
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(3, n, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    w = torch.rand(n, device="cuda", dtype=dtype, generator=gen) + 0.5
    dy = torch.randn(3, n, device="cuda", dtype=dtype, generator=gen)

    def step(x, r, w):
        y, h = T.add_rms_norm(x, r, (n,), w, 1e-6)
        return T.rms_norm(y * h, (n,), w, 1e-6)

    def grads(f):
        xs = [t.clone().requires_grad_(True) for t in (x, r, w)]
        y = f(*xs)
        y.backward(dy)
        return [y, *(t.grad for t in xs)]

    compiled, codes = run_and_get_code(grads, torch.compile(step, fullgraph=True, dynamic=False))
    for code in codes:
        FileCheck().check("torch.ops.rmsnorm.").check_not("_rms_norm_fwd_split").check_not("_rms_norm_bwd_split").run(code)
    for a, b in zip(compiled, grads(step)):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.cuda
def test_no_recompiles_across_batch_sizes_on_the_kernel_path():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    f = torch.compile(_norm, backend=counter, fullgraph=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    for m in (4, 7, 16, 33):
        x = torch.randn(m, 64, device="cuda", requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        y = f(x, w)
        y.sum().backward()
        torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (64,), w, 1e-6), **TOL[torch.float32])
    assert counter.frame_count == 1


@pytest.mark.cuda
def test_reduce_overhead_has_no_cudagraph_skips():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(_add_norm, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(128, 257, device="cuda")
    r, w = torch.randn_like(x), torch.randn(257, device="cuda")
    for _ in range(4):
        y, s = f(x, r, w)
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch.testing.assert_close(y, _add_norm(x, r, w)[0])


@pytest.mark.cuda
def test_fallback_under_compile_is_decided_while_tracing():
    """fp64 on CUDA: the graph holds the reference's operations, counted once as a compiled
    fallback; "error" raises while compiling."""
    x = torch.randn(4, 16, device="cuda", dtype=torch.float64)
    with compiling_afresh(), T.fallback_policy("reference"):
        y = torch.compile(_norm, fullgraph=True)(x, None)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (16,), None, 1e-6))
    assert [v for k, v in T.dispatch_stats()["compiled"].items()
            if k.startswith("rmsnorm.fwd: reference (x dtype torch.float64")] == [1]
    with compiling_afresh(), T.fallback_policy("error"), pytest.raises(Exception, match="fallback policy is 'error'"):
        torch.compile(_norm, fullgraph=True)(x, None)
