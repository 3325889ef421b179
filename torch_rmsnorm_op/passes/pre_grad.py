"""The pre-grad stage: each norm of the graph Dynamo captured as the rule (``rule.py``) decides.

- **Ours**: the op stays; a plain residual add it reads moves into it (``a + b -> rmsnorm.fwd``
  becomes ``rmsnorm.add_fwd(a, b, ...)``: one kernel reads a and b and writes y and the sum; its
  backward, ``add_bwd``, adds the sum's own gradient into dx).
- **Inductor's**: the norm becomes torch ops (``inductor_norm``), which AOTAutograd
  differentiates and Inductor compiles and fuses with its neighbours. They compute the op's
  values in the order Hugging Face's norms write them (``weight * normed.to(dtype)``), so the
  kernels, numerics and gradients are the stock model's.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor
from torch.fx import Graph, Node

from torch_rmsnorm_op.fallback import log, record_site
from torch_rmsnorm_op.passes import graph as G
from torch_rmsnorm_op.passes.rule import OURS, Decision, decisions


def inductor_norm(x: Tensor, weight: Tensor | None, eps: float, *, weight_offset: float = 0.0,
                  norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None
                  ) -> tuple[Tensor, Tensor]:
    """``rmsnorm.fwd`` composed from torch ops, for Inductor to compile and fuse with its
    neighbours: ``(y, rstd)``, the op's values (``reference.rms_norm_forward``), in the order of
    ops the Hugging Face norms write: ``weight * normed.to(norm_dtype)`` where the normalized row
    is rounded before the weight, ``normed * (weight.float() + offset)`` where it is not."""
    from torch_rmsnorm_op.reference import computation_dtype

    ctype = computation_dtype(x.dtype)
    xc = x.to(ctype)
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = xc * rstd
    if norm_dtype is not None:
        y = y.to(norm_dtype)
    out_dtype = out_dtype or x.dtype
    if weight is not None:
        if weight_offset == 0 and torch.promote_types(weight.dtype, y.dtype) in (out_dtype, ctype):
            y = weight * y  # rounded once, to the output's dtype or not at all: the op's fp32 product
        else:
            y = y.to(ctype) * (weight.to(ctype) + weight_offset)
    return y.to(out_dtype).contiguous(), rstd.squeeze(-1)


# --- where the new node goes ---------------------------------------------------------------

_SCALARS = (torch.SymFloat, torch.SymInt, torch.SymBool, float, int, bool)


def _scalars_to_hoist(node: Node, add: Node, order: dict[Node, int], found: list[Node]) -> bool:
    """Whether ``node`` exists where ``add`` stands, or is a scalar computed after it from
    nodes that do (or are such scalars themselves): those are appended to ``found``, each after
    its inputs."""
    if order[node] < order[add]:
        return True
    if node is add or node.op not in ("call_function", "call_method") or not isinstance(G.value(node), _SCALARS):
        return False
    if not all(_scalars_to_hoist(i, add, order, found) for i in node.all_input_nodes):
        return False
    if node not in found:
        found.append(node)
    return True


def _inputs_before(add: Node, norm: Node, order: dict[Node, int]) -> bool:
    """Whether the norm's inputs other than the add (or the cast of it the norm reads) exist
    where the add stands, once the scalars computed between the two are moved up before the add
    (under dynamic shapes Dynamo computes a float eps right before the norm). Moves them where it
    returns True."""
    found: list[Node] = []
    if not all(_scalars_to_hoist(n, add, order, found) for n in norm.all_input_nodes
               if n is not add and n is not norm.args[0]):
        return False
    for i, node in enumerate(found):
        add.prepend(node)
        order[node] = order[add] - (len(found) - i) / 1024  # just before the add, in their order
    return True


def _replace_with_sum(graph: Graph, site: Decision, order: dict[Node, int]) -> bool:
    """Replace the site's ``add -> norm`` with one ``rmsnorm.add_fwd`` standing where the add
    stood; False (nothing changed) where the norm's other inputs are computed only after the
    add."""
    norm, add = site.norm, site.add
    cast = norm.args[0]
    if not _inputs_before(add, norm, order):
        return False
    target = torch.ops.rmsnorm.add_fwd.default
    args, kwargs = (*add.args, *norm.args[1:]), dict(norm.kwargs)
    fake = G.fake_call(target, args, kwargs)
    with graph.inserting_after(add):
        fused = graph.call_function(target, args, kwargs)
    with graph.inserting_after(fused):
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
    for i, node in enumerate((fused, *outs)):
        order[node] = order[add] + (i + 1) / 8  # between the add and the node after it
    for node, value in zip((fused, *outs), (fake, *(fake or (None, None, None)))):
        G.set_fake(node, value)
    y, total, rstd = outs
    for user in list(norm.users):  # getitems (rule.output_class)
        user.replace_all_uses_with({0: y, 1: rstd}[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(norm)
    add.replace_all_uses_with(total)
    graph.erase_node(add)
    if cast is not add and not cast.users:
        graph.erase_node(cast)
    return True


def _replace_norm(graph: Graph, norm: Node) -> None:
    """Replace ``norm`` with a call of ``inductor_norm``, its results read as the op's."""
    args, kwargs = norm.args, dict(norm.kwargs)
    fake = G.fake_call(inductor_norm, args, kwargs)
    with graph.inserting_before(norm):
        new = graph.call_function(inductor_norm, args, kwargs)
    G.set_fake(new, fake)
    norm.replace_all_uses_with(new)
    graph.erase_node(norm)


def apply_rule(graph: Graph) -> dict[tuple[str, str], int]:
    """Rewrite every norm of ``graph`` as the rule decides; returns how many sites took each
    (forward, backward) choice."""
    counts: dict[tuple[str, str], int] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for site in decisions(graph):
        if site.forward == OURS:
            if site.add is not None:
                _replace_with_sum(graph, site, order)  # where it cannot, the add stays and the norm is ours
        else:
            _replace_norm(graph, site.norm)
        choice = (site.forward, site.backward)
        counts[choice] = counts.get(choice, 0) + 1
        record_site(*choice)
    if counts:
        graph.lint()
        log.debug("rmsnorm sites (forward, backward): %s", counts)
    return counts
