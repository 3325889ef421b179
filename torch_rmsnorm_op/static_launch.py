"""Inductor's static launcher for our kernels in compiled graphs.

A graph Inductor compiles launches the kernels it generates through its static CUDA launcher
(one C++ call a launch) and user-defined Triton kernels, ours among them, through Triton's
launcher, which binds the arguments in Python before its C launch, unless Inductor's option
``static_launch_user_defined_triton_kernels`` is on. Where a step waits on the host (a compiled
model at a few tokens), that Python is part of the step: at 1×16 tokens a patched Llama's or
Qwen3's step took 3.6-5.4% longer than the stock one, and launching our kernels statically took
back part (Llama, hidden 2048) or all (Qwen3; Llama inference at hidden 4096) of it
(docs/performance.md).

Inductor takes the launcher when it compiles a kernel, mostly in its compile worker processes,
which read the option from ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS`` when they
start, not from the parent's config. So ``install()`` sets both the option in this process and
that environment variable, for workers started afterwards; Inductor starts them at the first
compile with Inductor in the process. ``patch_rmsnorm`` calls it, and so do the ops' fake
implementations, which run while Dynamo captures a graph that calls them (``rms_norm``,
``RMSNorm`` or the ops themselves, unpatched), before Inductor's backend starts. Workers started
before keep Triton's launcher for user-defined kernels (a warning on the ``torch_rmsnorm_op``
logger says so). The option acts on every user-defined Triton kernel that graphs compiled afterwards
launch; Inductor keeps Triton's launcher for a kernel its static launcher cannot launch.

On by default. Turn it off with ``set_static_launch(False)`` or
``TORCH_RMSNORM_OP_STATIC_LAUNCH=0`` (before ``patch_rmsnorm`` or the first compile); where
``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS`` is set already, its value stands
and nothing here changes it.
"""

from __future__ import annotations

import os

from torch_rmsnorm_op import _torch_compat
from torch_rmsnorm_op.fallback import log
from torch_rmsnorm_op.fusion import switch_from_env

ENV_VAR = "TORCH_RMSNORM_OP_STATIC_LAUNCH"
INDUCTOR_ENV_VAR = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"
_OPTION = "static_launch_user_defined_triton_kernels"
_enabled: bool | None = None  # None: ENV_VAR decides
_set_here = False  # whether INDUCTOR_ENV_VAR and the option hold values this module set
_option_before = False  # the option's value before this module set it


def set_static_launch(enabled: bool | None) -> None:
    """Turn the static launch of our kernels on or off for graphs compiled from now on (on:
    applied at the next ``install()``; off: what ``install()`` set is undone now); ``None``
    returns to ``$TORCH_RMSNORM_OP_STATIC_LAUNCH`` (default: on)."""
    global _enabled
    _enabled = enabled
    if not static_launch_enabled():
        _undo()


def static_launch_enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return switch_from_env(ENV_VAR)


def install() -> None:
    """Where the setting is on and ``$TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS``
    is not set by someone else: turn on Inductor's static launch of user-defined Triton kernels
    in this process and for the compile workers it starts from now on."""
    global _set_here, _option_before
    from torch._inductor import config  # before the variable is set: its value is read at import

    if not static_launch_enabled() or (INDUCTOR_ENV_VAR in os.environ and not _set_here):
        return
    if not hasattr(config, _OPTION):  # a torch without the option: nothing to set
        return
    if not _set_here:
        os.environ[INDUCTOR_ENV_VAR] = "1"
        _option_before = getattr(config, _OPTION)
        setattr(config, _OPTION, True)
        _set_here = True
        if _torch_compat.compile_workers_running():
            log.warning("Inductor's compile workers started before the static launch of user-defined Triton "
                        "kernels was set: kernels they compile keep Triton's launcher. Patch, or compile a "
                        "graph that calls the ops, before the first torch.compile of the process, or set %s=1 "
                        "before starting Python.", INDUCTOR_ENV_VAR)


def _undo() -> None:
    global _set_here
    if not _set_here:
        return
    from torch._inductor import config

    os.environ.pop(INDUCTOR_ENV_VAR, None)
    setattr(config, _OPTION, _option_before)
    _set_here = False
