"""What each choice of the compile rule costs, class of site by class of site.

One norm site of each class the rule sorts (``torch_rmsnorm_op/passes/rule.py``), as a decoder
layer has it at 4x2048 tokens, hidden 2048, bf16, a training step (forward and backward) under
``torch.compile``:

- ``sum -> matmuls``: a residual add, the norm, the q, k and v projections;
- ``sum -> other ops (float8 linears)``: the same, the projections torchao float8 training
  linears (rowwise; skipped where torchao is missing);
- ``fused (a scaled branch) -> matmuls``: a residual plus a scaled branch (``r + b * 0.25``),
  the norm, the projections;
- ``read by the norm alone -> other ops (RoPE)``: q/k heads (rows of 128) normalized, then RoPE;
- ``fused (the embeddings) -> matmuls``: an embedding lookup, the norm, the projections.

Each site runs as the stock module (Hugging Face's Llama norm, unpatched), patched with the
rule's own choice, and patched with each choice forced on it: ``ours/ours`` (the op, a residual
add moved into ``add_fwd``), ``inductor/inductor`` (``pre_grad.inductor_norm``), and
``inductor/ours``: Inductor's forward and our backward, an autograd function defined here whose
forward is ``inductor_norm`` and whose backward calls ``rmsnorm.bwd`` / ``add_bwd`` (the rule
never takes it: it measured no better than Inductor's backward where a fused term makes the
input, and 10% slower a site with torchao's float8 linears).
The figure is GPU time per step (the sum of the device durations of every kernel, memset and
memcpy, ``tools.benchmark.gpu_us``), in alternating rounds; ``ratio`` is the median over rounds
of the variant's time over stock's in the same round. The projections are 2048 -> 256 so that
the norm's share of the step shows.

Run: ``python profiling/site_classes.py --out DIR [--rounds 5]`` (CUDA). Writes
``DIR/site_classes.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import operator
import os
import statistics

import torch
from torch import nn

import torch_rmsnorm_op as T
from torch_rmsnorm_op.passes import graph as G
from torch_rmsnorm_op.passes import pre_grad
from torch_rmsnorm_op.tools.benchmark import gpu_us

TOKENS, HIDDEN, HEAD_DIM, HEADS, OUT = 8192, 2048, 128, 16, 256


class Norm(nn.Module):
    """Hugging Face's Llama RMSNorm, as stock models hold it."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class Site(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        n = HEAD_DIM if kind == "rope" else HIDDEN
        self.norm = Norm(n)
        self.q, self.k, self.v = (nn.Linear(HIDDEN, OUT, bias=False) for _ in range(3))
        self.embed = nn.Embedding(TOKENS, HIDDEN) if kind == "embedding" else None

    def forward(self, a, b):
        if self.kind == "embedding":
            y = self.norm(self.embed(a))
        elif self.kind == "rope":
            y = self.norm(a.view(TOKENS, HEADS, HEAD_DIM))
            half = HEAD_DIM // 2
            return (y * 0.5 + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * 0.25).float().square().mean()
        elif self.kind == "scaled":
            y = self.norm(a + b * 0.25)
        else:
            y = self.norm(a + b)
        return sum(p(y).float().square().mean() for p in (self.q, self.k, self.v))


CLASSES = {"sum -> matmuls": "sum", "sum -> other ops (float8 linears)": "float8",
           "fused (a scaled branch) -> matmuls": "scaled", "read by the norm alone -> other ops (RoPE)": "rope",
           "fused (the embeddings) -> matmuls": "embedding"}
CHOICES = {"ours/ours": ("ours", "ours"), "inductor/ours": ("inductor", "ours"),
           "inductor/inductor": ("inductor", "inductor")}


