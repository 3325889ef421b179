"""The launch table: every N the kernels serve gets a configuration that covers the row."""

import dataclasses

import pytest
import torch

from torch_rmsnorm_op import launch
from torch_rmsnorm_op.config import (
    BWD_DW_COLUMNS,
    EARLY_WEIGHT_ELEMENTS,
    MAX_N,
    MAX_SPLIT,
    KernelConfig,
    backward_config,
    fit_to_rows,
    forward_config,
    next_power_of_2,
    with_early_weight,
)


def _lengths():
    for p in range(21):
        for n in (2**p - 1, 2**p, 2**p + 1):
            if 1 <= n <= MAX_N:
                yield n
    yield from (257, 5000, 20000, 300000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_row_length_is_covered(dtype):
    for n in (*_lengths(), 1536, 5120, 5632, 6144, 7168):
        for cfg in (forward_config(n, dtype), forward_config(n, dtype, residual=True), backward_config(n, dtype)):
            assert 1 <= cfg.split <= MAX_SPLIT, (n, cfg)
            # Split mode: its programs cover the row (a power of two of them, some may be
            # empty); a looped program steps over any row; otherwise one block holds a whole row.
            if cfg.split > 1:
                assert cfg.block_n * cfg.split >= n > cfg.block_n * cfg.split // 2, (n, cfg)
            elif not cfg.looped:
                assert cfg.block_n >= n, (n, cfg)
            assert cfg.num_warps * 32 <= cfg.block_n * cfg.rows or cfg.block_n * cfg.rows < 128, (n, cfg)


def test_forward_rungs_that_only_some_row_lengths_take():
    """Rungs with ``divides`` serve only N that their step divides, and ``plain`` ones only the
    forward without a residual: other N, and the forward with a residual, take the next rung."""
    bf16 = torch.bfloat16
    plain, summed = forward_config(5120, bf16), forward_config(5120, bf16, residual=True)
    assert (plain.looped, plain.block_n, plain.num_warps, plain.mask_free) == (True, 1024, 8, True)
    assert (summed.looped, summed.block_n, summed.rows, summed.num_warps) == (False, 8192, 1, 4)
    for residual in (False, True):
        six = forward_config(6144, bf16, residual)
        assert (six.looped, six.block_n, six.mask_free) == (True, 2048, True)
        assert forward_config(5632, bf16, residual) == summed  # 2048 does not divide 5632
    assert forward_config(4608, bf16) == summed  # nor 1024 4608
    assert forward_config(5120, torch.float32) == forward_config(5120, torch.float32, residual=True)
    assert forward_config(1536, bf16) == forward_config(1536, bf16, residual=True)
    assert (forward_config(1536, bf16).rows, forward_config(1536, bf16).num_warps) == (1, 4)


def test_dweight_scratch_merges_in_pairs_only_where_it_is_large():
    """``launch.merged_partials``: one scratch row per row group, or one per pair where the
    scratch would exceed both MERGE_SCRATCH_BYTES and MERGE_SCRATCH_SHARE of dx. Group counts as
    on a GPU of 132 SMs (``row_groups``) at the benchmark's shapes."""
    from torch_rmsnorm_op.launch import merged_partials

    bf16, fp32 = torch.bfloat16, torch.float32
    assert merged_partials(132, 8192, 16384, bf16)  # 256 MiB, N = 16384: 8.25 MiB is 3.2% of dx
    assert not merged_partials(264, 32768, 4096, bf16)  # 256 MiB, N = 4096: 4.1 MiB is 1.6% of dx
    assert not merged_partials(264, 16384, 4096, bf16)  # 128 MiB: 3.2% of dx, but 4.1 MiB
    assert not merged_partials(512, 8192, 2048, bf16)  # a model's 8192 x 2048: 4 MiB, 12.5% of dx
    assert not merged_partials(4, 512, 262144, bf16)  # 4 MiB, 1.6% of dx
    assert not merged_partials(16, 128, 257, fp32)  # 16 KiB: not worth the merge's memset and wait
    assert merged_partials(7, 30, 262144, fp32)  # 7 MiB, a lone last group


def test_forward_rungs_for_few_rows():
    """Rungs with ``max_m`` serve a known M up to it; more rows, and a symbolic M (None), take
    the rungs tuned at many rows. fp32 has none."""
    bf16 = torch.bfloat16

    def shape(cfg):
        return cfg.looped, cfg.block_n, cfg.rows, cfg.num_warps

    for residual in (False, True):
        assert shape(forward_config(2048, bf16, residual, 16)) == (False, 2048, 1, 4)
        assert shape(forward_config(2048, bf16, residual, 4096)) == (False, 2048, 1, 4)
        assert forward_config(2048, bf16, residual, 4097) == forward_config(2048, bf16, residual)
        assert shape(forward_config(2048, bf16, residual)) == (False, 2048, 2, 8)
        assert shape(forward_config(4096, bf16, residual, 2048)) == (False, 4096, 1, 8)
        assert forward_config(4096, bf16, residual, 2048).mask_free
        assert forward_config(4096, bf16, residual, 2049) == forward_config(4096, bf16, residual)
        assert forward_config(4096, bf16, residual).looped
    for n in (2049, 3584, 4095):
        assert shape(forward_config(n, bf16, m=1024)) == (False, 4096, 1, 8)
        assert shape(forward_config(n, bf16, m=1025)) == shape(forward_config(n, bf16)) == (False, 4096, 1, 2)
    for residual in (False, True):  # N = 8,192: single-pass, then looped in steps of 2,048, then of 4,096
        assert shape(forward_config(8192, bf16, residual, 528)) == (False, 8192, 1, 8)
        assert forward_config(8192, bf16, residual, 528).mask_free
        assert forward_config(8192, bf16, residual, 1025) == forward_config(8192, bf16, residual)
        assert shape(forward_config(8192, bf16, residual)) == (True, 4096, 1, 16)
    assert shape(forward_config(8192, bf16, m=529)) == shape(forward_config(8192, bf16, m=1024)) == (True, 2048, 1, 8)
    assert forward_config(8192, bf16, True, 529) == forward_config(8192, bf16, True)  # without a residual only
    assert shape(forward_config(5120, bf16, m=1024)) == (False, 8192, 1, 4)
    assert shape(forward_config(5120, bf16, m=1025)) == (True, 1024, 1, 4)
    assert shape(forward_config(5120, bf16, m=2048)) == (True, 1024, 1, 4)
    assert forward_config(5120, bf16, m=2049) == forward_config(5120, bf16)
    assert shape(forward_config(5120, bf16)) == (True, 1024, 1, 8)
    summed = forward_config(5120, bf16, residual=True)
    assert all(forward_config(5120, bf16, True, m) == summed for m in (16, 2048, None))
    assert forward_config(4608, bf16, m=2048) == summed  # 1024 does not divide 4608
    fp32 = torch.float32
    for n in (2048, 4096, 5120):
        assert forward_config(n, fp32, m=16) == forward_config(n, fp32)
        # A weight as wide as x or narrower takes the few-rows rungs.
        assert forward_config(n, bf16, m=16, weight_dtype=bf16) == forward_config(n, bf16, m=16)
        assert forward_config(n, fp32, m=16, weight_dtype=bf16) == forward_config(n, fp32)
        # A wider one over 2-byte rows its own up to 2,048 rows at N <= 4,096: 2 rows x 4 warps.
        for residual in (False, True):
            wide = forward_config(n, bf16, residual, 2048, weight_dtype=fp32)
            if n <= 4096:
                assert shape(wide) == (False, n, 2, 4) and wide.mask_free, wide
                assert forward_config(n, bf16, residual, 16, weight_dtype=fp32) == wide
            else:
                assert wide == forward_config(n, bf16, residual)
            # More rows, or a symbolic M: the rungs for many rows.
            assert forward_config(n, bf16, residual, 2049, weight_dtype=fp32) == forward_config(n, bf16, residual)
            assert forward_config(n, bf16, residual, weight_dtype=fp32) == forward_config(n, bf16, residual)
        assert forward_config(n, fp32, m=16, weight_dtype=torch.float64) == forward_config(n, fp32)
    assert shape(forward_config(1536, bf16, m=528, weight_dtype=fp32)) == (False, 2048, 2, 4)
    assert forward_config(1024, bf16, m=16, weight_dtype=fp32) == forward_config(1024, bf16)


def test_the_forward_loads_its_weight_first_where_that_was_measured_faster():
    """Tiles of ``EARLY_WEIGHT_ELEMENTS`` per thread load the weight first at any M, symbolic
    included; one row per program, where M is known and its threads fill at most half of the
    device's; the N = 2,048 rung for many rows, as its options say; never several rows per
    program otherwise, nor the looped or split forward. The norm-add kernel's two weights load
    first at the wide tiles over few rows only."""
    cpu = torch.device("cpu")
    bf16 = torch.bfloat16
    many = forward_config(2048, bf16, m=8192)
    assert (many.rows, many.early_weight) == (2, True) and forward_config(2048, bf16).early_weight
    assert not forward_config(2048, bf16, m=4096).early_weight  # the few-rows rung: by M, below
    slots = 132 * 2048  # the H200's
    wide = KernelConfig(8192, 1, 4)  # N = 7,168: 64 elements per thread
    assert 8192 // (4 * 32) == EARLY_WEIGHT_ELEMENTS
    for m in (16, 2048, 16384, None):
        assert with_early_weight(wide, m, cpu, slots) == dataclasses.replace(wide, early_weight=True)
    assert with_early_weight(KernelConfig(8192, 2, 4), 16384, cpu, slots).early_weight  # fp32 N = 8,192
    assert not with_early_weight(KernelConfig(4096, 1, 4), 16384, cpu, slots).early_weight  # 32 per thread
    one_row = KernelConfig(2048, 1, 4, mask_free=True)  # 128 threads
    assert with_early_weight(one_row, 16, cpu, slots).early_weight
    assert with_early_weight(one_row, 1056, cpu, slots).early_weight  # 1,056 x 128 = half of the slots
    assert not with_early_weight(one_row, 1057, cpu, slots).early_weight
    assert not with_early_weight(one_row, 2048, cpu, slots).early_weight
    assert not with_early_weight(one_row, None, cpu, slots).early_weight
    assert not with_early_weight(KernelConfig(128, 2, 2), 264, cpu, slots).early_weight
    assert not with_early_weight(KernelConfig(8192, 1, 4, looped=True), 16, cpu, slots).early_weight
    assert not with_early_weight(KernelConfig(8192, 1, 4, split=4), 16, cpu, slots).early_weight
    for m, early in ((16, True), (1056, True), (1057, False), (None, False)):
        assert with_early_weight(wide, m, cpu, slots, weights=2).early_weight == early
        assert with_early_weight(one_row, m, cpu, slots, weights=2).early_weight == early
    assert with_early_weight(many, 8192, cpu, slots, weights=2).early_weight  # the rung's option holds
    assert not with_early_weight(dataclasses.replace(wide, early_weight=True), 8192, cpu, slots, 2).early_weight
    # Without thread_slots, the device's: the interpreter's 4 multiprocessors of 2,048 threads.
    assert with_early_weight(one_row, 32, cpu).early_weight
    assert not with_early_weight(one_row, 33, cpu).early_weight
    with pytest.raises(ValueError, match="early_weight is for the single-pass forward"):
        KernelConfig(1024, 1, 4, looped=True, early_weight=True)
    with pytest.raises(ValueError, match="early_weight is for the single-pass forward"):
        KernelConfig(1024, 1, 4, split=4, early_weight=True)


def test_backward_rungs_for_few_rows():
    """The N = 65-128 backward (head norms) takes 64-row tiles x 4 warps up to 32768 rows; more
    rows, a symbolic M (None), N <= 64 and fp32 keep the rungs tuned at many rows."""
    bf16, fp32 = torch.bfloat16, torch.float32
    many = backward_config(128, bf16)
    assert (many.rows, many.num_warps, many.programs_per_sm) == (32, 16, 2)
    def rung(cfg):  # the ladder's choice, apart from how dweight is summed over a few rows
        return dataclasses.replace(cfg, dw_columns=0)

    for m in (1, 8192, 32768):
        few = backward_config(128, bf16, m)
        assert (few.block_n, few.rows, few.num_warps, few.counted_loop) == (128, 64, 4, True)
        assert fit_to_rows(few, m, torch.device("cpu")) == few  # fewer, fuller row groups at any M
        assert backward_config(100, torch.float16, m) == few
        assert rung(backward_config(64, bf16, m)) == backward_config(64, bf16)
        assert rung(backward_config(128, fp32, m)) == backward_config(128, fp32)
    assert backward_config(128, bf16, 32769) == many
    assert rung(backward_config(256, bf16, 16)) == backward_config(256, bf16)


def test_backward_dweight_from_column_programs_over_few_rows():
    """Up to ``BWD_DW_COLUMNS[0]`` rows, M known, the backward's own launch writes dweight from
    column programs; more rows, a symbolic M (None) and split mode keep the partial rows and
    the reduction."""
    max_m, columns = BWD_DW_COLUMNS
    for n, dtype in ((2048, torch.bfloat16), (128, torch.bfloat16), (257, torch.float32), (16, torch.float16),
                     (5120, torch.bfloat16)):
        for m in (1, 16, max_m):
            assert backward_config(n, dtype, m).dw_columns == min(columns, next_power_of_2(n))
        assert backward_config(n, dtype, max_m + 1).dw_columns == 0
        assert backward_config(n, dtype).dw_columns == 0
    split = backward_config(MAX_N, torch.bfloat16, 16)
    assert split.split > 1 and split.dw_columns == 0


def test_a_symbolic_row_count_takes_the_rungs_for_many_rows_and_a_wider_weight_its_own(device):
    """``dispatch.forward_plan`` passes M to the table only where it is an int: a graph traced
    with a dynamic batch gets the launch tuned at many rows, one graph for every M; and it
    passes the weight's dtype: an fp32 weight over bf16 rows gets its own rungs for few rows
    (``FWD_LADDER_WIDE_WEIGHT``), and above them the launch tuned at many rows."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from torch_rmsnorm_op import dispatch

    bf16 = torch.bfloat16
    x, w = torch.empty(2048, 2048, dtype=bf16, device=device), torch.ones(2048, dtype=bf16, device=device)
    assert dispatch.forward_plan(x, w).cfg == forward_config(2048, bf16, m=2048)
    assert dispatch.forward_plan(x, w.float()).cfg == forward_config(2048, bf16, m=2048, weight_dtype=torch.float32)
    assert dispatch.forward_plan(x, w.float()).cfg.rows == 2
    x_many = torch.empty(2049, 2048, dtype=bf16, device=device)
    assert dispatch.forward_plan(x_many, w.float()).cfg == forward_config(2048, bf16)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(x, symbolic_context=context)
    with mode:
        plan = dispatch.forward_plan(x, mode.from_tensor(w))
    assert plan.cfg == forward_config(2048, bf16)
    assert plan.cfg != forward_config(2048, bf16, m=2048)


def test_a_summing_split_launch_keeps_its_pipeline_within_the_one_term_bytes():
    """A split backward launch that sums gradient terms holds ``STAGES - 1`` rows of x, of each
    term and of the residual's gradient in shared memory: it takes the most stages whose bytes
    stay within the one-term launch's, at least 1."""
    def stages(start, terms, dres):
        consts = {"SPLIT": 8, "BLOCK_N": 8192, "STAGES": start, "HAS_DRES": dres, "DY_TERMS": 1}
        return launch.summed_gradient_consts(consts, terms, 2).get("STAGES", start)

    # bf16's rung, stages 4: three rows of x, dy (and the residual's gradient) ahead
    assert [stages(4, t, True) for t in (2, 3, 4, 5)] == [3, 2, 2, 2]
    assert [stages(4, t, False) for t in (2, 3, 4, 5)] == [3, 2, 2, 2]
    # fp32's, stages 3
    assert [stages(3, t, True) for t in (2, 3, 4, 5)] == [2, 2, 2, 1]
    assert [stages(3, t, False) for t in (2, 3, 4, 5)] == [2, 2, 1, 1]
    assert stages(1, 5, True) == 1


def test_the_backward_loads_the_next_row_ahead_at_n_4097_to_8192():
    """The rows backward's rung for N = 4,097-8,192 (2- and 4-byte dtypes) holds one row a tile and
    loads the next ahead; a summing launch of it keeps that and its stages. ``prefetch`` is for
    the single-pass backward that reads x and dy once."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n in (4097, 5120, 8192):
            cfg = backward_config(n, dtype)
            assert (cfg.rows, cfg.num_warps, cfg.prefetch) == (1, 16, True), (dtype, n, cfg)
        assert not backward_config(4096, dtype).prefetch
        assert not backward_config(8193, dtype).prefetch
    consts = {"ROWS": 1, "ACC_ROWS": 1, "BLOCK_N": 8192, "STAGES": 1, "PREFETCH": True}
    assert launch.summed_gradient_consts(consts, 3, 2) == {"DY_TERMS": 3}
    staged = {"ROWS": 2, "ACC_ROWS": 1, "BLOCK_N": 2048, "STAGES": 1}
    assert launch.summed_gradient_consts({**staged, "PREFETCH": True}, 3, 2) == {"DY_TERMS": 3, "ROWS": 1}
    assert launch.summed_gradient_consts({**staged, "PREFETCH": False}, 3, 2) == {"DY_TERMS": 3, "ROWS": 1,
                                                                                 "STAGES": 2}
    for bad in (dict(split=4), dict(looped=True), dict(reload=True)):
        with pytest.raises(ValueError, match="prefetch is for the single-pass backward"):
            KernelConfig(1024, 1, 4, prefetch=True, **bad)
