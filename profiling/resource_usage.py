"""Registers and stack (spills) of the kernels' configurations, compiled for the H200 (sm_90a)
on a machine without a GPU: Triton's compiler and its bundled ``cuobjdump``; and the fp64
instructions in their PTX.

A spilling configuration is slow on the device, so this answers "does it fit?" before any
device time is spent. For each job (``pass:dtype:N``, pass ``fwd``, ``add_fwd``, ``bwd`` or
``add_bwd`` as in ``tune.py``, or ``norm_add_fwd``) it compiles the kernel the table's
configuration selects (rows, looped or split forward; rows or split backward; the norm-add
pair's kernel at the configuration of x's norm), specialized as Triton's launcher would
specialize it for the benchmark's contiguous x of 256 MiB (``--m`` for another row count):
16-byte aligned pointers, integer arguments by value (1 a constant, multiples of 16 marked so),
the launcher's constexprs (masks dropped where the tiles cover x exactly, the looped forward's
step count, the backward's dweight partials merged in pairs where the launcher would merge
them, the forward's weight loaded first where ``config.with_early_weight`` would load it on the
H200). With ``--near`` it also compiles the candidates ``tune.py`` times around the table's
configuration (``fwd_candidates`` / ``bwd_candidates``). With ``--terms T`` the backward sums
T gradient terms, as a compiled graph's launch does (``launch.summed_gradient_consts``;
``--keep-stages``: at the rung's own stages). Each line gives the shared memory the kernel
needs (the block's limit on the H100 and H200: 232,448 B). Compiles run in ``--workers``
processes. Do not set TRITON_INTERPRET.

Float arguments (eps) are fp32, as Triton's launcher types a Python float; ``--float-args fp64``
types them as Inductor's generated code does where it launches the kernels in a compiled graph
(``torch._inductor.codegen.triton_utils.signature_of``). Each line counts the PTX's fp64
instructions besides reading such an argument and converting it to fp32: ``0 fp64`` means the
kernel's arithmetic is fp32 whichever way it is launched.

Run: ``python profiling/resource_usage.py [--jobs bwd:bfloat16:16384,...] [--m M] [--near]
[--merge] [--float-args fp32|fp64] [--terms T [--keep-stages]] [--workers W]``; prints one line
per configuration, ``table`` marking the table's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune import bwd_candidates, fwd_candidates  # noqa: E402

from torch_rmsnorm_op import kernels, launch  # noqa: E402
from torch_rmsnorm_op.config import (  # noqa: E402
    KernelConfig,
    backward_config,
    cdiv,
    forward_config,
    with_early_weight,
)
from torch_rmsnorm_op.tools.benchmark import BANDWIDTH_BYTES  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SMS = 132  # the H200's multiprocessors: they size the grid's row groups (config.row_groups)
THREAD_SLOTS = SMS * 2048  # the threads the H200 holds at once (config.with_early_weight)
# The launches' compile option (fused multiply-adds on, stated rather than left to Triton's default).
COMPILE_OPTIONS = dict(enable_fp_fusion=True)
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Pointer parameters of the kernels that are not of x's dtype (weight and sums have x's dtype here).
POINTER_TYPES = {"RSTD": "*fp32", "X_RSTD": "*fp32", "SLOTS": "*i64", "DW_PARTIAL": "*fp32", "DW_FLAGS": "*i32"}
PASSES = ("fwd", "add_fwd", "bwd", "add_bwd", "norm_add_fwd")
FLOAT_ARGS = ("eps", "x_eps")
# PTX instructions on fp64 values, but for reading a float argument and converting it to fp32.
FP64_OP = re.compile(r"^\s*(?!ld\.param)(?!cvt\.\w+\.f32\.f64)[a-z][\w.]*\.f64\b", re.MULTILINE)


def kernel_for(cfg: KernelConfig, backward: bool, norm_add: bool = False):
    """The kernel ``launch.forward`` / ``launch.backward`` (``launch.forward_norm_add``) runs for ``cfg``."""
    if norm_add:
        return kernels._rms_norm_fwd_norm_add_rows
    if backward:
        return kernels._rms_norm_bwd_split if cfg.split > 1 else kernels._rms_norm_bwd_rows
    if cfg.split > 1:
        return kernels._rms_norm_fwd_split
    return kernels._rms_norm_fwd_looped if cfg.looped else kernels._rms_norm_fwd_rows


def row_groups(m: int, cfg: KernelConfig) -> tuple[int, int]:
    """``config.row_groups`` on a GPU of ``SMS`` multiprocessors: (row groups, rows per group)."""
    target = max(1, cfg.programs_per_sm * SMS // cfg.split)
    rows_per_group = cdiv(cdiv(m, target), cfg.rows) * cfg.rows
    return cdiv(m, rows_per_group), rows_per_group


def constexprs(cfg: KernelConfig, pass_name: str, m: int, n: int, dtype: torch.dtype,
               merge: bool | None = None, terms: int = 1, keep_stages: bool = False) -> dict:
    """The constexprs the launcher passes for ``cfg`` at [m, n] (with a weight, rstd stored, no
    weight offset or rounding; split mode in one launch). ``merge`` None: the dweight partials
    merged where the launcher would merge them (``launch.merged_partials``). A backward whose dy
    sums ``terms`` tensors takes ``launch.summed_gradient_consts``' (``keep_stages``: but the
    rung's stages)."""
    backward, residual = pass_name.endswith("bwd"), pass_name.startswith("add")
    common = dict(BLOCK_N=cfg.block_n, HAS_WEIGHT=True, LEAD_DIMS=1, WEIGHT_OFFSET=0.0)
    if pass_name == "norm_add_fwd":
        return common | dict(ROWS=cfg.rows, HAS_X_WEIGHT=True, UNMASKED=cfg.mask_free and launch.exact_tiles(cfg, m, n),
                             STORE_RSTD=True, ROUND=0, EARLY_WEIGHT=cfg.early_weight)
    if backward:
        if merge is None:
            merge = launch.merged_partials(row_groups(m, cfg)[0], m, n, dtype)
        common |= dict(HAS_DRES=residual, STAGES=cfg.stages, MERGE=merge, DY_TERMS=1)
        if cfg.split > 1:
            common |= dict(SPLIT=cfg.split, PHASE=0, INTERLEAVE=cfg.interleave)
        else:
            common |= dict(ROWS=cfg.rows, COUNTED_LOOP=cfg.counted_loop, RELOAD=cfg.reload, PREFETCH=cfg.prefetch,
                           ACC_ROWS=launch.dweight_acc_rows(cfg, dtype.itemsize), DW_COLUMNS=cfg.dw_columns,
                           DW_ROWS=1)
        if terms > 1:
            summed = launch.summed_gradient_consts(common, terms, dtype.itemsize)
            if keep_stages:
                summed.pop("STAGES", None)
            common |= summed
        return common
    common |= dict(HAS_RESIDUAL=residual, STORE_RSTD=True, ROUND=0)
    if cfg.split > 1:
        return common | dict(SPLIT=cfg.split, PHASE=0, STAGES=cfg.stages, INTERLEAVE=cfg.interleave)
    unmasked = cfg.mask_free and launch.exact_tiles(cfg, m, n)
    if cfg.looped:
        return common | dict(UNMASKED=unmasked, STAGES=cfg.stages, STEPS=launch.loop_steps(cfg, m, n))
    return common | dict(ROWS=cfg.rows, UNMASKED=unmasked, EARLY_WEIGHT=cfg.early_weight)


