"""The private torch APIs the package relies on, in one place, each where no public API does
the job. Checked on torch 2.11 and 2.13.

- ``functorch_transform()``: the innermost torch.func transform (``torch._C._functorch``), to
  route transforms the ops' autograd formula does not serve to the reference;
- ``dispatcher_has_nothing_to_do()``: the dispatcher state checks behind ``rms_norm``'s eager
  shortcut (autocast, torch function and dispatch modes, functorch, ``torch.jit.trace``);
- ``FunctionalTensorMode`` and ``decomposing_custom_triton_ops()``: where AOTAutograd
  functionalizes a graph, the ops decompose into their kernel launches (as
  ``torch.library.triton_op`` does), except while ``torch.export`` keeps custom ops whole;
- ``register_triton_kernels(op, kernels)``: the kernels' source joins AOTAutograd's cache key
  for graphs that call the op (as ``torch.library.triton_op`` registers its own);
- ``recording_graph()``: whether a graph is being recorded (``make_fx``'s proxy mode), which
  tells AOTAutograd's graph trace from its metadata pass over the same forward;
- ``triton_kernel_wrapper_functional()``, ``traced_triton_kernel(idx)``,
  ``constant_args(idx)`` and ``with_constant_args(idx, **more)``: the node a traced Triton
  launch is in a post-grad graph, the kernel it launches, and its constant arguments, as they
  are and with changes (the kernel side table), for ``post_grad.fuse_gradient_sums``;
- ``aot_compiling()``: whether AOTInductor is compiling a package (Inductor's
  ``V.aot_compilation``), where a CPU graph cannot keep an op that calls back into Python;
- ``inductor_cache_dir()``: Inductor's on-disk cache directory, where its kernels and their
  autotuned configurations (``*.best_config``) are kept;
- ``jagged_layout(t)``: a jagged nested tensor's ragged dim and its cached sequence lengths,
  which ``torch.nested.nested_tensor_from_jagged`` takes back when ``rms_norm`` rewraps its
  normalized values;
- ``inductor_config()`` and ``custom_graph_pass_class()``: the options the library's passes are
  installed in, and the base class of a cacheable pass (``passes.install_inductor_passes``);
- ``unrolled_reduction_limit()``: the reductions Inductor unrolls into their reader (the
  compile rule's vocabulary, ``passes/graph.py``);
- ``cuda_current_device()``: ``torch.cuda.current_device()`` without its lazy-init check, for
  launches that already hold a CUDA launcher;
- ``profiler_enabled()`` and ``forward_ad_level()``: whether the autograd profiler records, and
  the innermost forward-mode AD level (-1: none), read on every eager call;
- ``FakeTensor`` and ``FunctionalTensor``: the tensor types AOTAutograd traces with;
- ``has_kernel_for_dispatch_key(op, key)``: whether aten registers ``op`` for a dispatch key
  (autocast's lists per device);
- ``remove_batch_dim``, ``add_batch_dim`` and ``vmap_nesting()``: the legacy vmap's batched
  tensors (``torch._vmap_internals``), which batched gradients still use.
"""

from __future__ import annotations

import sys

import torch
from torch._C._functorch import TransformType, peek_interpreter_stack
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

__all__ = [
    "FakeTensor",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "add_batch_dim",
    "cuda_current_device",
    "forward_ad_level",
    "has_kernel_for_dispatch_key",
    "profiler_enabled",
    "remove_batch_dim",
    "vmap_nesting",
    "aot_compiling",
    "constant_args",
    "decomposing_custom_triton_ops",
    "dispatcher_has_nothing_to_do",
    "functorch_transform",
    "inductor_cache_dir",
    "custom_graph_pass_class",
    "inductor_config",
    "jagged_layout",
    "recording_graph",
    "register_triton_kernels",
    "traced_triton_kernel",
    "triton_kernel_wrapper_functional",
    "unrolled_reduction_limit",
    "with_constant_args",
]


def functorch_transform() -> str | None:
    """The name of the innermost active torch.func transform other than vmap, or None."""
    interpreter = peek_interpreter_stack()
    if interpreter is not None and interpreter.key() != TransformType.Vmap:
        return interpreter.key().name
    return None


