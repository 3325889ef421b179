"""Host side of the kernels: a ``dispatch.Plan`` and the tensors in, launches out.

The launchers take validated tensors and write into the outputs they are given (``ops.py``
allocates and validates). Each launches through one of two back ends: eagerly through
``_triton_compat.run`` (Triton's JIT the first time, the compiled kernel's own launcher after
that), or, while a compiled graph is traced, through ``torch.library.wrap_triton``, so that
Inductor sees the kernel and emits its launch in the generated code. An eager forward plan
that ran through a compiled kernel with every pointer 16-byte aligned keeps that launch
(``Plan.launcher``): a later call with the same plan replays it with the new addresses.

Under the Triton interpreter, which runs programs one after another, split mode's programs
cannot wait for each other: the same kernel runs as two launches (``PHASE`` 1 publishes the
partial sums, 2 reads them).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType, ModuleType

import torch
from torch import Tensor

from torch_rmsnorm_op import _torch_compat, _triton_compat
from torch_rmsnorm_op.config import (
    BWD_SUMMED,
    DW_COLUMN_TILE,
    MERGE_SCRATCH_BYTES,
    MERGE_SCRATCH_SHARE,
    KernelConfig,
    cdiv,
    next_power_of_2,
    reduce_tile,
    row_groups,
    sm_count,
    with_early_weight,
)
from torch_rmsnorm_op.dispatch import Plan
from torch_rmsnorm_op.layout import row_stride


@functools.cache
def _kernels():
    from torch_rmsnorm_op import kernels  # defines the kernels (TRITON_INTERPRET is read then)

    return kernels


def _launch(kernel, grid: tuple, args: list, consts: Mapping, num_warps: int, device: torch.device,
            traced: bool):
    """One launch: through ``wrap_triton`` while tracing, else eagerly on ``device``."""
    if traced:
        torch.library.wrap_triton(kernel)[grid](*args, **consts, num_warps=num_warps)
        return None
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return _triton_compat.run(kernel, device, grid, args, dict(consts), num_warps)
    return _triton_compat.run(kernel, device, grid, args, dict(consts), num_warps)


def _split_phases(traced: bool) -> tuple[int, ...]:
    return (1, 2) if not traced and _triton_compat.is_interpreted() else (0,)


def exact_tiles(cfg: KernelConfig, m, n: int) -> bool:
    """Whether a single-pass or looped forward's tiles cover [m, n] exactly: N a multiple of the
    block (looped: of the step), and for single-pass M a multiple of the rows per program (never
    assumed for a symbolic M)."""
    if n % cfg.block_n:
        return False
    return cfg.looped or (type(m) is int and m % cfg.rows == 0)


def loop_steps(cfg: KernelConfig, m, n: int) -> int:
    """A looped forward's steps per row when it runs without masks (``mask_free``, tiles that
    cover x exactly), else 0: as a constexpr (``STEPS``), a loop of known length that Triton
    unrolls, so a pass's loads are issued together; one compile per step count."""
    return n // cfg.block_n if cfg.looped and cfg.mask_free and exact_tiles(cfg, m, n) else 0