def int_args(cfg: KernelConfig, m: int, n: int, residual: bool) -> dict[str, int]:
    """The integer arguments of a launch on contiguous [m, n] tensors (launch.py's order of
    strides: x's row layout, then the other tensors' row strides; dres's 0 when absent)."""
    return dict(M=m, N=n, rows_per_group=row_groups(m, cfg)[1], x_size1=1, x_size2=1, x_stride0=n, x_stride1=0,
                x_stride2=0, r_stride=n, y_stride=n, h_stride=n, dy_stride=n, dx_stride=n,
                dres_stride=n if residual else 0)


def specialization(fn, dtype: torch.dtype, ints: dict[str, int], consts: dict,
                   float_args: str = "fp32") -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ``ASTSource``, as Triton's JIT specializes the launch:
    pointers by dtype, 16-byte aligned; eps ``float_args``; an int of value 1 a constant, else
    i32 (i64 past int32), divisible by 16 where its value is."""
    params = {p.name: p for p in fn.params}
    declared = {name for name, p in params.items() if p.is_constexpr}
    if declared != set(consts):
        raise ValueError(f"{fn.__name__}: constexprs {sorted(declared ^ set(consts))} differ from its parameters")
    sig, consts, divisible = {}, dict(consts), []
    for name in fn.arg_names:
        if name in declared:
            sig[name] = "constexpr"
        elif name in FLOAT_ARGS:
            sig[name] = float_args
        elif name not in ints:  # a pointer
            sig[name] = POINTER_TYPES.get(name, "*" + TRITON_TYPES[dtype])
            divisible.append(name)
        elif ints[name] == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32" if -(2**31) <= ints[name] < 2**31 else "i64"
            if ints[name] % 16 == 0:
                divisible.append(name)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    return sig, consts, attrs


def resource_usage(pass_name: str, dtype: torch.dtype, cfg: KernelConfig, m: int, n: int,
                   merge: bool | None = None, float_args: str = "fp32", terms: int = 1,
                   keep_stages: bool = False) -> tuple[int, int, int, int]:
    """(registers per thread, stack bytes per thread: where spills go, fp64 instructions, shared
    memory bytes) of one configuration, the first two read from the compiled cubin by Triton's
    bundled ``cuobjdump``, the third counted in its PTX (``FP64_OP``), the last from Triton's
    metadata."""
    backward = pass_name.endswith("bwd")
    fn = kernel_for(cfg, backward, pass_name == "norm_add_fwd")
    consts = constexprs(cfg, pass_name, m, n, dtype, merge, terms, keep_stages)
    ints = int_args(cfg, m, n, pass_name.startswith("add"))
    sig, consts, attrs = specialization(fn, dtype, ints, consts, float_args)
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                              options={"num_warps": cfg.num_warps, **COMPILE_OPTIONS})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    return (int(usage.group(1)), int(usage.group(2)), len(FP64_OP.findall(compiled.asm["ptx"])),
            compiled.metadata.shared)


def _line(task: tuple) -> str:
    job, pass_name, dtype, cfg, table, m, n, merge, float_args, terms, keep_stages = task
    regs, stack, fp64, shared = resource_usage(pass_name, dtype, cfg, m, n, merge, float_args, terms, keep_stages)
    return (f"{job} {'table' if table else '     '} {regs:3d} registers, {stack:5d} B stack, {fp64:3d} fp64, "
            f"{shared:6d} B shared: {cfg}")


def tasks(jobs: str, m: int | None, near: bool, merge: bool | None, float_args: str = "fp32", terms: int = 1,
          keep_stages: bool = False) -> list[tuple]:
    out = []
    for job in jobs.split(","):
        pass_name, dtype_name, n = job.split(":")
        if pass_name not in PASSES:
            raise SystemExit(f"{job}: pass must be one of {', '.join(PASSES)}")
        dtype, n = getattr(torch, dtype_name), int(n)
        backward = pass_name.endswith("bwd")
        rows = m or BANDWIDTH_BYTES // (n * dtype.itemsize)
        if backward:
            table = backward_config(n, dtype, rows)
        else:  # the norm-add pair's kernel runs at x's norm's configuration
            table = forward_config(n, dtype, pass_name == "add_fwd", rows)
            table = with_early_weight(table, rows, torch.device("cpu"), THREAD_SLOTS)
            if pass_name == "norm_add_fwd":
                if table.split > 1:
                    raise SystemExit(f"{job}: the norm-add kernel serves no split-mode configuration")
                table, near = launch._norm_add_config(table, rows, torch.device("cpu"), THREAD_SLOTS), False
        cfgs = [table]
        if near:
            try:
                cfgs += (bwd_candidates if backward else fwd_candidates)(n, table)
            except ValueError as e:  # a candidate the configuration class refuses
                print(f"{job}: no candidates from tune.py: {e}", file=sys.stderr)
        for cfg in dict.fromkeys(cfgs):
            out.append((job, pass_name, dtype, cfg, cfg == table, rows, n, merge, float_args, terms, keep_stages))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="fwd:bfloat16:32768,bwd:bfloat16:4096,bwd:bfloat16:16384,bwd:float32:16384",
                   help="comma-separated pass:dtype:N (pass fwd, add_fwd, bwd, add_bwd, norm_add_fwd)")
    p.add_argument("--m", type=int, help="rows of x (default: the benchmark's, x of 256 MiB)")
    p.add_argument("--near", action="store_true", help="also the candidates tune.py times around the table's")
    p.add_argument("--merge", action="store_true",
                   help="backward with its dweight partials merged in pairs (default: where the launcher merges)")
    p.add_argument("--float-args", choices=("fp32", "fp64"), default="fp32",
                   help="the type of eps: fp32 as Triton's launcher passes it, fp64 as Inductor's generated code does")
    p.add_argument("--terms", type=int, default=1, choices=range(1, launch.MAX_DY_TERMS + 1),
                   help="gradient tensors the backward sums (launch.summed_gradient_consts)")
    p.add_argument("--keep-stages", action="store_true", help="a summing backward at its rung's stages")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="compile processes")
    args = p.parse_args()
    if not isinstance(kernels._rms_norm_fwd_rows, triton.runtime.JITFunction):
        sys.exit("unset TRITON_INTERPRET: this compiles the kernels for sm_90a")
    print(f"Triton {triton.__version__}, sm_90a")
    todo = tasks(args.jobs, args.m, args.near, True if args.merge else None, args.float_args, args.terms,
                 args.keep_stages)
    if args.workers > 1 and len(todo) > 1:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(min(args.workers, len(todo)), mp_context=ctx) as pool:
            lines = pool.map(_line, todo)
            for line in lines:
                print(line, flush=True)
    else:
        for task in todo:
            print(_line(task), flush=True)


if __name__ == "__main__":
    main()
