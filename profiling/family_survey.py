"""Every transformers causal LM (or model of another head), patched, against itself unpatched.

Each ``*ForCausalLM`` class of the installed transformers (``--head``: the classes whose names
end in another head, such as ``ForConditionalGeneration``: multimodal and encoder-decoder
models, run on token ids alone) is built from its config class's defaults shrunk to two layers
of width 64 (``SMALL``, by ``torch_rmsnorm_op.tools.hf_configs.shrink_config``: the attributes
a config has, passed to its constructor so that the attributes derived from them follow;
per-layer kind lists cut to the two layers; a latent-attention config's key/value heads as its
query heads; the configs it holds, a multimodal model's text and vision configs among them,
shrunk alike; ``OWN``: what a default config leaves to checkpoints; dropout off), in fp32,
then patched (``patch_rmsnorm``). Its logits on random token ids (an encoder-decoder's decoder
gets the same ids) are compared with the unpatched model's under the ``"error"`` fallback
policy, so that every norm the patcher swapped must run the kernels; with
``--compile``, a training step (forward with labels, backward) of the patched model under
``torch.compile`` (Inductor) is compared with the unpatched model's eager step, logits and
every parameter's gradient, and graph breaks are counted (the unpatched model's compiled step
is counted too where the patched one breaks).

A row's ``status``: ``match``; ``mismatch`` (logits or gradients further apart than ``ATOL``);
``error`` (the patched model raised where the unpatched one ran); ``no norm`` (nothing
swapped, nothing reported); ``skipped`` (every norm-like module reported with its reason);
``not built`` (the shrunk default config does not build, or the unpatched model does not run
on it, eager or, with ``--compile``, compiled: the family needs a config of its own, as
``tests/test_families.py`` gives the families it covers). Each model runs in a process of its
own, so that one that exhausts memory or hangs costs only its row.

Run: ``python profiling/family_survey.py --out DIR [--compile] [--head H] [--models A,B] [--timeout S]``
(on a machine without a GPU the kernels run through the Triton interpreter). Writes
``DIR/survey.json`` and ``DIR/survey.md``.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_rmsnorm_op.tools.hf_configs import TINY, shrink_config  # noqa: E402

SMALL = TINY  # width 64, two layers (torch_rmsnorm_op.tools.hf_configs)
OWN = {  # what a family's default config leaves to its checkpoints
    "Lfm2MoeForCausalLM": dict(layer_types=["conv", "full_attention"]),
}
ATOL = dict(logits=1e-3, grads=1e-2)  # fp32 through two layers, a few roundings apart
ROWS, TOKENS = 2, 12
BUILT = "built"  # what a model's process prints once the unpatched model ran
MEMORY = 16 << 30  # the address space a model's process may take on a machine without a GPU


def model_names(head: str = "ForCausalLM") -> list[str]:
    """The installed transformers' model classes whose names end in ``head``."""
    import transformers

    return sorted(n for n in dir(transformers)
                  if n.endswith(head) and not n.startswith(("TF", "Flax", "Auto")))


def _build(name: str):
    import torch
    import transformers

    cls = getattr(transformers, name)
    config = _small_config(cls.config_class(), OWN.get(name, {}))
    torch.manual_seed(0)
    return cls(config)


def _small_config(default, own: dict):
    """``default`` (a config) shrunk as the module docstring says, with ``own`` on top, and each
    config it holds (a multimodal model's text and vision configs, a hybrid's parts) likewise."""
    return shrink_config(default, SMALL, own)