@functools.cache
def _forward_consts(cfg: KernelConfig, has_weight: bool, has_residual: bool, lead_dims: int, unmasked: bool,
                    steps: int, store_rstd: bool, weight_offset: float, round_code: int) -> Mapping:
    """The constexprs of the forward kernel ``cfg`` selects, in its parameter order."""
    if cfg.split > 1:
        out = dict(BLOCK_N=cfg.block_n, SPLIT=cfg.split, HAS_WEIGHT=has_weight, HAS_RESIDUAL=has_residual,
                   LEAD_DIMS=lead_dims, PHASE=0, STAGES=cfg.stages, STORE_RSTD=store_rstd,
                   INTERLEAVE=cfg.interleave, WEIGHT_OFFSET=weight_offset, ROUND=round_code)
    elif cfg.looped:
        out = dict(BLOCK_N=cfg.block_n, HAS_WEIGHT=has_weight, HAS_RESIDUAL=has_residual, LEAD_DIMS=lead_dims,
                   UNMASKED=unmasked, STAGES=cfg.stages, STORE_RSTD=store_rstd, STEPS=steps,
                   WEIGHT_OFFSET=weight_offset, ROUND=round_code)
    else:
        out = dict(BLOCK_N=cfg.block_n, ROWS=cfg.rows, HAS_WEIGHT=has_weight, HAS_RESIDUAL=has_residual,
                   LEAD_DIMS=lead_dims, UNMASKED=unmasked, STORE_RSTD=store_rstd, WEIGHT_OFFSET=weight_offset,
                   ROUND=round_code, EARLY_WEIGHT=cfg.early_weight)
    return MappingProxyType(out)


def forward(plan: Plan, x: Tensor, weight: Tensor | None, eps: float, y: Tensor, rstd: Tensor | None,
            residual: Tensor | None = None, h: Tensor | None = None, traced: bool = False,
            kernels: ModuleType | None = None) -> None:
    """Write ``y`` (and ``rstd`` unless None; with ``residual``, ``h = x + residual`` first, the
    row normalized being h) as ``plan`` says. ``x`` is addressed by ``plan.layout``; ``residual``,
    ``y`` and ``h`` have single-stride rows; ``weight`` is contiguous [N] or None; rstd holds M
    contiguous values. ``kernels`` replaces the package's kernels (a namespace with the same
    names; for tests)."""
    cfg, m, n, layout = plan.cfg, plan.m, plan.n, plan.layout
    if m == 0:
        return
    has_residual = residual is not None
    # None for the pointers the kernel neither reads nor writes under its constexprs: Triton takes
    # None as a constexpr, so the launch does not pass them (each pointer argument costs host time).
    ptrs = [x, residual, weight, y, h, rstd]
    # 1 for the strides of unread pointers: Triton specializes it as a constexpr, as None above
    strides = [*layout[1:], 1 if residual is None else row_stride(residual), row_stride(y),
               1 if h is None else row_stride(h)]
    unmasked = cfg.mask_free and exact_tiles(cfg, m, n)
    consts = _forward_consts(cfg, weight is not None, has_residual, layout.dims, unmasked,
                             loop_steps(cfg, m, n), rstd is not None, plan.weight_offset, plan.round_code)
    eps = float(eps)  # an int eps would be specialized apart
    k = kernels or _kernels()
    if cfg.split > 1:
        groups, rows_per_group = row_groups(m, n, x.device, cfg)
        # Zeros: no flag set. The phantom rows past M get slots too.
        slots = torch.zeros((m + rows_per_group, cfg.split), dtype=torch.int64, device=x.device)
        args = [*ptrs, slots, m, n, eps, rows_per_group, *strides]
        for phase in _split_phases(traced):
            _launch(k._rms_norm_fwd_split, (groups * cfg.split,), args, dict(consts, PHASE=phase), cfg.num_warps,
                    x.device, traced)
        return
    kernel = k._rms_norm_fwd_looped if cfg.looped else k._rms_norm_fwd_rows
    grid = (m if cfg.looped else cdiv(m, cfg.rows),)
    launcher = _launch(kernel, grid, [*ptrs, m, n, eps, *strides], consts, cfg.num_warps, x.device, traced)
    if (launcher is not None and kernels is None and plan.launcher is None and x.device.type == "cuda"
            and strides[-2] == n
            and all(t.data_ptr() & 15 == 0 for t in ptrs if t is not None)):
        plan.replay = ((*grid, 1, 1), (m, n), (*strides, *consts.values()))
        plan.launcher = launcher


