"""The compile-time rewrites that fuse the ops around a norm with it.

Four rewrites, all on by default for models patched with ``patch_rmsnorm`` and compiled with
Inductor:

- the residual add before a norm, into its forward (``fuse_residual_adds``, below);
- a norm whose output only such a fused add reads, into it (``fuse_norm_add_norms``: Gemma's
  norms around each residual add);
- a norm whose output only elementwise ops read, or whose input is the embeddings, left to
  Inductor, which fuses it with them (``decompose_epilogue_norms``);
- the sum of the gradients that reach a norm's output, into its backward
  (``fuse_gradient_sums``).

**Residual adds.**
Decoder layers write ``hidden = residual + hidden`` and normalize the sum; stock Inductor fuses
that add into its norm kernel, and an opaque norm op would take the fusion away (the add then
costs a pass of its own, forward and backward). When a model whose RMSNorms call
``torch.ops.rmsnorm.fwd`` is compiled with Inductor, this pass rewrites every

    s = a + b            y = rmsnorm.fwd(s, weight, eps, ...)

in the graph Dynamo captured (before AOTAutograd) into ``y, s, rstd = rmsnorm.add_fwd(a, b,
weight, eps, ...)``: one kernel reads a and b and writes y and the sum, and its backward adds
the sum's own gradient into dx. Model code stays as it is.

Nothing is rewritten where the computation would change: only an out-of-place ``a + b`` of two
tensors of one shape (no broadcast, no ``alpha``, no scalar), in float16/bfloat16/float32,
whose result feeds the norm directly or through a cast that changes nothing (NemotronH's and
the Mamba family's ``norm(hidden_states.to(dtype=self.norm.weight.dtype))`` where the
activations have the weight's dtype; ``_noop_cast``); a scalar computed between the two, as
Dynamo computes a float eps under dynamic shapes, moves up before the add. Nor is a sum with a
term that is an elementwise result nothing else reads (RoPE's ``q * cos + rotate_half(q) *
sin``, Granite's and MiniCPM's scaled branch ``residual + hidden * multiplier``), or, in a graph
not traced to be differentiated (inference), a mixture of experts' combined output (Mixtral's,
Qwen3-MoE's and Qwen2-MoE's weighted expert rows, gathered back into token order and summed): Inductor
computes it in the kernel of that term, where the fused op would need the term written for it;
the norm after it is left to Inductor (below). The fused op computes the sum as torch does (in
fp32, rounded to the promoted dtype), so the sum is the same bits either way, and normalizes it
with the unfused op's kernel configuration, so y is too, except at N where
the table keeps a rung for the forward without a residual (``plain`` in ``config.FWD_LADDER``:
N = 5,120), whose sum of squares is added in another order: there y may differ in its last
place.

The pass runs as Inductor's ``pre_grad_custom_pass``. Turn it off with
``set_residual_fusion(False)`` or ``TORCH_RMSNORM_OP_FUSE_ADD=0``.

**Norms around a residual add.** Gemma 2 and 3 normalize the attention's output, add it to the
residual stream and normalize the sum for the MLP (``post_attention_layernorm``, ``+ residual``,
``pre_feedforward_layernorm``; the same after the MLP into the next layer's input norm, and
OLMo 2's last MLP norm into the final norm). After the residual rewrite that is ``y1 =
rmsnorm.fwd(x)`` read only by ``rmsnorm.add_fwd(residual, y1)``: two kernels and six passes over
M x N, where stock Inductor's one kernel makes four. ``fuse_norm_add_norms`` puts
``rmsnorm.norm_add_fwd(x, residual, ...)`` in their place, which reads x and the residual once
and writes the sum and the output, where y1 is read by nothing else and both norms have the same
keywords, with no output dtype. The op computes the two ops' values: one kernel where that
holds bit for bit (``launch.norm_add_fuses``), the two ops' launches elsewhere; its gradient is
the two ops' backward ops, one after the other. The residual rewrite's switch turns it off too.

**Norms left to Inductor.** Qwen3's (and Gemma3's, OLMo2's) q/k norms feed RoPE, a chain of
elementwise ops that Inductor computes in the kernel of the reduction before it: stock Inductor
reads the projection's output once and writes the rotated heads, where our kernel would write
the normalized heads for a kernel of RoPE to read again, forward and backward. Where nothing
but elementwise ops (through views) reads a norm's output (those q/k norms; OLMo2's norms
after attention and MLP, which only the residual add reads), this rewrite puts the norm's own
computation in torch ops (``_inductor_norm``: the op's bits, in the order of ops the Hugging Face
norms write) in the graph instead of the op, and Inductor compiles and fuses it as in the stock
model: its kernels, not ours, with the stock model's numerics. The same holds for the first
decoder layer's input norm, whose input is the embedding lookup (or Gemma's scaled embeddings):
stock Inductor gathers the embedding rows in that norm's kernel, and in its backward adds the
norm's gradient into the embedding's, where our op would need the embeddings written for it and
its dx written for the embedding's backward. So too a norm whose input is a sum with a term
that is an elementwise result nothing else reads: HunYuan's q/k norms, after RoPE, where stock
Inductor reads the heads once and writes the normalized ones and our op would read the rotated
heads written for it (4 passes over the heads against 2, forward); Granite's norms after each
scaled residual branch, where stock Inductor reads the branch and the residual and writes the
sum and y, and the fused op would need the scaled branch written for it (6 passes against 4);
and in inference the norms after a mixture of experts, where stock Inductor gathers, weighs and
sums the experts' rows in the norm's kernel, and the fused op would need them summed by a kernel
of its own, one launch more a layer. And a norm whose input is any other elementwise result
that nothing else reads (Mamba's fp32 residual stream cast to bf16, BitNet's ``relu(gate) ** 2
* up``): stock Inductor computes it in the norm's kernel, where our op would need it written.
Any other norm stays ours: one whose output a projection's matmul, our ops or the graph's
output reads, and, since the rewrite runs after the residual rewrite, one whose output feeds a
fused add (Gemma's post-attention norms). Turn it off with
``set_epilogue_decomposition(False)`` or ``TORCH_RMSNORM_OP_INDUCTOR_EPILOGUES=0``; it runs in
the same ``pre_grad_custom_pass``.

**Gradient sums.** A norm's output usually feeds several ops: the q, k and v projections, or
the MLP's gate and up projections. Autograd sums their gradients (``add(add(dq, dk), dv)``)
before the norm's backward reads the sum; stock Inductor fuses that sum into its own norm
backward, so without this rewrite the patched model would pay a pass over three tensors per
site that stock does not. Where such a sum of two to five tensors (three in fp32) feeds only
the ``dy`` of our backward kernel (on CUDA, where the compiled graph launches the kernels
itself), the pass hands the terms to the kernel (``DY`` ... ``DY5``, ``DY_TERMS``), which adds
them in fp32, in the order torch adds them, and rounds once to the gradient's dtype, as Inductor
computes a sum it fuses, and the adds leave the graph: where the terms are tensors the graph
materializes anyway (the projections' matmul outputs), dx is the same bits as without the
rewrite (but at N = 256, where a summing tile's half as many rows reduce their sums in another
order: its last place may differ), and dweight too where the summing launch keeps its tile's
rows; where it takes fewer (``launch.summed_gradient_consts``), dweight's rows
are added in another order in fp32, and its one rounding may differ in the last place; a term
that is itself a pointwise result, which Inductor could have fused into the sum unrounded, is
rounded to its dtype first (as eager torch rounds it). Only same-dtype terms with the rows dy
has are taken (its shape and strides, or contiguous with its element count and last dim: a
mixture of experts sums its gradients over [tokens, hidden] and views the sum as [batch, seq,
hidden]). A sum Inductor has made an ``addmm`` (``inp + a @ b``: its own post-grad patterns
fuse the router's or a shared expert's projection gradient with the experts' where the sum feeds
anything but elementwise ops) counts as one: the kernel takes ``inp`` and ``aten.mm(a, b)``, so
the addmm's copy of ``inp`` into its output and its second read of it leave the step, and the
sum is computed as stock Inductor computes it (the product rounded, then added in fp32). A mixture
of experts with a shared expert (Qwen2-MoE, Qwen3-Next) sums five gradients at its MLP's norm: the
experts', the router's, the shared expert's gate and up projections' and its gate's. The
pass runs as Inductor's ``post_grad_custom_post_pass``, on
the backward graph AOTAutograd has partitioned. Turn it off with ``set_gradient_fusion(False)``
or ``TORCH_RMSNORM_OP_FUSE_GRAD=0``.

The same post-grad pass turns off the rstd stores of forward launches whose rstd nothing reads
(inference graphs) and drops their rstd buffers (``drop_unread_rstd``), and gives a launch the
tensor that a view it reads views where both start at one address (``launch_view_bases``: a
decoder's residual stream is [batch, seq, hidden], the projections' matmuls write [tokens,
hidden], and Inductor would pass each such view as a ``reinterpret_tensor`` call at every
launch). Neither changes a value the graph reads; neither has a switch.

The passes are ``CustomGraphPass`` objects (one per stage) with a ``uuid()`` (compiled graphs stay
cacheable), installed by ``torch_rmsnorm_op.patch_rmsnorm`` or ``install()``, chained with any
pass already set; a setting acts on graphs compiled after it. ``aot_eager`` and other backends
that run no Inductor passes see no rewrite.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import pathlib
from typing import NamedTuple

import torch
from torch.fx import Graph, Node
from torch.fx.immutable_collections import immutable_dict, immutable_list

from torch_rmsnorm_op.fallback import log

ENV_VAR = "TORCH_RMSNORM_OP_FUSE_ADD"
GRAD_ENV_VAR = "TORCH_RMSNORM_OP_FUSE_GRAD"
EPILOGUE_ENV_VAR = "TORCH_RMSNORM_OP_INDUCTOR_EPILOGUES"
_FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ADDS = (operator.add, torch.add, torch.Tensor.add)
# None: the environment variable decides
_enabled: dict[str, bool | None] = {ENV_VAR: None, GRAD_ENV_VAR: None, EPILOGUE_ENV_VAR: None}


def switch_from_env(var: str) -> bool:
    """An on/off switch from ``$var``: off for 0, false, off or no; on when unset."""
    return os.environ.get(var, "1").strip().lower() not in ("0", "false", "off", "no")


def _setting(var: str) -> bool:
    if _enabled[var] is not None:
        return _enabled[var]
    return switch_from_env(var)


def set_residual_fusion(enabled: bool | None) -> None:
    """Turn the residual-add rewrite on or off for graphs compiled from now on; ``None``
    returns to ``$TORCH_RMSNORM_OP_FUSE_ADD`` (default: on)."""
    _enabled[ENV_VAR] = enabled


def residual_fusion_enabled() -> bool:
    return _setting(ENV_VAR)


def set_gradient_fusion(enabled: bool | None) -> None:
    """Turn the gradient-sum rewrite on or off for graphs compiled from now on; ``None``
    returns to ``$TORCH_RMSNORM_OP_FUSE_GRAD`` (default: on)."""
    _enabled[GRAD_ENV_VAR] = enabled


def gradient_fusion_enabled() -> bool:
    return _setting(GRAD_ENV_VAR)


def set_epilogue_decomposition(enabled: bool | None) -> None:
    """Turn on or off, for graphs compiled from now on, leaving to Inductor the norms whose
    output only elementwise ops read or whose input is the embeddings
    (``decompose_epilogue_norms``); ``None`` returns to
    ``$TORCH_RMSNORM_OP_INDUCTOR_EPILOGUES`` (default: on)."""
    _enabled[EPILOGUE_ENV_VAR] = enabled


def epilogue_decomposition_enabled() -> bool:
    return _setting(EPILOGUE_ENV_VAR)


def _rewritten(graph: Graph, count: int, message: str) -> int:
    """A rewrite's end: where it changed ``count`` nodes of ``graph``, check the graph and log
    ``message`` (with ``%d`` for the count); returns ``count``."""
    if count:
        graph.lint()
        log.debug(message, count)
    return count


def _is_call(node: Node, op) -> bool:
    """Whether ``node`` calls the op ``op`` (a packet such as ``torch.ops.rmsnorm.fwd``)."""
    return node.op == "call_function" and node.target in (op, op.default)


def _is_norm(node: Node) -> bool:
    return _is_call(node, torch.ops.rmsnorm.fwd)


def _set_fake(node: Node, value) -> None:
    """Record ``value`` (a fake result, from ``_fake_call``; None: none was recorded) as ``node``'s."""
    if value is not None:
        node.meta["example_value"] = node.meta["val"] = value


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


