"""``torch.ops.rmsnorm`` as layers of the Hugging Face ``kernels`` package, with no download.

``kernels.kernelize(model, mode=...)`` replaces the ``forward`` of every module whose
class carries a ``kernel_layer_name`` by the ``forward`` of the layer that the registered
mapping gives for that name, the device type and the mode. transformers marks its
RMSNorm classes so (``use_kernel_forward_from_hub``) when a ``kernels`` release it
supports is installed: ``"RMSNorm"`` (classes with ``weight`` and ``variance_epsilon``),
``"RMSNormZeroCentered"`` (Qwen3.5's ``(1 + weight)`` norms, with ``weight`` and ``eps``)
and ``"RMSNormGated"`` (gated norms, ``forward(hidden_states, gate)``, with ``weight`` and
``variance_epsilon``). ``kernel_mapping()`` maps the three names to this package's layers::

    from kernels import Mode, kernelize, use_kernel_mapping
    from torch_rmsnorm_op.hf_kernels import kernel_mapping

    with use_kernel_mapping(kernel_mapping()):
        model = kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)

Its repositories (``Repository``) follow the protocol ``kernels`` defines for layer
repositories (``layer_name`` and ``load()`` returning the layer class), as
``LayerRepository`` (the Hub) and ``LocalLayerRepository`` (a built kernel directory)
do; they load the layers from this package, so nothing is fetched or built.

One layer name covers classes that compute differently (transformers 5.24 puts
``"RMSNorm"`` on 131 classes with Llama's forward and 14 that round once, as OLMo2), and
a ``kernels`` layer holds no state of its own. So the layers decide per class: the first
call for a class probes that class's own forward (``recognize``) on a stand-in instance
holding only what the layer reads (a random ``weight`` and the epsilon attribute; for
the gated layer also the module's plain attributes that its class's code names, such as
its activation's name, which join the key), once per class. Under ``torch.compile`` the probe runs while the graph is
traced (``torch.compiler.assume_constant_result``), so the graph holds the chosen call
alone. A class whose forward computes none of the semantics, or reads anything else,
keeps its own forward (the layer calls it) and a warning says why.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torch_rmsnorm_op.recognize import SEMANTICS_BY_NAME, GatedSemantics, is_plain, recognize

if TYPE_CHECKING:
    from kernels import Mode

_lock = threading.Lock()
_class_semantics_cache: dict[tuple, str | None] = {}  # by _class_semantics's arguments


_gated_semantics: dict[str, GatedSemantics] = {}  # the gated layer's semantics, by _gated_key


def _gated_key(semantics: GatedSemantics) -> str:
    return f"{semantics.name}, gate optional" if semantics.gate_optional else semantics.name


def _probe_class(cls: type[nn.Module], eps_attribute: str, gated: bool = False,
                 attributes: tuple[tuple[str, object], ...] = (), size: int = 32) -> str | None:
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    stand_in.weight = nn.Parameter(torch.ones(size))
    setattr(stand_in, eps_attribute, 1e-6)
    for name, value in attributes:
        setattr(stand_in, name, value)
    try:
        found = recognize(stand_in, by_name=False, gated=gated)
    except Exception as e:  # the class needs more than weight and the epsilon attribute
        found = None
        reason = f"{type(e).__name__}: {e}"
    else:
        reason = "not examined" if found is None else found.reason
    if found is None or found.semantics is None:
        given = ", ".join(["weight", *(name for name, _ in attributes)]) + " and"
        warnings.warn(f"torch_rmsnorm_op.hf_kernels: {cls.__module__}.{cls.__qualname__} keeps its own forward "
                      f"(its forward, given {given} {eps_attribute}: {reason})", stacklevel=2)
        return None
    if isinstance(found.semantics, GatedSemantics):
        _gated_semantics[_gated_key(found.semantics)] = found.semantics
        return _gated_key(found.semantics)
    return found.semantics.name


@torch.compiler.assume_constant_result
def _class_semantics(cls: type[nn.Module], eps_attribute: str, gated: bool = False,
                     attributes: tuple[tuple[str, object], ...] = (), size: int = 32) -> str | None:
    """The name of the semantics (``recognize.SEMANTICS_BY_NAME``) that ``cls``'s own forward
    computes from ``weight`` and ``eps_attribute``, or None; probed once per class. For the
    ``gated`` layer, ``attributes`` (``_plain_attributes``) and the weight's ``size``
    join the probe and the key, and the name is a key of ``_gated_semantics``."""
    key = (cls, eps_attribute, gated, attributes, size)
    with _lock:
        if key not in _class_semantics_cache:
            _class_semantics_cache[key] = _probe_class(cls, eps_attribute, gated, attributes, size)
        return _class_semantics_cache[key]


def _layer_forward(module: nn.Module, x: Tensor, eps_attribute: str) -> Tensor:
    name = _class_semantics(type(module), eps_attribute)
    if name is None:
        return type(module).forward(module, x)
    return SEMANTICS_BY_NAME[name].rms_norm(x, (x.shape[-1],), module.weight, getattr(module, eps_attribute))


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


@torch.compiler.assume_constant_result
def _names_in_code(cls: type[nn.Module]) -> tuple[str, ...]:
    """The public names that the functions of ``cls`` and of its bases below ``nn.Module``
    hold (attribute and global names, string constants), sorted: every attribute their code
    can read by name."""
    return _names_in_class_code(cls)


@functools.cache  # inside: Dynamo inlines a cached function, marked or not
def _names_in_class_code(cls: type[nn.Module]) -> tuple[str, ...]:
    names: set[str] = set()
    for base in cls.__mro__:
        if base in (nn.Module, object) or not issubclass(base, nn.Module):
            continue
        for member in vars(base).values():
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            code = getattr(member, "__code__", None)
            if isinstance(code, types.CodeType):
                for c in _code_objects(code):
                    names.update(c.co_names)
                    names.update(v for v in c.co_consts if isinstance(v, str) and v.isidentifier())
    return tuple(sorted(n for n in names if not n.startswith("_") and n != "training"))


def _plain_attributes(module: nn.Module, eps_attribute: str) -> tuple[tuple[str, object], ...]:
    """What else a gated forward reads: the module's plain attributes (``recognize.is_plain``)
    that its class's code names (the activation's name, a group size), by name. The names
    come from the class, tested one by one against the instance, so that ``torch.compile``
    traces this on every supported torch (2.11's Dynamo does not iterate a module's
    ``__dict__``)."""
    state = module.__dict__
    return tuple((name, state[name]) for name in _names_in_code(type(module))
                 if name != eps_attribute and name in state and is_plain(state[name]))


def _gated_layer_forward(module: nn.Module, x: Tensor, gate: Tensor | None, eps_attribute: str) -> Tensor:
    attributes = _plain_attributes(module, eps_attribute)
    key = _class_semantics(type(module), eps_attribute, True, attributes, module.weight.shape[0])
    if key is None:
        return type(module).forward(module, x, gate)
    semantics = _gated_semantics[key]
    if gate is None and not semantics.gate_optional:
        raise TypeError(f"gate is required: {type(module).__name__}'s own forward does not run without one")
    return semantics.rms_norm(x, gate, module.weight, getattr(module, eps_attribute))


# The layers: no constructor and no members but forward and the two flags (``kernels``
# validates this); forward runs bound to the model's own module and reads its attributes.
class RMSNorm(nn.Module):
    """The layer for ``"RMSNorm"``: modules with ``weight`` and ``variance_epsilon``."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: Tensor) -> Tensor:
        return _layer_forward(self, hidden_states, "variance_epsilon")


