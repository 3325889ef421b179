"""What the package needs of Triton beyond its public API, in one place: a cheap eager launch
of compiled kernels, and fixes for the interpreter. Checked on Triton 3.6 and 3.9.

Triton's JIT dispatch (binding the arguments, its cache key, the lookup) costs about as much
host time as the launch itself, on every call. Once the JIT has compiled a specialization,
``run`` launches it through the compiled kernel's own launcher; where that launcher is Triton
3.6's C launcher (``_RUN_PARAMS``, ``_C_LAUNCH_FORMAT``) and the kernel needs no scratch, its C
``launch`` itself. Any other Triton goes through ``CompiledKernel.run``; with a launch hook
registered (a profiler such as proton) through ``CompiledKernel[grid]``, so the hook sees every
launch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton

# Fused multiply-adds on, stated rather than left to Triton's default, which Triton 3.9 warns
# will change in 3.10: the kernels' rounding (and bits) must not move with it.
COMPILE_OPTIONS = dict(enable_fp_fusion=True)


@functools.cache
def is_interpreted() -> bool:
    """True when kernels are defined under ``TRITON_INTERPRET=1`` (they run on CPU tensors)."""
    from torch_rmsnorm_op.kernels import _rms_norm_fwd_rows

    interpreted = not isinstance(_rms_norm_fwd_rows, triton.runtime.JITFunction)
    if interpreted:
        _squeeze_interpreter_loop_bounds()
        _round_interpreter_bf16()
        _patch_interpreter_language_once()
    return interpreted


def _round_interpreter_bf16() -> None:
    """The interpreter (3.6 to 3.9) truncates fp32 to bf16 where the GPU rounds to nearest even
    (as torch does), so interpreted bf16 results would sit up to one bf16 ulp off the GPU's.
    Give it the GPU's rounding (CPU runs only; compiled kernels are untouched)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    if cast is None or getattr(cast, "rounds_bf16", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return cast_impl(self, src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    fp_to_fp = builder.create_fp_to_fp
    cast_impl.rounds_bf16 = True
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp


def _patch_interpreter_language_once() -> None:
    """Triton 3.9's interpreter patches ``triton.language`` (a scan of every member of its
    modules, about 1 ms) at each launch and again at every call of a ``@triton.jit`` helper
    from inside a kernel, where the launch has already patched it: a patched builtin is no
    longer a builtin, so the helper's pass changes nothing, and its scope is never restored.
    Skip that pass when every language module the helper sees is already patched (a kernel's
    launch still patches and restores as before; CPU runs only, compiled kernels untouched)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope is None or getattr(patch_lang, "skips_patched", False):
        return

    def patched(fn):
        langs = [value for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return scope()  # nothing to patch, nothing to restore
        return patch_lang(fn)

    patched.skips_patched = True
    interpreter._patch_lang = patched


def _squeeze_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a scalar kernel argument used as a ``range`` bound into an
    index with ``int()`` of a 1-element array, which numpy 2 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"); Triton 3.9 squeezes the array first. Give
    older interpreters that same conversion (CPU runs only; compiled kernels are untouched)."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


class Launcher(NamedTuple):
    """A compiled kernel and its hook-free launch: ``call(gx, gy, gz, stream, *head, *args)``,
    ``args`` every kernel parameter in order, constexprs included."""

    compiled: Any  # triton.compiler.CompiledKernel
    call: Callable
    head: tuple


# Triton 3.6's CUDA launcher: ``CudaLauncher.__call__(self, gridX, gridY, gridZ, stream, function,
# *args)`` allocates no scratch for a kernel that needs none and calls its C ``launch`` with
# these leading arguments (the driver module's ``_BASE_ARGS_FORMAT``).
_RUN_PARAMS = ("self", "gridX", "gridY", "gridZ", "stream", "function")
_C_LAUNCH_FORMAT = "iiiKKppOOOOOO"  # grid, stream, function, cooperative, pdl, two scratch, metadata, hooks


def _launcher(compiled) -> Launcher:
    """What ``compiled[grid](*args, stream=stream)`` runs when no launch hook is registered,
    without its closure, its launch metadata and the two empty hook chains it hands the
    launcher: Triton 3.6's C ``launch`` where it applies, else ``compiled.run``."""
    run = compiled.run
    code = getattr(type(run).__call__, "__code__", None)
    driver = sys.modules.get(type(run).__module__)
    if (code is not None and code.co_argcount == len(_RUN_PARAMS) and code.co_varnames[:len(_RUN_PARAMS)] == _RUN_PARAMS
            and getattr(driver, "_BASE_ARGS_FORMAT", None) == _C_LAUNCH_FORMAT
            and getattr(run, "global_scratch_size", None) == 0 and getattr(run, "profile_scratch_size", None) == 0
            and hasattr(run, "launch")):
        head = (compiled.function, bool(run.launch_cooperative_grid), bool(run.launch_pdl), None, None,
                compiled.packed_metadata, None, None, None)
        return Launcher(compiled, run.launch, head)
    return Launcher(compiled, run, (compiled.function, compiled.packed_metadata, None, None, None))