def _pointwise_sum(node: object, norm: Node) -> bool:
    """Whether ``node``, which ``norm`` normalizes, adds to another tensor a term that Inductor
    computes in the kernel that reads it, nothing else reading it: an elementwise result (RoPE's
    ``q * cos + rotate_half(q) * sin``, Granite's ``residual + hidden * multiplier``), or, where
    nothing differentiates the norm (``_differentiated``), a mixture of experts' combined output
    (``_expert_combine``; DeepSeek V3's ``experts + shared_experts``, an add, counts as one, not as
    an elementwise result). Inductor computes such a sum in the kernel of that term, and a norm
    after it in the same kernel (``decompose_epilogue_norms``), where the fused op would need
    the term written for it. A cast that changes nothing (``_noop_cast``) is not such a term:
    Inductor computes nothing for it."""
    if not (isinstance(node, Node) and _is_add(node)):
        return False
    terms = [a for a in node.args if isinstance(a, Node) and len(a.users) == 1]
    combines = [a for a in terms if _expert_combine(a)]
    return (any(_is_pointwise(a) and not _noop_cast(a) and a not in combines for a in terms)
            or bool(combines and not _differentiated(norm)))


def _differentiated(norm: Node) -> bool:
    """Whether the graph was traced to be differentiated through ``norm`` (its output requires
    grad). Summed in the kernel that reads it, a mixture of experts' output saves a launch in
    an inference forward; in a training step the norms so left to Inductor took more GPU time
    than the fused add and ours (Mixtral, hidden 2048, 4x2048 tokens, on the H200: 1.009x
    stock's GPU time against 0.996-0.998x; docs/performance.md, "Mixtures of experts")."""
    value = _value(norm)
    y = value[0] if isinstance(value, (tuple, list)) and value else value
    return not isinstance(y, torch.Tensor) or y.requires_grad


