"""The post-grad stage (``passes/post_grad.py``): rewrites of our kernels' launches in the
graphs AOTAutograd records on CUDA. The unit tests build such graphs by hand (placeholders with
fake values and functional launches of our kernels), so they run on any machine; the ``cuda``
tests compile models."""

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
from torch_rmsnorm_op import _torch_compat
from torch_rmsnorm_op import launch as launch_module
from torch_rmsnorm_op.passes import Settings, pass_class, post_grad

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
    with compiling_afresh():
        out, codes = run_and_get_code(f, *args)
    return out, "\n".join(codes)


@pytest.fixture(autouse=True)
def _passes():
    T.install_inductor_passes()
    yield
    T.install_inductor_passes()


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
        assert post_grad.fuse_gradient_sums(g.graph) == 1
        args = post_grad._constexprs(launch)
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
    assert post_grad.fuse_gradient_sums(g.graph) == 1
    args = post_grad._constexprs(launch)
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
    assert post_grad.fuse_gradient_sums(g.graph) == 1
    args = post_grad._constexprs(launch)
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
    assert post_grad.fuse_gradient_sums(g.graph) == 1
    kw = launch.kwargs["kwargs"]
    assert (kw["DY_TERMS"], kw["ROWS"], kw["ACC_ROWS"], kw["STAGES"]) == (terms, *want)


def test_a_summing_launch_changes_constexprs_where_they_are():
    """Constexprs the kernel side table holds change there, not in the launch's arguments."""
    g = _BackwardGraph()  # constexprs the side table holds change there
    launch = g.launch(g.add(g.tensor("a"), g.tensor("b")))
    kwargs = {k: v for k, v in launch.kwargs["kwargs"].items() if k != "DY_TERMS"}
    launch.kwargs = dict(launch.kwargs, kwargs=kwargs, constant_args_idx=_torch_compat.with_constant_args(
        launch.kwargs["constant_args_idx"], DY_TERMS=1))
    assert post_grad.fuse_gradient_sums(g.graph) == 1
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
        fused = post_grad.fuse_gradient_sums(g.graph)
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
        assert post_grad.fuse_gradient_sums(g.graph) == 1, shape
        args = post_grad._constexprs(launch)
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
        assert post_grad.fuse_gradient_sums(g.graph) == 0, name
        assert _targets(g.graph) == before, name


def test_gradient_sums_leave_other_launches_alone():
    g = _BackwardGraph()
    dy = g.add(g.tensor("a"), g.tensor("b"))
    g.launch(dy, "_rms_norm_fwd_rows")
    assert post_grad.fuse_gradient_sums(g.graph) == 0 and len(_adds(g.graph)) == 1


# --- unread rstd, on forward graphs as AOTAutograd records CUDA launches ----------------------