def norm_add_fuses(plan: Plan, sum_plan: Plan, x: Tensor, residual: Tensor) -> bool:
    """Whether ``forward_norm_add`` runs x's norm (``plan``) and the sum's (``sum_plan``) in one
    kernel, where that gives the two ops' bits:

    - both plans take the same single-pass configuration, which the fused kernel runs, or the
      same looped one of a single step (the row in one block: N = 4,096 from 2,049 rows), which
      it runs as one row per program of that block and warps (``_norm_add_config``); and x
      and the residual have contiguous rows starting 16-byte aligned (as the norm the first op
      writes does), so that Triton lays out their loads, and the sums of squares over them, as
      in the two kernels (on CUDA, x's rows 40 elements apart beside a contiguous residual's
      33 gave another y);
    - x has a 2-byte dtype, and its norm is rounded to it only after its weight (no
      ``norm_dtype``), or, for bf16 x, also before it (``norm_dtype=bfloat16``, the cast back
      to the input dtype most Hugging Face norms make), where the kernel rounds the product by integer operations
      (``kernels.common._bf16_exact``). Rounded by a cast, the product of two bf16 values met
      the add in one fused multiply-add where the two kernels round it first (on CUDA a quarter
      of the sums differed in their last place); fp16 x with ``norm_dtype`` has no such
      rounding, and fp32 x leaves the product unrounded, free for the same contraction.

    A tensor traced for a compiled graph counts as aligned, as Inductor assumes its buffers are."""
    cfg = plan.cfg
    if cfg != sum_plan.cfg or (cfg.looped and cfg.block_n < plan.n) or cfg.split > 1:
        return False
    if x.dtype.itemsize != 2 or plan.round_code not in (0, 2 if x.dtype == torch.bfloat16 else 0):
        return False
    contiguous = (1, 1, 1, plan.n, 1, 1)
    if tuple(plan.layout) != contiguous or tuple(sum_plan.layout) != contiguous:
        return False
    return all(type(t) not in (Tensor, torch.nn.Parameter) or t.data_ptr() & 15 == 0 for t in (x, residual))


def _norm_add_config(cfg: KernelConfig, m, device: torch.device, thread_slots: int | None = None) -> KernelConfig:
    """The single-pass configuration the norm-add kernel runs for ``cfg`` over ``m`` rows: itself,
    or for a looped one of a single step, one row per program of its block and warps, whose sum
    of squares, over the same block in the same layout, has the looped kernel's bits; its two
    weights loaded first where ``with_early_weight`` says for two."""
    if cfg.looped:
        cfg = KernelConfig(cfg.block_n, 1, cfg.num_warps, mask_free=cfg.mask_free)
    return with_early_weight(cfg, m, device, thread_slots, weights=2)


def forward_norm_add(plan: Plan, x: Tensor, residual: Tensor, x_weight: Tensor | None, weight: Tensor | None,
                     x_eps: float, eps: float, y: Tensor, h: Tensor, rstd: Tensor | None, x_rstd: Tensor | None,
                     traced: bool = False, kernels: ModuleType | None = None) -> None:
    """Write ``h = residual + rmsnorm(x, x_weight, x_eps)`` and ``y = rmsnorm(h, weight, eps)``
    (and both rstds unless None) in one launch of ``plan``'s configuration (``norm_add_fuses``).
    ``x`` is addressed by ``plan.layout``; ``residual``, ``y`` and ``h`` have single-stride rows;
    the weights are contiguous [N] or None."""
    m, n, layout = plan.m, plan.n, plan.layout
    cfg = plan.norm_add_cfg
    if cfg is None:
        cfg = plan.norm_add_cfg = _norm_add_config(plan.cfg, m, x.device)
    if m == 0:
        return
    ptrs = [x, residual, x_weight, weight, y, h, rstd, x_rstd]
    strides = [*layout[1:], row_stride(residual), row_stride(y), row_stride(h)]
    consts = dict(BLOCK_N=cfg.block_n, ROWS=cfg.rows, HAS_X_WEIGHT=x_weight is not None,
                  HAS_WEIGHT=weight is not None, LEAD_DIMS=layout.dims,
                  UNMASKED=cfg.mask_free and exact_tiles(cfg, m, n), STORE_RSTD=rstd is not None,
                  WEIGHT_OFFSET=plan.weight_offset, ROUND=plan.round_code, EARLY_WEIGHT=cfg.early_weight)
    k = kernels or _kernels()
    _launch(k._rms_norm_fwd_norm_add_rows, (cdiv(m, cfg.rows),), [*ptrs, m, n, float(x_eps), float(eps), *strides],
            consts, cfg.num_warps, x.device, traced)


