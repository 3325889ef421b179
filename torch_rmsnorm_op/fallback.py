"""The fallback policy: when the Triton kernels do not serve a valid input, what happens.

Fallback reasons are inputs that are valid but outside the kernels' reach
(``dispatch.py`` decides them): no Triton-capable device, a dtype other than
fp16/bf16/fp32, N above ``config.MAX_N``, a split mode the GPU cannot run.
Rows the kernels cannot address in place are copied, not a fallback. Invalid
inputs are not fallbacks: they raise (``contract.py``).

Policies:
    ``"reference"``  run the PyTorch reference and count it;
    ``"warn"``       the same, plus one ``UserWarning`` per distinct reason (default);
    ``"error"``      raise ``FallbackError`` naming the reason and how to change the policy.

The policy is set by ``set_fallback_policy``, the ``fallback_policy`` context
manager, or the ``TORCH_RMSNORM_OP_FALLBACK`` environment variable (read when
first needed), in that order of precedence. Every decision is counted
(``dispatch_stats``) and fallbacks are logged on the ``torch_rmsnorm_op``
logger, so ``TORCH_LOGS=+torch_rmsnorm_op`` shows them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterator

import torch

log = logging.getLogger("torch_rmsnorm_op")

POLICIES = ("reference", "warn", "error")
DEFAULT_POLICY = "warn"
ENV_VAR = "TORCH_RMSNORM_OP_FALLBACK"

_lock = threading.Lock()
_policy: str | None = None  # set explicitly; None means "environment, else default"
_kernel_calls: Counter[str] = Counter()
_fallback_calls: Counter[tuple[str, str]] = Counter()
_compiled: Counter[str] = Counter()  # decisions taken while tracing a compiled graph
_sites: Counter[str] = Counter()  # the compile rule's choices, one per norm of a graph Inductor compiles
_warned: set[str] = set()


class _ThreadState(threading.local):
    """Per thread: ``probing``, whether it runs the library's own probes. Every counted call
    reads it; a class default, so that a thread that never set it reads it without the
    ``AttributeError`` that ``getattr`` with a default raises and catches inside (the eager
    call's host time, docs/performance.md)."""

    probing = False


_thread = _ThreadState()


class FallbackError(RuntimeError):
    """Raised under the ``"error"`` policy when an input needs the reference path."""


def _validate(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"fallback policy must be one of {POLICIES}, got {policy!r}")
    return policy


def get_fallback_policy() -> str:
    """The policy in force: explicit setting, else ``$TORCH_RMSNORM_OP_FALLBACK``, else ``"warn"``
    (``"reference"`` inside ``probing``, in the thread that probes)."""
    if _probing():
        return "reference"
    if _policy is not None:
        return _policy
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            return _validate(env.strip().lower())
        except ValueError as e:
            raise ValueError(f"${ENV_VAR}: {e}") from None
    return DEFAULT_POLICY


def set_fallback_policy(policy: str | None) -> None:
    """Set the policy process-wide; ``None`` returns to the environment variable / default."""
    global _policy
    _policy = None if policy is None else _validate(policy)


@contextlib.contextmanager
def fallback_policy(policy: str) -> Iterator[None]:
    """Use ``policy`` inside the block, then restore the previous setting."""
    global _policy
    previous = _policy
    set_fallback_policy(policy)
    try:
        yield
    finally:
        _policy = previous


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """The library's own calls of the ops inside the block, in this thread (the patcher's probes
    of a module, which may run on a device the kernels do not serve): the policy is
    ``"reference"``, and nothing is counted or warned about, so that ``dispatch_stats`` and the
    first warning of each reason stay the user's calls'. Other threads' calls keep their policy
    and are counted."""
    previous = _probing()
    _thread.probing = True
    try:
        yield
    finally:
        _thread.probing = previous


def _probing() -> bool:
    return _thread.probing


def _counts_as_call_site() -> bool:
    """A decision taken while tracing counts once per call site: in the trace that records the
    graph, not in AOTAutograd's metadata pass over the same forward (which decides alike)."""
    from torch_rmsnorm_op._torch_compat import recording_graph

    return recording_graph()


def record_kernel(op: str, compiled: bool = False) -> None:
    """Count one call served by the Triton kernels; with ``compiled``, one call site of a
    compiled graph whose launch the graph now holds (decided once, while tracing)."""
    if _probing():
        return
    with _lock:
        if compiled:
            if _counts_as_call_site():
                _compiled[f"{op}: kernel"] += 1
        else:
            _kernel_calls[op] += 1


def record_fallback(op: str, reason: str, compiled: bool = False) -> None:
    """Apply the policy to one fallback: raise, or count, log and maybe warn. With
    ``compiled``, the fallback is a call site of a compiled graph, decided while tracing: the
    graph then holds the reference's operations, and "error" raises while compiling."""
    if _probing():
        return
    policy = get_fallback_policy()
    if policy == "error":
        raise FallbackError(
            f"{op}: the Triton kernels do not serve this input ({reason}) and the fallback policy is "
            f"'error'. Use torch_rmsnorm_op.set_fallback_policy('reference') or 'warn', the "
            f"fallback_policy(...) context manager, or {ENV_VAR}=reference to run the PyTorch "
            "reference instead."
        )
    with _lock:
        if compiled:
            if _counts_as_call_site():
                _compiled[f"{op}: reference ({reason})"] += 1
        else:
            _fallback_calls[(op, reason)] += 1
        first = reason not in _warned
        _warned.add(reason)
    log.debug("%s: PyTorch reference fallback (%s)", op, reason)
    if policy == "warn" and first:
        warnings.warn(
            f"torch_rmsnorm_op: {op} falls back to the PyTorch reference ({reason}). "
            f"Set the fallback policy to 'reference' to silence this, or 'error' to forbid it.",
            stacklevel=_caller_stacklevel(),
        )


def record_site(forward: str, backward: str) -> None:
    """Count one norm of a graph Inductor compiles with the library's passes, by who runs its
    forward and its backward (``"ours"``, ``"inductor"``; backward ``"none"`` where nothing
    differentiates it)."""
    with _lock:
        _sites[f"forward {forward}, backward {backward}"] += 1


# Frames of this package and of torch (the dispatcher's Python, nn.Module's call) between the
# user's line and record_fallback: a warning points past them.
_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))


