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

The replacement keeps the very same ``Parameter`` object (optimizers and
checkpoints stay valid; ``state_dict`` keys do not change) and remembers the
original module, which ``unpatch_rmsnorm`` puts back. Only the model passed
in changes; nothing happens at import time. Modules nested in wrappers (PEFT's
``ModulesToSaveWrapper`` holds copies as ordinary submodules) are found like
any other submodule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor, nn

from torch_rmsnorm_op import passes
from torch_rmsnorm_op.module import RMSNorm
from torch_rmsnorm_op.recognize import GatedSemantics, Semantics, public_attributes, recognize


class PatchedRMSNorm(nn.Module):
    """An RMSNorm served by ``torch.ops.rmsnorm``, standing in for ``original``.

    ``weight`` is the original's own Parameter (or None). ``semantics`` is what the original
    computes; each call turns it into ``rms_norm``'s keyword arguments for the input's and
    the weight's dtypes. ``normalized_shape`` None normalizes the input's last dim. The
    original's other plain attributes (``recognize.public_attributes``: ``variance_epsilon``,
    ``elementwise_affine``, a gated norm's ``group_size``) are copied onto it.
    """

    def __init__(self, original: nn.Module, normalized_shape: tuple[int, ...] | None, eps: float | None,
                 weight: nn.Parameter | None, semantics: Semantics | GatedSemantics) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.weight = weight
        self.semantics = semantics
        object.__setattr__(self, "_original", original)  # not a submodule: no duplicate state_dict keys
        # The original's other plain attributes, for code that reads them off the module it holds
        # (Mamba 2's fused CUDA path passes norm.variance_epsilon and norm.weight to its kernel).
        for name, value, plain in public_attributes(original):
            if plain and not hasattr(self, name):
                setattr(self, name, value)

    @property
    def original(self) -> nn.Module:
        return self._original

    def forward(self, x: Tensor) -> Tensor:
        shape = self.normalized_shape if self.normalized_shape is not None else (x.shape[-1],)
        return self.semantics.rms_norm(x, shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        shape = "last dim" if self.normalized_shape is None else tuple(self.normalized_shape)
        return f"{shape}, eps={self.eps}, {self.semantics.name}, replaces={type(self._original).__name__}"


class PatchedGatedRMSNorm(PatchedRMSNorm):
    """A gated RMSNorm (``forward(hidden_states, gate)``: Qwen3-Next's, Mamba 2's) whose norm
    ``torch.ops.rmsnorm`` serves, standing in for ``original``. ``semantics`` (a
    ``GatedSemantics``) says where the gate multiplies, with which activation, and over which
    groups the norm runs; the gate, its activation and the casts around the norm are torch
    ops, which Inductor fuses with the norm when compiled (``passes/rule.py``)."""

    def __init__(self, original: nn.Module, eps: float | None, weight: nn.Parameter,
                 semantics: GatedSemantics) -> None:
        super().__init__(original, (weight.shape[0],), eps, weight, semantics)

    def forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
        if gate is None and not self.semantics.gate_optional:
            raise TypeError(f"gate is required: {type(self._original).__name__}.forward, which this module "
                            f"replaces, does not run without one")
        return self.semantics.rms_norm(hidden_states, gate, self.weight, self.eps)


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
    """What ``patch_rmsnorm`` did: ``swapped`` (``Swapped`` rows) and ``skipped`` (``Skipped`` rows)."""

    swapped: list[Swapped] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def semantics_counts(self) -> dict[str, int]:
        """How many modules were swapped with each semantics."""
        counts: dict[str, int] = {}
        for row in self.swapped:
            counts[row.semantics] = counts.get(row.semantics, 0) + 1
        return counts

    def __str__(self) -> str:
        lines = [f"patched {len(self.swapped)} RMSNorm module(s), skipped {len(self.skipped)}"]
        lines += [f"  swapped {name or '<root>'} ({cls}) as {sem}" for name, cls, sem in self.swapped]
        lines += [f"  skipped {name or '<root>'} ({cls}): {why}" for name, cls, why in self.skipped]
        return "\n".join(lines)


def _replacement(module: nn.Module, cache: dict) -> tuple[PatchedRMSNorm | None, str | None]:
    """The replacement for ``module``, or None with the reason it is left alone (None: not
    an RMSNorm at all, not reported)."""
    if isinstance(module, RMSNorm):
        return None, "already a torch_rmsnorm_op.RMSNorm"
    found = recognize(module, cache=cache)
    if found is None:
        return None, None
    if found.semantics is None:
        return None, found.reason
    if isinstance(found.semantics, GatedSemantics):
        return PatchedGatedRMSNorm(module, found.eps, found.weight, found.semantics), None
    return PatchedRMSNorm(module, found.normalized_shape, found.eps, found.weight, found.semantics), None


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
        patched.train(child.training)
        setattr(parent, attr, patched)
        replaced[id(child)] = patched
        report.swapped.append(Swapped(name, type(child).__name__, patched.semantics.name))
    if report.swapped:
        # Compiled with Inductor, the compile rule decides who runs each swapped norm.
        if passes.inductor_passes_installed() is None:
            passes.install_inductor_passes()
    return report


def unpatch_rmsnorm(model: nn.Module) -> int:
    """Put every original module back where ``patch_rmsnorm`` swapped it, at every attribute
    that holds the patched module; returns how many patched modules were undone (a module
    held in several places counts once, as ``PatchReport.swapped`` lists it once)."""
    undone: set[int] = set()
    for _, parent, attr, child in list(_named_children_recursive(model)):
        if isinstance(child, PatchedRMSNorm):
            setattr(parent, attr, child.original)
            undone.add(id(child))
    return len(undone)


@contextlib.contextmanager
def patched_rmsnorm(model: nn.Module) -> Iterator[PatchReport]:
    """``with patched_rmsnorm(model) as report:`` patch for the block, then unpatch."""
    report = patch_rmsnorm(model)
    try:
        yield report
    finally:
        unpatch_rmsnorm(model)