def _step(model, ids, train: bool, compiled: bool):
    import torch

    run = torch.compile(model) if compiled else model
    inputs = dict(input_ids=ids)
    if "decoder_input_ids" in inspect.signature(model.forward).parameters:  # an encoder-decoder
        inputs["decoder_input_ids"] = ids
    if not train:
        with torch.no_grad():
            return run(**inputs).logits, {}
    model.zero_grad(set_to_none=True)
    out = run(**inputs, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def survey(name: str, compiled: bool = False, built=lambda: None) -> dict:
    """One model's row (module docstring); ``built()`` is called once the unpatched model ran."""
    import torch
    from torch._dynamo.utils import counters

    import torch_rmsnorm_op as T

    row: dict = {"model": name}
    ids = torch.randint(3, SMALL["vocab_size"], (ROWS, TOKENS), generator=torch.Generator().manual_seed(1))
    try:
        model = _build(name).train(compiled)
        patched = copy.deepcopy(model)  # before a step leaves state a copy cannot take
        want, want_grads = _step(model, ids, compiled, False)
    except Exception as e:  # noqa: BLE001 (any failure of the family's own code)
        return {**row, "status": "not built", "detail": f"{type(e).__name__}: {e}"[:200]}
    built()
    report = T.patch_rmsnorm(patched)
    row.update(swapped=len(report.swapped), reported=len(report.skipped),
               semantics=report.semantics_counts(), reasons=sorted({s.reason for s in report.skipped}))
    if not report.swapped:
        return {**row, "status": "skipped" if report.skipped else "no norm"}
    T.reset_dispatch_stats()
    torch._dynamo.reset()
    counters.clear()
    try:
        with T.fallback_policy("error"):
            got, got_grads = _step(patched, ids, compiled, compiled)
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {e}"[:300]
        if compiled:  # the unpatched model's compiled step, on the same config
            torch._dynamo.reset()
            try:
                _step(model, ids, True, True)
            except Exception:  # noqa: BLE001
                return {**row, "status": "not built",
                        "detail": f"the unpatched model's compiled step fails too: {detail}"}
        return {**row, "status": "error", "detail": detail}
    row["logits_max_abs_diff"] = (got - want).abs().max().item()
    missing = sorted(set(want_grads) - set(got_grads))
    kernels = T.dispatch_stats()["kernel"]
    row["kernel_calls"] = sum(kernels.values())
    row["kernels"] = dict(sorted(kernels.items()))  # by op: which norms the compiled graphs fused, and how
    if compiled:
        row["grads_max_abs_diff"] = max(
            [(got_grads[k] - g).abs().max().item() for k, g in want_grads.items() if k in got_grads], default=0.0)
        row["graph_breaks"] = sum(counters["graph_break"].values())
        if row["graph_breaks"]:
            torch._dynamo.reset()
            counters.clear()
            _step(model, ids, True, True)
            row["stock_graph_breaks"] = sum(counters["graph_break"].values())
    close = row["logits_max_abs_diff"] <= ATOL["logits"] and row.get("grads_max_abs_diff", 0.0) <= ATOL["grads"]
    return {**row, "status": "match" if close and not missing else "mismatch", "missing_grads": missing[:5]}


def _diff(row: dict, key: str) -> str:
    return "" if key not in row else f"{row[key]:.1e}"


def _markdown(rows: list[dict], meta: dict) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [f"# Family survey: *{meta.get('head', 'ForCausalLM')} "
             f"({'compiled training step' if meta['compile'] else 'eager inference'})", "",
             f"transformers {meta['transformers']}, torch {meta['torch']}, {meta['device']}, {meta['date']}; "
             f"{len(rows)} models: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), "",
             "| model | status | swapped | reported | semantics | logits diff | grads diff | graph breaks "
             "| kernel calls | detail |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        breaks = "" if "graph_breaks" not in r else str(r["graph_breaks"]) + (
            f" (stock {r['stock_graph_breaks']})" if "stock_graph_breaks" in r else "")
        detail = r.get("detail") or "; ".join(r.get("reasons", []))
        diffs = f"{_diff(r, 'logits_max_abs_diff')} | {_diff(r, 'grads_max_abs_diff')}"
        kernels = ", ".join(f"{op.removeprefix('rmsnorm.')} {n}" for op, n in r.get("kernels", {}).items())
        lines.append(f"| {r['model']} | {r['status']} | {r.get('swapped', '')} | {r.get('reported', '')} | "
                     f"{r.get('semantics', '')} | {diffs} | {breaks} | {kernels} | {detail.replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--compile", action="store_true", help="a compiled training step, not eager inference")
    p.add_argument("--head", default="ForCausalLM", help="the classes whose names end in this (default: %(default)s)")
    p.add_argument("--models", help="comma-separated class names (default: every class of --head)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per model")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the per-model process
    args = p.parse_args()
    if args.one:
        print(json.dumps(survey(args.one, args.compile, built=lambda: print(BUILT, flush=True))))
        return
    import torch
    import transformers

    env, limit = dict(os.environ), None
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")

        def limit():  # a default config of full size must not take the machine's memory
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    names = args.models.split(",") if args.models else model_names(args.head)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "head": args.head,
            "compile": args.compile,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)",
            "date": time.strftime("%Y-%m-%d")}
    for name in names:
        command = [sys.executable, __file__, "--one", name] + (["--compile"] if args.compile else [])
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout,
                                  preexec_fn=limit)
            out = done.stdout.splitlines()
            lines = [line for line in out if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "model": name, "status": "error" if BUILT in out else "not built",
                "detail": f"exit {done.returncode}: {done.stderr.strip()[-200:]}"}
        except subprocess.TimeoutExpired:
            row = {"model": name, "status": "error", "detail": f"over {args.timeout} s"}
        rows.append(row)
        print(name, row["status"], flush=True)
        with open(os.path.join(args.out, "survey.json"), "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "survey.md"), "w") as f:
            f.write(_markdown(rows, meta))


if __name__ == "__main__":
    main()