def _forward_launch(g, kernel="_rms_norm_fwd_rows", read=(), constants=None):
    """A functional launch of forward ``kernel`` in ``g`` (a ``_BackwardGraph``) writing y, the
    residual sum and its rstd outputs into fresh buffers, with ``STORE_RSTD`` in its arguments
    (or in ``constants``, the side table); the graph returns y and the outputs named in ``read``.
    Returns the launch and its rstd buffers."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from torch_rmsnorm_op import kernels

    outputs = post_grad._RSTD_OUTPUTS[kernel]
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
    return post_grad._constexprs(launch)["STORE_RSTD"]


@pytest.mark.parametrize("kernel", ["_rms_norm_fwd_rows", "_rms_norm_fwd_looped", "_rms_norm_fwd_split",
                                    "_rms_norm_fwd_norm_add_rows"])
@pytest.mark.parametrize("where", ["kwargs", "side table"])
def test_a_forward_whose_rstd_nothing_reads_does_not_store_it(kernel, where):
    """An inference graph's forward launch: ``STORE_RSTD`` turns off where the launch holds it,
    the rstd pointers become None (in the kernel side table, where tracing puts a None), the
    launch clones no rstd, and the rstd buffers and their unread results leave the graph."""
    g = _BackwardGraph()
    launch, buffers = _forward_launch(g, kernel, constants={"STORE_RSTD": True} if where == "side table" else None)
    assert post_grad.drop_unread_rstd(g.graph) == 1
    kw = launch.kwargs["kwargs"]
    outputs = post_grad._RSTD_OUTPUTS[kernel]
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
    assert post_grad.drop_unread_rstd(g.graph) == 0  # nothing more to drop


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
    assert post_grad.drop_unread_rstd(g.graph) == 0
    assert launch.kwargs == before and _stores_rstd(launch)
    assert all(b in g.graph.nodes for b in buffers)


def test_unread_rstd_leaves_other_launches_alone():
    """A backward launch, and a forward launch whose stores are already off, stay as they are."""
    g = _BackwardGraph()
    launch = g.launch(g.tensor("dy"))
    before = dict(launch.kwargs)
    assert post_grad.drop_unread_rstd(g.graph) == 0 and launch.kwargs == before
    g = _BackwardGraph()
    launch, buffers = _forward_launch(g, constants={"STORE_RSTD": False})
    assert post_grad.drop_unread_rstd(g.graph) == 0 and all(b in g.graph.nodes for b in buffers)



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
        assert post_grad.launch_view_bases(g.graph) == 1
        assert launch.kwargs["kwargs"]["DY"] is base, chain
        _, eager = launch.meta["eager_input_vals"]
        assert eager["kwargs"]["DY"].shape == (4, 8)
        assert [n.op for n in g.graph.nodes if n.op == "call_function"] == ["call_function"], chain  # the launch
        g.graph.lint()
        assert post_grad.launch_view_bases(g.graph) == 0


def test_views_that_start_elsewhere_or_read_otherwise_stay():
    """A view that starts past its tensor's start (a slice from row 1), one of another dtype and
    a tensor the launch writes stay the launch's arguments; a view another node also reads
    stays in the graph while the launch takes its tensor."""
    g = _BackwardGraph()
    base = g.tensor("mm", shape=(5, 8))
    launch = g.launch(_view(g, torch.ops.aten.slice.Tensor, base, 0, 1, 5))
    assert post_grad.launch_view_bases(g.graph) == 0
    g = _BackwardGraph()
    launch = g.launch(_view(g, torch.ops.aten.view.dtype, g.tensor("mm"), torch.float16))
    assert post_grad.launch_view_bases(g.graph) == 0
    g = _BackwardGraph()
    written = _view(g, torch.ops.aten.view.default, g.tensor("dx"), [1, 4, 8])
    launch = g.launch(g.tensor("dy"), DX=written)
    assert post_grad.launch_view_bases(g.graph) == 0 and launch.kwargs["kwargs"]["DX"] is written
    g = _BackwardGraph()
    base = g.tensor("mm")
    view = _view(g, torch.ops.aten.view.default, base, [1, 4, 8])
    other = g.graph.call_function(torch.ops.aten.neg.default, (view,))
    launch = g.launch(view)
    assert post_grad.launch_view_bases(g.graph) == 1
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
    monkeypatch.setattr(post_grad, "launch_view_bases", lambda graph: 0)
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
    real, real_consts = post_grad.fuse_gradient_sums, launch_module.summed_gradient_consts
    monkeypatch.setattr(post_grad, "fuse_gradient_sums", lambda graph: counts.append(real(graph)) or counts[-1])
    monkeypatch.setattr(launch_module, "summed_gradient_consts",
                        lambda consts, n, elem: terms.append(n) or real_consts(consts, n, elem))
    results, codes = [], []
    for enabled in (True, False):
        T.install_inductor_passes(gradient_sums=enabled)
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
            T.install_inductor_passes()
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
    real = post_grad.fuse_gradient_sums
    monkeypatch.setattr(post_grad, "fuse_gradient_sums", lambda graph: counts.append(real(graph)) or counts[-1])
    results = []
    for enabled in (True, False):
        T.install_inductor_passes(gradient_sums=enabled)
        counts.clear()
        model = copy.deepcopy(base)
        T.patch_rmsnorm(model)
        try:
            with compiling_afresh(), T.fallback_policy("error"):
                loss = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids).loss
                loss.backward()
        finally:
            T.install_inductor_passes()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
        assert sum(counts) == (2 * layers - 1 if enabled else 0), counts
    (loss_on, grads_on), (loss_off, grads_off) = results
    assert torch.equal(loss_on, loss_off)
    for (name, _), a, b in zip(base.named_parameters(), grads_on, grads_off):
        if "norm" in name:
            torch.testing.assert_close(a, b, **few_roundings(a.dtype), msg=name)
        else:
            assert torch.equal(a, b), name


def test_the_gradient_sum_setting_turns_the_rewrite_off():
    """Installed with ``gradient_sums=False``, the post-grad pass leaves the sum in the graph."""
    g = _BackwardGraph()
    g.launch(g.add(g.tensor("a"), g.tensor("b")))
    pass_class()("post_grad", Settings(gradient_sums=False))(g.graph)
    assert len(_adds(g.graph)) == 1


def test_the_post_grad_pass_drops_unread_rstd_with_gradient_sums_off():
    """The post-grad pass drops unread rstd whatever the gradient-sum setting says."""
    g = _BackwardGraph()
    launch, _ = _forward_launch(g)
    pass_class()("post_grad", Settings(gradient_sums=False))(g.graph)
    assert not _stores_rstd(launch)
