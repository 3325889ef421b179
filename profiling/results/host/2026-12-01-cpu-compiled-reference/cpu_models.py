"""A patched transformers Llama compiled on CPU without the Triton interpreter, against the stock
one compiled in the same process: training step (forward with labels + backward) and inference
forward, wall-clock, 5 steps per impl per round, impls in turn; ``ratio_paired`` is the median
over rounds of patched / stock (each round's medians). Usage: ``python cpu_models.py [ROUNDS]``;
prints one JSON line (the dispatch counts: where the norms were decided)."""

import os

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are defined

import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import torch_rmsnorm_op as T  # noqa: E402

warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               use_cache=False, attn_implementation="sdpa")
stock = transformers.LlamaForCausalLM(cfg)
patched = copy.deepcopy(stock)
T.patch_rmsnorm(patched)
T.set_fallback_policy("reference")
ids = torch.randint(0, 1000, (2, 128))
compiled = {"stock": (stock, torch.compile(stock)), "patched": (patched, torch.compile(patched))}


def train(model, step):
    model.zero_grad(set_to_none=True)
    step(input_ids=ids, labels=ids).loss.backward()


def infer(model, step):
    with torch.no_grad():
        step(input_ids=ids)


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
out = {}
for name, run in (("train", train), ("infer", infer)):
    for model, step in compiled.values():
        for _ in range(3):  # compile and warm up
            run(model, step)
    ratios, times = [], {"stock": [], "patched": []}
    for _ in range(rounds):
        medians = {}
        for impl, (model, step) in compiled.items():
            steps = []
            for _ in range(5):
                start = time.perf_counter()
                run(model, step)
                steps.append(time.perf_counter() - start)
            medians[impl] = statistics.median(steps)
            times[impl] += steps
        ratios.append(medians["patched"] / medians["stock"])
    out[name] = dict(stock_ms=round(1e3 * statistics.median(times["stock"]), 3),
                     patched_ms=round(1e3 * statistics.median(times["patched"]), 3),
                     ratio_paired=round(statistics.median(ratios), 3))
print(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(), stats=T.dispatch_stats(), **out)))
