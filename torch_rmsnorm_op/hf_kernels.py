"""``torch.ops.rmsnorm`` as layers of the Hugging Face ``kernels`` package, with no download.

``kernels.kernelize(model, mode=...)`` replaces the ``forward`` of every module whose
class carries a ``kernel_layer_name`` by the ``forward`` of the layer that the registered
mapping gives for that name, the device type and the mode. transformers marks its
RMSNorm classes so (``use_kernel_forward_from_hub``) when a ``kernels`` release it
supports is installed: ``"RMSNorm"`` (classes with ``weight`` and ``variance_epsilon``)
and ``"RMSNormZeroCentered"`` (Qwen3.5's ``(1 + weight)`` norms, with ``weight`` and
``eps``). ``kernel_mapping()`` maps both names to this package's layers::

    from kernels import Mode, kernelize, use_kernel_mapping
    from torch_rmsnorm_op.hf_kernels import kernel_mapping

    with use_kernel_mapping(kernel_mapping()):
        model = kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)

Its repositories (``Repository``) follow the protocol ``kernels`` defines for layer
repositories (``layer_name`` and ``load()`` returning the layer class), as
``LayerRepository`` (the Hub) and ``LocalLayerRepository`` (a built kernel directory)
do; they load the layers from this package, so nothing is fetched or built.

One layer name covers classes that compute differently (transformers 5.24 puts
``"RMSNorm"`` on 131 classes with Llama's forward and 14 that round once, as OLMo2),
and a ``kernels`` layer holds no state of its own. So the layers decide per class: the
first call for a class probes that class's own forward (``recognize``) on a stand-in
instance holding only what the layer reads (a random ``weight`` and the epsilon
attribute), once per class. Under ``torch.compile`` the probe runs while the graph is
traced (``torch.compiler.assume_constant_result``), so the graph holds the chosen call
alone. A class whose forward computes none of the semantics, or reads anything else,
keeps its own forward (the layer calls it) and a warning says why.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torch_rmsnorm_op.recognize import SEMANTICS_BY_NAME, recognize

if TYPE_CHECKING:
    from kernels import Mode

_lock = threading.Lock()
_class_semantics_cache: dict[tuple[type, str], str | None] = {}


def _probe_class(cls: type[nn.Module], eps_attribute: str) -> str | None:
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    stand_in.weight = nn.Parameter(torch.ones(32))
    setattr(stand_in, eps_attribute, 1e-6)
    try:
        found = recognize(stand_in, by_name=False, gated=False)
    except Exception as e:  # the class needs more than weight and the epsilon attribute
        found = None
        reason = f"{type(e).__name__}: {e}"
    else:
        reason = "not examined" if found is None else found.reason
    if found is None or found.semantics is None:
        warnings.warn(f"torch_rmsnorm_op.hf_kernels: {cls.__module__}.{cls.__qualname__} keeps its own forward "
                      f"(its forward, given weight and {eps_attribute}: {reason})", stacklevel=2)
        return None
    return found.semantics.name


@torch.compiler.assume_constant_result
def _class_semantics(cls: type[nn.Module], eps_attribute: str) -> str | None:
    """The name of the semantics (``recognize.SEMANTICS_BY_NAME``) that ``cls``'s own forward
    computes from ``weight`` and ``eps_attribute``, or None; probed once per class."""
    key = (cls, eps_attribute)
    with _lock:
        if key not in _class_semantics_cache:
            _class_semantics_cache[key] = _probe_class(cls, eps_attribute)
        return _class_semantics_cache[key]


def _layer_forward(module: nn.Module, x: Tensor, eps_attribute: str) -> Tensor:
    name = _class_semantics(type(module), eps_attribute)
    if name is None:
        return type(module).forward(module, x)
    return SEMANTICS_BY_NAME[name].rms_norm(x, (x.shape[-1],), module.weight, getattr(module, eps_attribute))


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


LAYERS: dict[str, type[nn.Module]] = {"RMSNorm": RMSNorm, "RMSNormZeroCentered": RMSNormZeroCentered}


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
