"""What the compile rule reads in the graph Dynamo captured: the ops around a norm, sorted by
what Inductor does with them.

Inductor either computes an op inside the kernel that reads its result (elementwise ops,
gathers, views, short reductions: *fusable*) or runs it as a kernel of its own that reads its
inputs from memory and writes its output there (matmuls, attention, other libraries' ops, our
ops: *external*). A norm's neighbours of the first kind are what stock Inductor fuses with the
norm; our kernels can take none of them but a plain residual add.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_rmsnorm_op import _torch_compat

FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_VIEW_METHODS = frozenset({"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand",
                           "contiguous", "unflatten", "chunk", "split", "narrow", "view_as", "expand_as", "t",
                           "movedim", "unbind"})
_VIEW_FUNCTIONS = frozenset({torch.transpose, torch.reshape, torch.permute, torch.unsqueeze, torch.squeeze,
                             torch.flatten, torch.chunk, torch.split, torch.narrow, torch.t, torch.movedim,
                             torch.unbind})
_CASTS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16"})
# elementwise ops Inductor fuses that carry no pointwise tag under their own name
_ELEMENTWISE = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack, F.dropout, torch.dropout,
                          torch.where, operator.truediv, operator.floordiv, operator.mod})
_ELEMENTWISE_METHODS = frozenset({"cat", "masked_fill", "masked_fill_", "where", "clamp", "clip", "float_power"})
_GATHERS = frozenset({F.embedding, torch.embedding, torch.index_select, torch.gather, torch.take_along_dim})
_GATHER_METHODS = frozenset({"index_select", "gather", "take_along_dim"})
_SUMS = frozenset({torch.sum})
# ops that read their operands from memory whatever produced them
_MATMULS = frozenset({F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                      torch.einsum, F.scaled_dot_product_attention, F.conv1d, F.conv2d, F.conv3d, F.bilinear})
_MATMUL_METHODS = frozenset({"matmul", "mm", "bmm", "__matmul__"})
_ADDS = (operator.add, torch.add, torch.Tensor.add)
# the same ops in an aten-level graph (``torch.export``'s, which AOTInductor compiles): by name
_ATEN_MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "linear", "matmul", "_scaled_mm", "convolution",
                           "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                           "_scaled_dot_product_flash_attention_for_cpu"})
_ATEN_GATHERS = frozenset({"embedding", "index", "index_select", "gather"})
_ATEN_CASTS = frozenset({"_to_copy", "to", "type_as"})
_ATEN_ELEMENTWISE = frozenset({"cat", "stack", "dropout", "native_dropout", "clone"})


def value(node: object):
    """The fake value Dynamo recorded for ``node`` (None for anything else)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def is_call(node: Node, op) -> bool:
    """Whether ``node`` calls the op ``op`` (a packet such as ``torch.ops.rmsnorm.fwd``)."""
    return node.op == "call_function" and node.target in (op, op.default)


def is_norm(node: Node) -> bool:
    return is_call(node, torch.ops.rmsnorm.fwd)


def _namespace(target: object) -> str | None:
    """The namespace of an op (an overload, or a packet of overloads); None for anything else."""
    namespace = getattr(target, "namespace", None)
    overloads = getattr(target, "overloads", None)
    if namespace is None and callable(overloads) and overloads():
        namespace = getattr(getattr(target, overloads()[0]), "namespace", None)
    return namespace if isinstance(namespace, str) else None


def is_our_op(node: Node) -> bool:
    """A call of any ``torch.ops.rmsnorm`` op."""
    return node.op == "call_function" and _namespace(node.target) == "rmsnorm"


