"""DTensor sharding rules for the ``torch.ops.rmsnorm`` ops.

The ops normalize each row over the last dim, so rows are independent: a DTensor sharded over
any leading dim (``Shard(d)``, ``d`` < the last dim) or replicated runs the kernels on each
rank's local shard, and every output keeps the input's placement. The rules, per mesh dim:

    op        inputs                                      outputs
    fwd       x: P, weight: Replicate                     y: P, rstd: P
    bwd       dy, x, rstd: P, weight: Replicate           dx: P, dweight: Partial if P shards rows
    add_fwd   x, residual: P, weight: Replicate           y, residual_out, rstd: P
    add_bwd   dy, dresidual_out, residual_out, rstd: P,   dx: P, dweight: Partial if P shards rows
              weight: Replicate
    norm_add_fwd  x, residual: P, x_weight, weight:       y, residual_out, rstd, x_rstd: P
              Replicate

with ``P`` one of ``Replicate()``, ``Shard(d)`` for ``d < x.ndim - 1``. With rows sharded, each
rank's dweight sums its own rows only, hence ``Partial()`` (a sum over ranks); with ``P``
Replicate, every rank holds the full sum. No rule shards the normalized (last) dim: DTensor
redistributes such an input (and a weight that is not replicated) to a placement a rule
accepts before the op runs, so a row is never normalized in pieces.

Registration (``torch.distributed.tensor.experimental.register_sharding``) needs
``torch.distributed.tensor``, whose import costs about half a second, several times what the
package's own import does; the package does not import it. Instead, importing the package
registers the rules at once if ``torch.distributed.tensor`` is already imported, and otherwise
on the import that brings it in (a ``sys.meta_path`` finder that runs the registration right
after the module is executed, then removes itself). Nothing happens where
``torch.distributed`` is not available. ``register_sharding_rules()`` registers explicitly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

_DTENSOR = "torch.distributed.tensor"
_lock = threading.Lock()
_registered = False


def _row_placements(ndim: int) -> list[Any]:
    """The placements of an ``ndim``-dim input whose last dim is normalized: Replicate, or
    sharded over one of its leading dims."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate(), *(Shard(d) for d in range(ndim - 1))]


def _weight_placement(weight: object) -> Any:
    from torch.distributed.tensor import Replicate

    return None if weight is None else Replicate()


def _weight_grad_placement(weight: object, rows: Any) -> Any:
    """dweight sums over rows: complete where ``rows`` is Replicate, a per-rank part otherwise."""
    from torch.distributed.tensor import Partial, Replicate

    if weight is None:
        return None
    return Replicate() if isinstance(rows, Replicate) else Partial()


# Each function returns DTensor's acceptable shardings for one mesh dim: (output placements,
# input placements), one placement per argument (None for a non-tensor or absent argument).


def _fwd_sharding(x: Any, weight: Any, eps: float, **kwargs: Any) -> list[tuple[list, list]]:
    w = _weight_placement(weight)
    return [([p, p], [p, w, None]) for p in _row_placements(x.ndim)]


def _bwd_sharding(dy: Any, x: Any, weight: Any, rstd: Any, **kwargs: Any) -> list[tuple[list, list]]:
    w = _weight_placement(weight)
    return [([p, _weight_grad_placement(weight, p)], [p, p, w, p]) for p in _row_placements(x.ndim)]


def _add_fwd_sharding(x: Any, residual: Any, weight: Any, eps: float, **kwargs: Any) -> list[tuple[list, list]]:
    w = _weight_placement(weight)
    return [([p, p, p], [p, p, w, None]) for p in _row_placements(x.ndim)]


def _add_bwd_sharding(dy: Any, dresidual_out: Any, residual_out: Any, weight: Any, rstd: Any,
                      **kwargs: Any) -> list[tuple[list, list]]:
    w = _weight_placement(weight)
    return [
        ([p, _weight_grad_placement(weight, p)], [p, None if dresidual_out is None else p, p, w, p])
        for p in _row_placements(residual_out.ndim)
    ]


def _norm_add_fwd_sharding(x: Any, residual: Any, x_weight: Any, x_eps: float, weight: Any, eps: float,
                           **kwargs: Any) -> list[tuple[list, list]]:
    xw, w = _weight_placement(x_weight), _weight_placement(weight)
    return [([p, p, p, p], [p, p, xw, None, w, None]) for p in _row_placements(x.ndim)]


def register_sharding_rules() -> None:
    """Register the rules with DTensor (imports ``torch.distributed.tensor``). Idempotent;
    importing the package calls it when ``torch.distributed.tensor`` is or gets imported."""
    global _registered
    with _lock:
        if _registered:
            return
        from torch.distributed.tensor.experimental import register_sharding

        ops = torch.ops.rmsnorm
        for op, rule in ((ops.fwd.default, _fwd_sharding), (ops.bwd.default, _bwd_sharding),
                         (ops.add_fwd.default, _add_fwd_sharding), (ops.add_bwd.default, _add_bwd_sharding),
                         (ops.norm_add_fwd.default, _norm_add_fwd_sharding)):
            register_sharding(op)(rule)
        _registered = True


def sharding_rules_registered() -> bool:
    """Whether DTensor has the rules (``register_sharding_rules`` has run)."""
    return _registered


class _RegisteringLoader(importlib.abc.Loader):
    """``torch.distributed.tensor``'s own loader, then the registration; the module keeps its
    own loader as ``__loader__``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _register_after_import()


class _AfterDTensorImport(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed.tensor`` through the other finders and wraps its loader."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DTENSOR:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


_finder = _AfterDTensorImport()


def _register_after_import() -> None:
    # Whatever fails here must not fail the user's import of torch.distributed.tensor:
    # without the rules, DTensor refuses the ops with its own error.
    try:
        register_sharding_rules()
    except Exception as e:
        warnings.warn(f"torch_rmsnorm_op: DTensor sharding rules for torch.ops.rmsnorm not registered: {e!r}",
                      RuntimeWarning, stacklevel=2)
    finally:
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def _install() -> None:
    if not torch.distributed.is_available():
        return
    if _DTENSOR in sys.modules:
        _register_after_import()
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


_install()
