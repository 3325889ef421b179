"""The compile rule: for every norm a graph computes, who runs its forward and who its backward.

Stock Inductor computes a norm in a kernel with its neighbours: the elementwise op or gather
that makes its input, the elementwise ops that read its output, and in the backward the
elementwise gradients that reach it. Our kernels take none of those but a plain residual add
before the norm (``rmsnorm::add_fwd`` / ``add_bwd``) and the sum of the gradients that reach its
output (``post_grad.fuse_gradient_sums``). So a direction runs our kernel only where every tensor
it reads or writes is one the step keeps in memory anyway; there the kernel does the passes
Inductor's would, faster. Everywhere else Inductor keeps the direction, as in the stock model.

Sorted by what the graph shows around the norm:

- its **input** (through a cast that changes nothing), one of
  - ``sum``: a plain add of two stored tensors: the add moves into our kernels, forward and
    backward;
  - ``sum with a fused term``: a plain add with a term that Inductor computes in the kernel
    that reads it (an elementwise result or a gather read once: a scaled residual branch, a
    mixture of experts' combined rows, the embeddings, another norm's output left to Inductor).
    The forward stays Inductor's; the backward reads only stored tensors: the sum's gradient is
    the residual stream's, written anyway;
  - ``read by the norm alone``: a stored tensor (a matmul's output, a graph input) that only the
    norm reads;
  - ``stored, read elsewhere too``: a stored tensor other ops read as well. Its gradient is the
    sum of ours and theirs, an add that Inductor fuses into its norm backward: Inductor keeps
    both directions;
  - ``fused``: anything Inductor computes in the norm's kernel (an elementwise result, a gather).
- its **output** (through views), one of
  - ``matmuls``: read only by ops that read it from memory (matmuls, attention, our ops, the
    graph's output, and gathers of its rows beside those);
  - ``other ops``: read by other ops that are not elementwise (torchao's float8 linears, other
    autograd functions), which Inductor may fuse with the norm's forward (the float8 scaling and
    cast of a linear's input) but whose gradients reach the norm as tensors;
  - ``elementwise``: read by an elementwise op (RoPE after a q/k norm, a gate, a residual add of
    its output), whose gradient Inductor computes in the norm's backward kernel.

The forward runs our kernel where the input is ``sum`` or a stored tensor and the output is
``matmuls``; the backward where the input is not ``fused`` or ``stored, read elsewhere too`` and
the output is not ``elementwise``. In a graph that differentiates the norm, our forward also
needs our backward (a norm whose backward Inductor keeps keeps its forward there too).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Graph, Node

from torch_rmsnorm_op.passes import graph as G

OURS, INDUCTOR, NONE = "ours", "inductor", "none"

# input class -> (our forward can take it, our backward can take it)
INPUTS = {
    "sum": (True, True),
    "sum with a fused term": (False, True),
    "read by the norm alone": (True, True),
    "stored, read elsewhere too": (True, False),
    "fused": (False, False),
}
# output class -> (our forward can take it, our backward can take it)
OUTPUTS = {
    "matmuls": (True, True),
    "other ops": (False, True),
    "elementwise": (False, False),
}


@dataclass(frozen=True)
class Decision:
    """One norm site of a graph: how its neighbours are sorted, and who runs each direction."""

    norm: Node
    input: str
    output: str
    differentiated: bool
    forward: str  # OURS or INDUCTOR
    backward: str  # OURS, INDUCTOR, or NONE where nothing differentiates the norm

    @property
    def add(self) -> Node | None:
        """The plain add the norm reads, which moves into the norm's op where ours runs it."""
        x = G.through_noop_cast(self.norm.args[0])
        return x if self.input in ("sum", "sum with a fused term") else None


def decide(input_class: str, output_class: str, differentiated: bool) -> tuple[str, str]:
    """The rule: (forward, backward) for a site of these classes."""
    in_fwd, in_bwd = INPUTS[input_class]
    out_fwd, out_bwd = OUTPUTS[output_class]
    backward = NONE
    if differentiated:
        backward = OURS if in_bwd and out_bwd else INDUCTOR
    forward = OURS if in_fwd and out_fwd and backward != INDUCTOR else INDUCTOR
    return forward, backward


def _y(norm: Node) -> Node | None:
    """The node of the norm's output y, where the op's results are read through ``getitem``
    (else None: the op's tuple is used as a whole)."""
    if not all(u.op == "call_function" and u.target is operator.getitem for u in norm.users):
        return None
    ys = [u for u in norm.users if u.args[1] == 0]
    return ys[0] if len(ys) == 1 else None


def output_class(norm: Node) -> str | None:
    """How the norm's output is read (``OUTPUTS``); None where its results are used otherwise
    than through their getitems (the site then keeps our op as it is). A gather of its rows (the
    tokens a mixture of experts routes to each expert) reads it from memory where another reader
    makes the step store it anyway; read by gathers alone, Inductor computes the rows it gathers."""
    y = _y(norm)
    if y is None:
        return None
    found = G.readers(y)
    stored = [r for r in found if G.is_external(r) or G.is_autograd_function(r)]
    if any(not (r in stored or (stored and G.is_gather(r))) for r in found):
        return "elementwise"
    if any(G.is_autograd_function(r) for r in found):
        return "other ops"
    return "matmuls"


def _fused_here(node: object, inductor_norms: set[Node]) -> bool:
    """Whether Inductor computes ``node`` in the kernel of the norm that reads it: a fusable op
    (or another norm's output, where Inductor runs that norm's forward) that nothing else
    reads, or a gather, which Inductor gathers again wherever it is read."""
    base = G.base(node)
    if isinstance(base, Node) and base.op == "call_function" and base.target is operator.getitem \
            and isinstance(base.args[0], Node) and base.args[0] in inductor_norms:
        return len(G.readers(base)) == 1
    if not G.fusable(base):
        return False
    return G.gathered(base) or len(G.readers(base)) == 1


def input_class(norm: Node, inductor_norms: set[Node]) -> str:
    """How the norm's input is made (``INPUTS``). ``inductor_norms``: the norms before it in the
    graph whose forward Inductor runs (their outputs are fusable)."""
    x = G.through_noop_cast(norm.args[0])
    if G.is_plain_add(x):
        return "sum with a fused term" if any(_fused_here(t, inductor_norms) for t in x.args) else "sum"
    if _fused_here(x, inductor_norms):
        return "fused"
    source = G.base(x)
    if not isinstance(source, Node):
        return "fused"
    if G.fusable(source) and G.gathered(source):
        return "fused"
    return "read by the norm alone" if len(G.readers(source)) == 1 else "stored, read elsewhere too"


def decisions(graph: Graph) -> list[Decision]:
    """The rule for every ``rmsnorm.fwd`` of ``graph``, in graph order. A norm whose results are
    used otherwise than through getitems, or whose input is no graph node, keeps our op."""
    found, inductor_norms = [], set()
    for norm in graph.nodes:
        if not G.is_norm(norm) or not norm.args or not isinstance(norm.args[0], Node):
            continue
        out = output_class(norm)
        if out is None:
            continue
        inp = input_class(norm, inductor_norms)
        differentiated = G.differentiated(norm)
        forward, backward = decide(inp, out, differentiated)
        if forward == INDUCTOR:
            inductor_norms.add(norm)
        found.append(Decision(norm, inp, out, differentiated, forward, backward))
    return found
