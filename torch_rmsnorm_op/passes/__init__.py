"""The library's Inductor passes, and the one call that installs them.

``install_inductor_passes()`` sets three Inductor options for graphs compiled afterwards in this
process, and ``uninstall_inductor_passes()`` puts back the values it found:

- ``pre_grad_custom_pass``: the compile rule (``rule.py``, applied by ``pre_grad.py``): each norm
  of a graph that calls ``rmsnorm.fwd`` keeps our kernel, forward and backward, where every
  tensor it reads and writes is one the step keeps in memory anyway (a residual add it reads
  moves into it), gives Inductor its forward where Inductor would fuse the forward with its
  neighbours, or gives Inductor both directions;
- ``post_grad_custom_post_pass``: rewrites of our launches in the traced graphs
  (``post_grad.py``: gradient sums into the backward kernel, unread rstd, view arguments);
- ``static_launch_user_defined_triton_kernels``: Inductor's static CUDA launcher for the
  user-defined Triton kernels (ours among them, other libraries' too) of graphs it compiles in
  this process. Inductor's compile worker processes read that option from
  ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS`` when they start, never from this
  process: set it to 1 before starting Python for the kernels they compile.

Each pass chains the pass that was set before it and has a ``uuid()``, so compiled graphs stay
cacheable. ``patch_rmsnorm`` installs the passes with their defaults where they are not
installed. Nothing else in the library sets an Inductor option, and nothing writes the
environment. ``aot_eager`` and other backends that run no Inductor passes see no rewrite.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import threading
from dataclasses import dataclass

from torch.fx import Graph

from torch_rmsnorm_op import _torch_compat
from torch_rmsnorm_op.fallback import log

_STATIC_LAUNCH = "static_launch_user_defined_triton_kernels"
_OPTIONS = {"pre_grad": "pre_grad_custom_pass", "post_grad": "post_grad_custom_post_pass"}


@dataclass(frozen=True)
class Settings:
    """What ``install_inductor_passes`` turns on."""

    rule: bool = True
    gradient_sums: bool = True
    static_launch: bool = True


_lock = threading.Lock()
_installed: tuple[Settings, dict[str, object]] | None = None  # settings, the option values found


def _run(stage: str, settings: Settings, graph: Graph) -> None:
    if stage == "pre_grad":
        if settings.rule:
            from torch_rmsnorm_op.passes import pre_grad

            pre_grad.apply_rule(graph)
    else:
        from torch_rmsnorm_op.passes import post_grad

        post_grad.rewrite(graph, gradient_sums=settings.gradient_sums)


@functools.cache
def pass_class() -> type:
    """``RMSNormPass``: Inductor's ``CustomGraphPass`` (defined on first use, so that importing
    the package does not import Inductor)."""

    class RMSNormPass(_torch_compat.custom_graph_pass_class()):
        """One stage's rewrites (``"pre_grad"`` or ``"post_grad"``) under ``settings``, then the
        pass that was set before it (if any)."""

        def __init__(self, stage: str, settings: Settings, then=None) -> None:
            self.stage, self.settings, self.then = stage, settings, then

        def _chained(self) -> tuple:
            """The passes set before this one (Inductor's option may hold a list)."""
            then = self.then if isinstance(self.then, (list, tuple)) else (self.then,)
            return tuple(p for p in then if p is not None)

        def __call__(self, graph: Graph) -> None:
            _run(self.stage, self.settings, graph)
            for then in self._chained():
                then(graph)

        def uuid(self) -> bytes:
            h = hashlib.sha256(library_digest())
            h.update(f"{self.stage} {self.settings}".encode())
            for then in self._chained():
                uuid = getattr(then, "uuid", None)
                h.update(uuid() if callable(uuid) else repr(then).encode())
            return h.digest()

        def __reduce__(self):
            # Inductor pickles its config into the compile cache's key: a class defined in a
            # function pickles by reference to a module-level rebuild, its uuid in the key.
            return _rebuild_pass, (self.stage, self.settings, self.then, self.uuid())

    return RMSNormPass


def _rebuild_pass(stage: str, settings: Settings, then, uuid: bytes):
    """Unpickle an ``RMSNormPass`` (``uuid``: the one it had, part of the pickled key)."""
    return pass_class()(stage, settings, then)


def source_digest(root: pathlib.Path) -> bytes:
    """A digest of the library's source under ``root``: its modules, kernels and passes, not its
    tools."""
    h = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("kernels/*.py"), *root.glob("passes/*.py")]):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.digest()


@functools.cache
def library_digest() -> bytes:
    """The installed library's ``source_digest``, part of the passes' uuid and so of the compile
    caches' keys: a graph's rewrites, fallback decisions and launch configurations come from
    this code, so a graph compiled by other code of the library is not served."""
    return source_digest(pathlib.Path(__file__).parent.parent)


def install_inductor_passes(*, rule: bool = True, gradient_sums: bool = True, static_launch: bool = True) -> None:
    """Install the library's Inductor passes for graphs compiled from now on in this process.

    ``rule``: decide for each norm who runs its forward and its backward (our kernels or
    Inductor's, fused with its neighbours), moving the residual add a norm reads into our kernel
    where ours runs it; off, every norm keeps our op and nothing moves. ``gradient_sums``: the
    sum of the gradients reaching a norm moves into our backward kernel (CUDA). ``static_launch``:
    Inductor's static launcher for user-defined Triton kernels compiled in this process.

    Called again, it replaces the settings; ``uninstall_inductor_passes`` puts back the options'
    values found at the first call. Graphs already compiled keep what they were compiled with."""
    global _installed
    config = _torch_compat.inductor_config()
    settings = Settings(rule, gradient_sums, static_launch)
    with _lock:
        cls = pass_class()
        found = _installed[1] if _installed is not None else {
            option: _outside(getattr(config, option, None), cls) for option in (*_OPTIONS.values(), _STATIC_LAUNCH)}
        for stage, option in _OPTIONS.items():
            setattr(config, option, cls(stage, settings, found[option]))
        if hasattr(config, _STATIC_LAUNCH):  # a torch without the option has nothing to set
            setattr(config, _STATIC_LAUNCH, True if static_launch else found[_STATIC_LAUNCH])
        _installed = (settings, found)
    log.debug("installed the Inductor passes: %s", settings)


def _outside(value: object, cls: type) -> object:
    """``value`` without our passes: a pass of ours found in an option while none is installed
    (put back by a ``config.patch`` that began while it was installed) is replaced, not chained."""
    while isinstance(value, cls):
        value = value.then
    return value


def uninstall_inductor_passes() -> None:
    """Put back the Inductor options ``install_inductor_passes`` set, as they were before it,
    where they still hold what it set (a value set since by someone else stays). Nothing
    happens where the passes are not installed."""
    global _installed
    config = _torch_compat.inductor_config()
    with _lock:
        if _installed is None:
            return
        settings, found = _installed
        cls = pass_class()
        for option in _OPTIONS.values():
            if isinstance(getattr(config, option), cls):
                setattr(config, option, found[option])
        if hasattr(config, _STATIC_LAUNCH) and settings.static_launch and getattr(config, _STATIC_LAUNCH) is True:
            setattr(config, _STATIC_LAUNCH, found[_STATIC_LAUNCH])
        _installed = None


def inductor_passes_installed() -> Settings | None:
    """The settings of the installed passes, or None where they are not installed."""
    return None if _installed is None else _installed[0]
