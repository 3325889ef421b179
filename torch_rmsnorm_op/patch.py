"""The module patcher: swap a model's RMSNorms for ``torch.ops.rmsnorm``, in place, and back.

What is swapped: every module that ``recognize.recognize`` proves to compute one of
the RMSNorm semantics that ``rms_norm``'s keyword arguments express (``torch``:
``nn.RMSNorm``, OLMo2; ``llama``: Llama and the transformers classes with its forward;
``gemma``: ``(1 + weight)``; ``t5``: ``T5LayerNorm``; ``centered`` and ``input_scaled``:
MuseSpark's ``1 + weight`` added in the weight's dtype, scaling the normalized row or the
input; each also per group of the row, ``recognize.GroupedSemantics``). Recognition is by
what the module computes, never by its class name alone: each candidate's own forward runs on probe
inputs against each semantics (``recognize`` says how), so a lookalike with other
semantics is skipped with the measured difference, never silently changed. Every
module the patcher examines and leaves alone is in the report with the reason. Gated
norms (``forward(hidden_states, gate)``) are recognized the same way against the gated
forms (``recognize.GatedSemantics``) and swapped for a ``PatchedGatedRMSNorm``.

The replacement is a stand-in that holds no state of its own: it shares the original
module's instance state (its ``__dict__``: parameters, buffers, hooks of every kind, the
training flag, plain attributes), so whatever the user changes through either object
(a new ``weight`` Parameter, ``load_state_dict(..., assign=True)``, ``.to()``,
``to_empty``, ``variance_epsilon``, a hook registered or removed) is the other's too, and
``unpatch_rmsnorm`` puts back the original as the model stands then. Each call reads the
weight and the epsilon where the original's forward reads them; where the state no longer
is what the probe proved (an attribute the forward may read has changed, the weight is
gone or another shape), the call runs the original's own forward. ``state_dict`` keys do
not change; deepcopy, pickling and ``torch.save`` keep the pairing. Only the model passed
in changes; nothing happens at import time. Modules nested in wrappers (PEFT's
``ModulesToSaveWrapper`` holds copies as ordinary submodules) are found like any other
submodule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor, fx, nn
from torch.nn.utils import parametrize

from torch_rmsnorm_op import passes
from torch_rmsnorm_op.contract import RMSNormInputError
from torch_rmsnorm_op.functional import rms_norm
from torch_rmsnorm_op.module import RMSNorm
from torch_rmsnorm_op.recognize import (
    EPS_ATTRIBUTES,
    GatedSemantics,
    GroupedSemantics,
    Semantics,
    public_attributes,
    recognize,
)

_MISSING = object()


@dataclass(frozen=True)
class StandIn:
    """What a patched module reads off the state it shares with the original, per call.

    ``semantics``: what the original computes. ``torch_norm``: the original runs
    ``nn.RMSNorm``'s own forward (``F.rms_norm`` of its ``normalized_shape``, ``weight`` and
    ``eps``, read as they are at each call). Otherwise the epsilon is the number in
    ``eps_attribute`` (and ``also_eps``: the other attributes that held the one the forward
    uses when it was probed, which must still agree), the weight the 1-D ``weight`` over the
    input's last dim (``weighted``) or none, of groups ``group_size`` divides where the
    semantics has groups, and ``watched`` the original's other public attributes as they were
    probed, ``(name, value, plain)``: a plain value (a number, a string, a tuple of them)
    must still be equal and of the same type, any other the same object."""

    semantics: Semantics | GroupedSemantics | GatedSemantics
    torch_norm: bool
    eps_attribute: str = ""
    also_eps: tuple[str, ...] = ()
    weighted: bool = False
    group_size: int | None = None
    watched: tuple[tuple[str, object, bool], ...] = ()

    @classmethod
    def of(cls, original: nn.Module, semantics: Semantics | GroupedSemantics | GatedSemantics,
           eps: float | None) -> StandIn:
        """The stand-in for ``original``, which computes ``semantics`` with epsilon ``eps``."""
        if isinstance(original, nn.RMSNorm) and type(original).forward is nn.RMSNorm.forward:
            return cls(semantics, torch_norm=True)
        names = tuple(name for name in EPS_ATTRIBUTES if _number(getattr(original, name, None))
                      and float(getattr(original, name)) == eps)
        if not names:
            raise ValueError(f"eps: no attribute of {type(original).__name__} ({', '.join(EPS_ATTRIBUTES)}) holds "
                             f"{eps}, the epsilon its forward was found to use")
        watched = tuple((name, value, plain) for name, value, plain in public_attributes(original)
                        if name not in names)
        return cls(semantics, False, names[0], names[1:], getattr(original, "weight", None) is not None,
                   getattr(semantics, "group_size", None), watched)

    def arguments(self, module: nn.Module, x: Tensor) -> tuple | None:
        """``(normalized_shape, weight, eps)`` as ``module``'s state gives them now, for
        ``semantics.rms_norm``; None where that state is not what the probe proved. (A weight
        that does not match x's last dim is the call's to refuse: ``RMSNormInputError``.)"""
        if self.torch_norm:
            return module.normalized_shape, module.weight, module.eps
        for name, value, plain in self.watched:
            now = getattr(module, name, _MISSING)
            if now is not value and not (plain and type(now) is type(value) and now == value):
                return None
        eps = getattr(module, self.eps_attribute, None)
        if type(eps) is not float and not _number(eps):
            return None
        for name in self.also_eps:
            if getattr(module, name, None) != eps:
                return None
        if self.group_size is not None and x.shape[-1] % self.group_size:
            return None
        weight = getattr(module, "weight", None)
        if self.weighted:
            return (weight.shape, weight, eps) if isinstance(weight, Tensor) else None
        return (x.shape[-1:], None, eps) if weight is None else None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _blank(cls: type) -> nn.Module:
    """An unbound stand-in of class ``cls``, which ``__setstate__`` binds (copies, unpickling)."""
    return cls.__new__(cls)


class PatchedRMSNorm(nn.Module):
    """An RMSNorm served by ``torch.ops.rmsnorm``, standing in for ``original``.

    It shares ``original``'s instance state (module docstring): its parameters (``weight``,
    the very Parameter), buffers, hooks, training flag and attributes (``variance_epsilon``,
    ``eps``, ``normalized_shape``, a gated norm's ``group_size``) are the original's, read
    and written through either object. ``semantics`` is what the original computes; each
    call turns it into ``rms_norm``'s keyword arguments for the input's and the weight's
    dtypes, with the weight and epsilon the state holds then (``StandIn``), or runs the
    original's own forward where the state is no longer what was probed. Under
    ``torch.fx.symbolic_trace`` it is one ``call_module`` node (as ``nn.RMSNorm`` is); it
    cannot be scripted by TorchScript (``__prepare_scriptable__`` says what to do)."""

    __slots__ = ("_original", "_stand_in")

    def __init__(self, original: nn.Module, semantics: Semantics | GroupedSemantics | GatedSemantics,
                 eps: float | None) -> None:
        # No nn.Module.__init__: the state is the original's (_bind).
        self._bind(original, StandIn.of(original, semantics, eps))

    def _bind(self, original: nn.Module, stand_in: StandIn) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_stand_in", stand_in)
        object.__setattr__(self, "__dict__", original.__dict__)

    @property
    def original(self) -> nn.Module:
        """The module this one stands in for (``unpatch_rmsnorm`` puts it back)."""
        return self._original

    @property
    def semantics(self) -> Semantics | GroupedSemantics | GatedSemantics:
        """What the original computes (``recognize``)."""
        return self._stand_in.semantics

    @property
    def stand_in(self) -> StandIn:
        """What each call reads off the shared state (``StandIn.arguments(self, x)``: the
        ``(normalized_shape, weight, eps)`` a call on ``x`` takes, or None where it runs the
        original's forward)."""
        return self._stand_in

    def forward(self, x: Tensor) -> Tensor:
        if type(x) is not Tensor and isinstance(x, fx.Proxy):
            return self._traced(x)
        stand_in = self._stand_in
        if stand_in.torch_norm:  # nn.RMSNorm's forward: F.rms_norm's contract, which rms_norm's is
            return rms_norm(x, self.normalized_shape, self.weight, self.eps)
        arguments = stand_in.arguments(self, x)
        if arguments is not None:
            try:
                return stand_in.semantics.rms_norm(x, *arguments)
            except RMSNormInputError:  # refused before anything ran (a weight of another size): the original decides
                pass
        return self._original.forward(x)

    def _traced(self, *args: fx.Proxy | None) -> fx.Proxy:
        """Under ``torch.fx.symbolic_trace``: one ``call_module`` node that calls this module
        (the input's dtype, which the semantics depend on, is known only when it runs); at the
        root of the trace, or outside the traced module, the original's own forward, traced."""
        tracer = args[0].tracer
        try:
            path = tracer.path_of_module(self)
        except NameError:
            path = ""
        if not path:
            return self._original.forward(*args)
        return tracer.create_proxy("call_module", path, args, {})

    def __reduce_ex__(self, protocol: int) -> tuple:
        """copy, deepcopy and pickle rebuild the pair: the original (which holds the state) and
        the stand-in bound to it, made blank first so that a reference back to this module met
        while copying the original resolves to the copy."""
        return _blank, (type(self),), (self._original, self._stand_in)

    def __setstate__(self, state: tuple[nn.Module, StandIn]) -> None:
        self._bind(*state)

    def __prepare_scriptable__(self) -> nn.Module:
        """Raise: ``torch.jit.script`` calls this before compiling, and TorchScript cannot run
        the ops' Python. (Returning the original instead would unpatch the user's model, which
        ``torch.jit.script`` edits in place.)"""
        raise RuntimeError(
            f"torch_rmsnorm_op: TorchScript cannot compile {type(self).__name__}, which stands in for "
            f"{type(self._original).__name__} and runs torch.ops.rmsnorm from Python. Compile the patched model with "
            f"torch.compile or torch.export, or call torch_rmsnorm_op.unpatch_rmsnorm(model) before torch.jit.script")

    def extra_repr(self) -> str:
        stand_in = self._stand_in
        if stand_in.torch_norm:
            shape, eps = tuple(self.normalized_shape), self.eps
        else:
            weight = getattr(self, "weight", None)
            shape = "last dim" if weight is None else tuple(weight.shape)
            eps = getattr(self, stand_in.eps_attribute, None)
        return f"{shape}, eps={eps}, {stand_in.semantics.name}, replaces={type(self._original).__name__}"


class PatchedGatedRMSNorm(PatchedRMSNorm):
    """A gated RMSNorm (``forward(hidden_states, gate)``: Qwen3-Next's, Mamba 2's) whose norm
    ``torch.ops.rmsnorm`` serves, standing in for ``original`` as ``PatchedRMSNorm`` does.
    ``semantics`` (a ``GatedSemantics``) says where the gate multiplies, with which
    activation, and over which groups the norm runs; the gate, its activation and the casts
    around the norm are torch ops, which Inductor fuses with the norm when compiled
    (``passes/rule.py``)."""

    __slots__ = ()

    def forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
        if type(hidden_states) is not Tensor and isinstance(hidden_states, fx.Proxy):
            return self._traced(hidden_states, gate)
        semantics = self._stand_in.semantics
        if gate is None and not semantics.gate_optional:
            raise TypeError(f"gate is required: {type(self._original).__name__}.forward, which this module "
                            f"replaces, does not run without one")
        arguments = self._stand_in.arguments(self, hidden_states)
        if arguments is not None:
            try:
                return semantics.rms_norm(hidden_states, gate, *arguments[1:])
            except RMSNormInputError:  # refused before anything ran: the original decides
                pass
        return self._original.forward(hidden_states, gate)


class Swapped(NamedTuple):
    """A swapped module: its qualified name, its class, the name of the semantics it computes."""

    name: str
    cls: str
    semantics: str


class Skipped(NamedTuple):
    """A module left alone: its qualified name, its class, why."""

    name: str
    cls: str
    reason: str


@dataclass
class PatchReport:
    """What ``patch_rmsnorm`` did: ``swapped`` (``Swapped`` rows) and ``skipped`` (``Skipped``
    rows); ``formulas`` gives what each semantics named in ``swapped`` computes."""

    swapped: list[Swapped] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    formulas: dict[str, str] = field(default_factory=dict)

    def semantics_counts(self) -> dict[str, int]:
        """How many modules were swapped with each semantics."""
        counts: dict[str, int] = {}
        for row in self.swapped:
            counts[row.semantics] = counts.get(row.semantics, 0) + 1
        return counts

    def __str__(self) -> str:
        lines = [f"{len(self.swapped)} RMSNorm module(s) swapped for torch.ops.rmsnorm, {len(self.skipped)} examined "
                 f"and left alone"]
        for name, cls, sem in self.swapped:
            what = self.formulas.get(sem)
            lines.append(f"  swapped {name or '<root>'} ({cls}), which computes {sem!r}"
                         + (f": {what}" if what else ""))
        lines += [f"  left alone {name or '<root>'} ({cls}): {why}" for name, cls, why in self.skipped]
        if self.swapped:
            lines.append("  (x: the input; n = x * rsqrt(mean(x**2) + eps), computed in float32, float64 for float64 "
                         "x; w: the module's weight)")
        return "\n".join(lines)


def formula(semantics: Semantics | GroupedSemantics | GatedSemantics) -> str:
    """What ``semantics`` computes, in words and torch code (``n``: the normalized row)."""
    if isinstance(semantics, GroupedSemantics):
        return f"{semantics.semantics.formula}, per group of {semantics.group_size} features of the row"
    if isinstance(semantics, GatedSemantics):
        text = semantics.form.formula.replace("act(", f"{semantics.activation}(")
        return text if semantics.group_size is None else f"{text}, n per group of {semantics.group_size} features"
    return semantics.formula


def _replacement(module: nn.Module, cache: dict) -> tuple[PatchedRMSNorm | None, str | None]:
    """The replacement for ``module``, or None with the reason it is left alone (None: not
    an RMSNorm at all, not reported)."""
    if isinstance(module, RMSNorm):
        return None, "already a torch_rmsnorm_op.RMSNorm"
    found = recognize(module, cache=cache, keeps_hooks=True)  # the stand-in runs the hooks
    if found is None:
        return None, None
    if found.semantics is None:
        return None, found.reason
    cls = PatchedGatedRMSNorm if isinstance(found.semantics, GatedSemantics) else PatchedRMSNorm
    return cls(module, found.semantics, found.eps), None


def _named_children_recursive(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(qualified name, parent, attribute, child) for every submodule, parents first: every
    attribute that holds it, also where one module sits under two attributes of one parent
    (``named_children`` lists such a module once) or under several parents."""
    for name, child in model.named_modules(remove_duplicate=False):
        if name:
            parent_name, _, attr = name.rpartition(".")
            yield name, model.get_submodule(parent_name), attr, child


def patch_rmsnorm(model: nn.Module) -> PatchReport:
    """Swap, in place, every RMSNorm inside ``model`` (not ``model`` itself) whose semantics the
    probe proves (module docstring) for a ``PatchedRMSNorm``; report every module examined
    and left alone, with the reason. Patching twice changes nothing more. Where a norm is
    swapped, it also installs the library's Inductor passes (``install_inductor_passes``) with
    their defaults, where they are not installed, for graphs compiled afterwards."""
    report = PatchReport()
    cache: dict = {}  # one probe per kind of module (class, attributes, weight dtype), not per module
    if not isinstance(model, PatchedRMSNorm) and _replacement(model, cache)[0] is not None:
        report.skipped.append(Skipped("", type(model).__name__, "the root module cannot be swapped in place: patch "
                                                                "its parent, or use torch_rmsnorm_op.RMSNorm"))
    replaced: dict[int, PatchedRMSNorm] = {}  # a module shared by two parents is swapped once
    for name, parent, attr, child in list(_named_children_recursive(model)):
        if isinstance(child, PatchedRMSNorm):
            report.skipped.append(Skipped(name, type(child.original).__name__, "already patched"))
            continue
        if id(child) in replaced:
            setattr(parent, attr, replaced[id(child)])
            continue
        patched, why = _replacement(child, cache)
        if patched is None:
            if why is not None:
                report.skipped.append(Skipped(name, type(child).__name__, why))
            continue
        setattr(parent, attr, patched)
        replaced[id(child)] = patched
        report.swapped.append(Swapped(name, type(child).__name__, patched.semantics.name))
        report.formulas[patched.semantics.name] = formula(patched.semantics)
    if report.swapped:
        # Compiled with Inductor, the compile rule decides who runs each swapped norm.
        if passes.inductor_passes_installed() is None:
            passes.install_inductor_passes()
    return report


def unpatch_rmsnorm(model: nn.Module) -> int:
    """Put every original module back where ``patch_rmsnorm`` swapped it, at every attribute
    that holds the patched module, as the model stands now (the original shares the patched
    module's state: its current parameters, device, dtype, attributes and hooks); returns how
    many patched modules were undone (a module held in several places counts once, as
    ``PatchReport.swapped`` lists it once). A patched module given a parametrization after the
    patch (``torch.nn.utils.parametrize``, which changes its class) raises ``ValueError``
    naming it, before anything is put back: remove the parametrization first."""
    found = [(name, parent, attr, child) for name, parent, attr, child in _named_children_recursive(model)
             if isinstance(child, PatchedRMSNorm)]
    for name, _, _, child in found:
        if parametrize.is_parametrized(child):
            raise ValueError(f"unpatch_rmsnorm: {name} has a parametrization registered after the patch "
                             f"(torch.nn.utils.parametrize), which the original module's class does not carry: "
                             f"remove it (parametrize.remove_parametrizations) before unpatching")
    for _, parent, attr, child in found:
        setattr(parent, attr, child.original)
    return len({id(child) for *_, child in found})


@contextlib.contextmanager
def patched_rmsnorm(model: nn.Module) -> Iterator[PatchReport]:
    """``with patched_rmsnorm(model) as report:`` patch for the block, then unpatch."""
    report = patch_rmsnorm(model)
    try:
        yield report
    finally:
        unpatch_rmsnorm(model)