# Bound once: this runs on every eager call.
_any_autocast, _function_modes, _dispatch_modes, _jit_tracing = (
    torch._C._is_any_autocast_enabled, torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack,
    torch._C._is_tracing)


def dispatcher_has_nothing_to_do() -> bool:
    """No autocast, no torch function or dispatch mode, no torch.func transform (vmap
    included: its batched tensors look plain to Python), not recorded by ``torch.jit.trace``."""
    return (
        not _any_autocast()
        and _function_modes() == 0
        and _dispatch_modes() == 0
        and peek_interpreter_stack() is None
        and not _jit_tracing()  # torch.jit.is_tracing() outside TorchScript
    )


def decomposing_custom_triton_ops() -> bool:
    """False while ``torch.export`` keeps custom Triton ops whole in the exported program."""
    return bool(getattr(torch._functorch.config, "decompose_custom_triton_ops", True))


def register_triton_kernels(op: str, kernels: list) -> None:
    """Make ``kernels``' source part of AOTAutograd's cache key for graphs calling ``op``."""
    registry = getattr(torch._library.triton, "triton_ops_to_kernels", None)
    if registry is not None:
        registry[op] = list(kernels)


def recording_graph() -> bool:
    """Whether ``make_fx``'s proxy mode is active: a graph is being recorded. AOTAutograd first
    runs a forward without it, to collect the outputs' metadata, then records the graph."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def triton_kernel_wrapper_functional():
    """The higher-order op of a functional Triton launch in AOTAutograd's graphs."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional as op

    return op


def traced_triton_kernel(kernel_idx: int):
    """The Triton kernel a traced launch names by ``kernel_idx``."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return kernel_side_table.get_kernel(kernel_idx)


def constant_args(constant_args_idx: int) -> dict:
    """A traced launch's constant arguments (those the graph cannot hold as values)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return kernel_side_table.get_constant_args(constant_args_idx)


def with_constant_args(constant_args_idx: int, drop: tuple[str, ...] = (), **more) -> int:
    """The index of a traced launch's constant arguments (``constant_args_idx``) without those
    named in ``drop`` and with ``more``."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kept = {k: v for k, v in constant_args(constant_args_idx).items() if k not in drop}
    return kernel_side_table.add_constant_args({**kept, **more})


def aot_compiling() -> bool:
    """Whether AOTInductor is compiling a package (``aoti_compile_and_package``) right now."""
    virtualized = sys.modules.get("torch._inductor.virtualized")  # not imported: nothing compiles
    return virtualized is not None and virtualized.V.aot_compilation


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def jagged_layout(t: torch.Tensor) -> tuple[int, int | None, int | None]:
    """A jagged nested tensor's ragged dim and its cached minimum and maximum sequence lengths
    (None where not cached)."""
    return t._ragged_idx, t._maybe_min_seqlen, t._maybe_max_seqlen


def inductor_config():
    """Inductor's config module (``torch._inductor.config``), whose options the library's
    passes are installed in (``passes.install_inductor_passes``)."""
    from torch._inductor import config

    return config


def custom_graph_pass_class() -> type:
    """Inductor's ``CustomGraphPass``, the base of a pass with a ``uuid()`` for its caches."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def unrolled_reduction_limit() -> int:
    """The element count up to which Inductor unrolls a reduction into the kernel that reads its
    result (``unroll_reductions_threshold``)."""
    return int(inductor_config().unroll_reductions_threshold)


# Bound once: each is read on a hot path (an eager call, a launch).
cuda_current_device = getattr(torch._C, "_cuda_getDevice", None)  # absent from builds without CUDA
profiler_enabled = torch._C._autograd._profiler_enabled
has_kernel_for_dispatch_key = torch._C._dispatch_has_kernel_for_dispatch_key
remove_batch_dim = torch._remove_batch_dim
add_batch_dim = torch._add_batch_dim
_forward_ad = torch.autograd.forward_ad


def forward_ad_level() -> int:
    """The innermost forward-mode AD level, -1 where none is active."""
    return _forward_ad._current_level


def vmap_nesting() -> int:
    """How many levels of the legacy vmap this thread is inside."""
    top = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    return top
