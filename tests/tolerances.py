"""The tests' one tolerance table, declared before any comparison: ``TOL[dtype]`` gives
``assert_close``'s ``atol``/``rtol`` for a result in that dtype computed from the same inputs as
its reference. fp32/fp16/bf16 are the correctness campaign's (``tools/campaign.py``: fp32
tight, fp16 about 6 ulps of its 2^-11 unit roundoff, bf16 twice its 2^-7 machine epsilon);
fp64 and complex64 are for the reference paths. ``GRAD_FACTOR`` widens them for gradients,
which go through one more reduction and rounding than the forward; ``MODEL`` is for whole
models (several layers of bf16 or fp32 arithmetic before the compared output)."""

import torch

from torch_rmsnorm_op.tools.campaign import TOLERANCES

TOL: dict[torch.dtype, dict[str, float]] = {
    **{dtype: dict(atol=atol, rtol=rtol) for dtype, (atol, rtol) in TOLERANCES.items()},
    torch.float64: dict(atol=1e-12, rtol=1e-10),
    torch.complex64: dict(atol=1e-5, rtol=1e-4),
}
GRAD_FACTOR = 4


def grad_tol(dtype: torch.dtype) -> dict[str, float]:
    return {k: GRAD_FACTOR * v for k, v in TOL[dtype].items()}


MODEL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
}
