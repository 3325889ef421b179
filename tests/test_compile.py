"""torch.compile: no graph breaks, the ops in the AOT forward/backward graphs, Inductor's code."""

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import torch_rmsnorm_op as T

# A machine without a package index may lack it (the README's second command installs it).
expecttest = pytest.importorskip("expecttest", reason="expecttest is not installed here")


def _norm(x, w):
    return T.rms_norm(x, (x.shape[-1],), w, 1e-6)


class TestGraphs(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def _graphs(self, device):
        graphs = {}

        def capture(name):
            def compiler(gm, _inputs):
                graphs[name] = gm.code.strip()
                return make_boxed_func(gm.forward)

            return compiler

        backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
        f = torch.compile(_norm, backend=backend, fullgraph=True, dynamic=False)
        x = torch.randn(4, 16, device=device, requires_grad=True)
        w = torch.randn(16, device=device, requires_grad=True)
        f(x, w).sum().backward()
        return graphs

    def test_aot_graphs_call_the_ops(self):
        graphs = self._graphs("cuda" if torch.cuda.is_available() else "cpu")
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


def test_no_graph_breaks(device):
    x = torch.randn(4, 16, device=device)
    w = torch.randn(16, device=device)
    explanation = torch._dynamo.explain(_norm)(x, w)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    module = T.RMSNorm(16).to(device)
    assert torch._dynamo.explain(module)(x).graph_break_count == 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_calls_the_op_and_matches_eager(device, dynamic):
    torch._dynamo.reset()
    f = torch.compile(_norm, fullgraph=True, dynamic=dynamic)
    x = torch.randn(6, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    y, (code, *_) = run_and_get_code(f, x, w)
    FileCheck().check("torch.ops.rmsnorm.fwd.default(").run(code)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (32,), w, 1e-6), atol=1e-5, rtol=1e-4)
    T.reset_dispatch_stats()
    y.sum().backward()
    assert T.dispatch_stats()["kernel"] == {"rmsnorm.bwd": 1}
