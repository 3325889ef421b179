"""The post-grad stage: rewrites of our kernels' launches in the graphs AOTAutograd traced.

On CUDA the ops decompose into their kernels' launches while AOTAutograd traces a graph
(``ops.py``), so the forward and backward graphs Inductor lowers hold
``triton_kernel_wrapper_functional`` nodes naming ``_rms_norm_*``. Three rewrites act on them,
none changing a value the graph reads:

- ``fuse_gradient_sums``: a norm's output usually feeds several matmuls (q, k and v; gate and
  up), and autograd sums their gradients before the norm's backward reads the sum; stock Inductor
  fuses that sum into its norm backward. Where such a sum of two to five tensors (three in fp32)
  feeds only the ``dy`` of our backward launch, the launch takes the terms (``DY`` ... ``DY5``,
  ``DY_TERMS``), adds them in fp32 in the order torch adds them, and rounds once, as Inductor
  computes a sum it fuses; the adds leave the graph. Only same-dtype terms with dy's rows are
  taken. A sum Inductor has made an ``addmm`` (``inp + a @ b``) counts as two terms, ``inp`` and
  ``aten.mm(a, b)``, so the addmm's copy of ``inp`` leaves the step. Where the summing launch takes
  fewer rows per tile (``launch.summed_gradient_consts``), dweight's rows are added in another
  order and its one rounding may differ in the last place.
- ``drop_unread_rstd``: forward launches whose rstd nothing reads (inference) do not store it.
- ``launch_view_bases``: a launch reads the tensor a view argument views where both start at
  one address, so Inductor passes no ``reinterpret_tensor`` call at each launch.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.immutable_collections import immutable_dict, immutable_list

from torch_rmsnorm_op import _torch_compat
from torch_rmsnorm_op.fallback import log
from torch_rmsnorm_op.passes.graph import FUSABLE_DTYPES, fake_call, same_shape
from torch_rmsnorm_op.passes.graph import value as fake_value


def _rewritten(graph: Graph, count: int, message: str) -> int:
    """A rewrite's end: where it changed ``count`` nodes of ``graph``, check the graph and log
    ``message`` (with ``%d`` for the count); returns ``count``."""
    if count:
        graph.lint()
        log.debug(message, count)
    return count


_BACKWARD_KERNELS = ("_rms_norm_bwd_rows", "_rms_norm_bwd_split")
_DY_KEYS = ("DY", "DY2", "DY3", "DY4", "DY5")  # launch.MAX_DY_TERMS
# forward kernel: the rstd outputs it writes under STORE_RSTD
_RSTD_OUTPUTS = {"_rms_norm_fwd_rows": ("RSTD",), "_rms_norm_fwd_looped": ("RSTD",),
                 "_rms_norm_fwd_split": ("RSTD",), "_rms_norm_fwd_norm_add_rows": ("RSTD", "X_RSTD")}


def _launched_kernel(node: Node) -> str | None:
    """The name of the kernel ``node`` launches, where it is a functional Triton kernel wrapper
    (as AOTAutograd records the launches on CUDA); else None."""
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
    return {**_torch_compat.constant_args(node.kwargs["constant_args_idx"]), **node.kwargs["kwargs"]}


def _with_constexprs(node: Node, kwargs: dict, changes: dict, **more) -> None:
    """Give the launch ``node`` the graph arguments ``kwargs`` with the constexprs ``changes``,
    each set where the launch holds it: in its graph arguments where it is a plain value, else
    in the kernel side table; and ``more`` (``_set_launch``). The side table holds what the graph
    cannot (None among them, as tracing puts it there): a None in ``changes`` goes there, and
    ``kwargs`` takes the place of a side-table entry of the same name."""
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
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.device != like.device:
        return False
    if same_shape(value, like) and all(statically_known_true(a == b) for a, b in zip(value.stride(), like.stride())):
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
        values = [fake_value(node), *(fake_value(a) for a in parts)]
    elif node.target is torch.ops.aten.addmm.default:
        if len(node.args) != 3 or node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
            return None
        inp, a, b = node.args
        if not all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in (fake_value(a), fake_value(b))):
            return None
        parts = [inp, _Product(a, b, node)]
        values = [fake_value(node), fake_value(inp)]
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

    like = fake_value(dy)
    if not isinstance(like, torch.Tensor) or like.dtype not in FUSABLE_DTYPES:
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
    value = fake_call(torch.ops.aten.mm.default, (product.a, product.b), {})
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
        _with_constexprs(node, kwargs, summed_gradient_consts(constexprs, len(terms), fake_value(dy).dtype.itemsize))
        for gone in taken:  # from dy on: each is read only by the one before it
            graph.erase_node(gone)
        count += 1
    return _rewritten(graph, count, "summed %d gradient(s) in rmsnorm backward kernels")


# --- viewed inputs -----------------------------------------------------------------------------

def _view_base(node: object) -> Node | None:
    """The tensor a chain of views (``_unsafe_view`` among them, which Inductor also lowers to a
    view) ends at, where ``node`` is such a chain whose every view starts where its input does,
    in its dtype: the same data pointer. Else None."""
    base = None
    while (isinstance(node, Node) and node.op == "call_function" and node.args and isinstance(node.args[0], Node)
           and (getattr(node.target, "is_view", False) or node.target is torch.ops.aten._unsafe_view.default)):
        view, source = fake_value(node), fake_value(node.args[0])
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


def rewrite(graph: Graph, gradient_sums: bool = True) -> int:
    """The post-grad stage: ``drop_unread_rstd``, ``fuse_gradient_sums`` (where
    ``gradient_sums``), ``launch_view_bases``; returns how many launches changed."""
    count = drop_unread_rstd(graph) + (fuse_gradient_sums(graph) if gradient_sums else 0)
    return count + launch_view_bases(graph)