def specialization(args: list) -> tuple:
    """What Triton's JIT specializes kernel arguments on, or finer: per tensor its dtype and
    16-byte alignment; per int whether it is 1, a multiple of 16, in int32 range, beyond int64;
    a float (eps, fp32 for Triton) by type; anything else by type and value. A tensor of any
    class (a Parameter too) by its dtype, never by the object: a Parameter keeps its identity
    when ``module.to`` changes its dtype."""
    return tuple([
        (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
        else (a == 1, a & 15 == 0, -(2**31) <= a < 2**31, a >= 2**63) if type(a) is int
        else float if type(a) is float
        else (type(a), a)
        for a in args
    ])


# Compiled kernels by (kernel, device index, num_warps, constexprs, argument keys).
_COMPILED: dict[tuple, Launcher] = {}
_STREAM = None


def current_stream(index: int) -> int:
    global _STREAM
    if _STREAM is None:
        _STREAM = triton.runtime.driver.active.get_current_stream
    return _STREAM(index)


def run(kernel, device: torch.device, grid: tuple[int, ...], args: list, consts: dict,
        num_warps: int = 4) -> Launcher | None:
    """``kernel[grid](*args, **consts, num_warps=num_warps, **COMPILE_OPTIONS)`` on ``device``,
    the current device: through Triton's JIT the first time a specialization is seen (and
    always when interpreted), through the compiled kernel's launcher after that. Returns the
    launcher it launched through, or None for a launch through the JIT."""
    if is_interpreted():
        kernel[grid](*args, **consts, num_warps=num_warps, **COMPILE_OPTIONS)
        return None
    key = (id(kernel), device.index, num_warps, *consts.values(), specialization(args))
    launcher = _COMPILED.get(key)
    if launcher is None:
        _COMPILED[key] = _launcher(kernel[grid](*args, **consts, num_warps=num_warps, **COMPILE_OPTIONS))
        return None
    # The compiled launcher takes every parameter in order, constexprs included.
    grid3 = grid + (1,) * (3 - len(grid))
    stream = current_stream(device.index)
    if no_launch_hooks():
        launcher.call(*grid3, stream, *launcher.head, *args, *consts.values())
    else:
        launcher.compiled[grid3](*args, *consts.values(), stream=stream)
    return launcher


# Before ``triton.knobs`` (Triton < 3.4) the launch hooks lived elsewhere: there, always Triton's runner.
_KNOBS = getattr(triton, "knobs", None)


def no_launch_hooks() -> bool:
    """Whether no Triton launch hook (a profiler's, e.g. proton) is registered: the knobs are
    hook chains (empty by default) or single callables, depending on the Triton version."""
    if _KNOBS is None:
        return False
    runtime = _KNOBS.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # inline, not a helper per hook: this runs on every eager launch
    return ((enter is None or (type(enter) is _HOOK_CHAIN and not enter.calls))
            and (leave is None or (type(leave) is _HOOK_CHAIN and not leave.calls)))


_HOOK_CHAIN = getattr(_KNOBS, "HookChain", None)