def replay_forward(plan: Plan, x: Tensor, weight: Tensor | None, eps: float, y: Tensor, rstd: Tensor | None,
                   residual: Tensor | None = None, h: Tensor | None = None) -> bool:
    """``forward(plan, ...)`` through the launch the plan kept, when it applies: every pointer
    16-byte aligned (what the kernel was specialized on), x's device the current one, no launch
    hook, y's rows contiguous. Returns whether it launched."""
    xp, yp = x.data_ptr(), y.data_ptr()
    rp = None if residual is None else residual.data_ptr()
    wp = None if weight is None else weight.data_ptr()
    hp = None if h is None else h.data_ptr()
    sp = None if rstd is None else rstd.data_ptr()
    index = x.get_device()
    # torch.cuda.current_device() without its lazy-init check: a plan's launcher means CUDA is up
    if ((xp | (rp or 0) | (wp or 0) | yp | (hp or 0) | (sp or 0)) & 15 or index != _torch_compat.cuda_current_device()
            or not _triton_compat.no_launch_hooks()):
        return False
    launcher = plan.launcher
    grid3, sizes, tail = plan.replay
    launcher.call(*grid3, _triton_compat.current_stream(index), *launcher.head, xp, rp, wp, yp, hp, sp, *sizes,
                  float(eps), *tail)
    return True


def forward_norm_only(plan: Plan, x: Tensor, weight: Tensor | None, eps: float, y: Tensor) -> None:
    """``forward(plan, x, weight, eps, y, None)``, a forward without residual or rstd (an eager
    ``rms_norm``'s), through the launch the plan kept where ``replay_forward``'s conditions hold:
    the same launch with fewer arguments to look at."""
    launcher = plan.launcher
    if launcher is not None:
        xp, yp = x.data_ptr(), y.data_ptr()
        wp = None if weight is None else weight.data_ptr()
        index = x.get_device()
        # torch.cuda.current_device() without its lazy-init check: a plan's launcher means CUDA is up
        if (not (xp | yp | (wp or 0)) & 15 and index == _torch_compat.cuda_current_device()
                and _triton_compat.no_launch_hooks()):
            grid3, sizes, tail = plan.replay
            launcher.call(*grid3, _triton_compat.current_stream(index), *launcher.head, xp, None, wp, yp, None, None,
                          *sizes, eps, *tail)
            return
    forward(plan, x, weight, eps, y, None)


def _known(cond) -> bool:
    """A size comparison: its value when the sizes are ints; under tracing with symbolic sizes,
    True only where provable (no guard is added)."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)


def merged_partials(groups, m, n: int, dtype: torch.dtype) -> bool:
    """Whether the backward's ``groups`` row groups over [m, n] rows of ``dtype`` share partial
    rows in pairs (``kernels.common._merge_partial``): where one row per group would exceed both
    ``MERGE_SCRATCH_BYTES`` and ``MERGE_SCRATCH_SHARE`` of dx."""
    scratch = groups * n * 4
    return _known(scratch > MERGE_SCRATCH_BYTES) and _known(scratch > MERGE_SCRATCH_SHARE * m * n * dtype.itemsize)


def backward_workspace(plan: Plan, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Uninitialized fp32 scratch for the dweight partials of ``plan`` over x of ``dtype``:
    [partial rows, N], one partial row per row group or per pair of them."""
    rows, _ = _partials(plan, dtype, device)
    return torch.empty((rows, plan.n), dtype=torch.float32, device=device)


