"""What an RMSNorm-like module computes, found by running it.

Every RMSNorm here shares ``rstd = 1/sqrt(mean(x**2) + eps)`` and ``n = x * rstd``
computed in fp32 (fp64 for fp64 inputs); they differ in where they round and what
dtype they return. ``Semantics`` names one such order of roundings and casts and
turns it, per call, into the keyword arguments of ``torch_rmsnorm_op.rms_norm``:

========  ===============================================  ==========================================
name      what the module computes                         in transformers, for example
========  ===============================================  ==========================================
torch     ``(n * w).to(x.dtype)``: one rounding             ``nn.RMSNorm``/``F.rms_norm``; OLMo2,
                                                           OLMo3, Helium, Moshi, Gemma3n, NemotronH
llama     ``w * n.to(x.dtype)``: output ``promote(w, x)``   Llama and the classes copying its forward
                                                           (Qwen2/3, Mistral, ...), Llama4, CpmAnt
gemma     ``(n * (1 + w.float())).type_as(x)``              Gemma, Gemma2, Gemma3, Qwen3.5, Qwen3-Next
t5        ``w * n.to(w.dtype)`` if w is fp16/bf16, else     T5, mT5, LongT5, UMT5, Pix2Struct, Idefics
          ``w * n`` (in fp32)
centered  ``(n * (1 + w).float()).type_as(x)``: the         MuseSpark's text layers
          offset added in the weight's dtype
input_    ``norm((x.float() * (1 + w).float()).type_as(x))``  MuseSpark's post-feedforward and
scaled    the weight scales x before a weightless norm       experts' output norms
========  ===============================================  ==========================================

The rule (``recognize``): a module is *examined* when it is an ``nn.RMSNorm`` or when
its class, or a base class defined outside torch, is named like a norm: "rmsnorm" in
the name in any case, or a name ending in "Norm" (``T5LayerNorm``, ``Llama4TextL2Norm``).
An examined module is *RMSNorm-like* when it has no submodules, no buffers, no
parameter but ``weight`` (a 1-D Parameter; ``normalized_shape`` for ``nn.RMSNorm``) or
none, a number in ``variance_epsilon``, ``eps`` or ``epsilon``, a ``forward`` that takes
the input alone (or, with a weight, the input and a gate: below), no forward of its own
on the instance, and no forward or backward hooks unless the caller keeps them (the
patcher does). The *probe* then decides what it computes: its own ``forward`` (never its
hooks) runs on a deepcopy holding a random weight (so
neither Llama's init of ones nor Gemma's of zeros hides a difference), in train and
eval mode, on inputs of fp32 and bf16 (and the weight's own dtype) with weights of
each of those dtypes, including a row whose mean square equals the epsilon; each
semantics (with each epsilon attribute's value) is computed on the same inputs by the
PyTorch reference, and the first one that agrees on every probe is chosen. Agreement
means the same shape and dtype, no element further apart than one unit in the last
place of the output dtype, and at most 2% of the elements apart at all beyond fp32
rounding noise (a semantics that rounds once more than the module moves about a
quarter of the bf16 elements by one unit). Finally the chosen semantics runs through
``torch_rmsnorm_op.rms_norm`` itself on the probe of the weight's dtype, as it will
once swapped, and must agree within one unit everywhere. A module that
fails any of this is left alone with the reason.

A gated norm, whose forward takes the input and a gate (Qwen3-Next's, Mamba 2's), is
examined alike against ``GatedSemantics``: a form from ``GATED_FORMS`` (the gate before
or after the norm, Llama's rounding or fp32), the gate's activation and the groups the
norm runs over, its forward run on (x, gate) pairs.

A module with a weight whose ``group_size`` or ``n_groups`` attribute names groups of the
row (Qwen4Exp's hyper-connection norms) is also probed against each semantics applied per
group (``GroupedSemantics``: the kernels normalize the groups, torch applies the weight).
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from torch_rmsnorm_op import reference
from torch_rmsnorm_op.fallback import probing
from torch_rmsnorm_op.functional import rms_norm

_HALF = (torch.float16, torch.bfloat16)
EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")


@dataclass(frozen=True)
class Semantics:
    """One RMSNorm's roundings and casts. ``norm_rounding``: where ``n`` is rounded before
    the weight multiplies it (``"none"``; ``"input"``: to x's dtype; ``"half_weight"``: to the
    weight's dtype when that is fp16/bf16). ``output``: the result's dtype (``"input"``: x's;
    ``"promote"``: ``promote_types(weight, x)``; ``"half_weight"``: the weight's when fp16/bf16,
    else ``promote_types(weight, x, float32)``). The weight enters as ``weight + weight_offset``,
    added in fp32 (by the kernels), or, with ``offset_in_weight_dtype``, in the weight's own
    dtype (by torch, before the call: a bf16 weight's sum is rounded to bf16 as the module
    rounds it); the offset is an int (the families' offsets are), which ``torch.compile``
    keeps as a constant where it would make a float an input of the graph. With
    ``scale_first``, that weight scales x instead (in the computation dtype, rounded to x's
    dtype, by torch) and the kernels normalize the product without a weight."""

    name: str
    formula: str
    weight_offset: int = 0
    norm_rounding: Literal["none", "input", "half_weight"] = "none"
    output: Literal["input", "promote", "half_weight"] = "input"
    offset_in_weight_dtype: bool = False
    scale_first: bool = False

    def offset_weight(self, weight: Tensor | None) -> Tensor | None:
        """The weight the kernels take: ``weight + weight_offset`` in the weight's dtype where
        the offset is added there, else the weight itself (``kwargs`` then gives the offset)."""
        if weight is None or not self.offset_in_weight_dtype or not self.weight_offset:
            return weight
        return weight + self.weight_offset

    def scale_input(self, x: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``(x, weight)`` as the norm takes them: where the weight scales the input first, the
        scaled input and no weight."""
        if weight is None or not self.scale_first:
            return x, weight
        ctype = reference.computation_dtype(x.dtype)
        return (x.to(ctype) * self.offset_weight(weight).to(ctype)).to(x.dtype), None

    def kwargs(self, x_dtype: torch.dtype, weight_dtype: torch.dtype | None
               ) -> tuple[int, torch.dtype | None, torch.dtype | None]:
        """``(weight_offset, norm_dtype, out_dtype)`` for ``rms_norm`` on x of ``x_dtype``; None
        where the argument's default already means it (a rounding to the computation dtype is
        no rounding), so the common cases keep the default kernel path. The offset is 0 where
        ``offset_weight`` adds it."""
        compute = torch.float64 if x_dtype == torch.float64 else torch.float32
        half_weight = weight_dtype in _HALF
        norm_dtype = None
        if self.norm_rounding == "input":
            norm_dtype = x_dtype
        elif self.norm_rounding == "half_weight" and half_weight:
            norm_dtype = weight_dtype
        if norm_dtype == compute:
            norm_dtype = None
        out_dtype = x_dtype
        if weight_dtype is not None:
            if self.output == "promote":
                out_dtype = torch.promote_types(weight_dtype, x_dtype)
            elif self.output == "half_weight":
                out_dtype = weight_dtype if half_weight else torch.promote_types(
                    weight_dtype, torch.promote_types(x_dtype, torch.float32))
        offset = 0 if self.offset_in_weight_dtype else self.weight_offset
        return offset, norm_dtype, (None if out_dtype == x_dtype else out_dtype)

    def rms_norm(self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
                 eps: float | None) -> Tensor:
        """This semantics computed by ``torch_rmsnorm_op.rms_norm`` (the kernels)."""
        x, weight = self.scale_input(x, weight)
        offset, norm_dtype, out_dtype = self.kwargs(x.dtype, None if weight is None else weight.dtype)
        return rms_norm(x, normalized_shape, self.offset_weight(weight), eps, weight_offset=offset,
                        norm_dtype=norm_dtype, out_dtype=out_dtype)

    def reference(self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
                  eps: float | None) -> Tensor:
        """This semantics computed by the PyTorch reference (``reference.rms_norm_forward``)."""
        x, weight = self.scale_input(x, weight)
        offset, norm_dtype, out_dtype = self.kwargs(x.dtype, None if weight is None else weight.dtype)
        n = math.prod(normalized_shape)
        rows = x.reshape(*x.shape[: x.dim() - len(normalized_shape)], n)
        w = None if weight is None else self.offset_weight(weight).reshape(n)
        eps = reference.default_eps(x.dtype) if eps is None else eps
        y, _ = reference.rms_norm_forward(rows, w, eps, offset, norm_dtype, out_dtype)
        return y.view(x.shape)


TORCH = Semantics("torch", "(n * w).to(x.dtype): normalize and scale in fp32, round once")
LLAMA = Semantics("llama", "w * n.to(x.dtype): round, then scale; output in promote(w, x)",
                  norm_rounding="input", output="promote")
GEMMA = Semantics("gemma", "(n * (1 + w.float())).type_as(x): offset weight in fp32, round once",
                  weight_offset=1)
T5 = Semantics("t5", "w * n.to(w.dtype) for a fp16/bf16 weight, else w * n in fp32",
               norm_rounding="half_weight", output="half_weight")
CENTERED = Semantics("centered", "(n * (1 + w).float()).type_as(x): offset weight in w's dtype, round once",
                    weight_offset=1, offset_in_weight_dtype=True)
INPUT_SCALED = Semantics("input_scaled", "norm((x.float() * (1 + w).float()).type_as(x)): x scaled by the "
                         "centered weight and rounded, then normalized without a weight", weight_offset=1,
                         offset_in_weight_dtype=True, scale_first=True)
# In order of preference: where several agree on every probe (a module without weight, or
# fp32 throughout) the plainest is chosen.
SEMANTICS: tuple[Semantics, ...] = (TORCH, LLAMA, GEMMA, T5, CENTERED, INPUT_SCALED)
SEMANTICS_BY_NAME: dict[str, Semantics] = {s.name: s for s in SEMANTICS}


@dataclass(frozen=True)
class GroupedSemantics:
    """A norm over groups of ``group_size`` elements of the last dim (Qwen4Exp's norms of its
    hyper-connection streams, one group per stream), each group scaled by its part of the
    weight as ``semantics`` scales a row. The kernels normalize the groups as rows, without a
    weight, rounded where ``semantics`` rounds the normalized row (else in the computation
    dtype); the weight, its offset and the output's cast are torch ops."""

    semantics: Semantics
    group_size: int

    @property
    def name(self) -> str:
        return f"{self.semantics.name}, groups of {self.group_size}"

    def compute(self, x: Tensor, weight: Tensor | None, eps: float | None, norm: Callable[..., Tensor]) -> Tensor:
        """The grouped norm with ``norm`` (``rms_norm``'s signature and keywords) normalizing
        the groups."""
        x, weight = self.semantics.scale_input(x, weight)
        w = self.semantics.offset_weight(weight)
        offset, norm_dtype, out_dtype = self.semantics.kwargs(x.dtype, None if w is None else w.dtype)
        groups = x.unflatten(-1, (x.shape[-1] // self.group_size, self.group_size))
        if w is None:  # the semantics' own roundings, with no weight to apply
            return norm(groups, (self.group_size,), None, eps, norm_dtype=norm_dtype, out_dtype=out_dtype).flatten(-2)
        ctype = reference.computation_dtype(x.dtype)
        n_dtype = norm_dtype or ctype  # the normalized row as the semantics rounds it before the weight
        n = norm(groups, (self.group_size,), None, eps, out_dtype=None if n_dtype == x.dtype else n_dtype).flatten(-2)
        return (n.to(ctype) * (w.to(ctype) + offset)).to(out_dtype or x.dtype)

    def rms_norm(self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
                 eps: float | None) -> Tensor:
        """This grouped norm with the groups normalized by ``torch_rmsnorm_op.rms_norm``."""
        return self.compute(x, weight, eps, rms_norm)

    def reference(self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None,
                  eps: float | None) -> Tensor:
        """This grouped norm with the groups normalized by the PyTorch reference."""
        return self.compute(x, weight, eps, _reference_norm)


# --- gated norms ------------------------------------------------------------------------------

GATE_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class GatedForm:
    """Where a gated RMSNorm's gate ``act(gate)`` (computed in fp32) multiplies, and how its norm
    rounds. ``gate_first``: the gate multiplies x (cast to fp32) and the product is normalized
    (Mamba 2's order), else it multiplies the norm's output. ``norm``: ``LLAMA`` (the normalized
    row rounded to x's dtype before the weight) or ``TORCH`` (scaled by the weight in fp32).
    ``cast_back``: the result is cast to x's dtype."""

    name: str
    formula: str
    gate_first: bool
    norm: Semantics
    cast_back: bool


GATED_FORMS: tuple[GatedForm, ...] = (
    GatedForm("llama*{act}(gate)", "(w * n.to(x.dtype) * act(gate.float())).to(x.dtype)", False, LLAMA, True),
    GatedForm("torch*{act}(gate)", "(w.float() * n * act(gate.float())).to(x.dtype)", False, TORCH, True),
    GatedForm("llama(x*{act}(gate))", "w * norm(x.float() * act(gate.float())).to(x.dtype)", True, LLAMA, False),
    GatedForm("torch(x*{act}(gate))", "(w * norm(x.float() * act(gate.float()))).to(x.dtype)", True, TORCH, True),
)


@dataclass(frozen=True)
class GatedSemantics:
    """A gated RMSNorm (``forward(hidden_states, gate)``): its ``form``, the gate's
    ``activation`` (a key of ``GATE_ACTIVATIONS``), and ``group_size`` where the norm normalizes
    groups of that many elements of the last dim (Mamba 2's ``n_groups``; None: the whole
    row). ``gate_optional``: the module's forward takes ``gate=None`` (then no gate multiplies)."""

    form: GatedForm
    activation: str
    group_size: int | None = None
    gate_optional: bool = False

    @property
    def name(self) -> str:
        name = self.form.name.format(act=self.activation)
        return name if self.group_size is None else f"{name}, groups of {self.group_size}"

    def compute(self, x: Tensor, gate: Tensor | None, weight: Tensor | None, eps: float | None,
                norm: Callable[..., Tensor]) -> Tensor:
        """The gated norm with ``norm`` (``rms_norm``'s signature and keywords) computing the
        norm's part; the gate, the groups' weight and the casts in torch ops."""
        # The ops run in the order transformers' modules write them (the gate's activation where
        # it multiplies), so that a compiled graph holds what the module's graph holds.
        x_dtype = x.dtype
        ctype = reference.computation_dtype(x_dtype)
        activation = GATE_ACTIVATIONS[self.activation]
        h = x.to(ctype) * activation(gate.to(ctype)) if gate is not None and self.form.gate_first else x
        grouped = self.group_size is not None and self.group_size != h.shape[-1]
        w = None if grouped else weight
        if self.form.norm.name == LLAMA.name:  # rounded to x's dtype, then scaled: output promote(w, x)
            norm_dtype = None if x_dtype == ctype or w is None else x_dtype
            out_dtype = x_dtype if w is None else torch.promote_types(w.dtype, x_dtype)
        else:  # scaled in fp32, rounded at the end
            norm_dtype, out_dtype = None, ctype if w is None else torch.promote_types(w.dtype, ctype)
        if grouped:
            rows = h.unflatten(-1, (h.shape[-1] // self.group_size, self.group_size))
            y = norm(rows, (self.group_size,), None, eps, norm_dtype=norm_dtype,
                     out_dtype=None if out_dtype == h.dtype else out_dtype).flatten(-2)
            y = y if weight is None else weight * y
        else:
            y = norm(h, (h.shape[-1],), w, eps, norm_dtype=norm_dtype,
                     out_dtype=None if out_dtype == h.dtype else out_dtype)
        if gate is not None and not self.form.gate_first:
            y = y * activation(gate.to(ctype))
        return y.to(x_dtype) if self.form.cast_back else y

    def rms_norm(self, x: Tensor, gate: Tensor | None, weight: Tensor | None, eps: float | None) -> Tensor:
        """This gated norm with its norm computed by ``torch_rmsnorm_op.rms_norm`` (the kernels)."""
        return self.compute(x, gate, weight, eps, rms_norm)

    def reference(self, x: Tensor, gate: Tensor | None, weight: Tensor | None, eps: float | None) -> Tensor:
        """This gated norm with its norm computed by the PyTorch reference."""
        return self.compute(x, gate, weight, eps, _reference_norm)


def _reference_norm(x: Tensor, shape: Sequence[int], weight: Tensor | None, eps: float | None, *,
                    norm_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    eps = reference.default_eps(x.dtype) if eps is None else eps
    return reference.rms_norm_forward(x, weight, eps, 0.0, norm_dtype, out_dtype)[0]


@dataclass(frozen=True)
class Recognition:
    """What ``recognize`` found: the semantics with the epsilon and shape the module uses, or
    ``semantics`` None and the ``reason`` it is left alone. ``normalized_shape`` None: the
    module (one without weight) normalizes the last dim of whatever input it gets."""

    semantics: Semantics | GroupedSemantics | GatedSemantics | None
    normalized_shape: tuple[int, ...] | None = None
    eps: float | None = None
    weight: nn.Parameter | None = None
    reason: str | None = None


def _named_like_a_norm(module: nn.Module) -> tuple[bool, bool]:
    """(examined, named RMSNorm) from the names of the module's class and its non-torch bases."""
    examined = named_rms = False
    for cls in type(module).__mro__:
        if cls is nn.Module or cls.__module__.split(".")[0] == "torch":
            continue
        name = cls.__name__.lower()
        named_rms = named_rms or "rmsnorm" in name
        examined = examined or named_rms or name.endswith("norm")
    return examined, named_rms


def _structure(module: nn.Module, torch_norm: bool, gated: bool = True, keeps_hooks: bool = False
               ) -> tuple[tuple[int, ...] | None, list[float | None], str | None]:
    """``(normalized_shape, epsilon candidates, None)`` for an RMSNorm-like module, else
    ``(None, [], why not)``. ``normalized_shape`` is ``(32,)`` for a module without weight:
    such a module normalizes whatever last dim it gets. ``gated``: a forward taking the input
    and a gate (``_gate_parameter``) is RMSNorm-like too, where the module has a weight.
    ``keeps_hooks``: the caller keeps the module's hooks (else a module with forward or
    backward hooks is not RMSNorm-like: a swap would drop them)."""
    children = [name for name, _ in module.named_children()]
    if children:
        return None, [], f"has submodules ({', '.join(children)})"
    others = [name for name, _ in module.named_parameters(recurse=False) if name != "weight"]
    if others:
        return None, [], f"has parameters other than weight ({', '.join(others)})"
    buffers = [name for name, _ in module.named_buffers(recurse=False)]
    if buffers:
        return None, [], f"has buffers ({', '.join(buffers)})"
    weight = getattr(module, "weight", None)
    if weight is not None and not isinstance(weight, nn.Parameter):
        return None, [], f"its weight is a {type(weight).__name__}, not a Parameter"
    if torch_norm:
        shape = tuple(module.normalized_shape)
        if weight is not None and tuple(weight.shape) != shape:
            return None, [], f"weight of shape {tuple(weight.shape)} for normalized_shape {shape}"
        eps_values = [module.eps]
    else:
        if weight is not None and weight.dim() != 1:
            return None, [], f"weight is not 1-D (shape {tuple(weight.shape)})"
        shape = (weight.shape[0],) if weight is not None else (32,)
        eps_values = []
        for attr in EPS_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) not in eps_values:
                eps_values.append(float(value))
        if not eps_values:
            return None, [], f"no epsilon attribute ({', '.join(EPS_ATTRIBUTES)}) holding a number"
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    gate = gated and not torch_norm and weight is not None and _gate_parameter(module) is not None
    if not gate and (len(params) != 1 or params[0].kind not in positional):
        names = ", ".join(p.name for p in params)
        return None, [], f"its forward takes ({names}), not the input alone"
    if "forward" in vars(module):
        return None, [], ("its forward is replaced on the instance (a hook of another library): that forward runs, "
                          "not the class's that a probe could test")
    hooks = [] if keeps_hooks else [name for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                                                       "_backward_hooks") if getattr(module, name, None)]
    if hooks:
        return None, [], f"has hooks ({', '.join(h.strip('_') for h in hooks)}): a swap would drop them"
    return shape, eps_values, None


def _gate_parameter(module: nn.Module) -> inspect.Parameter | None:
    """The gate of a forward that takes ``(input, gate)`` or ``(input, gate=None)``, both
    positional, else None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != 2 or any(p.kind not in positional for p in params) or params[0].default is not params[0].empty:
        return None
    if params[1].default not in (params[1].empty, None):
        return None
    return params[1]


def _probe_dtypes(weight: Tensor | None) -> tuple[torch.dtype, ...]:
    dtypes = [torch.float32, torch.bfloat16]
    if weight is not None and weight.dtype.is_floating_point and weight.dtype not in dtypes:
        dtypes.append(weight.dtype)
    return tuple(dtypes)


def _probe_input(shape: tuple[int, ...], eps_values: list[float | None], device: torch.device) -> Tensor:
    """2 x R rows of ``shape`` (R: 512 elements' worth, between 2 and 8): random, one scaled up,
    one whose mean square is the largest epsilon (there the epsilon moves rstd by a factor
    sqrt(2): a misread one shows)."""
    gen = torch.Generator().manual_seed(0)
    rows = min(8, max(2, -(-512 // max(1, math.prod(shape)))))
    x = torch.randn((2, rows, *shape), generator=gen, dtype=torch.float64)
    eps = max((e for e in eps_values if e), default=0.0)
    x[0, 0] *= math.sqrt(eps) if eps > 0 else 1e-3
    x[1, 0] *= 100.0
    return x.to(device)


# Elementwise noise allowed (relative): fp32 rounding noise where the module and the reference
# run the same torch ops; more where the kernels (another reduction order) are compared.
_REFERENCE_NOISE = 16 * torch.finfo(torch.float32).eps
_KERNEL_NOISE = 1e-4
# Share of the elements that may be apart by more than the noise, for the reference: a
# semantics that rounds once more or less than the module moves about a quarter of the bf16
# elements by one unit. The kernels are held to one unit everywhere, not to a share: they sum
# a row in another order than torch, so any element near a rounding boundary may land one unit
# away, and how many do depends on the configuration.
_REFERENCE_APART = 0.02
_KERNEL_APART = 1.0


def _disagreement(want: Tensor, got: Tensor, noise: float = _REFERENCE_NOISE,
                  apart_limit: float = _REFERENCE_APART) -> tuple[float, str | None]:
    """``(size of the error, None)`` when ``got`` agrees with ``want``: same shape and dtype, no
    element further apart than one unit in the last place of the output dtype (plus ``noise``)
    and at most ``apart_limit`` of the elements apart by more than ``noise``. Else ``(size,
    how they differ)``; the size (in units) ranks near misses."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return math.inf, (f"output {tuple(got.shape)} {_name(got.dtype)}, the module's "
                          f"{tuple(want.shape)} {_name(want.dtype)}")
    if want.numel() == 0:
        return 0.0, None
    a, b = want.double(), got.double()
    err = torch.where(a.isnan() & b.isnan(), 0.0, (a - b).abs()).nan_to_num(math.inf)
    floor = noise * a.abs() + 1e-7
    ulp = torch.finfo(want.dtype).eps * a.abs() + floor  # at least one unit in the last place
    apart = (err > floor).double().mean().item()
    worst = (err / ulp).max().item()
    if worst <= 1.0 and apart <= apart_limit:
        return worst, None
    return worst, (f"largest difference {err.max().item():.3g}, {worst:.3g} times the spacing of {_name(want.dtype)} "
                   f"values there (units in the last place); {apart:.0%} of the elements differ by more than "
                   f"rounding noise")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _clone_with_weight(module: nn.Module, weight: nn.Parameter | None, value: Tensor | None) -> nn.Module:
    """A deepcopy of ``module`` whose weight is ``value`` (the original weight is not copied)."""
    memo = {} if weight is None else {id(weight): nn.Parameter(value, requires_grad=weight.requires_grad)}
    return copy.deepcopy(module, memo)


def _run(module: nn.Module, *inputs: Tensor | None) -> Tensor:
    """The module's own forward on ``inputs``: not its ``__call__``, so that no hook of the
    module's (copied with it) or global module hook sees the probe."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. F.rms_norm's "Mismatch dtype between input and weight"
        return module.forward(*inputs)


_SIMPLE = (bool, int, float, str, type(None), torch.dtype)


def public_attributes(module: nn.Module) -> list[tuple[str, object, bool]]:
    """The instance's own attributes but the private ones and ``training``, each with whether it
    is plain: a number, string, bool, None or dtype, or a tuple of them (state a forward may
    read, which a key can hold and a copy can take)."""
    return [(name, value, is_plain(value))
            for name, value in vars(module).items() if not name.startswith("_") and name != "training"]


def is_plain(value: object) -> bool:
    """Whether ``value`` is a number, string, bool, None or dtype, or a tuple of them."""
    return isinstance(value, _SIMPLE) or (isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value))


def _probe_key(module: nn.Module, shape: tuple[int, ...], weight: Tensor | None) -> tuple | None:
    """What the probe's result depends on: the class, the mode, the weight's shape, dtype and
    device, and the instance's plain attributes; None (do not share) if any attribute is
    something else (a tensor, a callable, an object), which the forward might read."""
    attributes = public_attributes(module)
    if not all(plain for _, _, plain in attributes):
        return None
    w = None if weight is None else (weight.dtype, weight.device, weight.requires_grad)
    return type(module), module.training, shape, w, tuple((name, value) for name, value, _ in attributes)


def recognize(module: nn.Module, *, by_name: bool = True, cache: dict | None = None,
              gated: bool = True, keeps_hooks: bool = False) -> Recognition | None:
    """What ``module`` computes (module docstring): None when it is not examined (not named
    like a norm, or named like another norm and not RMSNorm-like); else a ``Recognition``
    with the semantics (a ``GatedSemantics`` for a gated norm), or with the reason it is left
    alone. ``by_name=False`` examines the module whatever its name (its class declares itself
    an RMSNorm some other way); ``gated=False`` leaves gated norms alone. ``cache`` (a dict
    the caller keeps, e.g. for one model) shares a probe's result among modules that only the
    weight's values tell apart. ``keeps_hooks``: the caller keeps the module's hooks (the
    patcher's replacement runs them), so hooks do not leave it alone; the probe never runs
    them. ``module`` itself is not run and not changed."""
    torch_norm = isinstance(module, nn.RMSNorm)
    examined, named_rms = _named_like_a_norm(module) if by_name else (True, True)
    if not (torch_norm or examined):
        return None
    shape, eps_values, why = _structure(module, torch_norm, gated, keeps_hooks)
    if why is not None:
        if not (torch_norm or named_rms):
            return None
        prefix = "named like an RMSNorm but " if by_name else ""
        return Recognition(None, reason=f"{prefix}not RMSNorm-like: {why}")
    weight = getattr(module, "weight", None)
    device = weight.device if weight is not None else torch.device("cpu")
    if device.type == "meta":
        return Recognition(None, reason="parameters on the meta device: nothing to probe")
    key = None if cache is None else _probe_key(module, shape, weight)
    found = cache.get(key) if key is not None else None
    if found is None:
        gate = None if torch_norm or not gated else _gate_parameter(module)
        if gate is None:
            found = _probe(module, shape, eps_values, weight, device)
        else:
            found = _probe_gated(module, shape, eps_values, weight, device, gate.default is None)
        if key is not None:
            cache[key] = found
    if found.semantics is None:
        return found
    last_dim_only = weight is None and not torch_norm
    return Recognition(found.semantics, None if last_dim_only else shape, found.eps, weight)


# One probe: the forward's inputs (x, or x and the gate), the weight it held, and its output.
_Probe = tuple[tuple[Tensor | None, ...], Tensor | None, Tensor]


def _run_probes(module: nn.Module, weight: nn.Parameter | None, w64: Tensor | None, dtypes: tuple[torch.dtype, ...],
                inputs: Callable[[torch.dtype], list[tuple[Tensor | None, ...]]]) -> list[_Probe] | Recognition:
    """The module's own forward on ``inputs(x_dtype)`` (argument tuples) for each x dtype and
    weight dtype of ``dtypes``, on a copy holding ``w64`` in that dtype. Pairs of mixed dtypes
    that the forward refuses are not probed, but the module must run its weight's dtype; it
    must not depend on train or eval mode. A ``Recognition`` with the reason where it fails."""
    probes: list[_Probe] = []
    for w_dtype in (dtypes if weight is not None else (None,)):
        w = None if w64 is None else w64.to(w_dtype)
        try:
            clone = _clone_with_weight(module, weight, w)
        except Exception as e:  # state deepcopy cannot copy (a hook holding a lock, say)
            return Recognition(None, reason=f"it cannot be copied for the probe: {type(e).__name__}: {e}")
        for x_dtype in dtypes:
            for args in inputs(x_dtype):
                try:
                    want = _run(clone, *args)
                except Exception as e:  # a forward that cannot run this pair
                    if w_dtype is None or x_dtype == w_dtype:
                        return Recognition(None, reason=f"its forward failed on the probe: {type(e).__name__}: {e}")
                    continue
                if not isinstance(want, Tensor):
                    return Recognition(None, reason=f"its forward returns a {type(want).__name__}, not a tensor")
                if not probes:  # once more in the other mode: the forward must not depend on it
                    clone.train(not module.training)
                    again = _run(clone, *args)
                    clone.train(module.training)
                    if not (isinstance(again, Tensor) and again.shape == want.shape and torch.equal(again, want)):
                        return Recognition(None, reason="its forward differs between train and eval mode")
                probes.append((args, None if weight is None else clone.weight, want))
    return probes


def _where(args: tuple[Tensor | None, ...], w: Tensor | None) -> str:
    where = f"x {_name(args[0].dtype)}" + ("" if w is None else f", weight {_name(w.dtype)}")
    return where + (", no gate" if len(args) > 1 and args[1] is None else "")


def _choose(probes: list[_Probe], candidates: list[tuple[float | None, Semantics | GroupedSemantics | GatedSemantics]],
            reference: Callable[..., Tensor], weight: nn.Parameter | None, kernels: Callable[..., Tensor],
            shape: tuple[int, ...]) -> Recognition | str:
    """The first ``(eps, semantics)`` of ``candidates`` whose ``reference(semantics, args, w,
    eps)`` agrees with the module on every probe, then run through the kernels
    (``kernels(semantics, args, w, eps)``) on the probe of the weight's own dtype (the one a
    model runs; one kernel variant to build), as the swapped module will. None agreeing: the
    closest one's ``(name, how it differs)`` as a string."""
    best: tuple[float, str] | None = None
    for eps, semantics in candidates:
        for args, w, want in probes:
            size, failure = _disagreement(want, reference(semantics, args, w, eps))
            if failure is not None:
                if best is None or size < best[0]:
                    best = (size, f"{semantics.name}: {failure}, with {_where(args, w)}")
                break
        else:
            own = weight.dtype if weight is not None else torch.float32
            args, w, want = next((p for p in probes if p[0][0].dtype == own and (p[1] is None or p[1].dtype == own)
                                  and all(a is not None for a in p[0])), probes[0])
            try:
                with torch.no_grad(), probing():
                    got = kernels(semantics, args, w, eps)
            except Exception as e:
                return Recognition(None, reason=f"rms_norm failed on the probe: {type(e).__name__}: {e}")
            _, failure = _disagreement(want, got, _KERNEL_NOISE, _KERNEL_APART)
            if failure is not None:
                return Recognition(None, reason=f"computes {semantics.name}, but rms_norm disagrees on the probe: "
                                                f"{failure}")
            return Recognition(semantics, shape, eps, weight)
    assert best is not None
    return best[1]


def _probe(module: nn.Module, shape: tuple[int, ...], eps_values: list[float | None], weight: nn.Parameter | None,
           device: torch.device) -> Recognition:
    dtypes = _probe_dtypes(weight)
    x64 = _probe_input(shape, eps_values, device)
    gen = torch.Generator().manual_seed(1)
    w64 = None if weight is None else torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
    probes = _run_probes(module, weight, w64, dtypes, lambda x_dtype: [(x64.to(x_dtype),)])
    if isinstance(probes, Recognition):
        return probes
    candidates = [(eps, semantics) for eps in eps_values for semantics in SEMANTICS]
    if weight is not None:  # a weight of the row: it may scale groups the module normalizes apart
        candidates += [(eps, GroupedSemantics(semantics, size)) for eps in eps_values
                       for size in _group_sizes(module, shape[0])[1:] for semantics in SEMANTICS]
    found = _choose(probes, candidates,
                    lambda semantics, args, w, eps: semantics.reference(args[0], shape, w, eps), weight,
                    lambda semantics, args, w, eps: semantics.rms_norm(args[0], shape, w, eps), shape)
    if isinstance(found, Recognition):
        return found
    names = ", ".join(s.name for s in SEMANTICS)
    return Recognition(None, reason=f"computes none of {names} (the RMSNorm variants rms_norm computes, "
                                    f"recognize.SEMANTICS; closest: {found})")


def _group_sizes(module: nn.Module, n: int) -> list[int | None]:
    """The whole row (None), then the group sizes the module's attributes name: ``group_size``,
    or ``n // n_groups`` (Mamba 2's and Falcon-H1's gated norms normalize groups of the last
    dim). The probe decides which one the module computes."""
    sizes: list[int | None] = [None]
    group_size, n_groups = getattr(module, "group_size", None), getattr(module, "n_groups", None)
    for size in (group_size, n // n_groups if isinstance(n_groups, int) and n_groups > 0 else None):
        if isinstance(size, int) and not isinstance(size, bool) and 0 < size < n and not n % size and size not in sizes:
            sizes.append(size)
    return sizes


def _probe_gated(module: nn.Module, shape: tuple[int, ...], eps_values: list[float | None], weight: nn.Parameter,
                 device: torch.device, gate_optional: bool) -> Recognition:
    """``_probe`` for a gated norm: the module's forward runs on (x, gate) (and on (x, None)
    where it takes ``gate=None`` and runs without one), the gate of x's dtype, and every
    ``GatedSemantics`` (form, activation, group size) is computed on the same inputs by the
    PyTorch reference; the first that agrees on every probe, then verified through the kernels,
    is chosen."""
    dtypes = _probe_dtypes(weight)
    x64 = _probe_input(shape, eps_values, device)
    gate64 = (3.0 * torch.randn(x64.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)).to(device)
    w64 = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    if gate_optional:  # gate=None in the signature only (the forward reads the gate): the replacement refuses None
        try:
            _run(_clone_with_weight(module, weight, w64.to(weight.dtype)), x64.to(weight.dtype), None)
        except Exception:
            gate_optional = False
    probes = _run_probes(module, weight, w64, dtypes, lambda x_dtype: [
        (x64.to(x_dtype), gate) for gate in ((gate64.to(x_dtype), None) if gate_optional else (gate64.to(x_dtype),))])
    if isinstance(probes, Recognition):
        return probes
    candidates = [(eps, GatedSemantics(form, act, size, gate_optional)) for eps in eps_values for form in GATED_FORMS
                  for act in GATE_ACTIVATIONS for size in _group_sizes(module, shape[0])]
    found = _choose(probes, candidates, lambda semantics, args, w, eps: semantics.reference(*args, w, eps), weight,
                    lambda semantics, args, w, eps: semantics.rms_norm(*args, w, eps), shape)
    if isinstance(found, Recognition):
        return found
    names = ", ".join(form.name.format(act="act") for form in GATED_FORMS)
    return Recognition(None, reason=f"a gated norm that computes none of {names} (the gated variants rms_norm "
                                    f"computes, recognize.GATED_FORMS; act: {'/'.join(GATE_ACTIVATIONS)}; "
                                    f"closest: {found})")
