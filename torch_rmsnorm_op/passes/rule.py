"""The compile rule: for every norm a graph computes, whether our kernels or Inductor's run it.

Stock Inductor computes a norm in a kernel with its neighbours: the elementwise op or gather
that makes its input, the elementwise ops that read its output (RoPE after a q/k norm, a gate,
torchao's float8 scaling and cast of a linear's input), and in the backward the elementwise
gradients that reach it and leave it. Our kernels take none of those but a plain residual add
before the norm (``rmsnorm::add_fwd`` / ``add_bwd``) and the sum of the gradients that reach its
output (``post_grad.fuse_gradient_sums``). So a norm runs our kernels only where every tensor
they read and write is one the step keeps in memory anyway; there they do the passes Inductor's
would, faster. Everywhere else Inductor keeps the norm, forward and backward, as in the stock
model.

The rule sorts each norm by what the graph shows around it:

- its **input** (through a cast that changes nothing):
  - ``sum``: a plain add of two stored tensors, which moves into our kernels;
  - ``read by the norm alone``: a stored tensor (a matmul's output, a graph input) that only
    the norm reads;
  - ``stored, read elsewhere too``: a stored tensor other ops read as well: its gradient is the
    sum of the norm's and theirs, an add Inductor fuses into its norm backward;
  - ``fused``: what Inductor computes in the kernel that reads it: an elementwise result or a
    gather, or a plain add with such a term (a scaled residual branch, a mixture of experts'
    combined rows, the embeddings, another norm's output).
  A tensor is *stored* where the step writes it whatever runs the norm: the output of a matmul
  or another op of its own kernel, a graph input, a tensor several ops read (but a gather, which
  Inductor gathers again in every kernel that reads it).
- its **output** (through views):
  - ``matmuls``: read only by ops that read it from memory (matmuls, attention, our ops, the
    graph's output, and gathers of its rows beside those);
  - ``other ops``: read by an op Inductor fuses with the norm (elementwise, a reduction) or one
    the rule does not look into (an autograd function such as torchao's float8 linears, whose
    float8 scaling and cast Inductor fuses into the norm's kernel).

Our kernels run the norm where its input is ``sum`` or ``read by the norm alone`` and its output
``matmuls``; where nothing differentiates the norm (inference), also where its input is
``stored, read elsewhere too``. Inductor runs every other norm, both directions.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Graph, Node

from torch_rmsnorm_op.passes import graph as G

OURS, INDUCTOR, NONE = "ours", "inductor", "none"

INPUTS = ("sum", "read by the norm alone", "stored, read elsewhere too", "fused")
OUTPUTS = ("matmuls", "other ops")


@dataclass(frozen=True)
class Decision:
    """One norm site of a graph: how its neighbours are sorted, and who runs it."""

    norm: Node
    input: str
    output: str
    differentiated: bool
    forward: str  # OURS or INDUCTOR
    backward: str  # OURS, INDUCTOR, or NONE where nothing differentiates the norm

    @property
    def add(self) -> Node | None:
        """The plain add the norm reads, which moves into the norm's op where ours runs it."""
        return G.through_noop_cast(self.norm.args[0]) if self.input == "sum" else None


def decide(input_class: str, output_class: str, differentiated: bool) -> tuple[str, str]:
    """The rule: (forward, backward) for a site of these classes."""
    ours = output_class == "matmuls" and (
        input_class in ("sum", "read by the norm alone")
        or (input_class == "stored, read elsewhere too" and not differentiated))
    if not differentiated:
        return (OURS if ours else INDUCTOR), NONE
    return (OURS, OURS) if ours else (INDUCTOR, INDUCTOR)


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
    external = [r for r in found if G.is_external(r)]
    if external and all(r in external or G.is_gather(r) for r in found):
        return "matmuls"
    return "other ops"


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
        return "fused" if any(_fused_here(t, inductor_norms) for t in x.args) else "sum"
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
