"""Triton RMSNorm kernels as ``torch.ops.rmsnorm.fwd`` / ``torch.ops.rmsnorm.bwd``.

Importing registers the ops; it neither touches CUDA nor defines the Triton
kernels (that happens at the first launch). To run the kernels on CPU tensors
through the Triton interpreter, set ``TRITON_INTERPRET=1`` before that.
"""

from torch_rmsnorm_op import batching, distributed  # noqa: F401  (they register the vmap and DTensor sharding rules)
from torch_rmsnorm_op.contract import RMSNormDTypeError, RMSNormInputError
from torch_rmsnorm_op.fallback import (
    FallbackError,
    dispatch_stats,
    fallback_policy,
    get_fallback_policy,
    reset_dispatch_stats,
    set_fallback_policy,
)
from torch_rmsnorm_op.functional import add_rms_norm, rms_norm
from torch_rmsnorm_op.module import RMSNorm
from torch_rmsnorm_op.passes import inductor_passes_installed, install_inductor_passes, uninstall_inductor_passes
from torch_rmsnorm_op.patch import (
    PatchedGatedRMSNorm,
    PatchedRMSNorm,
    PatchReport,
    patch_rmsnorm,
    patched_rmsnorm,
    unpatch_rmsnorm,
)

__all__ = [
    "FallbackError",
    "PatchReport",
    "PatchedGatedRMSNorm",
    "PatchedRMSNorm",
    "RMSNorm",
    "RMSNormDTypeError",
    "RMSNormInputError",
    "add_rms_norm",
    "dispatch_stats",
    "fallback_policy",
    "get_fallback_policy",
    "inductor_passes_installed",
    "install_inductor_passes",
    "patch_rmsnorm",
    "patched_rmsnorm",
    "reset_dispatch_stats",
    "rms_norm",
    "set_fallback_policy",
    "uninstall_inductor_passes",
    "unpatch_rmsnorm",
]
__version__ = "0.1.0"
