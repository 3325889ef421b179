"""The correctness campaign: the kernels against the float64 reference, over a declared grid.

Every case draws random inputs (never zeros), poisons every output and the
dweight scratch with NaN, runs the launchers, and compares y, dx and dweight
with ``reference.py`` evaluated in float64 on the same inputs, under
tolerances declared here before any comparison:
``|out - ref| <= atol + rtol * |ref|`` elementwise, NaN never passes.
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from torch_rmsnorm_op import reference

EPS = 1e-6
ROW_PAD = 3  # strided cases: rows of N + ROW_PAD elements, the kernel must skip the pad

# (atol, rtol) per dtype. fp32: tight; fp16: atol = rtol = 3e-3 (about 6 ulps of
# its 2^-11 unit roundoff); bf16: twice its machine epsilon 2^-7, the output's
# own rounding being up to half of that.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2 * 2.0**-7, 2 * 2.0**-7),
}
DTYPES = tuple(TOLERANCES)
MS = (1, 17)
NS = (1, 7, 256, 257, 1000, 4096, 4097)
LARGE_N_CPU = 32771  # looped forward (2-byte dtypes), split mode (fp32 forward, backward); odd length
LARGE_N_GPU = 262144


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    m: int
    n: int
    has_weight: bool
    strided: bool

    def __str__(self) -> str:
        w = "w" if self.has_weight else "now"
        s = "strided" if self.strided else "contig"
        return f"{str(self.dtype).removeprefix('torch.')}-{self.m}x{self.n}-{w}-{s}"


@dataclass(frozen=True)
class Comparison:
    quantity: str  # "y", "dx" or "dweight"
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    passed: bool
    worst_ratio: float  # max over elements of |out - ref| / (atol + rtol * |ref|): passes iff <= 1


def cases(large_n: int = LARGE_N_CPU, dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[Case]:
    """The grid: dtypes x M x N (incl. one large N) x weight/no weight x contiguous/strided rows."""
    grid = itertools.product(dtypes, MS, NS + (large_n,), (True, False), (False, True))
    return [Case(*c) for c in grid]


def _rows(m: int, n: int, dtype: torch.dtype, device: torch.device, strided: bool, gen: torch.Generator) -> Tensor:
    cols = n + ROW_PAD if strided else n
    full = torch.randn((m, cols), generator=gen, device="cpu", dtype=torch.float32).to(device=device, dtype=dtype)
    return full[:, :n]


def compare(quantity: str, out: Tensor, ref: Tensor, atol: float, rtol: float) -> Comparison:
    """Elementwise ``|out - ref| <= atol + rtol * |ref|``; NaN/inf in ``out`` fails. ``max_abs`` and
    ``max_rel`` are maxima over all elements taken separately (either may exceed its tolerance in
    a passing comparison, on different elements); ``worst_ratio`` is the error over the allowed
    error at the worst element, the number that decides."""
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    err = (out64 - ref64).abs()
    finite = bool(torch.isfinite(out64).all())
    allowed = atol + rtol * ref64.abs()
    passed = finite and bool((err <= allowed).all())
    if err.numel() == 0:
        return Comparison(quantity, 0.0, 0.0, atol, rtol, passed, 0.0)
    big = ref64.abs() > atol
    max_rel = float((err[big] / ref64.abs()[big]).max()) if big.any() else 0.0
    max_abs = float(err.max()) if finite else math.inf
    worst = float((err / allowed).max()) if finite else math.inf
    return Comparison(quantity, max_abs, max_rel if finite else math.inf, atol, rtol, passed, worst)


def run_case(case: Case, device: torch.device, kernels: ModuleType | None = None, seed: int = 0) -> list[Comparison]:
    """Run one case through the launchers, with ``kernels`` (a namespace holding kernels of the
    package's names; default: the package's), and compare."""
    from torch_rmsnorm_op import dispatch, launch

    # crc32, not hash(): str hashes change with every process (PYTHONHASHSEED), the inputs must not
    gen = torch.Generator().manual_seed(seed + zlib.crc32(str(case).encode()))
    m, n, dtype = case.m, case.n, case.dtype
    x = _rows(m, n, dtype, device, case.strided, gen)
    dy = _rows(m, n, dtype, device, case.strided, gen)
    w = None
    if case.has_weight:
        w = (torch.randn(n, generator=gen) * 0.5 + 1.0).to(device=device, dtype=dtype)

    nan = float("nan")
    y = torch.full((m, n), nan, dtype=dtype, device=device)
    rstd = torch.full((m,), nan, dtype=torch.float32, device=device)
    launch.forward(dispatch.forward_plan(x, w), x, w, EPS, y, rstd, kernels=kernels)
    dx = torch.full((m, n), nan, dtype=dtype, device=device)
    dw = None if w is None else torch.full((n,), nan, dtype=dtype, device=device)
    plan = dispatch.backward_plan(x, w, dy.dtype)
    workspace = launch.backward_workspace(plan, dtype, x.device).fill_(nan)
    launch.backward(plan, dy, x, w, rstd, dx, dw, workspace=workspace, kernels=kernels)

    x64, dy64 = x.double().cpu(), dy.double().cpu()
    w64 = None if w is None else w.double().cpu()
    y_ref, rstd_ref = reference.rms_norm_forward(x64, w64, EPS)
    dx_ref, dw_ref = reference.rms_norm_backward(dy64, x64, w64, rstd_ref)

    atol, rtol = TOLERANCES[dtype]
    result = [
        compare("y", y, y_ref, atol, rtol),
        compare("rstd", rstd, rstd_ref, *TOLERANCES[torch.float32]),
        compare("dx", dx, dx_ref, atol, rtol),
    ]
    if dw is not None:
        # dweight sums M rows: its absolute error grows like sqrt(M).
        result.append(compare("dweight", dw, dw_ref, atol * math.sqrt(m), rtol))
    return result


def best_device() -> tuple[torch.device, str]:
    """CUDA when present, else the CPU through the Triton interpreter; with a description."""
    from torch_rmsnorm_op._triton_compat import is_interpreted

    if torch.cuda.is_available() and not is_interpreted():
        return torch.device("cuda"), f"CUDA ({torch.cuda.get_device_name()})"
    if is_interpreted():
        return torch.device("cpu"), "CPU through the Triton interpreter (TRITON_INTERPRET=1)"
    raise RuntimeError("no CUDA device and TRITON_INTERPRET is not set: the kernels cannot run here")