def _partials(plan: Plan, dtype: torch.dtype, device: torch.device) -> tuple[object, bool]:
    if plan.cfg.dw_columns:  # dweight written by the launch's column programs: no partial rows
        return 0, False
    groups, _ = row_groups(plan.m, plan.n, device, plan.cfg)
    merge = merged_partials(groups, plan.m, plan.n, dtype)
    return (cdiv(groups, 2) if merge else groups), merge


@functools.cache
def _reduce_consts(block_p: int, block_n: int) -> Mapping:
    return MappingProxyType(dict(BLOCK_P=block_p, BLOCK_N=block_n))


def reduce_dweight(partial: Tensor, dweight: Tensor, rows_bound: int = 1, traced: bool = False,
                   kernels: ModuleType | None = None) -> None:
    """``dweight`` [N] = the sum of the fp32 rows of ``partial`` [P, N], in a fixed order, one
    launch. ``rows_bound`` bounds P where P is symbolic (it sizes the reduction's tile)."""
    k = kernels or _kernels()
    p, n = partial.shape
    consts = _reduce_consts(*reduce_tile(p if type(p) is int else rows_bound, n, partial.device))
    _launch(k._rms_norm_dw_reduce, (cdiv(n, consts["BLOCK_N"]),), [partial, dweight, p, n], consts, 4,
            partial.device, traced)


