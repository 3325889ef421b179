"""Launch configurations: one deterministic table, keyed by N and dtype (a few rungs also by
the number of rows, where it is known).

No run-time autotuning: a different block shape changes the order of the
floating-point reductions, so results would stop being bit-identical from
run to run. Every threshold below is one place; change it here only.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

# Largest row length the kernels serve; longer rows go to the fallback policy.
# Split mode has no cliff up to here: it spreads a row over at most MAX_SPLIT programs
# (columns per program grow past the table's to keep it so), which must all be resident at
# once, so a GPU with fewer SMs than a row needs programs sends that N to the fallback
# policy (dispatch.split_mode_reason).
MAX_N = 1 << 20
MAX_SPLIT = 128

# The ladders below were chosen on the H200 by profiling/tune.py: bf16 unless marked, x of 256 MiB,
# % of the copy ceiling measured in the same run. "Bench timing" is tune.py --timing bench, the
# benchmark's own measure (back-to-back calls, profiler GPU time); without it tune.py times with
# triton.testing.do_bench, which clears L2 before every call and disagreed with the benchmark on
# the looped rungs: 8192 columns x 16 warps at N=8192 / 16384 97.6% / 94.8% under do_bench
# (fwd-looped-do-bench.json), 81.4% / 81.3% in the benchmark (bench-looped-8192x16.md). Files named
# here are in profiling/results/tuning/2026-11-29-h200-tuning/ (its README gives each file's command and
# code); docs/design.md gives the reasons, docs/tried.md the variants that lost.
#
# Forward: (max N, elements per program, warps, options). Single-pass (whole rows in
# registers), or looped (``looped``: one row per program, elements = columns per step, x read
# twice, the second time from cache: Inductor's loop). Three options only pick the rung: ``divides``
# (N a multiple of the elements; other N go on down the ladder), ``plain`` (forwards without a
# residual only) and ``max_m`` (at most this many rows, where M is known when the plan is made: an
# eager call, a graph traced with static shapes; a symbolic M, or a weight wider than x, goes on
# down: forward_config). Figures marked "retune" are from
# profiling/results/tuning/2026-12-04-h200-early-weight/retune-bf16.json: every tune.py forward candidate
# against Inductor at 16, 2048 and 8192 rows, inputs past L2, one round.
FWD_LADDER = (
    # N=256: 8 rows x 2 warps 98.3% (16 x 8: 96.1%); 1024: 2 x 2 97.4% (4 x 8: 97.2%; fwd-near.json)
    (1024, 2048, 2, {}),
    # N=1536: 1 row x 4 warps, retune 80.7% at 8192 rows (2 rows x 8 warps, the N=2048 rung: 75.8%; 4 rows x 1
    # warp 83.5%).
    (2047, 2048, 4, {}),
    # Few rows: N=2048 1 row x 4 warps (retune), 16 / 2048 rows 1.22 / 6.00 us against the rung below's 1.38 /
    # 6.67 (Inductor 1.40 / 6.34), with the residual at 2048 rows 9.58 against 10.31; at 8192 rows 18.33 against
    # 18.29.
    (2048, 2048, 4, dict(mask_free=True, max_m=4096)),
    # N=2048 at 8192 rows (retune): 2 rows x 8 warps without masks 85.8% (8 rows x 8 warps: 80.6%). With the
    # weight loaded first (early_weight): 17.98 -> 17.64 us at 8192 rows, 34.77 -> 34.43 with the residual, the
    # norm-add kernel 35.21 -> 34.59; with an fp32 weight 17.90 -> 17.88, and 5.38 -> 5.63 at 2048 rows, where
    # such a weight takes this rung (early-weight.json).
    (2048, 4096, 8, dict(mask_free=True, early_weight=True)),
    # N=2049-4095: 1 row x 2 warps, 64 elements a thread, so the weight loads first (with_early_weight); 1 row x 8
    # warps, the rung before, at 2048 / 8192 rows (profiling/results/tuning/2026-12-04-h200-early-weight/
    # rung-2049-4095.json, retune-bf16.json): N=2560 7.09 / 22.67 us against 7.84 / 23.57, 3072 7.87 / 25.38
    # against 9.18 / 26.32, 3584 8.83 / 29.22 against 9.91 / 30.07 (Inductor 9.61 / 37.01), with the residual
    # 15.85 / 57.38 against 16.25 / 57.86; N=3840 9.42 / 31.51 against 10.20 / 32.40. Few rows keep 1 row x 8 warps
    # (the weight first up to 528 rows): N=3584 at 16 / 528 / 1024 rows 1.28 / 3.05 / 4.44 us against 1 row x 2
    # warps' 1.42 / 3.12 / 4.50, at 2048 rows 8.05 against 7.84 (early-weight-a.json, early-weight.json); 16 rows
    # N=3840 1.29 against 1.78 (rung-2049-4095.json).
    (4095, 4096, 8, dict(max_m=1024)),
    (4095, 4096, 2, {}),
    # Few rows: N=4096 single-pass, 1 row x 8 warps without masks, up to 2048 rows. Without a residual, looped
    # steps of 2048 x 8 warps run 2048 rows in 10.53 us against 10.81 (retune), but not with one: the norm-add
    # kernel needs both forwards on one configuration (docs/tried.md).
    (4096, 4096, 8, dict(mask_free=True, max_m=2048)),
    # N=4096 looped, one step of the whole row x 8 warps without masks: the inference forward 94.1% / 97.6% at
    # 8192 / 16384 rows (profiling/results/tuning/2026-12-04-h200-real-shapes-rotating/real-shapes-fwd-inference.json).
    (4096, 4096, 8, dict(looped=True, mask_free=True)),
    # Few rows: N=4097-5120 single-pass, 1 row x 4 warps (the rung below 6144's): without a residual at 16 rows
    # 1.84 us against the looped rung's 2.07 (retune); 5120 at 1025-2048 rows looped in steps of 1024 x 4 warps,
    # 12.62 us at 2048 rows against 8 warps' 13.16 (1 row x 4 warps 12.66; retune).
    (5120, 8192, 4, dict(max_m=1024)),
    (5120, 1024, 4, dict(looped=True, mask_free=True, divides=True, plain=True, max_m=2048)),
    # N=5120 without a residual looped in 5 steps of 1024 columns x 8 warps, without masks: retune 92.6% at 8192
    # rows (1 row x 4 warps: 87.8%); with the residual the single-pass rung below stays.
    (5120, 1024, 8, dict(looped=True, mask_free=True, divides=True, plain=True)),
    # N=6144 looped in 3 steps of 2048 x 8 warps.
    (6144, 2048, 8, dict(looped=True, mask_free=True, divides=True)),
    # N=7168 1 row x 4 warps, training forward at 8192 rows 97.0%, 8 warps 94.0% (looped 1024 x 8 without masks
    # 93.2%, looped 4096 x 16 89.5%; fwd-7168-training.json in
    # profiling/results/tuning/2026-12-04-h200-real-shapes-rotating/); N=8192 takes the looped rung below.
    (8191, 8192, 4, {}),
    # Few rows of N=8192: single-pass, 1 row x 8 warps without masks, up to 528 rows; without a residual, looped
    # in steps of 2048 x 8 warps up to 1024 rows (with one, that loop is slower).
    (8192, 8192, 8, dict(mask_free=True, max_m=528)),
    (8192, 2048, 8, dict(looped=True, mask_free=True, plain=True, max_m=1024)),
    # Looped, by bench timing (fwd-near.json): 4096 columns x 16 warps, Inductor's own configuration
    # (inductor-best-configs.txt), 8192 97.4% (single-pass 2 rows x 4 warps 96.6%), 16384 96.7% (single-pass
    # 96.1%); 32768 at 8192 x 32 warps 93.9% (single-pass x 16 warps 90.5%). Without masks where N is a multiple
    # of the step (mask_free): 8192 98.6% (97.6%), 16384 97.5% (97.0%), 32768 98.1% (94.0%; fwd-looped-unmasked.json
    # against table-base.json). Without masks the loops also have a known length (launch.loop_steps), which
    # Triton unrolls, as in Inductor's kernels: 8192 99.7% (98.3-98.4%), 16384 97.3-97.5% (97.1-97.2%), 32768
    # 97.9-98.1% (97.7-97.8%; fwd-loop-steps-r1/r2.json against fwd-loop-runtime-bound-r1/r2.json).
    (16384, 4096, 16, dict(looped=True, mask_free=True)),
    (32768, 8192, 32, dict(looped=True, mask_free=True)),
    # N=65536 and up: split mode (below): 80.6% at 65536 against the looped rung's 77.1% (do_bench,
    # fwd-split-vs-looped.json)
)
# A weight wider than x (an fp32 weight over bf16 rows, as autocast leaves a model's parameters), a known M up
# to 2048 rows: 2 rows a program, which read the weight once for both, x 4 warps; elsewhere the rungs for many
# rows (forward_config). By profiling/tune.py --wdtype float32, one round
# (profiling/results/tuning/2026-12-04-h200-early-weight/retune-fp32-weight.json), against the rungs for many
# rows: 2048 x 4096 10.46 us against 11.66 (Inductor 10.30), 528 x 2048 2.97 against 3.21 (2.77).
FWD_LADDER_WIDE_WEIGHT = (
    FWD_LADDER[0],  # N <= 1024: the same rung whatever the weight
    (2048, 4096, 4, dict(mask_free=True, max_m=2048)),
    (4096, 8192, 4, dict(mask_free=True, max_m=2048)),
)
# 4-byte dtypes (fp32): N <= 4096 by bench timing (fwd-near.json); above, the single-pass rungs first tuned
# for bf16, which beat the looped form at N=32768 (do_bench: 85.8% at 16 warps, 87.8% at 32, looped 77.5%;
# fwd-fp32-do-bench.json).
FWD_LADDER_FP32 = (
    (1024, 1024, 1, {}),  # N=1024: 1 row x 1 warp 99.0% (4 rows x 8 warps 96.6%; fwd-near.json)
    # N=4096: looped 99.5% (2048 columns too; 4 rows x 8 warps 94.8%; fwd-near.json); without masks 93.2%
    # (fwd-looped-unmasked.json), 93.3% twice (fwd-mask-free-r1/r2.json), not explained: the PTX differs only in
    # the loads' and stores' predicates.
    (4096, 4096, 16, dict(looped=True)),
    (8192, 16384, 4, {}),
    (16384, 16384, 8, {}),
    (32768, 32768, 16, {}),
)
# Forward beyond the ladder, split mode: (max N, columns per program, warps, options).
# A persistent grid; at row i a program publishes its group's next row's partial, then waits for
# row i's total, its loads prefetched one row ahead into shared memory (stages 2; kernels/split.py).
# Groups walk interleaved rows (interleave: group g rows g, g + groups, ...), so that at any time
# they work on neighbouring rows, as a grid of one row per program does: against blocks of
# consecutive rows, bf16 N=65536 87.8% (83.3%), 262144 89.2% (87.4%), fp32 65536 89.2% (85.2%;
# split-interleave.json). Among its neighbours (split-near.json, bench timing) the table is best or tied:
# bf16 65536 87.3% (4 programs per SM 87.7%, 4 warps 87.1%, stages 3 83.6%, no prefetch 68.1%), 262144 89.2%
# (4 per SM 88.8%), fp32 65536 89.0% (8 warps 88.6%).
FWD_SPLIT = ((MAX_N, 16384, 8, dict(programs_per_sm=2, stages=2, interleave=True)),)
FWD_SPLIT_FP32 = ((MAX_N, 8192, 4, dict(programs_per_sm=2, stages=2, interleave=True)),)
# Single-pass forward: where the weight's load goes (with_early_weight). After the row's sum, its latency
# sits on each program's path between the sum and y's store; before x, it overlaps x's. GPU time, the
# table's configuration, weight late -> first (profiling/results/tuning/2026-12-04-h200-early-weight/
# early-weight.json, bf16 unless marked, no rstd):
# - tiles of 64 elements a thread (8192 columns x 4 warps at N = 5,120-7,168; fp32 8,192-32,768): faster at
#   every M measured, 16 x 7168 2.48 -> 1.64 us, 2048 x 7168 17.99 -> 16.50, 8192 x 7168 60.11 -> 58.13, with
#   the residual 30.40 -> 29.84 at 2,048 rows, fp32 528 x 16384 22.91 -> 20.80 (16 x 32768 5.54 -> 5.60);
# - one row a program, grids of at most half the device's threads: 16-528 rows up to 14% faster (16 x 2048
#   1.32 -> 1.14, 528 x 4096 3.44 -> 3.33; with the residual at 528 rows 0.3-1.2%; 1024 x 1536 2.81 -> 2.83).
#   A grid that fills the device once, every program resident from the start, runs 9-19% slower (2048 x 2048
#   4.91 -> 5.60, 1024 x 4096 4.84 -> 5.61), and more rows move by -2% to +4%;
# - several rows a program at small N: slower at every M (N = 128: 264-8192 rows 5-14%), left late.
# The norm-add kernel holds two weights: at 64 elements a thread both loaded first take 219 registers
# against 168 at N = 7,168, 2048 / 8192 rows 33.64 -> 35.61 / 118.94 -> 132.37 us; over few rows 9-22%
# faster (528 x 7168 9.95 -> 8.73).
# Written first, the weight's loads still go where ptxas puts them: in an inference forward (no rstd) it issued
# most of them after the row's sum, so the rows kernel holds them first with a barrier there: 2048 x 7168
# 16.89 -> 15.85 us, 8192 x 7168 58.10 -> 57.08, 528 x 8192 7.04 -> 5.97 (inference-*-barrier.json in
# profiling/results/tuning/2026-12-04-h200-early-weight/; no gain with rstd stored, mixed with the residual, where
# it is left out).
EARLY_WEIGHT_ELEMENTS = 64
EARLY_WEIGHT_SHARE = 0.5
# Backward, single-pass: (max N, elements per program, warps, options: programs per SM; the
# row-loop form, counted_loop (kernels._rms_norm_bwd), which moves results by up to 12 points
# either way, by N and dtype: bwd-loop-form.json; max_m, as the forward's). Figures by bench timing
# (near-table.json) unless marked.
BWD_LADDER = (
    (64, 4096, 16, dict(programs_per_sm=2)),  # N <= 64: the N=128 rung for many rows (not measured at few)
    # N=65-128 at up to 32768 rows (head norms of a few thousand tokens): 64 rows x 4 warps at every M, fewer and
    # fuller row groups than fit_to_rows would make (keep_rows: at N=128 the dweight partials, one row a group,
    # outweigh the grid).
    (128, 8192, 4, dict(programs_per_sm=2, counted_loop=True, keep_rows=True, max_m=32768)),
    # N=128 over more rows (head norms): 32 rows x 16 warps, 2 programs per SM.
    (128, 4096, 16, dict(programs_per_sm=2)),
    # N=256: 32 rows, counted loop 90.1% (in-kernel bounds 88.7%); rows prefetched a tile ahead (stages 2):
    # 85.5% against 83.5% under do_bench (staged.json)
    (256, 8192, 4, dict(programs_per_sm=4, stages=2, counted_loop=True)),
    # Where a tile row spans all of a program's threads, the dweight accumulator is one row
    # (launch.dweight_acc_rows): 8 rows x 2048 went from 255 registers to 174 (Triton 3.9, sm_90a;
    # profiling/resource_usage.py), and two or four programs fit on an SM. Rungs from N=1024 to 4096 by
    # profiling/tune.py with that accumulator. N=1024: counted loop.
    (1024, 4096, 4, dict(programs_per_sm=8, stages=2, counted_loop=True)),
    # N=2048: 2 rows x 8 warps, 4 programs per SM. At 8192 rows with the residual's gradient, as models launch it
    # (dy summed from 2 or 3 terms, BWD_SUMMED): 46.30 / 55.39 us against 51.32 / 70.27 for 4 rows x 8 warps, 2 per
    # SM, counted loop, and 70.29 (2 terms) for 8 rows, 1 per SM; with one term 38.59 against 4 rows' 37.48
    # (summed-2048.json in profiling/results/tuning/2026-12-04-h200-summed-backward-stages/).
    # 64 registers a thread (profiling/resource_usage.py): the 4 programs fit an SM's register file.
    (2048, 4096, 8, dict(programs_per_sm=4)),
    # N=4096: 2 rows x 8 warps, 2 programs per SM, counted loop.
    (4096, 8192, 8, dict(programs_per_sm=2, counted_loop=True)),
    # N=8192: 1 row x 16 warps, the next row loaded into registers ahead of each row's arithmetic (prefetch),
    # against 2 rows x 16 warps without it (91.5% at 256 MiB; counted loop 78.2%, 2 programs per SM 89.8%): 0.79-0.995x
    # its GPU time at every shape measured (N = 5120-8192 at 16-16384 rows): 2048 x 8192 30.24 against 32.98 us,
    # 8192 x 5120 with the residual's gradient and dy summed from 2 terms 113.85 against 142.39, 16384 x 5120 with 3
    # 250.51 against 315.09 (ab-*.json in profiling/results/tuning/2026-12-04-h200-backward-prefetch/). At N = 2048
    # and 4096 loading a tile ahead wins with one gradient term and loses with the summed terms models launch there.
    (8192, 8192, 16, dict(prefetch=True)),
    # N=16384: x and dy read a second time after the row sum (reload), counted loop: 87.1% (in-kernel bounds
    # 85.6%); do_bench: 82.0% against 80.3% reading them once (bwd-reload.json)
    (16384, 16384, 16, dict(counted_loop=True, reload=True)),
)
# A 2-byte backward launch whose dy sums 2 to 5 gradient tensors (post_grad.fuse_gradient_sums;
# launch.summed_gradient_consts), by BLOCK_N: (2 terms, 3 or more terms), each (rows per tile, at most the
# launch's own; the row loop's stages). Elsewhere such a launch halves its rows per tile, which leaves
# registers for the terms' loads, and keeps its stages. The grid, and so the dweight partials, stay the
# launch's. GPU time at 8192 rows with the residual's gradient, by profiling/tune.py --rounds 3
# (profiling/results/tuning/2026-12-04-h200-summed-backward-stages/):
# - N=2048: 2 rows (the rung's) with 2 terms, 46.36 us against 46.30 for 1 row (table.json, summed-2048.json);
#   with 3, 1 row prefetched a row ahead (stages 2): 55.39 -> 53.93 us, and at N = 1,536 45.37 -> 42.67;
# - N=4096: 2 rows (the rung's) with 2 terms, 95.07 -> 85.56 us (N = 3,584 86.88 -> 76.82) against 1 row;
#   with 3, 1 row at stages 2: 109.27 -> 104.20 (3,584: 99.64 -> 92.71).
# N=8192's rung (2 rows x 16 warps, 1 program per SM) keeps the halving: what beats it takes 4 warps and
# 2 programs per SM (N = 5,120 with 2 terms 142.37 -> 131.53 us), a grid that the terms do not pick.
BWD_SUMMED = {2048: ((2, 1), (1, 2)), 4096: ((2, 1), (1, 2))}
# The same for 4-byte dtypes (fp32), where the bf16 rungs are not the best (do_bench unless marked).
BWD_LADDER_FP32 = (
    (256, 8192, 8, dict(programs_per_sm=4)),  # N=256: 87.3% (4 warps 65.6%; bwd-near.json)
    (1024, 8192, 4, dict(programs_per_sm=8)),  # N=1024: 90.0%, 89.4% (4 rows 86.5%, 87.7%; bwd-loop-form, bwd-near)
    (4096, 16384, 8, dict(programs_per_sm=2)),  # 92.2% vs 16 warps 89.7% by bench timing (near-table.json)
    # N=8192: 1 row x 16 warps with the next row loaded ahead (prefetch), as the 2-byte rung: 8192 x 8192 206.62
    # against 2 rows x 16 warps' 210.27 us, 4096 x 8192 106.51 against 110.07, 8192 x 5120 127.76 against 129.67
    # (prefetch-fp32.json in profiling/results/tuning/2026-12-04-h200-backward-prefetch/; 2 rows: 87.7%, 1 row
    # without prefetch 88.0%, bwd-near-fp32.json).
    (8192, 8192, 16, dict(prefetch=True)),
    (16384, 16384, 32, dict(reload=True)),  # 89.4% (once, 16 warps: 81.6%; bwd-reload.json)
)
# Backward beyond the ladder, split mode: (max N, columns per program, warps, options).
# As the forward's split mode, on interleaved rows, with loads prefetched stages - 1 rows ahead; the weight
# chunk is held in registers across rows (+1.1 to +1.8 points: split-bwd-weight-held.json against
# split-bwd-weight-reread.json). The columns per program also size the dweight scratch (groups x N; under
# 2% of dx). By bench timing (split-near.json): 8 warps ahead of 16 at every N (32768 84.1% vs 82.8%, 65536
# 83.2% vs 81.7%, 262144 81.8% vs 77.1%; again in split-bwd-8-warps.json: 83.0% vs 81.9%, 81.9% vs 79.1%,
# fp16 65536 83.1% vs 81.2%); stages 3 and 4 tie (65536 83.6% / 83.2%), stages 2 does not (61.6%).
BWD_SPLIT = ((MAX_N, 8192, 8, dict(stages=4, interleave=True)),)
# fp32: chunks of 8192 columns, 32 KiB (the bytes of a bf16 chunk of 16384 columns, which spills), half
# the programs per row of 4096 columns: 92.0% against 85.5% (split-near.json), 93.1% (85.2%) and at
# N=262144 95.0% (75.5%; split-bwd-fp32-8192-65536.json, -262144.json).
BWD_SPLIT_FP32 = ((MAX_N, 8192, 8, dict(stages=3, interleave=True)),)
# Backward over a few rows, M known when the plan is made (an eager call, a graph traced with static
# shapes): (at most this many rows, columns per program). dweight comes from programs of the backward's own
# launch, each summing dy * x * rstd over every row for its block of columns (kernels/rows.py, DW_COLUMNS),
# instead of a partial row per row group and a reduction launch after it. Tiles of DW_COLUMN_TILE elements.
# By profiling/tune.py --dw-columns (GPU time of the backward's launches, inputs past L2;
# profiling/results/tuning/2026-12-02-h200-dweight-columns/dw-columns.json), us with partial rows and the
# reduction / 32 / 64 / 128 columns: bf16 16 x 2048 3.11 / 1.39 / 1.70 / 2.45, 512 x 2048 8.25 / 5.86 /
# 8.69 / 12.93, 16 x 4096 3.57 / 1.79 / 1.81 / 2.58, 512 x 4096 9.73 / 7.38 / 9.70 / 13.89, 256 x 5120
# 7.79 / 6.74 / 6.10 / 7.96, 256 x 128 4.00 / 2.52 / 3.18 / 5.61, with the residual's gradient and dy
# summed from 3 terms 16 x 2048 3.44 / 1.87 / 1.78 / 2.69; fp32 128 x 257 4.24 / 2.26 / 3.00 / 5.69. At
# 2048 rows the partial rows win (N = 2048 12.91 against 18.39 with 32 columns; 4096 18.58 against 34.86).
BWD_DW_COLUMNS = (512, 32)
DW_COLUMN_TILE = 2048
# The Triton interpreter runs programs one after another on the CPU; a small
# fixed count keeps its dweight reduction layout fixed too.
INTERPRETER_SM_COUNT = 4
# Backward programs merge their dweight partials in pairs (half the scratch rows; kernels/common.py,
# _merge_partial) when the unmerged scratch (groups x N fp32) would exceed both of these: a
# size (below it the merge's memset and wait cost more than the memory: 128x257 fwd+bwd 6.7
# -> 9.7 us, dweight-unmerged-bench.md against dweight-merge-everywhere-bench.md) and a share of dx
# (below it the scratch is within the target of dx + 2%; above it, merging above 1 MiB alone cost
# 2.0-3.5% of fwd+bwd time at 4096 fp32, 32768 and 65536, dweight-merge-above-1MiB-bench.md). At the
# benchmark's 256 MiB shapes that merges at N = 16384 only (peak extra 264.4 -> 260.2 MiB, dx + 3.3% ->
# 1.6%). The size is 6 MiB, above the scratch of the shapes models run (4 MiB at 8192 x 2048 bf16, 512
# groups), where merging costs more than it saves, and below the 8.25 MiB at 8192 x 16384, where it
# saves time.
MERGE_SCRATCH_BYTES = 6 << 20
MERGE_SCRATCH_SHARE = 1 / 50
# dweight reduction (kernels/reduce.py): one launch, one program per column tile summing every partial
# row, its tile's rows at a time, in one fixed order (reduce_tile). Many partial rows (more than
# REDUCE_BLOCK_P / 2: one per row group of a grid that fills the device, 128-1056 on the H200) go in
# tiles of REDUCE_TILE_MANY elements, 8 a thread: REDUCE_COLUMNS[1] columns wide where that still makes
# REDUCE_WIDE_PROGRAMS_PER_SM programs an SM, else REDUCE_COLUMNS[0] (128 x 8, 64 x 16). Fewer rows go
# in one step, in tiles as many columns wide as make REDUCE_TILE elements (16 KiB of fp32 a program):
# fixed 32 x 128 tiles left most rows masked where there are few, 7.85 us for 4 partial rows at N =
# 262144, 2048 programs (bench-kernel-breakdown.json); sized to the rows, 2.25 us (_rms_norm_dw_reduce at
# 512 x 262144 in profiling/results/benchmark/2026-12-01-h200-bench/).
# Against the reduction before (REDUCE_TILE elements at every row count, 128 x 32, and two launches, a
# first splitting the partial rows, where that left fewer programs than half the SMs: N < 2112), the
# backward with its reduction, GPU time (profiling/results/tuning/2026-12-04-h200-dweight-reduce-tiles/
# reduce-tiles.json; the reduction alone in brackets): rmsnorm.add_bwd 8192 x 2048 39.79 -> 38.20 us
# (4.24 -> 2.62), 2048 x 2048 14.71 -> 13.11, 8192 x 1536 32.55 -> 30.96, 8192 x 4096 70.29 -> 69.84
# (2.95 -> 2.47); rmsnorm.bwd 8192 x 128 6.59 -> 4.71 (3.14 -> 1.28), 131072 x 128 33.62 -> 32.02,
# 524288 x 256 209.58 -> 208.10 (4.41 -> 2.91), 131072 x 1024 205.77 -> 205.23 (5.35 -> 5.13), the other
# 256 MiB shapes within 0.4%. Other tiles at 8192 x 2048, the reduction alone: 256 x 8 2.71, 64 x 16
# 3.07, 128 x 16 3.48 against 128 x 8's 2.62; at N = 3584 64 x 16 2.38 against 128 x 8's 2.60.
REDUCE_TILE = 4096
REDUCE_BLOCK_P = 128
REDUCE_TILE_MANY = 1024
REDUCE_COLUMNS = (8, 16)
REDUCE_WIDE_PROGRAMS_PER_SM = 1.5


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelConfig:
    """One launch shape: ``rows`` rows of ``block_n`` columns per program, or, with
    ``split > 1``, each row spread over ``split`` programs of ``block_n`` columns.
    ``programs_per_sm`` sizes the backward grid (and so its groups x N dweight scratch) and the
    forward's in split mode;
    ``counted_loop`` picks the single-pass backward's row-loop form (``kernels._rms_norm_bwd``);
    ``looped`` (forward) walks one row per program in ``block_n`` steps, reading x twice;
    ``mask_free`` (single-pass or looped forward) drops the masks where the tiles cover x exactly
    (``kernels.exact_tiles``);
    ``reload`` (single-pass backward) reads x and dy again after the row sum;
    ``interleave`` (split mode) gives row group g rows g, g + groups, ... instead of a block of
    consecutive rows;
    ``keep_rows`` keeps ``rows`` at every M (``fit_to_rows`` leaves it);
    ``stages`` is the row (or step) loop's ``num_stages``: above 1, Triton's pipeliner loads
    ``stages - 1`` iterations ahead into shared memory;
    ``dw_columns`` (single-pass backward) > 0: dweight from programs of ``dw_columns`` columns
    each in the same launch, which read every row (``BWD_DW_COLUMNS``), not from partial rows;
    ``early_weight`` (single-pass forward) loads the weight before x instead of after the row's
    sum (``with_early_weight``);
    ``prefetch`` (single-pass backward) loads the next tile into registers before the current
    tile's arithmetic."""

    block_n: int
    rows: int
    num_warps: int
    split: int = 1
    programs_per_sm: int = 1
    counted_loop: bool = False
    looped: bool = False
    reload: bool = False
    stages: int = 1
    mask_free: bool = False
    interleave: bool = False
    keep_rows: bool = False
    dw_columns: int = 0
    early_weight: bool = False
    prefetch: bool = False

    def __post_init__(self) -> None:
        # The kernels would read outside the tensors, not fail, given these.
        if self.looped and (self.rows != 1 or self.split != 1):
            raise ValueError(f"KernelConfig: looped needs rows == 1 and split == 1, got {self}")
        if self.interleave and self.split == 1:
            raise ValueError(f"KernelConfig: interleave is for split mode (split > 1), got {self}")
        if self.mask_free and self.split != 1:
            raise ValueError(f"KernelConfig: mask_free is for single-pass and looped configs, got {self}")
        if self.stages < 1:
            raise ValueError(f"KernelConfig: stages must be >= 1, got {self}")
        if self.reload and self.split != 1:
            raise ValueError(f"KernelConfig: reload is single-pass only (split == 1), got {self}")
        if self.dw_columns and (self.split != 1 or self.looped or self.dw_columns & (self.dw_columns - 1)):
            raise ValueError(f"KernelConfig: dw_columns is a power of two, for the single-pass backward, got {self}")
        if self.early_weight and (self.split != 1 or self.looped):
            raise ValueError(f"KernelConfig: early_weight is for the single-pass forward, got {self}")
        if self.prefetch and (self.split != 1 or self.looped or self.reload):
            raise ValueError(f"KernelConfig: prefetch is for the single-pass backward without reload, got {self}")


