"""The fallback policy: when the Triton kernels do not serve a valid input, what happens.

Fallback reasons are inputs that are valid but outside the kernels' reach:
no Triton-capable device, a dtype other than fp16/bf16/fp32, a last dim that
is not contiguous (or rows that cannot be addressed with one row stride), N
above ``config.MAX_N``. Invalid inputs are not fallbacks: they raise
(``contract.py``).

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
import functools
import logging
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
from torch import Tensor

from torch_rmsnorm_op.config import MAX_N, backward_config, forward_config, sm_count
from torch_rmsnorm_op.layout import row_stride

log = logging.getLogger("torch_rmsnorm_op")

POLICIES = ("reference", "warn", "error")
DEFAULT_POLICY = "warn"
ENV_VAR = "TORCH_RMSNORM_OP_FALLBACK"

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_lock = threading.Lock()
_policy: str | None = None  # set explicitly; None means "environment, else default"
_kernel_calls: Counter[str] = Counter()
_fallback_calls: Counter[tuple[str, str]] = Counter()
_warned: set[str] = set()


class FallbackError(RuntimeError):
    """Raised under the ``"error"`` policy when an input needs the reference path."""


def _validate(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"fallback policy must be one of {POLICIES}, got {policy!r}")
    return policy


def get_fallback_policy() -> str:
    """The policy in force: explicit setting, else ``$TORCH_RMSNORM_OP_FALLBACK``, else ``"warn"``."""
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


@functools.cache
def _interpreted() -> bool:
    from torch_rmsnorm_op.kernels import is_interpreted  # defines the kernels on first use

    return is_interpreted()


def kernel_unsupported_reason(x: Tensor, weight: Tensor | None) -> str | None:
    """Why the Triton kernels cannot serve this (valid) input, or None if they can."""
    device = x.device
    reason = _device_dtype_reason(device, x.dtype, None if weight is None else weight.dtype)
    if reason is not None:
        return reason
    n = x.shape[-1]
    if n > MAX_N:
        return f"N = {n} above the kernels' maximum {MAX_N}"
    if row_stride(x) is None:
        if n > 1 and x.stride(-1) != 1:
            return "x's last dimension is not contiguous"
        return "x's rows cannot be addressed with a single row stride"
    if device.type == "cuda":
        return split_mode_reason(n, x.dtype, device)
    return None


@functools.cache  # fixed per device and dtypes; kernel_unsupported_reason runs on every call
def _device_dtype_reason(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype | None) -> str | None:
    """Why the kernels cannot serve x of ``dtype`` (and a weight of ``weight_dtype``) on ``device``."""
    if device.type == "cpu":
        if not _interpreted():
            return "cpu tensor without the Triton interpreter (set TRITON_INTERPRET=1 before the first call)"
    elif device.type != "cuda":
        return f"no Triton kernel for device type {device.type!r}"
    if dtype not in KERNEL_DTYPES:
        return f"x dtype {dtype} (kernels serve float16, bfloat16, float32)"
    if weight_dtype is not None and weight_dtype not in KERNEL_DTYPES:
        return f"weight dtype {weight_dtype} (kernels serve float16, bfloat16, float32)"
    return None


@functools.cache  # its inputs are fixed per (n, dtype, device); it runs on every CUDA call
def split_mode_reason(n: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why split mode (long rows) cannot run rows of ``n`` on this GPU, or None: a row's programs
    must all be resident at once (each waits for the others' partials), so never more of them
    than the GPU has multiprocessors; and their exchange is inline NVIDIA PTX (not ROCm)."""
    split = max(forward_config(n, dtype).split, backward_config(n, dtype).split)
    if split > sm_count(device):
        return f"N = {n} needs {split} programs per row, more than this GPU's {sm_count(device)} SMs"
    if split > 1 and torch.version.hip is not None:
        return f"N = {n} needs split mode, whose exchange between programs is NVIDIA PTX (kernels.py)"
    return None


def record_kernel(op: str) -> None:
    """Count one call served by the Triton kernels."""
    with _lock:
        _kernel_calls[op] += 1


def record_fallback(op: str, reason: str) -> None:
    """Apply the policy to one fallback: raise, or count, log and maybe warn."""
    policy = get_fallback_policy()
    if policy == "error":
        raise FallbackError(
            f"{op}: the Triton kernels do not serve this input ({reason}) and the fallback policy is "
            f"'error'. Use torch_rmsnorm_op.set_fallback_policy('reference') or 'warn', the "
            f"fallback_policy(...) context manager, or {ENV_VAR}=reference to run the PyTorch "
            "reference instead."
        )
    with _lock:
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
    """Counts since the last reset: ``{"kernel": {op: n}, "fallback": {"op: reason": n}}``."""
    with _lock:
        return {
            "kernel": dict(_kernel_calls),
            "fallback": {f"{op}: {reason}": n for (op, reason), n in _fallback_calls.items()},
        }


def reset_dispatch_stats() -> None:
    """Zero the counters and forget which reasons were already warned about."""
    with _lock:
        _kernel_calls.clear()
        _fallback_calls.clear()
        _warned.clear()