def dweight_acc_rows(cfg: KernelConfig, elem_bytes: int) -> int:
    """Rows of the rows backward's dweight accumulator (``kernels.rows._accumulate``): 1 where a
    tile row spans all of the program's threads at 16 bytes per thread, so that each thread holds
    whole columns of the tile and summing a tile's rows stays in its registers; else ``cfg.rows``
    (a tile's rows lie in different threads, and summing them costs an exchange per tile)."""
    return 1 if cfg.block_n >= cfg.num_warps * 32 * (16 // elem_bytes) else cfg.rows


@functools.cache
def _backward_consts(cfg: KernelConfig, has_weight: bool, has_dres: bool, lead_dims: int, merge: bool,
                     weight_offset: float, elem_bytes: int, dw_rows: int = 1) -> Mapping:
    if cfg.split > 1:
        out = dict(BLOCK_N=cfg.block_n, SPLIT=cfg.split, HAS_WEIGHT=has_weight, HAS_DRES=has_dres,
                   LEAD_DIMS=lead_dims, PHASE=0, STAGES=cfg.stages, MERGE=merge, INTERLEAVE=cfg.interleave,
                   WEIGHT_OFFSET=weight_offset, DY_TERMS=1)
    else:
        out = dict(BLOCK_N=cfg.block_n, ROWS=cfg.rows, HAS_WEIGHT=has_weight, HAS_DRES=has_dres,
                   LEAD_DIMS=lead_dims, COUNTED_LOOP=cfg.counted_loop, RELOAD=cfg.reload, STAGES=cfg.stages,
                   PREFETCH=cfg.prefetch,
                   MERGE=merge, WEIGHT_OFFSET=weight_offset, ACC_ROWS=dweight_acc_rows(cfg, elem_bytes),
                   DY_TERMS=1, DW_COLUMNS=cfg.dw_columns if has_weight else 0, DW_ROWS=dw_rows)
    return MappingProxyType(out)


def dweight_column_rows(cfg: KernelConfig, m: int) -> int:
    """Rows a step of the backward's dweight column programs (``cfg.dw_columns`` > 0): tiles of
    up to ``DW_COLUMN_TILE`` elements, no more rows than M's next power of two."""
    return max(1, min(next_power_of_2(m), DW_COLUMN_TILE // cfg.dw_columns))


# The most tensors a backward launch sums into its gradient (the kernels' DY ... DY5).
MAX_DY_TERMS = 5
# The most a compiled graph's launch of 4-byte gradients is handed (post_grad.fuse_gradient_sums):
# fp32 tiles hold twice the bytes, and with 4 or 5 terms the N = 8,192 rung spilled 236-292
# registers (3 terms: 34-70).
MAX_DY_TERMS_FP32 = 3


def max_dy_terms(elem_bytes: int) -> int:
    """The most gradient terms ``post_grad.fuse_gradient_sums`` hands a backward launch of
    ``elem_bytes``-byte gradients."""
    return MAX_DY_TERMS if elem_bytes <= 2 else MAX_DY_TERMS_FP32


def summed_gradient_consts(consts: Mapping, terms: int, elem_bytes: int) -> dict:
    """The constexprs that change when a backward launch with ``consts`` sums ``terms`` (2 to
    ``MAX_DY_TERMS``) gradient tensors of ``elem_bytes`` bytes: ``DY_TERMS``, and for the rows
    kernel the rows per tile and the row loop's stages (``config.BWD_SUMMED``, whose 3-term
    entry serves more terms; elsewhere half the rows, at least 1),
    which leave registers for the terms' loads; a launch that loads its next tile ahead
    (``PREFETCH``) keeps its stages. A split launch keeps its chunks and takes fewer stages
    where it needs to: its pipeline holds ``STAGES - 1`` rows of x, of each term and of the
    residual's gradient in shared memory, whose bytes stay within the one-term launch's (at
    N = 65,536 in bf16, stages 4 with five terms and the residual's gradient would need 336 KiB).
    The grid, the rows per group and the dweight partials of the launch stay as they are (the
    row loop masks a tile that crosses its group's end)."""
    out = {"DY_TERMS": terms}
    if "SPLIT" in consts and consts["STAGES"] > 1:
        tensors = 1 + bool(consts["HAS_DRES"])  # read beside the gradient's terms: x, the residual's gradient
        stages = 1 + (consts["STAGES"] - 1) * (1 + tensors) // (terms + tensors)
        if stages != consts["STAGES"]:
            out["STAGES"] = stages
    if "ROWS" in consts and consts["ROWS"] > 1:
        table = BWD_SUMMED.get(consts["BLOCK_N"]) if elem_bytes == 2 else None
        rows, stages = table[min(terms, 3) - 2] if table else (consts["ROWS"] // 2, consts["STAGES"])
        if consts.get("PREFETCH"):  # its loads are already a tile ahead
            stages = consts["STAGES"]
        rows = min(consts["ROWS"], rows)
        if rows != consts["ROWS"]:
            out["ROWS"] = rows
            if consts["ACC_ROWS"] == consts["ROWS"]:
                out["ACC_ROWS"] = rows
        if stages != consts["STAGES"]:
            out["STAGES"] = stages
    return out


def backward(plan: Plan, dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor,
             dweight: Tensor | None, dres: Tensor | None = None, workspace: Tensor | None = None,
             traced: bool = False, kernels: ModuleType | None = None, dy_terms: tuple[Tensor, ...] = ()) -> None:
    """Write ``dx`` (plus ``dres``, the gradient that reached the forward's residual sum, if
    given) and, with a weight, ``dweight`` [N] (contiguous), as ``plan`` says (M, N >= 1): one
    launch, and a dweight reduction unless the grid is a single row group or dweight comes
    from the launch's column programs (``cfg.dw_columns``). ``x`` is addressed
    by ``plan.layout``; dy, dx and dres have single-stride rows; rstd holds M contiguous values.
    ``workspace`` is the dweight scratch (``backward_workspace``), allocated when None.
    ``dy_terms``: up to ``MAX_DY_TERMS - 1`` more tensors of dy's dtype and strides; the
    gradient is then their sum with dy, in fp32, in order, rounded once to dy's dtype (what the
    backward of a norm whose output feeds several ops receives; ``post_grad.fuse_gradient_sums``
    passes them)."""
    if len(dy_terms) >= MAX_DY_TERMS or any(t.dtype != dy.dtype or t.stride() != dy.stride() for t in dy_terms):
        raise ValueError(f"dy_terms: at most {MAX_DY_TERMS - 1} tensors, of dy's dtype and strides")
    cfg, m, n, layout = plan.cfg, plan.m, plan.n, plan.layout
    device = x.device
    groups, rows_per_group = row_groups(m, n, device, cfg)
    has_weight = weight is not None
    partial = flags = None
    merge = False
    direct = False
    columns = has_weight and cfg.dw_columns > 0
    if has_weight:
        rows, merge = _partials(plan, x.dtype, device)
        # One row group: its partial row is dweight, written by the kernel in dweight's dtype;
        # so are the column programs' blocks of it.
        direct = columns or (type(rows) is int and rows == 1 and not merge)
        if direct:
            partial = dweight
        elif workspace is not None:
            partial = workspace
        else:
            partial = torch.empty((rows, n), dtype=torch.float32, device=device)
        if merge:
            flags = torch.zeros(rows * cfg.split, dtype=torch.int32, device=device)
    # None for the pointers the kernel does not read under its constexprs (see forward)
    ptrs = [dy, *dy_terms, *(None,) * (MAX_DY_TERMS - 1 - len(dy_terms)), x, weight, rstd, dx, dres, partial, flags]
    strides = [*layout[1:], row_stride(dy), row_stride(dx), 1 if dres is None else row_stride(dres)]
    consts = _backward_consts(cfg, has_weight, dres is not None, layout.dims, merge, plan.weight_offset,
                              x.dtype.itemsize, dweight_column_rows(cfg, m) if columns else 1)
    if dy_terms:
        consts = {**consts, **summed_gradient_consts(consts, 1 + len(dy_terms), dy.dtype.itemsize)}
    k = kernels or _kernels()
    if cfg.split > 1:
        slots = torch.zeros((m + rows_per_group, cfg.split), dtype=torch.int64, device=device)
        args = [*ptrs, slots, m, n, rows_per_group, *strides]
        for phase in _split_phases(traced):
            _launch(k._rms_norm_bwd_split, (groups * cfg.split,), args, dict(consts, PHASE=phase), cfg.num_warps,
                    device, traced)
    else:
        grid = groups + (cdiv(n, cfg.dw_columns) if columns else 0)
        _launch(k._rms_norm_bwd_rows, (grid,), [*ptrs, m, n, rows_per_group, *strides], consts, cfg.num_warps,
                device, traced)
    if has_weight and not direct:
        bound = max(1, cfg.programs_per_sm * sm_count(device) // cfg.split)
        reduce_dweight(partial, dweight, bound, traced, k)


_KERNEL_NAMES = ("_rms_norm_fwd_rows", "_rms_norm_fwd_norm_add_rows", "_rms_norm_fwd_looped", "_rms_norm_fwd_split",
                 "_rms_norm_bwd_rows", "_rms_norm_bwd_split", "_rms_norm_dw_reduce")


@functools.cache
def register_kernels_for_cache_key(op: str) -> None:
    """Make every kernel of the package part of the compile cache's key for graphs that call
    ``op`` (``rmsnorm::<name>``): AOTAutograd keys a graph on the ops Dynamo captured, the
    forward ops, and the graph it caches launches the backward's kernels too. Not under the
    Triton interpreter: no graph launches interpreted kernels (a CPU graph calls the op whole),
    and the cache cannot read their source."""
    if _triton_compat.is_interpreted():
        return
    k = _kernels()
    _torch_compat.register_triton_kernels(op, [getattr(k, name) for name in _KERNEL_NAMES])