def _config(n: int, ladder: tuple, split_ladder: tuple, residual: bool = False, m: int | None = None) -> KernelConfig:
    block = next_power_of_2(n)
    for max_n, elements, warps, options in ladder:
        if n <= max_n:
            options = dict(options)
            divides, plain = options.pop("divides", False), options.pop("plain", False)
            max_m = options.pop("max_m", None)
            if (divides and n % elements) or (plain and residual) or (max_m is not None and (m is None or m > max_m)):
                continue
            looped = options.get("looped", False)
            if looped:  # elements = columns per step, one row per program
                block = min(block, elements)
            rows = 1 if looped else max(1, elements // block)
            # Tiny tiles (small N): fewer warps than the rung's, at least 4 elements per thread.
            warps = max(1, min(warps, block * rows // 128))
            return KernelConfig(block, rows, warps, 1, **options)
    _, split_block, warps, options = next(rung for rung in split_ladder if n <= rung[0])
    split = min(next_power_of_2(cdiv(n, split_block)), MAX_SPLIT)
    return KernelConfig(next_power_of_2(cdiv(n, split)), 1, warps, split, **options)


def fit_to_rows(cfg: KernelConfig, m: int, device: torch.device) -> KernelConfig:
    """``cfg`` with fewer rows per program where M is small, so that the grid still spreads over
    the multiprocessors: at 16 rows of 2048 a rung's 8 rows per program left 2 programs doing all
    the work. A single-pass forward keeps at least one program per SM while it can; the backward
    (``row_groups``) at least one row group per SM; a ``keep_rows`` configuration stays as it is."""
    if cfg.split > 1 or cfg.looped or cfg.rows == 1 or cfg.keep_rows or type(m) is not int:
        return cfg
    target = sm_count(device) * (cfg.programs_per_sm if cfg.programs_per_sm > 1 else 1)
    rows = cfg.rows
    while rows > 1 and cdiv(m, rows) < target:
        rows //= 2
    # mask_free stays: the launcher drops the masks only where the new tiles still cover x exactly.
    return cfg if rows == cfg.rows else dataclasses.replace(cfg, rows=rows)


def with_early_weight(cfg: KernelConfig, m: int | torch.SymInt, device: torch.device,
                      thread_slots: int | None = None, weights: int = 1) -> KernelConfig:
    """``cfg``, a forward's configuration as ``fit_to_rows`` left it, with ``early_weight`` set
    where the single-pass forward runs faster loading its weight before x: where the rung sets
    it; where each thread holds at least ``EARLY_WEIGHT_ELEMENTS`` of a tile's elements, at any
    M; and with one row per program, where M is known and the grid's threads fill at most
    ``EARLY_WEIGHT_SHARE`` of the threads ``device`` holds at once (``thread_slots``, if given,
    stands for that count). A kernel that loads ``weights`` = 2 (the norm-add kernel) loads them
    first at such wide tiles only in that last case; there ``early_weight`` is cleared otherwise.
    The measurements are beside ``EARLY_WEIGHT_ELEMENTS``."""
    if cfg.split > 1 or cfg.looped:
        return cfg
    threads = cfg.num_warps * 32
    wide = cfg.block_n * cfg.rows >= EARLY_WEIGHT_ELEMENTS * threads
    if thread_slots is None and cfg.rows == 1 and type(m) is int:
        thread_slots = sm_count(device) * sm_threads(device)
    few_rows = cfg.rows == 1 and type(m) is int and m * threads <= EARLY_WEIGHT_SHARE * thread_slots
    early = few_rows if wide and weights > 1 else cfg.early_weight or wide or few_rows
    return cfg if early == cfg.early_weight else dataclasses.replace(cfg, early_weight=early)


def _row_bounds(*ladders: tuple) -> tuple[int, ...]:
    """The row counts at which a choice over ``ladders`` can change (their rungs' ``max_m``), ascending."""
    return tuple(sorted({o["max_m"] for ladder in ladders for *_, o in ladder if "max_m" in o}))


_FWD_ROW_BOUNDS = _row_bounds(FWD_LADDER, FWD_LADDER_FP32)
_WIDE_WEIGHT_ROW_BOUNDS = _row_bounds(FWD_LADDER_WIDE_WEIGHT)
_BWD_ROW_BOUNDS = tuple(sorted({*_row_bounds(BWD_LADDER, BWD_LADDER_FP32), BWD_DW_COLUMNS[0]}))


def _bound_rows(m: int | torch.SymInt | None, bounds: tuple[int, ...]) -> int | None:
    """``m`` as the ladders see it: the first bound at or above it, so that every M up to a bound
    shares one cached configuration; None where M is not a known int or above every bound."""
    if type(m) is not int:
        return None
    return next((bound for bound in bounds if m <= bound), None)


def forward_config(n: int, dtype: torch.dtype, residual: bool = False, m: int | torch.SymInt | None = None,
                   weight_dtype: torch.dtype | None = None) -> KernelConfig:
    """Forward launch shape for rows of length ``n`` (``1 <= n <= MAX_N``) of ``dtype`` (the
    normalized sum's, with ``residual``: the forward that adds a residual first), over ``m``
    rows: where M is not an int (None, or symbolic while tracing) the rungs tuned at many rows
    serve. A ``weight_dtype`` wider than ``dtype`` takes its own rungs for few rows
    (``FWD_LADDER_WIDE_WEIGHT``), else the rungs for many rows: the few-rows rungs give each
    program one row, which reads the whole weight once a row (at 528 x 2048 bf16 with an fp32
    weight, 1 row x 4 warps took 3.29 us against the many-rows rung's 3.21;
    profiling/results/tuning/2026-12-04-h200-early-weight/retune-fp32-weight.json)."""
    if weight_dtype is not None and weight_dtype.itemsize > dtype.itemsize:
        return _wide_weight_config(n, dtype, residual, _bound_rows(m, _WIDE_WEIGHT_ROW_BOUNDS))
    return _forward_config(n, dtype, residual, _bound_rows(m, _FWD_ROW_BOUNDS))


@functools.cache
def _wide_weight_config(n: int, dtype: torch.dtype, residual: bool, m: int | None) -> KernelConfig:
    if dtype.itemsize == 2 and m is not None and n <= FWD_LADDER_WIDE_WEIGHT[-1][0]:
        return _config(n, FWD_LADDER_WIDE_WEIGHT, FWD_SPLIT, residual, m)
    return _forward_config(n, dtype, residual, None)


@functools.cache
def _forward_config(n: int, dtype: torch.dtype, residual: bool, m: int | None) -> KernelConfig:
    if dtype.itemsize == 4:
        return _config(n, FWD_LADDER_FP32, FWD_SPLIT_FP32, residual, m)
    return _config(n, FWD_LADDER, FWD_SPLIT, residual, m)


def backward_config(n: int, dtype: torch.dtype, m: int | torch.SymInt | None = None) -> KernelConfig:
    """Backward (dx + dweight partials) launch shape for rows of length ``n`` of ``dtype``, over
    ``m`` rows: where M is not an int (None, or symbolic while tracing) the rungs tuned at many
    rows serve; up to ``BWD_DW_COLUMNS[0]`` rows, dweight from column programs."""
    return _backward_config(n, dtype, _bound_rows(m, _BWD_ROW_BOUNDS))


@functools.cache
def _backward_config(n: int, dtype: torch.dtype, m: int | None) -> KernelConfig:
    if dtype.itemsize == 4:
        cfg = _config(n, BWD_LADDER_FP32, BWD_SPLIT_FP32, m=m)
    else:
        cfg = _config(n, BWD_LADDER, BWD_SPLIT, m=m)
    max_m, columns = BWD_DW_COLUMNS
    if m is not None and m <= max_m and cfg.split == 1:
        cfg = dataclasses.replace(cfg, dw_columns=min(columns, next_power_of_2(n)))
    return cfg


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached; asked lazily, never at import)."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def sm_threads(device: torch.device) -> int:
    """Threads a multiprocessor holds at once (cached): 2,048 on the H200, and taken as such
    off CUDA."""
    if device.type != "cuda":
        return 2048
    return torch.cuda.get_device_properties(device).max_threads_per_multi_processor


def reduce_tile(rows: int, n: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_P, BLOCK_N)`` of the dweight reduction that sums ``rows`` partial rows of ``n``
    columns on ``device``."""
    block_p = min(REDUCE_BLOCK_P, next_power_of_2(rows))
    if block_p < REDUCE_BLOCK_P:
        return block_p, REDUCE_TILE // block_p
    narrow, wide = REDUCE_COLUMNS
    block_n = wide if cdiv(n, wide) >= REDUCE_WIDE_PROGRAMS_PER_SM * sm_count(device) else narrow
    return REDUCE_TILE_MANY // block_n, block_n


def row_groups(m: int, n: int, device: torch.device, cfg: KernelConfig) -> tuple[int, int]:
    """``(row groups, rows per group)`` of a grid of ``groups * cfg.split`` programs that walk
    their group's rows: the backward's, and the forward's in split mode. Every group gets >= 1
    row, so every dweight partial row is written."""
    target = max(1, cfg.programs_per_sm * sm_count(device) // cfg.split)
    rows_per_group = cdiv(m, target)
    # Whole tiles per group, so only the last group has a ragged tile.
    rows_per_group = cdiv(rows_per_group, cfg.rows) * cfg.rows
    return cdiv(m, rows_per_group), rows_per_group