class InductorForward(torch.autograd.Function):
    """Inductor's forward (``inductor_norm``), our backward (``rmsnorm.bwd``), of a plain norm."""

    @staticmethod
    def forward(ctx, x, weight, eps, weight_offset, norm_dtype, out_dtype):
        y, rstd = pre_grad.inductor_norm(x, weight, eps, weight_offset=weight_offset, norm_dtype=norm_dtype,
                                         out_dtype=out_dtype)
        ctx.mark_non_differentiable(rstd)
        ctx.weight_offset = weight_offset
        ctx.save_for_backward(x, weight, rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = torch.ops.rmsnorm.bwd(dy, x, weight, rstd, weight_offset=ctx.weight_offset)
        return dx, dweight, None, None, None, None


class InductorAddForward(torch.autograd.Function):
    """Inductor's forward (the sum, then ``inductor_norm``), our backward (``rmsnorm.add_bwd``)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, weight_offset, norm_dtype, out_dtype):
        h = x + residual
        y, rstd = pre_grad.inductor_norm(h, weight, eps, weight_offset=weight_offset, norm_dtype=norm_dtype,
                                         out_dtype=out_dtype)
        ctx.mark_non_differentiable(rstd)
        ctx.weight_offset = weight_offset
        ctx.save_for_backward(h, weight, rstd)
        return y, h, rstd

    @staticmethod
    def backward(ctx, dy, dh, _):
        h, weight, rstd = ctx.saved_tensors
        dsum, dweight = torch.ops.rmsnorm.add_bwd(dy, dh, h, weight, rstd, weight_offset=ctx.weight_offset)
        return dsum, dsum, dweight, None, None, None, None


def _hybrid(graph, site) -> None:
    """Replace the site (and the add it reads) with ``InductorForward`` / ``InductorAddForward``."""
    norm = site.norm
    kw = [norm.kwargs.get(k, d) for k, d in (("weight_offset", 0.0), ("norm_dtype", None), ("out_dtype", None))]
    x = G.through_noop_cast(norm.args[0])
    if G.is_plain_add(x):
        with graph.inserting_after(norm):
            new = graph.call_function(InductorAddForward.apply, (*x.args, *norm.args[1:], *kw))
        with graph.inserting_after(new):
            y, h, rstd = (graph.call_function(operator.getitem, (new, i)) for i in range(3))
        for user in list(norm.users):
            user.replace_all_uses_with({0: y, 1: rstd}[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(norm)
        x.replace_all_uses_with(h)
        graph.erase_node(x)
    else:
        with graph.inserting_before(norm):
            new = graph.call_function(InductorForward.apply, (*norm.args, *kw))
        norm.replace_all_uses_with(new)
        graph.erase_node(norm)


@contextlib.contextmanager
def forced(choice):
    """The pre-grad stage, for graphs compiled inside: every site takes ``choice`` (None: the
    rule's own)."""
    real = pre_grad.apply_rule

    def apply(graph):
        order = {n: i for i, n in enumerate(graph.nodes)}
        for site in pre_grad.decisions(graph):
            x = G.through_noop_cast(site.norm.args[0])
            if choice == ("ours", "ours"):
                if G.is_plain_add(x):
                    pre_grad._replace_with_sum(graph, dataclasses.replace(site, input="sum"), order)
            elif choice == ("inductor", "inductor"):
                pre_grad._replace_norm(graph, site.norm)
            else:
                _hybrid(graph, site)
            T.fallback.record_site(*choice)
        graph.lint()

    if choice is not None:
        pre_grad.apply_rule = apply
    try:
        yield
    finally:
        pre_grad.apply_rule = real


def build(kind: str, device: str):
    torch.manual_seed(0)
    model = Site(kind).to(device, torch.bfloat16)
    if kind == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "embedding":
        a = torch.randint(0, TOKENS, (TOKENS,), device=device, generator=g)
        b = None
    else:
        n = HEADS * HEAD_DIM if kind == "rope" else HIDDEN
        a = torch.randn(TOKENS, n, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        b = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    return model, (a, b)


def variants(kind: str, device: str) -> dict:
    """Compiled steps of the site: stock, the rule's choice, each forced choice."""
    stock, inputs = build(kind, device)
    out = {}
    for name, choice in [("stock", None), ("rule", None), *CHOICES.items()]:
        model = copy.deepcopy(stock)
        if name != "stock":
            T.patch_rmsnorm(model)
        # A backend of its own per variant: Dynamo serves a compiled frame only to the backend
        # that compiled it, and the variants share Site.forward's code and guards.
        compiled = torch.compile(model, backend=lambda gm, example: torch._inductor.compile(gm, example))
        T.reset_dispatch_stats()
        # the caches key on the pass's settings, not on the forcing: each variant compiles afresh
        with forced(choice), torch._inductor.config.patch(force_disable_caches=True):
            compiled(*inputs).backward()  # compiles, with the rule as forced

        def step(compiled=compiled, model=model):
            for p in model.parameters():
                p.grad = None
            for t in inputs:
                if t is not None and t.grad is not None:
                    t.grad = None
            compiled(*inputs).backward()

        out[name] = (step, dict(T.dispatch_stats()["sites"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter): tests the "
                        "script, its times are not GPU timings")
    args = parser.parse_args()
    global TOKENS, HIDDEN, HEAD_DIM, HEADS, OUT
    device = "cuda"
    if args.smoke:
        TOKENS, HIDDEN, HEAD_DIM, HEADS, OUT = 16, 64, 16, 4, 16
        device, args.rounds, args.iters = "cpu", 1, 1
    os.makedirs(args.out, exist_ok=True)
    T.install_inductor_passes()
    torch._dynamo.config.recompile_limit = 1000  # every variant of every class compiles Site.forward
    rows = []
    for label, kind in CLASSES.items():
        try:
            steps = variants(kind, device)
        except ImportError as e:
            rows.append({"class": label, "error": f"{type(e).__name__}: {e}"})
            continue
        times = {name: [] for name in steps}
        kernels = {name: {} for name in steps}
        for r in range(args.rounds):
            order = list(steps) if r % 2 == 0 else list(reversed(steps))
            for name in order:
                times[name].append(gpu_us(steps[name][0], args.iters, 1, kernels[name]))
        for name in steps:
            ratios = [t / s for t, s in zip(times[name], times["stock"])]
            rows.append({"class": label, "variant": name, "sites": steps[name][1],
                         "gpu_us": round(statistics.median(times[name]), 2),
                         "ratio": round(statistics.median(ratios), 4),
                         "kernels_us": dict(list(kernels[name].items())[:8])})
        print(label, {row["variant"]: row["ratio"] for row in rows if row.get("class") == label and "ratio" in row},
              flush=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke: not GPU timings)"
    result = {"gpu": gpu, "torch": torch.__version__,
              "triton": __import__("triton").__version__, "date": datetime.date.today().isoformat(),
              "tokens": TOKENS, "hidden": HIDDEN, "rows": rows}
    with open(os.path.join(args.out, "site_classes.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'class':42} {'variant':18} {'GPU us':>10} {'vs stock':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['class']:42} {row['error']}")
        else:
            print(f"{row['class']:42} {row['variant']:18} {row['gpu_us']:10.1f} {row['ratio']:9.4f}")


if __name__ == "__main__":
    main()