def _is_gather(node: Node) -> bool:
    """Rows picked by an index tensor: ``t[index]`` (not a view), ``index_select``."""
    if node.op == "call_function" and node.target is operator.getitem:
        return not _basic_index(node.args[1])
    return node.target in (torch.index_select, "index_select") and node.op in ("call_function", "call_method")


def _leading_sum(node: Node) -> bool:
    """A sum over dims that do not include the last (its rows stay whole rows)."""
    if not ((node.op == "call_method" and node.target == "sum") or (node.op == "call_function"
                                                                     and node.target is torch.sum)):
        return False
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    source = _value(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
    if dims is None or not isinstance(source, torch.Tensor):
        return False
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return all(isinstance(d, int) and d % source.dim() != source.dim() - 1 for d in dims)


def _expert_combine(term: Node) -> bool:
    """Whether ``term`` is, through views and dtype casts each read once, a sum over leading dims
    (no row split) of elementwise results picked by index, each read once: a mixture of experts'
    output, ``(expert_out * routing_weight)[inverse_order].view(tokens, top_k, hidden).sum(1)``
    (Mixtral's and Qwen3-MoE's combine), or such a sum plus a tensor (Qwen2-MoE's shared expert,
    ``(combine + shared).reshape(batch, seq, hidden)``; DeepSeek V3's, ``combine.view(...) +
    shared``). Inductor gathers, weighs and sums the experts' rows in the kernel that reads the
    result."""
    node = term
    while len(node.users) == 1 and (_is_view(node) or (_is_pointwise(node) and node.target == "to")) \
            and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    if len(node.users) == 1 and _is_add(node):
        return any(len(a.users) == 1 and _expert_combine(a) for a in node.args)
    if len(node.users) != 1 or not _leading_sum(node):
        return False
    node = node.args[0]
    while len(node.users) == 1 and (_is_view(node) or _is_gather(node)) and isinstance(node.args[0], Node):
        node = node.args[0]
    return len(node.users) == 1 and _is_pointwise(node)


def _fusable(add: Node) -> bool:
    """An out-of-place add of two tensors of one shape and device, in fp16/bf16/fp32."""
    a, b = (_value(n) for n in add.args)
    s = _value(add)
    if not all(isinstance(t, torch.Tensor) for t in (a, b, s)):
        return False
    if not (_same_shape(a, b) and _same_shape(a, s)) or a.device != b.device:
        return False
    return a.dtype in _FUSABLE_DTYPES and b.dtype in _FUSABLE_DTYPES


_SCALARS = (torch.SymFloat, torch.SymInt, torch.SymBool, float, int, bool)


def _scalars_to_hoist(node: Node, add: Node, order: dict[Node, int], found: list[Node]) -> bool:
    """Whether ``node`` exists where ``add`` stands, or is a scalar computed after it from
    nodes that do (or are such scalars themselves): those are appended to ``found``, each after
    its inputs."""
    if order[node] < order[add]:
        return True
    if node is add or node.op not in ("call_function", "call_method") or not isinstance(_value(node), _SCALARS):
        return False
    if not all(_scalars_to_hoist(i, add, order, found) for i in node.all_input_nodes):
        return False
    if node not in found:
        found.append(node)
    return True


def _inputs_before(add: Node, norm: Node, order: dict[Node, int]) -> bool:
    """Whether the norm's inputs other than the add (or the no-op cast of it the norm reads)
    exist where the add stands (the fused op stands there), once the scalars computed between
    the two from inputs that exist by then are moved up before the add: under dynamic shapes
    Dynamo computes a float eps right before the norm (``sym_float``, of a tensor attribute's
    ``item()``). Moves them where it returns True."""
    found: list[Node] = []
    if not all(_scalars_to_hoist(n, add, order, found) for n in norm.all_input_nodes
               if n is not add and n is not norm.args[0]):
        return False
    for i, node in enumerate(found):
        add.prepend(node)
        order[node] = order[add] - (len(found) - i) / 1024  # just before the add, in their order
    return True


def _fake_call(target, args: tuple, kwargs: dict):
    """``target``'s outputs on the fake values Dynamo recorded for ``args`` (the nodes among
    them), for a new node's meta; None where the first argument has none."""
    values = [_value(a) if isinstance(a, Node) else a for a in args]
    mode = getattr(values[0], "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return target(*values, **kwargs)


_CASTS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16"})


def _is_cast(node: Node) -> bool:
    """A dtype conversion of one tensor (``x.to(dtype)``, ``x.float()``, ...), not asked to copy."""
    if not (node.op == "call_method" and node.target in _CASTS) and not (
            node.op == "call_function" and node.target is torch.Tensor.to):
        return False
    if not node.args or not isinstance(node.args[0], Node) or set(node.kwargs) - {"dtype", "non_blocking"}:
        return False
    return not any(isinstance(a, bool) for a in node.args[1:])  # to(dtype, non_blocking, copy) given by position


def _noop_cast(node: Node) -> bool:
    """Whether ``node`` is a dtype conversion that gives back its input as it is: the same
    dtype, device, shape and strides, no copy asked. NemotronH and the Mamba family normalize
    ``hidden_states.to(dtype=self.norm.weight.dtype)``, which is that where the activations
    have the weight's dtype; the graph Dynamo captures keeps the call."""
    if not _is_cast(node):
        return False
    before, after = _value(node.args[0]), _value(node)
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    if after is before:
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return (before.dtype == after.dtype and before.device == after.device and _same_shape(before, after)
            and all(statically_known_true(x == y) for x, y in zip(before.stride(), after.stride())))


def _through_noop_cast(x: object) -> object:
    """The input of ``x`` where ``x`` is a cast that changes nothing (``_noop_cast``), else ``x``:
    what a norm of ``x`` reads."""
    return x.args[0] if isinstance(x, Node) and _noop_cast(x) else x


def fuse_residual_adds(graph: Graph) -> int:
    """Rewrite every fusable ``a + b -> rmsnorm.fwd`` in ``graph`` into ``rmsnorm.add_fwd``,
    the norm reading the sum directly or through a cast that changes nothing (``_noop_cast``);
    returns how many. Leaves every other node as it is."""
    count = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for norm in list(graph.nodes):
        if not _is_norm(norm) or not norm.args or not isinstance(norm.args[0], Node):
            continue
        cast = norm.args[0]
        add = _through_noop_cast(cast)
        if not _is_add(add) or _pointwise_sum(add, norm) or not _fusable(add) or not _inputs_before(add, norm, order):
            continue
        args = (*add.args, *norm.args[1:])
        fake = _fake_call(torch.ops.rmsnorm.add_fwd.default, args, norm.kwargs)
        with graph.inserting_after(add):
            fused = graph.call_function(torch.ops.rmsnorm.add_fwd.default, args, dict(norm.kwargs))
        with graph.inserting_after(fused):
            outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
        for i, node in enumerate((fused, *outs)):
            order[node] = order[add] + (i + 1) / 8  # between the add and the node after it
        for node, value in zip((fused, *outs), (fake, *(fake or (None, None, None)))):
            _set_fake(node, value)
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
        if cast is not add and not cast.users:
            graph.erase_node(cast)
        count += 1
    return _rewritten(graph, count, "fused %d residual add(s) into rmsnorm.add_fwd")


def _only_output(norm: Node) -> Node | None:
    """The node of ``rmsnorm.fwd`` ``norm``'s y, when y is the only output anything reads and
    one op reads it; else None."""
    if not norm.users or not all(u.op == "call_function" and u.target is operator.getitem for u in norm.users):
        return None
    read = [u for u in norm.users if u.users]
    if len(read) != 1 or read[0].args[1] != 0 or len(read[0].users) != 1:
        return None
    return read[0]


def fuse_norm_add_norms(graph: Graph) -> int:
    """Rewrite every ``y1 = rmsnorm.fwd(x) -> rmsnorm.add_fwd(residual, y1)`` in ``graph`` (a
    norm whose output only the sum of a fused residual add reads: Gemma's norms after attention
    and after the MLP, each followed by a norm of the sum) into ``rmsnorm.norm_add_fwd``, where
    both norms have the same keywords and x's norm writes x's dtype; returns how many."""
    count = 0
    for add in list(graph.nodes):
        if not _is_call(add, torch.ops.rmsnorm.add_fwd) or len(add.args) != 4:
            continue
        if add.kwargs.get("out_dtype") is not None:
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem for u in add.users):
            continue
        for i in (0, 1):
            y1, residual = add.args[i], add.args[1 - i]
            norm = y1.args[0] if isinstance(y1, Node) and y1.target is operator.getitem else None
            if (isinstance(norm, Node) and _is_norm(norm) and len(norm.args) == 3 and _only_output(norm) is y1
                    and isinstance(residual, Node) and residual is not y1 and dict(norm.kwargs) == dict(add.kwargs)):
                break
        else:
            continue
        kwargs = {k: v for k, v in add.kwargs.items() if k != "out_dtype"}
        args = (norm.args[0], residual, norm.args[1], norm.args[2], *add.args[2:])
        fake = _fake_call(torch.ops.rmsnorm.norm_add_fwd.default, args, kwargs)
        with graph.inserting_before(add):
            fused = graph.call_function(torch.ops.rmsnorm.norm_add_fwd.default, args, kwargs)
        _set_fake(fused, fake)
        for user in list(add.users):
            with graph.inserting_before(user):
                out = graph.call_function(operator.getitem, (fused, user.args[1]))
            _set_fake(out, None if fake is None else fake[user.args[1]])
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(add)
        for node in (*norm.users, norm):
            graph.erase_node(node)
        count += 1
    return _rewritten(graph, count, "fused %d norm -> residual add -> norm chain(s) into rmsnorm.norm_add_fwd")


# --- norms left to Inductor ----------------------------------------------------------------

# Ops Inductor computes in the kernel that produces their input (a reduction's epilogue):
# views, and elementwise arithmetic and casts (RoPE's mul, neg, cat and add).
_VIEW_METHODS = frozenset({"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand",
                           "contiguous", "unflatten", "chunk", "split", "narrow"})
_VIEW_FUNCTIONS = frozenset({torch.transpose, torch.reshape, torch.permute, torch.unsqueeze, torch.squeeze,
                             torch.flatten, torch.chunk, torch.split, torch.narrow})
_POINTWISE_METHODS = frozenset({"mul", "add", "sub", "neg", "div", "float", "half", "bfloat16", "type_as",
                                "masked_fill"})
_POINTWISE_FUNCTIONS = frozenset({operator.mul, operator.add, operator.sub, operator.neg, operator.truediv,
                                  torch.mul, torch.add, torch.sub, torch.neg, torch.div, torch.cat, torch.concat,
                                  torch.concatenate,
                                  torch.masked_fill, torch.nn.functional.silu, torch.nn.functional.gelu})


def _basic_index(index: object) -> bool:
    """A ``getitem`` index that makes a view: ints, slices, None, Ellipsis (or a tuple of them)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)


def _is_view(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _basic_index(node.args[1])
    return node.target in _VIEW_FUNCTIONS


def _is_pointwise(node: Node) -> bool:
    if node.op == "call_method":
        if node.target == "to":  # a dtype cast, not a move
            return all(isinstance(a, torch.dtype) for a in node.args[1:]) and set(node.kwargs) <= {"dtype"}
        return node.target in _POINTWISE_METHODS
    return node.op == "call_function" and node.target in _POINTWISE_FUNCTIONS


def _read_pointwise_only(y: Node) -> bool:
    """Whether every op that reads ``y``, through views, is elementwise (and something does)."""
    pending, seen = list(y.users), set()
    if not pending:
        return False
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_view(node) and node.users:
            pending.extend(node.users)
        elif not _is_pointwise(node):
            return False
    return True


_EMBEDDINGS = frozenset({torch.nn.functional.embedding, torch.embedding})


_DROPOUTS = frozenset({torch.nn.functional.dropout, torch.dropout})


def _embedding_lookup(x: object) -> bool:
    """Whether ``x`` is an embedding lookup, or views of one, elementwise ops of it with scalars
    (Gemma's scaled embeddings) and a dropout of it (T5's): a gather Inductor computes in the
    kernel that reads its result. A sum with another tensor (the residual stream after a layer)
    is not."""
    while isinstance(x, Node):
        if x.op == "call_function" and x.target in _EMBEDDINGS:
            return True
        if not (_is_view(x) or _is_pointwise(x) or (x.op == "call_function" and x.target in _DROPOUTS)):
            return False
        tensors = [a for a in x.all_input_nodes if isinstance(_value(a), torch.Tensor) and _value(a).dim() > 0]
        if len(tensors) != 1:
            return False
        x = tensors[0]
    return False


def _inductor_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, weight_offset: float = 0.0,
                   norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None):
    """``rmsnorm.fwd`` composed from torch ops, for Inductor to compile and fuse with its readers.

    The same bits as the op's forward (``reference.rms_norm_forward``), in the order of ops the
    Hugging Face norms write: ``weight * normed.to(norm_dtype)`` where the normalized row is
    rounded before the weight (Llama, Qwen3), ``normed * (weight.float() + offset)`` where it is
    not (Gemma). Autograd then differentiates what the stock model's graph holds, and Inductor
    builds the stock model's backward kernels: Qwen3's q/k-norm backward took 361 µs of a
    training step against stock's 361 on the H200, and 410 against 368 in the reference's
    order, which multiplies in fp32 and rounds at the end."""
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
            # Rounded once, to the output's dtype or not at all: the op's fp32 product.
            y = weight * y
        else:
            y = y.to(ctype) * (weight.to(ctype) + weight_offset)
    return y.to(out_dtype).contiguous(), rstd.squeeze(-1)


def _elementwise_read_once(x: object) -> bool:
    """Whether ``x`` is an elementwise result (a cast to another dtype among them) that nothing
    but the norm reads: Mamba's fp32 residual stream normalized in the weight's bf16,
    ``norm(hidden_states.to(dtype=self.norm.weight.dtype))``; BitNet's MLP sub-norm of
    ``relu(gate) ** 2 * up``. Inductor computes it in the norm's kernel, where our op would need
    it written. A cast that changes nothing is not one (the residual rewrite reads through it),
    nor is an add of two tensors: the residual rewrite decides about sums (``_pointwise_sum``)."""
    if not (isinstance(x, Node) and len(x.users) == 1 and (_is_pointwise(x) or _is_cast(x))):
        return False
    if _noop_cast(x) or _is_add(x):
        return False
    tensors = [_value(a) for a in x.all_input_nodes]
    after = _value(x)
    return isinstance(after, torch.Tensor) and all(
        t.device == after.device for t in tensors if isinstance(t, torch.Tensor))


def decompose_epilogue_norms(graph: Graph) -> int:
    """Replace with the same computation in torch ops, which Inductor fuses with its neighbours
    as it does in the stock model, every ``rmsnorm.fwd`` in ``graph`` whose rstd nothing reads
    and whose output only elementwise ops read (through views; Qwen3's q/k norms, read by
    RoPE), whose input is an embedding lookup (the first decoder layer's input norm: the
    gather, forward, and the embedding's gradient, backward, join the norm's kernels), or whose
    input (read through a cast that changes nothing) is a sum with a term that is an elementwise
    result nothing else reads (HunYuan's q/k norms, after RoPE; Granite's norms after its scaled
    residual branches; MuseSpark's after its residual gates) or, in inference, a
    mixture of experts' combined output (``_pointwise_sum``), or whose input is any other
    elementwise result that nothing else reads (``_elementwise_read_once``: Mamba's cast,
    BitNet's MLP product); returns how many.
    Every other norm stays as it is."""
    count = 0
    for norm in list(graph.nodes):
        if not _is_norm(norm) or not norm.users:
            continue
        users = list(norm.users)
        if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users):
            continue
        cast = norm.args[0]
        x = _through_noop_cast(cast)
        if not (all(_read_pointwise_only(u) for u in users) or _embedding_lookup(x) or _pointwise_sum(x, norm)
                or (_elementwise_read_once(x) and len(cast.users) == 1)):
            continue
        fake = _fake_call(_inductor_norm, norm.args, norm.kwargs)
        with graph.inserting_before(norm):
            new = graph.call_function(_inductor_norm, norm.args, dict(norm.kwargs))
        _set_fake(new, fake)
        norm.replace_all_uses_with(new)
        graph.erase_node(norm)
        count += 1
    return _rewritten(graph, count, "left %d rmsnorm.fwd to Inductor, fused with their neighbours")


def rewrite_pre_grad(graph: Graph) -> int:
    """The pre-grad stage: ``fuse_residual_adds`` and ``fuse_norm_add_norms`` (where the residual
    rewrite is on), then ``decompose_epilogue_norms`` (where on; after the others, so that a
    norm whose output feeds a fused add stays ours); returns how many nodes were rewritten."""
    count = fuse_residual_adds(graph) + fuse_norm_add_norms(graph) if residual_fusion_enabled() else 0
    return count + (decompose_epilogue_norms(graph) if epilogue_decomposition_enabled() else 0)


# --- gradient sums -------------------------------------------------------------------------

_BACKWARD_KERNELS = ("_rms_norm_bwd_rows", "_rms_norm_bwd_split")
_DY_KEYS = ("DY", "DY2", "DY3", "DY4", "DY5")  # launch.MAX_DY_TERMS
# forward kernel: the rstd outputs it writes under STORE_RSTD
_RSTD_OUTPUTS = {"_rms_norm_fwd_rows": ("RSTD",), "_rms_norm_fwd_looped": ("RSTD",),
                 "_rms_norm_fwd_split": ("RSTD",), "_rms_norm_fwd_norm_add_rows": ("RSTD", "X_RSTD")}


def _launched_kernel(node: Node) -> str | None:
    """The name of the kernel ``node`` launches, where it is a functional Triton kernel wrapper
    (as AOTAutograd records the launches on CUDA); else None."""
    from torch_rmsnorm_op import _torch_compat

    if node.op != "call_function" or node.target is not _torch_compat.triton_kernel_wrapper_functional():
        return None
    kernel = _torch_compat.traced_triton_kernel(node.kwargs["kernel_idx"])
    return getattr(getattr(kernel, "fn", None), "__name__", None)


def _backward_launch(node: Node) -> bool:
    """Whether ``node`` launches one of our backward kernels."""
    return _launched_kernel(node) in _BACKWARD_KERNELS


def _set_launch(node: Node, **changes) -> None:
    """Set the launch ``node``'s arguments (``kwargs``, ``constant_args_idx``,
    ``tensors_to_clone``) to ``changes``, and the values Inductor keeps of them
    (``eager_input_vals``, whose strides it gives each buffer of the launch) with them: a tensor
    argument takes the value it had in the launch, else its node's."""
    before = dict(node.kwargs["kwargs"])
    node.kwargs = dict(node.kwargs, **changes)
    if "eager_input_vals" not in node.meta:
        return
    args, eager = node.meta["eager_input_vals"]
    had = {id(value): eager["kwargs"].get(key) for key, value in before.items() if isinstance(value, Node)}
    values = {key: (had.get(id(value), value.meta.get("val")) if isinstance(value, Node) else value)
              for key, value in node.kwargs["kwargs"].items()}
    eager = {**eager, **changes, "kwargs": immutable_dict(values)}
    if "tensors_to_clone" in changes:
        eager["tensors_to_clone"] = immutable_list(changes["tensors_to_clone"])
    # the graph's own containers: Inductor flattens these values against the launch's arguments
    node.meta["eager_input_vals"] = (args, immutable_dict(eager))


def _constexprs(node: Node) -> dict:
    """The launch ``node``'s constexprs and other arguments: its graph arguments where they are
    plain values, else in the kernel side table."""
    from torch_rmsnorm_op import _torch_compat

    return {**_torch_compat.constant_args(node.kwargs["constant_args_idx"]), **node.kwargs["kwargs"]}


def _with_constexprs(node: Node, kwargs: dict, changes: dict, **more) -> None:
    """Give the launch ``node`` the graph arguments ``kwargs`` with the constexprs ``changes``,
    each set where the launch holds it: in its graph arguments where it is a plain value, else
    in the kernel side table; and ``more`` (``_set_launch``). The side table holds what the graph
    cannot (None among them, as tracing puts it there): a None in ``changes`` goes there, and
    ``kwargs`` takes the place of a side-table entry of the same name."""
    from torch_rmsnorm_op import _torch_compat

    idx = node.kwargs["constant_args_idx"]
    constants = _torch_compat.constant_args(idx)
    kwargs = {**kwargs, **{k: v for k, v in changes.items() if k not in constants and v is not None}}
    moved = {k: v for k, v in changes.items() if k in constants or v is None}
    kwargs = {k: v for k, v in kwargs.items() if k not in moved}
    drop = tuple(k for k in kwargs if k in constants)
    if moved or drop:
        idx = _torch_compat.with_constant_args(idx, drop, **moved)
    _set_launch(node, kwargs=kwargs, constant_args_idx=idx, **more)


def drop_unread_rstd(graph: Graph) -> int:
    """Turn off the rstd stores of our forward launches in ``graph`` whose rstd nothing reads (an
    inference graph, or a forward whose backward does not save it), and drop their rstd
    buffers; returns how many launches changed. The launch then writes y (and the residual sum)
    only, as an eager call without grad does, and the compiled call allocates one buffer less.
    Every output the graph reads stays the same bits."""
    count = 0
    for node in list(graph.nodes):
        outputs = _RSTD_OUTPUTS.get(_launched_kernel(node))
        if outputs is None:
            continue
        kwargs = dict(node.kwargs["kwargs"])
        if not _constexprs(node).get("STORE_RSTD") or any(user.target is not operator.getitem for user in node.users):
            continue
        if any(user.args[1] in outputs and user.users for user in node.users):
            continue
        for user in [u for u in node.users if u.args[1] in outputs]:
            graph.erase_node(user)
        buffers = [kwargs[key] for key in outputs]
        # None for the pointers, as in an eager call without grad
        _with_constexprs(node, kwargs, {"STORE_RSTD": False, **dict.fromkeys(outputs)},
                         tensors_to_clone=[name for name in node.kwargs["tensors_to_clone"] if name not in outputs])
        for buffer in buffers:
            if isinstance(buffer, Node) and not buffer.users and buffer.op == "call_function":
                graph.erase_node(buffer)
        count += 1
    return _rewritten(graph, count, "dropped the unread rstd of %d rmsnorm forward launch(es)")


def _contiguous(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are provably its shape's contiguous ones (no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    expected = 1
    for size, stride in reversed(tuple(zip(t.shape, t.stride()))):
        if not (statically_known_true(size == 1) or statically_known_true(stride == expected)):
            return False
        expected = expected * size
    return True


def _same_rows(value: object, dtype: torch.dtype, like: torch.Tensor) -> bool:
    """``value`` is a tensor of ``dtype`` on ``like``'s device whose [M, N] rows are where a
    launch that reads ``like`` looks for them: ``like``'s shape and strides, or both contiguous
    with ``like``'s element count and last dim (a mixture of experts sums its gradients over
    [tokens, hidden], which reach the norm viewed as [batch, seq, hidden])."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.device != like.device:
        return False
    if _same_shape(value, like) and all(statically_known_true(a == b) for a, b in zip(value.stride(), like.stride())):
        return True
    return (value.dim() > 0 and like.dim() > 0 and _contiguous(value) and _contiguous(like)
            and statically_known_true(value.shape[-1] == like.shape[-1])
            and statically_known_true(value.numel() == like.numel()))


class _Product(NamedTuple):
    """A product ``a @ b`` that the rewrite computes as a term of its own, from an addmm."""

    a: Node
    b: Node
    addmm: Node


def _sum_parts(node: object, like: torch.Tensor) -> list | None:
    """The two tensors ``node`` adds, where it is a plain sum with one user whose operands and
    result have ``like``'s rows (``_same_rows``) and dtype: an ``aten.add.Tensor`` of two tensors
    (alpha 1), or an ``aten.addmm`` (alpha and beta 1), Inductor's ``inp + a @ b``, whose
    product comes back as a ``_Product``. Else None."""
    if not (isinstance(node, Node) and node.op == "call_function" and len(node.users) == 1):
        return None
    dtype = like.dtype
    if node.target is torch.ops.aten.add.Tensor:
        if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
            return None
        parts = list(node.args)
        values = [_value(node), *(_value(a) for a in parts)]
    elif node.target is torch.ops.aten.addmm.default:
        if len(node.args) != 3 or node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
            return None
        inp, a, b = node.args
        if not all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in (_value(a), _value(b))):
            return None
        parts = [inp, _Product(a, b, node)]
        values = [_value(node), _value(inp)]
    else:
        return None
    return parts if all(_same_rows(v, dtype, like) for v in values) else None


def _viewed(dy: Node) -> tuple[Node, list[Node]]:
    """The node a chain of views (``view``, ``_unsafe_view``, ``reshape``) ends at, where each
    of them has one user, and the views, from ``dy`` on."""
    views = []
    while (dy.op == "call_function" and len(dy.users) == 1 and dy.args and isinstance(dy.args[0], Node)
           and dy.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                             torch.ops.aten.reshape.default)):
        views.append(dy)
        dy = dy.args[0]
    return dy, views


def _gradient_terms(dy: Node) -> tuple[list, list[Node]] | None:
    """The tensors (nodes, or ``_Product``s) whose sum ``dy`` is, where it is a plain sum
    (``_sum_parts``, through views that keep its rows), with the nodes that the sum takes; else
    None. A sum that is itself an operand of the sum is taken apart in turn, up to the terms a
    launch of its dtype takes (``launch.max_dy_terms``), in the order torch adds them (a chain
    ``((a + b) + c) + d``, as autograd accumulates a tensor's gradients, or Inductor's chain of
    addmms): the kernel adds the terms from the first on, so the inner sum's terms come first.
    Of two operands that are both sums, the first is taken apart and the second stays a term
    (``(a + b) + (c + d)``: a, b and the sum c + d, added as torch adds them)."""
    from torch_rmsnorm_op.launch import max_dy_terms

    like = _value(dy)
    if not isinstance(like, torch.Tensor) or like.dtype not in _FUSABLE_DTYPES:
        return None
    top, views = _viewed(dy)
    taken = [*views, top]
    terms = _sum_parts(top, like)
    if terms is None:
        return None
    terms = _inner_first(terms, like)
    while len(terms) < max_dy_terms(like.dtype.itemsize):
        parts = _sum_parts(terms[0], like)
        if parts is None:
            break
        taken.append(terms[0])
        terms = [*_inner_first(parts, like), *terms[1:]]
    return terms, taken


def _inner_first(parts: list, like: torch.Tensor) -> list:
    """The two operands of a sum, one that is itself a plain sum first (fp32 addition commutes,
    so ``c + (a + b)`` is ``(a + b) + c``)."""
    a, b = parts
    return [b, a] if _sum_parts(a, like) is None and _sum_parts(b, like) is not None else [a, b]


def _product_node(graph: Graph, product: _Product) -> Node:
    """``aten.mm(a, b)`` in place of the addmm that computed ``inp + a @ b``."""
    with graph.inserting_before(product.addmm):
        node = graph.call_function(torch.ops.aten.mm.default, (product.a, product.b))
    value = _fake_call(torch.ops.aten.mm.default, (product.a, product.b), {})
    if value is not None:
        node.meta["val"] = value
    return node


def fuse_gradient_sums(graph: Graph) -> int:
    """Hand every plain sum of two to five gradients that feeds only the ``dy`` of one of our
    backward kernels' launches in ``graph`` to the kernel (``launch.summed_gradient_consts``),
    erasing the sums; returns how many launches now sum their gradient. A sum Inductor has made
    an ``addmm`` (``inp + a @ b``, where the add's result feeds anything but elementwise ops)
    becomes ``aten.mm(a, b)``, one of the terms: the addmm's copy of ``inp`` into its output
    and the product's read of it leave the step. Leaves every other node as it is."""
    from torch_rmsnorm_op.launch import summed_gradient_consts

    count = 0
    for node in list(graph.nodes):
        if not _backward_launch(node):
            continue
        kwargs = dict(node.kwargs["kwargs"])
        constexprs = _constexprs(node)
        dy = kwargs.get("DY")
        if constexprs.get("DY_TERMS", 1) != 1 or any(constexprs.get(k, 0) is not None for k in _DY_KEYS[1:]):
            continue
        if any(v is dy for k, v in kwargs.items() if k != "DY"):
            continue  # the sum is also another argument of the launch
        found = _gradient_terms(dy) if isinstance(dy, Node) else None
        if found is None:
            continue
        terms, taken = found
        terms = [_product_node(graph, t) if isinstance(t, _Product) else t for t in terms]
        kwargs.update(zip(_DY_KEYS, terms))
        _with_constexprs(node, kwargs, summed_gradient_consts(constexprs, len(terms), _value(dy).dtype.itemsize))
        for gone in taken:  # from dy on: each is read only by the one before it
            graph.erase_node(gone)
        count += 1
    return _rewritten(graph, count, "summed %d gradient(s) in rmsnorm backward kernels")


# --- Inductor passes -------------------------------------------------------------------------

def _pre_grad_settings() -> tuple[bool, ...]:
    return residual_fusion_enabled(), epilogue_decomposition_enabled()


def _post_grad_settings() -> tuple[bool, ...]:
    return (gradient_fusion_enabled(),)


# --- viewed inputs -----------------------------------------------------------------------------

def _view_base(node: object) -> Node | None:
    """The tensor a chain of views (``_unsafe_view`` among them, which Inductor also lowers to a
    view) ends at, where ``node`` is such a chain whose every view starts where its input does,
    in its dtype: the same data pointer. Else None."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    base = None
    while (isinstance(node, Node) and node.op == "call_function" and node.args and isinstance(node.args[0], Node)
           and (getattr(node.target, "is_view", False) or node.target is torch.ops.aten._unsafe_view.default)):
        view, source = _value(node), _value(node.args[0])
        if not (isinstance(view, torch.Tensor) and isinstance(source, torch.Tensor) and view.dtype == source.dtype
                and statically_known_true(view.storage_offset() == source.storage_offset())):
            break
        node = base = node.args[0]
    return base


def launch_view_bases(graph: Graph) -> int:
    """Give our launches in ``graph`` the tensor that a view argument they read views, where it
    starts at the same address (``_view_base``): a kernel takes only a tensor's pointer, its
    strides come as the launch's ints, so the launch reads the same memory. Inductor passes a
    view of a buffer as a ``reinterpret_tensor`` call at each launch, host time on every call;
    the base it passes as it is. Returns how many launches changed; views nothing else reads
    leave the graph."""
    count = 0
    for node in list(graph.nodes):
        if not (_launched_kernel(node) or "").startswith("_rms_norm"):
            continue
        kwargs = dict(node.kwargs["kwargs"])
        written = set(node.kwargs["tensors_to_clone"])
        views = {key: (value, _view_base(value)) for key, value in kwargs.items() if key not in written}
        views = {key: pair for key, pair in views.items() if pair[1] is not None}
        if not views:
            continue
        _set_launch(node, kwargs={**kwargs, **{key: base for key, (_, base) in views.items()}})
        for view in dict.fromkeys(view for view, _ in views.values()):
            while view.op == "call_function" and not view.users:  # the chain, as far as nothing reads it
                source = view.args[0]
                graph.erase_node(view)
                view = source
        count += 1
    return _rewritten(graph, count, "gave %d rmsnorm launch(es) the tensors their view arguments view")


def rewrite_post_grad(graph: Graph) -> int:
    """The post-grad stage: ``drop_unread_rstd``, then ``fuse_gradient_sums`` where that rewrite
    is on, then ``launch_view_bases``; returns how many launches changed."""
    count = drop_unread_rstd(graph) + (fuse_gradient_sums(graph) if gradient_fusion_enabled() else 0)
    return count + launch_view_bases(graph)


# stage: (Inductor's option, the rewrite's name in this module, the settings of its switchable
# rewrites, whether it runs with them all off)
_STAGES = {"pre_grad": ("pre_grad_custom_pass", "rewrite_pre_grad", _pre_grad_settings, False),
           "post_grad": ("post_grad_custom_post_pass", "rewrite_post_grad", _post_grad_settings, True)}


@functools.cache
def fusion_pass_class() -> type:
    """``FusionPass``: Inductor's ``CustomGraphPass`` (defined on first use, so that importing
    the package does not import Inductor)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FusionPass(CustomGraphPass):
        """One stage's rewrites: at ``"pre_grad"`` (Inductor's ``pre_grad_custom_pass``)
        ``rewrite_pre_grad``, at ``"post_grad"`` (``post_grad_custom_post_pass``)
        ``rewrite_post_grad``, where they are on; then the pass that was installed before it
        (if any)."""

        def __init__(self, stage: str, then=None) -> None:
            self.stage, self.then = stage, then

        def _chained(self) -> tuple:
            """The passes installed before this one (Inductor's option may hold a list)."""
            then = self.then if isinstance(self.then, (list, tuple)) else (self.then,)
            return tuple(p for p in then if p is not None)

        def __call__(self, graph: Graph) -> None:
            _, rewrite, settings, always = _STAGES[self.stage]
            if always or any(settings()):
                globals()[rewrite](graph)
            for then in self._chained():
                then(graph)

        def uuid(self) -> bytes:
            h = hashlib.sha256(library_digest())
            h.update(f"{self.stage} {_STAGES[self.stage][2]()}".encode())
            for then in self._chained():
                uuid = getattr(then, "uuid", None)
                h.update(uuid() if callable(uuid) else repr(then).encode())
            return h.digest()

        def __reduce__(self):
            # Inductor pickles its config into the compile cache's key: a class defined in a
            # function pickles by reference to a module-level rebuild, its uuid in the key.
            return _rebuild_pass, (self.stage, self.then, self.uuid())

    return FusionPass


def source_digest(root: pathlib.Path) -> bytes:
    """A digest of the library's source under ``root``: its modules and kernels, not its tools."""
    h = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("kernels/*.py")]):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.digest()


@functools.cache
def library_digest() -> bytes:
    """The installed library's ``source_digest``, part of the passes' uuid and so of the compile
    caches' keys for patched models: a graph's rewrites, fallback decisions and launch
    configurations come from this code, not only from the kernels' source (which the caches
    key on too), so a graph compiled by other code of the library is not served."""
    return source_digest(pathlib.Path(__file__).parent)


def _rebuild_pass(stage: str, then, uuid: bytes):
    """Unpickle a ``FusionPass`` (``uuid``: the one it had, part of the pickled key)."""
    return fusion_pass_class()(stage, then)


def install() -> None:
    """Install the rewrites as Inductor's custom passes, one per stage (once each; chained with
    a pass already set). Graphs compiled afterwards are rewritten where each rewrite is enabled."""
    from torch._inductor import config

    cls = fusion_pass_class()
    for stage, (option, *_) in _STAGES.items():
        current = getattr(config, option)
        if not (isinstance(current, cls) and current.stage == stage):
            setattr(config, option, cls(stage, current))
