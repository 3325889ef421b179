"""Registers and stack (spills) of the kernels' configurations, compiled for the H200 (sm_90a)
on a machine without a GPU: Triton's compiler and its bundled ``cuobjdump``.

A spilling configuration is slow on the device (profiling/NOTES.md), so this answers "does it
fit?" before any device time is spent. Compiles the table's configuration for each job, and
with ``--near`` the neighbours ``tune.py --near`` would time. Do not set TRITON_INTERPRET.
Run: ``python profiling/resource_usage.py [--jobs bwd:bfloat16:16384,...] [--near]``.
"""

from __future__ import annotations

import argparse
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
from tune import neighbours  # noqa: E402

from torch_rmsnorm_op import kernels  # noqa: E402
from torch_rmsnorm_op.config import KernelConfig, backward_config, forward_config  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
INTS = {"stride_x": "i64", "stride_y": "i64", "stride_dy": "i64", "stride_dx": "i64",
        "M": "i32", "N": "i32", "rows_per_group": "i32"}


def signature(backward: bool, dtype: torch.dtype) -> dict[str, str]:
    t = "*" + TRITON_TYPES[dtype]
    if backward:
        ptrs = dict(DY=t, X=t, W=t, RSTD="*fp32", DX=t, DW_PARTIAL="*fp32", DW_FLAGS="*i32", SLOTS="*i64")
        rest = ["stride_dy", "stride_x", "stride_dx", "M", "N", "rows_per_group"]
    else:
        ptrs = dict(X=t, W=t, Y=t, RSTD="*fp32", SLOTS="*i64")
        rest = ["stride_x", "stride_y", "M", "N", "eps", "rows_per_group"]
    return ptrs | {name: INTS.get(name, "fp32") for name in rest}


def resource_usage(backward: bool, dtype: torch.dtype, cfg: KernelConfig, merge: bool = False,
                   n: int | None = None) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread: where spills go) of one configuration,
    read from the compiled cubin by Triton's bundled ``cuobjdump``; ``n``, if given, picks the
    specialization the launcher would (a ``mask_free`` config without masks when its tiles cover
    x exactly)."""
    fn = kernels._rms_norm_bwd if backward else kernels._rms_norm_fwd
    exact = n is not None and kernels.exact_tiles(cfg, cfg.rows, n)  # M: a multiple of the rows, as benchmarked
    steps = 0 if backward or n is None else kernels.loop_steps(cfg, cfg.rows, n)
    consts = dict(kernels.constexprs(cfg, backward, has_weight=True, merge=merge and backward, exact_tiles=exact,
                                     steps=steps))
    sig = signature(backward, dtype) | {name: "constexpr" for name in consts}
    # What Triton's launcher specializes on for the benchmark's tensors: 16-byte aligned pointers,
    # N and the row strides multiples of 16. Without it the loads are not vectorized.
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in sig.items()
               if kind.startswith("*") or name == "N" or name.startswith("stride")}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned), target=TARGET,
                              options={"num_warps": cfg.num_warps, **kernels.COMPILE_OPTIONS})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    return int(usage.group(1)), int(usage.group(2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="fwd:bfloat16:32768,bwd:bfloat16:4096,bwd:bfloat16:16384,bwd:float32:16384")
    p.add_argument("--near", action="store_true", help="also the neighbours tune.py --near times")
    p.add_argument("--merge", action="store_true", help="backward with its dweight partials merged in pairs")
    args = p.parse_args()
    if kernels.is_interpreted():
        sys.exit("unset TRITON_INTERPRET: this compiles the kernels for sm_90a")
    print(f"Triton {triton.__version__}, sm_90a")
    for job in args.jobs.split(","):
        pass_name, dtype_name, n = job.split(":")
        backward, dtype, n = pass_name == "bwd", getattr(torch, dtype_name), int(n)
        table = (backward_config if backward else forward_config)(n, dtype)
        for cfg in [table] + (neighbours(table, backward, n) if args.near else []):
            regs, stack = resource_usage(backward, dtype, cfg, args.merge, n)
            print(f"{job} {'table' if cfg == table else '     '} {regs:3d} registers, {stack:5d} B stack: {cfg}")


if __name__ == "__main__":
    main()
