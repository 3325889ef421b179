"""Launch configurations: one deterministic table, keyed by N (and dtype).

No run-time autotuning: a different block shape changes the order of the
floating-point reductions, so results would stop being bit-identical from
run to run. Every threshold below is one place; change it here only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Largest row length the kernels serve; longer rows go to the fallback policy.
# Split mode has no cliff up to here (64 programs of 16384 columns per row).
MAX_N = 1 << 20

# Rows up to this N stay whole in one program's registers (single-pass mode);
# longer rows are split over several programs of at most SPLIT_BLOCK columns.
FWD_SINGLE_PASS_MAX_N = 16384
BWD_SINGLE_PASS_MAX_N = 8192
FWD_SPLIT_BLOCK = 16384
BWD_SPLIT_BLOCK = 8192
# Small rows: pack several rows per program so each moves a useful tile.
FWD_TILE_ELEMENTS = 4096
BWD_TILE_ELEMENTS = 2048
# Backward grid: programs per multiprocessor (bounds the dweight scratch: groups x N fp32).
BWD_PROGRAMS_PER_SM = 2
# The Triton interpreter runs programs one after another on the CPU; a small
# fixed count keeps its dweight reduction layout fixed too.
INTERPRETER_SM_COUNT = 4
# dweight reduction tile: partial rows x columns per step.
REDUCE_BLOCK_P = 32
REDUCE_BLOCK_N = 128


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelConfig:
    """One launch shape: ``rows`` rows of ``block_n`` columns per program, or, with
    ``split > 1``, each row spread over ``split`` programs of ``block_n`` columns."""

    block_n: int
    rows: int
    num_warps: int
    split: int = 1
    programs_per_sm: int = BWD_PROGRAMS_PER_SM  # backward only


def _warps_for(elements: int) -> int:
    # About 16 elements per thread, between 1 and 16 warps.
    return max(1, min(16, next_power_of_2(elements) // 512))


def _config(n: int, single_max: int, split_block: int, tile: int) -> KernelConfig:
    if n <= single_max:
        block = next_power_of_2(n)
        rows = max(1, tile // block)
        return KernelConfig(block, rows, _warps_for(block * rows))
    split = next_power_of_2(cdiv(n, split_block))
    block = next_power_of_2(cdiv(n, split))
    return KernelConfig(block, 1, _warps_for(block), split)


@functools.cache
def forward_config(n: int, dtype: torch.dtype) -> KernelConfig:
    """Forward launch shape for rows of length ``n`` (``1 <= n <= MAX_N``)."""
    return _config(n, FWD_SINGLE_PASS_MAX_N, FWD_SPLIT_BLOCK, FWD_TILE_ELEMENTS)


@functools.cache
def backward_config(n: int, dtype: torch.dtype) -> KernelConfig:
    """Backward (dx + dweight partials) launch shape for rows of length ``n``."""
    return _config(n, BWD_SINGLE_PASS_MAX_N, BWD_SPLIT_BLOCK, BWD_TILE_ELEMENTS)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; asked lazily, never at import)."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def backward_programs(m: int, n: int, device: torch.device, cfg: KernelConfig) -> tuple[int, int]:
    """``(row groups, rows per group)`` for the backward grid (``groups * cfg.split`` programs).
    Every group gets >= 1 row, so every dweight partial row is written."""
    target = max(1, cfg.programs_per_sm * sm_count(device) // cfg.split)
    rows_per_group = cdiv(m, target)
    # Whole tiles per group, so only the last group has a ragged tile.
    rows_per_group = cdiv(rows_per_group, cfg.rows) * cfg.rows
    return cdiv(m, rows_per_group), rows_per_group
