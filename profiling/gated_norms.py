"""Gated RMSNorms (``forward(hidden_states, gate)``), transformers' modules against the patched
ones, eager and compiled: ``python profiling/gated_norms.py --out FILE [--tokens 16,8192]``
(``--smoke``: CPU, tiny shapes, through the Triton interpreter; not timings).

Per module and token count, bf16 weights and inputs, at the shapes the models run (a linear-
attention layer's norm: rows of one value head, tokens x heads of them; a Mamba 2 mixer's:
rows of the intermediate width, normalized in groups):

- ``qwen3_5``: ``Qwen3_5RMSNormGated(128)``, Llama's norm then ``silu(gate)``, 32 heads;
- ``kimi_linear``: ``KimiLinearRMSNormGated(128)``, fp32 norm then ``sigmoid(gate)``, 32 heads;
- ``mamba2``: the Mamba 2 mixer's grouped norm, ``x * silu(gate)`` then the norm, as
  ``Zamba2RMSNormGated(8192, group_size=1024)`` (the code of transformers 5.25's
  ``Mamba2RMSNormGated``; the class NemotronH's mixers use in transformers 5.17, whose
  ``Mamba2`` norm has no groups).

Four ways each: ``stock`` (the module), ``patched`` (``patch_rmsnorm``), and both under
``torch.compile(dynamic=False)`` (``stock_compiled``, ``patched_compiled``; Inductor). For the
forward (``fwd``) and forward+backward (``fwd_bwd``, the gradients of x, the gate and the
weight): ``*_gpu_us``, the GPU time of all kernels of one call (``torch.profiler`` device
events, 40 calls, averaged) and ``*_call_us``, the wall time of one call to its end
(``triton.testing.do_bench``-style: CUDA events around 40 calls); compiled,
``*_kernels``, the kernels its output code launches, in order. Inputs rotate through a pool
of at least 200 MB so that none comes from L2. ``max_abs_diff``: the largest difference of the
patched output from the module's, eager.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys

import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from norm_add import gpu_us  # noqa: E402  (the GPU time of all kernels of one call)

import torch_rmsnorm_op as T  # noqa: E402

HEADS = 32


def modules() -> dict[str, tuple[nn.Module, int]]:
    """name -> (module, rows per token)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    return {"qwen3_5": (Qwen3_5RMSNormGated(128, eps=1e-6), HEADS),
            "kimi_linear": (KimiLinearRMSNormGated(128, eps=1e-6), HEADS),
            "mamba2": (Zamba2RMSNormGated(8192, group_size=1024, eps=1e-5), 1)}


def _step(module: nn.Module, backward: bool):
    def run(x, gate, dy):
        y = module(x, gate)
        if backward:
            torch.autograd.grad(y, (x, gate, module.weight), dy)
        return y

    return run


def launched_kernels(code: list[str]) -> list[str]:
    """The kernels Inductor's output code (every graph of one call) launches, in order."""
    return [name for source in code
            for name in re.findall(r"^\s+((?:triton|cpp)_\w+)(?:\.run)?\(", source, re.MULTILINE)]


def call_us(fn, pool: list, iters: int) -> float:
    for i in range(3):
        fn(*pool[i % len(pool)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(*pool[i % len(pool)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="16,8192")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no timings")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1000)  # one graph per shape, never eager
    iters = 1 if args.smoke else 40
    rows = []
    for name, (stock, per_token) in modules().items():
        if args.smoke:  # the smallest module of the same class and attributes
            stock = type(stock)(64, eps=stock.variance_epsilon, **({"group_size": 32} if name == "mamba2" else {}))
        stock = stock.to(device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            stock.weight.normal_(1.0, 0.1)
        holder = nn.ModuleList([copy.deepcopy(stock)])
        report = T.patch_rmsnorm(holder)
        patched = holder[0]
        n = stock.weight.shape[0]
        for tokens in map(int, ("4" if args.smoke else args.tokens).split(",")):
            m = tokens * per_token
            count = 1 if args.smoke else max(2, int(200e6 // (m * n * 2 * 3)) + 1)
            pool = [tuple(torch.randn(m, n, device=device, dtype=torch.bfloat16).requires_grad_(i < 2)
                          for i in range(3)) for _ in range(count)]
            with torch.no_grad():
                diff = (patched(*pool[0][:2]).float() - stock(*pool[0][:2]).float()).abs().max().item()
            row = dict(module=name, cls=type(stock).__name__, semantics=report.swapped[0].semantics, tokens=tokens,
                       rows=m, cols=n, max_abs_diff=diff)
            torch._dynamo.reset()
            for impl, module in (("stock", stock), ("patched", patched)):
                for compiled in (False, True):
                    for pass_, backward in (("fwd", False), ("fwd_bwd", True)):
                        fn = _step(module, backward)
                        key = f"{impl}{'_compiled' if compiled else ''}_{pass_}"
                        if compiled:
                            fn = torch.compile(fn, dynamic=False)
                            _, code = run_and_get_code(fn, *pool[0])
                            row[f"{key}_kernels"] = launched_kernels(code)
                        if args.smoke:
                            fn(*pool[0])
                            continue
                        row[f"{key}_gpu_us"] = gpu_us(fn, pool, iters)
                        row[f"{key}_call_us"] = call_us(fn, pool, iters)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del pool
    meta = dict(torch=torch.__version__, triton=__import__("triton").__version__,
                transformers=__import__("transformers").__version__, smoke=args.smoke)
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
