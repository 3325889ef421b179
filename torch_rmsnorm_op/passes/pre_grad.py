"""The pre-grad stage: each norm of the graph Dynamo captured as the rule (``rule.py``) decides.

- **Ours, forward and backward**: the op stays; a plain residual add it reads moves into it
  (``a + b -> rmsnorm.fwd`` becomes ``rmsnorm.add_fwd(a, b, ...)``: one kernel reads a and b and
  writes y and the sum; its backward adds the sum's own gradient into dx).
- **Inductor's forward, our backward**: the norm (and the add it reads) becomes torch ops in an
  autograd function whose backward calls ``rmsnorm.bwd`` / ``add_bwd`` (``InductorForward``,
  ``InductorAddForward``): Inductor compiles and fuses the forward as in the stock model,
  AOTAutograd puts our backward op in the backward graph.
- **Inductor's, both directions**: the norm becomes torch ops (``inductor_norm``), which
  AOTAutograd differentiates and Inductor fuses as in the stock model.

The torch ops compute the op's values in the order Hugging Face's norms write them
(``weight * normed.to(dtype)``): where Inductor keeps a norm, its kernels and numerics are the
stock model's.
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


class InductorForward(torch.autograd.Function):
    """``rmsnorm.fwd``'s values from torch ops (``inductor_norm``), its gradient from
    ``rmsnorm.bwd``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float, weight_offset: float,
                norm_dtype: torch.dtype | None, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        y, rstd = inductor_norm(x, weight, eps, weight_offset=weight_offset, norm_dtype=norm_dtype,
                                out_dtype=out_dtype)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)
        ctx.weight_offset = weight_offset
        ctx.save_for_backward(x, weight, rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy: Tensor | None, _drstd: Tensor | None):
        if dy is None:
            return None, None, None, None, None, None
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = torch.ops.rmsnorm.bwd(dy, x, weight, rstd, weight_offset=ctx.weight_offset)
        need_x, need_w = ctx.needs_input_grad[:2]
        return (dx if need_x else None), (dweight if need_w else None), None, None, None, None


class InductorAddForward(torch.autograd.Function):
    """``rmsnorm.add_fwd``'s values from torch ops (the sum as torch adds, then
    ``inductor_norm``), its gradient from ``rmsnorm.add_bwd``."""

    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, weight_offset: float,
                norm_dtype: torch.dtype | None, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
        h = x + residual
        y, rstd = inductor_norm(h, weight, eps, weight_offset=weight_offset, norm_dtype=norm_dtype,
                                out_dtype=out_dtype)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)
        ctx.weight_offset = weight_offset
        ctx.dtypes = (x.dtype, residual.dtype)
        ctx.save_for_backward(h, weight, rstd)
        return y, h, rstd

    @staticmethod
    def backward(ctx, dy: Tensor | None, dh: Tensor | None, _drstd: Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        dweight = None
        if dy is None:
            dsum = dh
        else:
            dsum, dweight = torch.ops.rmsnorm.add_bwd(dy, dh, h, weight, rstd, weight_offset=ctx.weight_offset)
        if dsum is None:
            return None, None, None, None, None, None, None
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        x_dtype, r_dtype = ctx.dtypes
        return ((dsum.to(x_dtype) if need_x else None), (dsum.to(r_dtype) if need_r else None),
                (dweight if need_w else None), None, None, None, None)


def _keywords(norm: Node) -> tuple:
    kw = norm.kwargs
    return kw.get("weight_offset", 0.0), kw.get("norm_dtype"), kw.get("out_dtype")


def inductor_forward(x: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0,
                     norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None):
    """``InductorForward`` as a graph node calls it."""
    return InductorForward.apply(x, weight, eps, weight_offset, norm_dtype, out_dtype)


def inductor_add_forward(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, weight_offset: float = 0.0,
                         norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None):
    """``InductorAddForward`` as a graph node calls it."""
    return InductorAddForward.apply(x, residual, weight, eps, weight_offset, norm_dtype, out_dtype)


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


def _replace_with_sum(graph: Graph, site: Decision, target, order: dict[Node, int]) -> bool:
    """Replace the site's ``add -> norm`` with one node of ``target`` (an op or function of
    ``add_fwd``'s arguments and results) standing where the add stood; False (nothing changed)
    where the norm's other inputs are computed only after the add."""
    norm, add = site.norm, site.add
    cast = norm.args[0]
    if not _inputs_before(add, norm, order):
        return False
    args = (*add.args, *norm.args[1:])
    kwargs = dict(norm.kwargs)
    if target is not torch.ops.rmsnorm.add_fwd.default:
        kwargs = dict(zip(("weight_offset", "norm_dtype", "out_dtype"), _keywords(norm)))
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


def _replace_norm(graph: Graph, norm: Node, target) -> None:
    """Replace ``norm`` with a call of ``target`` (a function of ``fwd``'s arguments returning
    ``(y, rstd)``), its results read as the op's."""
    args, kwargs = norm.args, dict(zip(("weight_offset", "norm_dtype", "out_dtype"), _keywords(norm)))
    fake = G.fake_call(target, args, kwargs)
    with graph.inserting_before(norm):
        new = graph.call_function(target, args, kwargs)
    G.set_fake(new, fake)
    norm.replace_all_uses_with(new)
    graph.erase_node(norm)


def apply_rule(graph: Graph) -> dict[tuple[str, str], int]:
    """Rewrite every norm of ``graph`` as the rule decides; returns how many sites took each
    (forward, backward) choice."""
    counts: dict[tuple[str, str], int] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for site in decisions(graph):
        choice = (site.forward, site.backward)
        if site.forward == OURS:
            if site.add is not None and not _replace_with_sum(graph, site, torch.ops.rmsnorm.add_fwd.default, order):
                choice = (OURS, site.backward)  # the add stays; the norm stays ours
        elif site.backward == OURS:
            if site.add is None or not _replace_with_sum(graph, site, inductor_add_forward, order):
                _replace_norm(graph, site.norm, inductor_forward)
        else:
            _replace_norm(graph, site.norm, inductor_norm)
        counts[choice] = counts.get(choice, 0) + 1
        record_site(*choice)
    if counts:
        graph.lint()
        log.debug("rmsnorm sites (forward, backward): %s", counts)
    return counts