def _aten(node: Node) -> str | None:
    """The name of the aten op ``node`` calls (``"mm"`` for ``aten.mm.default``), else None."""
    if node.op != "call_function" or _namespace(node.target) != "aten":
        return None
    return node.target.__name__.split(".")[0]


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _basic_index(index: object) -> bool:
    """A ``getitem`` index that makes a view: ints, slices, None, Ellipsis (or a tuple of them)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)


def is_view(node: Node) -> bool:
    if _aten(node) is not None:
        return bool(getattr(node.target, "is_view", False)) or _aten(node) in ("_unsafe_view", "reshape")
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(value(node.args[0]), torch.Tensor) and _basic_index(node.args[1])
    return node.target in _VIEW_FUNCTIONS


def is_cast(node: Node) -> bool:
    """A dtype conversion of one tensor (``x.to(dtype)``, ``x.float()``, ...), not asked to copy
    or to move."""
    if _aten(node) in _ATEN_CASTS:
        return bool(node.args) and isinstance(node.args[0], Node) and "device" not in node.kwargs
    if not (node.op == "call_method" and node.target in _CASTS) and not (
            node.op == "call_function" and node.target is torch.Tensor.to):
        return False
    if not node.args or not isinstance(node.args[0], Node) or set(node.kwargs) - {"dtype", "non_blocking"}:
        return False
    return all(isinstance(a, (torch.dtype, Node)) for a in node.args[1:])


def noop_cast(node: object) -> bool:
    """Whether ``node`` is a dtype conversion that gives back its input as it is: the same
    dtype, device, shape and strides (``hidden.to(norm.weight.dtype)`` where the activations
    have the weight's dtype). Inductor computes nothing for it."""
    if not (isinstance(node, Node) and is_cast(node)):
        return False
    before, after = value(node.args[0]), value(node)
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    return after is before or (
        before.dtype == after.dtype and before.device == after.device and same_shape(before, after)
        and all(statically_known_true(x == y) for x, y in zip(before.stride(), after.stride())))


def through_noop_cast(x: object) -> object:
    """The input of ``x`` where ``x`` is a cast that changes nothing, else ``x``."""
    return x.args[0] if noop_cast(x) else x


def _name(node: Node) -> str | None:
    target = node.target
    if node.op == "call_method":
        return target
    return getattr(target, "__name__", None)


def is_elementwise(node: Node) -> bool:
    """An elementwise op: a dtype cast, or an op whose aten overload carries the pointwise tag
    (``mul``, ``silu``, ``rsqrt``, ...), or one Inductor fuses the same way (``cat``,
    ``dropout``, ``where``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    if is_cast(node) or node.target in _ELEMENTWISE or (node.op == "call_method" and node.target in
                                                         _ELEMENTWISE_METHODS):
        return True
    tags = getattr(node.target, "tags", None)  # an aten overload
    if node.op == "call_function" and tags is not None:
        return torch.Tag.pointwise in tags or _aten(node) in _ATEN_ELEMENTWISE
    name = _name(node)
    return name is not None and _aten_pointwise(name.removeprefix("__").removesuffix("__").rstrip("_"))


@functools.cache
def _aten_pointwise(name: str) -> bool:
    """Whether an overload of ``aten.<name>`` carries the pointwise tag."""
    packet = getattr(torch.ops.aten, name, None)
    return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def is_gather(node: Node) -> bool:
    """Rows picked by an index tensor: an embedding lookup, ``index_select``, ``t[index]``."""
    if _aten(node) is not None:
        return _aten(node) in _ATEN_GATHERS
    if node.op == "call_function" and node.target is operator.getitem:
        return isinstance(value(node.args[0]), torch.Tensor) and not _basic_index(node.args[1])
    if node.op == "call_method":
        return node.target in _GATHER_METHODS
    return node.op == "call_function" and node.target in _GATHERS


def _short_sum(node: Node) -> bool:
    """A sum over dims other than the last whose reduced elements Inductor unrolls into the
    kernel that reads the result (a mixture of experts' sum over the chosen experts)."""
    if not ((node.op == "call_method" and node.target == "sum") or (node.op == "call_function"
                                                                     and node.target in _SUMS)
            or _aten(node) == "sum"):
        return False
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    source = value(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
    if dims is None or not isinstance(source, torch.Tensor) or source.dim() == 0:
        return False
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    if not all(isinstance(d, int) and d % source.dim() != source.dim() - 1 for d in dims):
        return False
    count = 1
    for d in dims:
        count = count * source.shape[d]
    return statically_known_true(count <= _torch_compat.unrolled_reduction_limit())


def fusable(node: object) -> bool:
    """Whether Inductor computes ``node`` inside the kernel that reads it (elementwise ops,
    gathers, views, short sums), rather than as a kernel that writes it to memory."""
    return isinstance(node, Node) and (is_elementwise(node) or is_gather(node) or is_view(node) or _short_sum(node))


def readers(node: Node) -> list[Node]:
    """The ops that read ``node``, through views (each view replaced by its own readers)."""
    found, pending, seen = [], list(node.users), set()
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        if is_view(user) and user.users:
            pending.extend(user.users)
        elif not is_view(user):
            found.append(user)
    return found


def base(node: object) -> object:
    """The node a chain of views ends at (``node`` itself where it is no view)."""
    while isinstance(node, Node) and is_view(node) and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def gathered(node: object) -> bool:
    """Whether ``node`` is, through views and elementwise ops of one tensor, a gather: rows an
    index picks (an embedding lookup, scaled or dropped out), which Inductor gathers again in
    every kernel that reads them rather than writing them once."""
    while isinstance(node, Node):
        if is_gather(node):
            return True
        if not (is_view(node) or is_elementwise(node)):
            return False
        tensors = [a for a in node.all_input_nodes if isinstance(value(a), torch.Tensor) and value(a).dim() > 0]
        if len(tensors) != 1:
            return False
        node = tensors[0]
    return False


def is_external(node: Node) -> bool:
    """An op that reads its tensor operands from memory whatever produced them: a matmul,
    attention, a convolution, an op of another library (a custom op), one of ours, or the
    graph's output."""
    if node.op == "output":
        return True
    if node.op == "call_method":
        return node.target in _MATMUL_METHODS
    if node.op != "call_function":
        return False
    if node.target in _MATMULS or is_our_op(node) or _aten(node) in _ATEN_MATMULS:
        return True
    # another library's op; not a higher-order op (an autograd function's body: torchao's float8
    # linears scale and cast their input there, which Inductor fuses into the norm's kernel)
    namespace = _namespace(node.target)
    return namespace is not None and namespace not in ("aten", "prims", "higher_order")


def is_plain_add(node: object) -> bool:
    """An out-of-place ``a + b`` of two tensors of one shape, device and a dtype the kernels take
    (no broadcast, no scalar, no ``alpha``): the add our fused kernels compute."""
    if not isinstance(node, Node):
        return False
    if not ((node.op == "call_function" and node.target in _ADDS) or (node.op == "call_method"
                                                                      and node.target == "add")
            or (_aten(node) == "add" and node.target.__name__ == "add.Tensor")):
        return False
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1 or set(node.kwargs) - {"alpha"}:
        return False
    if not all(isinstance(a, Node) for a in node.args):
        return False
    a, b = (value(n) for n in node.args)
    s = value(node)
    if not all(isinstance(t, torch.Tensor) for t in (a, b, s)):
        return False
    if not (same_shape(a, b) and same_shape(a, s)) or a.device != b.device:
        return False
    return a.dtype in FUSABLE_DTYPES and b.dtype in FUSABLE_DTYPES


def differentiated(norm: Node) -> bool:
    """Whether the graph was traced to be differentiated through ``norm`` (its output requires
    grad)."""
    v = value(norm)
    y = v[0] if isinstance(v, (tuple, list)) and v else v
    return not isinstance(y, torch.Tensor) or y.requires_grad


def fake_call(target, args: tuple, kwargs: dict):
    """``target``'s outputs on the fake values Dynamo recorded for ``args`` (the nodes among
    them), for a new node's meta; None where the first argument has none."""
    values = [value(a) if isinstance(a, Node) else a for a in args]
    mode = getattr(values[0], "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return target(*values, **kwargs)


def set_fake(node: Node, fake) -> None:
    """Record ``fake`` (a fake result, from ``fake_call``; None: none was recorded) as ``node``'s."""
    if fake is not None:
        node.meta["example_value"] = node.meta["val"] = fake
