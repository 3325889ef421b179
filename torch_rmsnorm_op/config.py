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
# The looped path has no cliff up to here; the backward scratch is
# programs x N fp32, so this bounds the scratch as well.
MAX_N = 1 << 20

# Forward keeps the whole row in registers up to this N (fp32 elements per
# thread stay <= 32 at 16 warps); longer rows loop over FWD_LOOP_BLOCK chunks.
FWD_SINGLE_PASS_MAX_N = 16384
FWD_LOOP_BLOCK = 4096
# Backward holds x, dy, weight and the dweight accumulator per row: half the span.
BWD_SINGLE_PASS_MAX_N = 8192
BWD_LOOP_BLOCK = 2048
# Small rows: pack several rows per program so each moves a useful tile.
TILE_ELEMENTS = 4096
# Backward grid for dweight partials: programs per multiprocessor.
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
    """One launch shape: BLOCK_N columns x ROWS rows per step."""

    block_n: int
    rows: int
    num_warps: int
    single_pass: bool


def _warps_for(elements: int) -> int:
    # About 16 elements per thread, between 1 and 16 warps.
    return max(1, min(16, next_power_of_2(elements) // 512))


def forward_config(n: int, dtype: torch.dtype) -> KernelConfig:
    """Forward launch shape for rows of length ``n`` (``n >= 1``)."""
    if n <= FWD_SINGLE_PASS_MAX_N:
        block = next_power_of_2(n)
        rows = max(1, TILE_ELEMENTS // block)
        return KernelConfig(block, rows, _warps_for(block * rows), True)
    return KernelConfig(FWD_LOOP_BLOCK, 1, _warps_for(FWD_LOOP_BLOCK), False)


def backward_config(n: int, dtype: torch.dtype) -> KernelConfig:
    """Backward (dx + dweight partials) launch shape for rows of length ``n``."""
    if n <= BWD_SINGLE_PASS_MAX_N:
        block = next_power_of_2(n)
        rows = max(1, TILE_ELEMENTS // 2 // block)
        return KernelConfig(block, rows, _warps_for(block * rows), True)
    return KernelConfig(BWD_LOOP_BLOCK, 1, _warps_for(BWD_LOOP_BLOCK), False)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; asked lazily, never at import)."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def backward_programs(m: int, n: int, device: torch.device, cfg: KernelConfig) -> tuple[int, int]:
    """``(programs, rows_per_program)`` for the backward grid; every program gets >= 1 row,
    so every dweight partial row is written."""
    target = BWD_PROGRAMS_PER_SM * sm_count(device)
    rows_per_program = cdiv(m, target)
    # Whole tiles per program, so only the last program has a ragged tile.
    rows_per_program = cdiv(rows_per_program, cfg.rows) * cfg.rows
    return cdiv(m, rows_per_program), rows_per_program
