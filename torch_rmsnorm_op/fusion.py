"""The compile-time rewrite that fuses a residual add into the norm after it.

Decoder layers write ``hidden = residual + hidden`` and normalize the sum; stock Inductor fuses
that add into its norm kernel, and an opaque norm op would take the fusion away (the add then
costs a pass of its own, forward and backward). When a model whose RMSNorms call
``torch.ops.rmsnorm.fwd`` is compiled with Inductor, this pass rewrites every

    s = a + b            y = rmsnorm.fwd(s, weight, eps, ...)

in the graph Dynamo captured (before AOTAutograd) into ``y, s, rstd = rmsnorm.add_fwd(a, b,
weight, eps, ...)``: one kernel reads a and b and writes y and the sum, and its backward adds
the sum's own gradient into dx. Model code stays as it is.

Nothing is rewritten where the result could change: only an out-of-place ``a + b`` of two
tensors of one shape (no broadcast, no ``alpha``, no scalar), in float16/bfloat16/float32,
whose result feeds the norm directly. The fused op computes the sum as torch does (in fp32,
rounded to the promoted dtype) and normalizes it with the same kernel configuration as the
unfused op, so y and the sum are the same bits either way.

The pass runs as Inductor's ``pre_grad_custom_pass`` (a ``CustomGraphPass`` with a ``uuid()``,
so compiled graphs stay cacheable), installed by ``torch_rmsnorm_op.patch_rmsnorm`` or
``install()``, chained with any pass already set. Turn it off with
``set_residual_fusion(False)`` or ``TORCH_RMSNORM_OP_FUSE_ADD=0``; it acts on graphs compiled
after that. ``aot_eager`` and other backends that run no Inductor passes see no rewrite.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os

import torch
from torch.fx import Graph, Node

from torch_rmsnorm_op.fallback import log

ENV_VAR = "TORCH_RMSNORM_OP_FUSE_ADD"
_FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ADDS = (operator.add, torch.add, torch.Tensor.add)
_enabled: bool | None = None  # None: the environment variable, else on


def set_residual_fusion(enabled: bool | None) -> None:
    """Turn the residual-add rewrite on or off for graphs compiled from now on; ``None``
    returns to ``$TORCH_RMSNORM_OP_FUSE_ADD`` (default: on)."""
    global _enabled
    _enabled = enabled


def residual_fusion_enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _is_norm(node: Node) -> bool:
    fwd = torch.ops.rmsnorm.fwd
    return node.op == "call_function" and node.target in (fwd, fwd.default)


def _is_add(node: Node) -> bool:
    if node.op == "call_function" and node.target in _ADDS:
        pass
    elif not (node.op == "call_method" and node.target == "add"):
        return False
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1 or set(node.kwargs) - {"alpha"}:
        return False
    return all(isinstance(a, Node) for a in node.args)


def _value(node: object):
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _fusable(add: Node, norm: Node, order: dict[Node, int]) -> bool:
    a, b = (_value(n) for n in add.args)
    s = _value(add)
    if not all(isinstance(t, torch.Tensor) for t in (a, b, s)):
        return False
    if not (_same_shape(a, b) and _same_shape(a, s)) or a.device != b.device:
        return False
    if a.dtype not in _FUSABLE_DTYPES or b.dtype not in _FUSABLE_DTYPES:
        return False
    # The fused op stands where the add stood: the norm's other inputs must exist by then.
    return all(order[n] < order[add] for n in norm.all_input_nodes if n is not add)


def _fake_outputs(add: Node, norm: Node):
    """The fused op's outputs on the fake values Dynamo recorded, for the new nodes' meta."""
    a, b = (_value(n) for n in add.args)
    w = _value(norm.args[1]) if len(norm.args) > 1 else None
    mode = getattr(a, "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return torch.ops.rmsnorm.add_fwd.default(a, b, w, *norm.args[2:], **norm.kwargs)


def fuse_residual_adds(graph: Graph) -> int:
    """Rewrite every fusable ``a + b -> rmsnorm.fwd`` in ``graph`` into ``rmsnorm.add_fwd``;
    returns how many. Leaves every other node as it is."""
    count = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for norm in list(graph.nodes):
        if not _is_norm(norm) or not norm.args or not isinstance(norm.args[0], Node):
            continue
        add = norm.args[0]
        if not _is_add(add) or not _fusable(add, norm, order):
            continue
        fake = _fake_outputs(add, norm)
        with graph.inserting_after(add):
            fused = graph.call_function(torch.ops.rmsnorm.add_fwd.default, (*add.args, *norm.args[1:]),
                                        dict(norm.kwargs))
        with graph.inserting_after(fused):
            outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
        for i, node in enumerate((fused, *outs)):
            order[node] = order[add] + (i + 1) / 8  # between the add and the node after it
        for node, value in zip((fused, *outs), (fake, *(fake or (None, None, None)))):
            if value is not None:
                node.meta["example_value"] = node.meta["val"] = value
        y, total, rstd = outs
        for user in list(norm.users):
            if user.op == "call_function" and user.target is operator.getitem and user.args[0] is norm:
                user.replace_all_uses_with({0: y, 1: rstd}[user.args[1]])
                graph.erase_node(user)
            else:  # the op's tuple used as a whole
                user.replace_input_with(norm, fused)
        graph.erase_node(norm)
        add.replace_all_uses_with(total)
        graph.erase_node(add)
        count += 1
    if count:
        graph.lint()
        log.debug("fused %d residual add(s) into rmsnorm.add_fwd", count)
    return count


@functools.cache
def residual_fusion_pass_class() -> type:
    """``ResidualFusionPass``: Inductor's ``CustomGraphPass`` (defined on first use, so that
    importing the package does not import Inductor)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ResidualFusionPass(CustomGraphPass):
        """Inductor ``pre_grad_custom_pass``: ``fuse_residual_adds`` when the rewrite is on, then
        the pass that was installed before it (if any)."""

        def __init__(self, then=None) -> None:
            self.then = then

        def __call__(self, graph: Graph) -> None:
            if residual_fusion_enabled():
                fuse_residual_adds(graph)
            if self.then is not None:
                self.then(graph)

        def uuid(self) -> bytes:
            h = hashlib.sha256()
            with open(__file__, "rb") as f:
                h.update(f.read())
            h.update(b"on" if residual_fusion_enabled() else b"off")
            then = getattr(self.then, "uuid", None)
            if self.then is not None:
                h.update(then() if callable(then) else repr(self.then).encode())
            return h.digest()

        def __reduce__(self):
            # Inductor pickles its config into the compile cache's key: a class defined in a
            # function pickles by reference to a module-level rebuild, its uuid in the key.
            return _rebuild_pass, (self.then, self.uuid())

    return ResidualFusionPass


def _rebuild_pass(then, uuid: bytes):
    """Unpickle a ``ResidualFusionPass`` (``uuid``: the one it had, part of the pickled key)."""
    return residual_fusion_pass_class()(then)


def install() -> None:
    """Install the rewrite as Inductor's ``pre_grad_custom_pass`` (once; chained with a pass
    already set). Graphs compiled afterwards are rewritten where the rewrite is enabled."""
    from torch._inductor import config

    cls = residual_fusion_pass_class()
    current = config.pre_grad_custom_pass
    if isinstance(current, cls):
        return
    config.pre_grad_custom_pass = cls(current)
