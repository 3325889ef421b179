"""``RMSNorm``: a drop-in ``torch.nn.RMSNorm`` whose forward runs ``torch.ops.rmsnorm``."""

# No postponed annotations: torch.fx writes forward's annotations into the code it generates (as torch.Tensor).
import torch
from torch import Tensor, nn

from torch_rmsnorm_op.functional import rms_norm


class RMSNorm(nn.RMSNorm):
    """Same constructor, parameters, ``state_dict`` keys and ``extra_repr`` as ``nn.RMSNorm``
    (it is a subclass); only ``forward`` changes. ``torch.fx.symbolic_trace`` records its call
    of ``rms_norm`` (as it records ``nn.RMSNorm``'s of ``F.rms_norm``); ``torch.jit.script``
    compiles a forward that calls ``torch.ops.rmsnorm.fwd`` itself (``scripted_rms_norm``)."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            return scripted_rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


def scripted_rms_norm(x: Tensor, normalized_shape: list[int], weight: Tensor | None, eps: float | None) -> Tensor:
    """``rms_norm(x, normalized_shape, weight, eps)`` as TorchScript compiles it: the
    normalized dims flattened into one row and ``torch.ops.rmsnorm.fwd`` called on the rows
    (its own checks and fallback policy apply). ``x`` must end in ``normalized_shape``."""
    k = len(normalized_shape)
    if k == 0 or x.dim() < k or x.shape[x.dim() - k:] != normalized_shape:
        raise RuntimeError("rms_norm: given normalized_shape=" + str(normalized_shape) + ", expected input with "
                           "shape [*" + str(normalized_shape)[1:] + ", but got input of size" + str(x.shape))
    n = 1
    for size in normalized_shape:
        n *= size
    w: Tensor | None = None
    if weight is not None:
        w = weight.reshape([n])
    if eps is None:  # F.rms_norm's default (reference.default_eps): the computation dtype's machine epsilon
        eps = 2.220446049250313e-16 if x.dtype == torch.float64 else 1.1920928955078125e-07
    y = torch.ops.rmsnorm.fwd(x.reshape(x.shape[: x.dim() - k] + [n]), w, eps)[0]
    return y.view(x.shape)