def _caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called from ``record_fallback``, for the first frame
    outside this package and torch: the user's call, however many layers it went through."""
    frame, level = sys._getframe(2), 2  # record_fallback's caller
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def dispatch_stats() -> dict[str, dict[str, int]]:
    """Counts since the last reset: ``{"kernel": {op: n}, "fallback": {"op: reason": n},
    "compiled": {"op: kernel" or "op: reference (reason)": n}, "sites": {"forward f, backward
    b": n}}``. ``kernel`` and ``fallback`` count calls that ran; ``compiled`` counts the call
    sites of compiled graphs, decided once while the graph was traced (the graph then launches
    the kernels, or runs the reference's operations, on every call without counting them);
    ``sites`` counts the norms of graphs Inductor compiled with the library's passes by the
    compile rule's choice (``passes/rule.py``): a norm whose forward and backward are
    ``inductor`` runs Inductor's fused kernels and no op of ours."""
    with _lock:
        return {
            "kernel": dict(_kernel_calls),
            "fallback": {f"{op}: {reason}": n for (op, reason), n in _fallback_calls.items()},
            "compiled": dict(_compiled),
            "sites": dict(_sites),
        }


def reset_dispatch_stats() -> None:
    """Zero the counters and forget which reasons were already warned about."""
    with _lock:
        _kernel_calls.clear()
        _fallback_calls.clear()
        _compiled.clear()
        _sites.clear()
        _warned.clear()