class RMSNormZeroCentered(nn.Module):
    """The layer for ``"RMSNormZeroCentered"``: modules with ``weight`` (used as
    ``1 + weight``) and ``eps``."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: Tensor) -> Tensor:
        return _layer_forward(self, x, "eps")


class RMSNormGated(nn.Module):
    """The layer for ``"RMSNormGated"``: gated norms (``forward(hidden_states, gate)``) with
    ``weight`` and ``variance_epsilon`` (Qwen3-Next's, Qwen 3.5's, Kimi Linear's)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
        return _gated_layer_forward(self, hidden_states, gate, "variance_epsilon")


LAYERS: dict[str, type[nn.Module]] = {"RMSNorm": RMSNorm, "RMSNormZeroCentered": RMSNormZeroCentered,
                                      "RMSNormGated": RMSNormGated}


class Repository:
    """A ``kernels`` layer repository for one of ``LAYERS``: ``load()`` returns the layer
    class from this package. Equal repositories hash alike (``kernels`` caches loaded
    layers by repository)."""

    def __init__(self, layer_name: str) -> None:
        if layer_name not in LAYERS:
            raise ValueError(f"layer_name must be one of {sorted(LAYERS)}, got {layer_name!r}")
        self.layer_name = layer_name

    def load(self) -> type[nn.Module]:
        return LAYERS[self.layer_name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Repository) and other.layer_name == self.layer_name

    def __hash__(self) -> int:
        return hash((Repository, self.layer_name))

    def __repr__(self) -> str:
        return f"Repository({self.layer_name!r})"

    def __str__(self) -> str:
        return f"torch_rmsnorm_op.hf_kernels, layer `{self.layer_name}`"


def kernel_mapping(device_types: Sequence[str] = ("cuda", "rocm")) -> dict[str, dict[str, dict[Mode, Repository]]]:
    """The mapping for ``kernels.register_kernel_mapping`` / ``use_kernel_mapping``: each of
    ``LAYERS`` on each of ``device_types``, for inference and training, with and without
    ``torch.compile``. On ``"cpu"`` the ops run the PyTorch reference (counted as fallbacks
    under the fallback policy), or the kernels through the Triton interpreter when
    ``TRITON_INTERPRET=1``. Needs the ``kernels`` package."""
    from kernels import Mode

    modes = (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE)
    return {name: {device: {mode: Repository(name) for mode in modes} for device in device_types} for name in LAYERS}
