"""How far one expert choice moves a mixture of experts: ``python profiling/router_flips.py
--model qwen3_next [--hidden 2048] [--tokens 16] [--rows 4]`` (``--smoke``: the benchmark's tiny
model on CPU).

It builds the model ``bench-models`` times (``build_model``: bf16, the same seed, config and
norm weights, the same input ids for ``--tokens``), runs one eager training step of the
unpatched model, and reads every router's logits. It runs the step patched (``patch_rmsnorm``,
eager) and prints how far that moves the loss and the gradients, and how many rows' chosen experts
differ from the unpatched model's. Then, for the ``--rows`` (layer, token) rows whose
k-th largest router logit is closest to the next one, it runs the step again with that row's
k-th expert replaced by the best one not chosen (its softmax weight taken from the same logits,
renormalized as the router does) and prints the relative change of the loss and the relative L2
change of all RMSNorm weights' gradients: the fields ``bench-models`` checks. A compiled model
whose roundings differ from eager's by one bf16 ulp can make that choice; the printed changes say
how far it then moves from the reference without anything being wrong.

Routers of the form ``(logits, scores, indices) = router(hidden)`` with softmax top-k scores
(Mixtral's, Qwen3-MoE's, Qwen3-Next's); others raise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_rmsnorm_op as T  # noqa: E402
from torch_rmsnorm_op.tools import model_benchmark as B  # noqa: E402

SOFTMAX_ROUTERS = ("MixtralTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter")
Routed = list[tuple[torch.Tensor, torch.Tensor]]  # per router: (logits, chosen experts)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers, in layer order; raises for a router this script cannot re-score."""
    found = [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]
    if not found:
        raise ValueError(f"{type(model).__name__} has no top-k router")
    for m in found:
        if type(m).__name__ not in SOFTMAX_ROUTERS:
            raise ValueError(f"router {type(m).__name__} is not one of {SOFTMAX_ROUTERS} (softmax top-k scores)")
    return found


def step(model: nn.Module, ids: torch.Tensor, record: Routed | None = None,
         force: dict[int, tuple[int, int]] | None = None) -> tuple[float, torch.Tensor]:
    """One eager training step: (loss, the RMSNorm weights' gradients). ``record`` receives each
    router's (logits, chosen experts); ``force`` maps a router's index to (row, expert): that row's
    last chosen expert, its lowest-scored, is replaced by ``expert``."""
    hooks = []
    for i, router in enumerate(routers(model)):
        def hook(mod, args, out, i=i):
            logits, scores, idx = out
            if record is not None:
                record.append((logits.detach().float().clone(), idx.detach().clone()))
            if force is not None and i in force:
                row, expert = force[i]
                idx = idx.clone()
                idx[row, -1] = expert
                top = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, idx)
                if getattr(mod, "norm_topk_prob", True):
                    top = top / top.sum(-1, keepdim=True)
                out = (logits, top.to(scores.dtype), idx)
            return out
        hooks.append(router.register_forward_hook(hook))
    try:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return loss.item(), B._norm_grads([m.weight for m in B.norm_modules(model)])


def closest_rows(routed: Routed, rows: int) -> list[tuple[float, int, int, int, float]]:
    """(margin, layer, row, expert, k-th logit) of the ``rows`` rows whose k-th and (k+1)-th router
    logits are closest, smallest margin first; ``expert``: the best one the router did not choose
    (at a tie, the router's choice decides which of the tied experts that is)."""
    found = []
    for layer, (logits, idx) in enumerate(routed):
        k = idx.shape[-1]
        top = logits.topk(k + 1, -1).values
        margin = top[:, k - 1] - top[:, k]
        for row in range(logits.shape[0]):
            unchosen = logits[row].scatter(0, idx[row], float("-inf"))
            found.append((margin[row].item(), layer, row, int(unchosen.argmax()), top[row, k - 1].item()))
    return sorted(found)[:rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3_next", help="a mixture-of-experts family of bench-models")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16, help="one sequence of this many tokens")
    parser.add_argument("--rows", type=int, default=4, help="closest rows to try")
    parser.add_argument("--smoke", action="store_true", help="the benchmark's tiny model, on CPU")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.rows < 1:
        parser.error("--tokens and --rows must be at least 1")

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    spec = B.ModelSpec.of(args.model, B.SMOKE_HIDDEN if args.smoke else args.hidden, smoke=args.smoke)
    model = B.build_model(spec, device)
    ids = torch.randint(0, spec.vocab, (1, args.tokens), device=device,
                        generator=torch.Generator(device=device).manual_seed(args.tokens))
    routed: Routed = []
    base = step(model, ids, record=routed)
    logits, idx = routed[0]
    print(f"{args.model} hidden {spec.hidden} x {spec.layers} layers, {args.tokens} tokens, {device}: "
          f"top_k {idx.shape[-1]} of {logits.shape[-1]} experts; loss {base[0]:.6f}")
    report = T.patch_rmsnorm(model)
    routed_patched: Routed = []
    patched = step(model, ids, record=routed_patched)
    T.unpatch_rmsnorm(model)
    differ = sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
                 for (_, a), (_, b) in zip(routed, routed_patched))
    print(f"patched ({len(report.swapped)} norms swapped), eager: the loss moves by "
          f"{abs(patched[0] - base[0]) / abs(base[0]):.2e} (relative), the norm weights' gradients by "
          f"{B._rel_l2(patched[1], base[1]):.4f} (relative L2); router choices differing in {differ} of "
          f"{sum(i.shape[0] for _, i in routed)} (layer, token) rows")
    for margin, layer, row, expert, value in closest_rows(routed, args.rows):
        moved = step(model, ids, force={layer: (row, expert)})
        print(f"layer {layer} token {row}: k-th logit {value:.4f}, margin to the next {margin:.2e}; "
              f"choosing expert {expert} instead moves the loss by {abs(moved[0] - base[0]) / abs(base[0]):.2e} "
              f"(relative), the norm weights' gradients by {B._rel_l2(moved[1], base[1]):.4f} (relative L2)",
              flush=True)


if __name__ == "__main__":
    main()
