"""A patched transformers Llama compiled on CPU without the Triton interpreter, against the stock
one compiled in the same process: training step (forward with labels + backward) and inference
forward, wall-clock, 5 steps per impl per round, impls in turn; ``ratio_paired`` is the median
over rounds of patched / stock (each round's medians). Usage: ``python cpu_models.py [ROUNDS]``;
prints one JSON line (the dispatch counts: where the norms were decided)."""
import os; os.environ.pop("TRITON_INTERPRET", None)
import copy, json, statistics, sys, time, warnings
import torch, transformers
import torch_rmsnorm_op as T
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
cs, cp = torch.compile(stock), torch.compile(patched)
def train(m, c):
    m.zero_grad(set_to_none=True); c(input_ids=ids, labels=ids).loss.backward()
def infer(m, c):
    with torch.no_grad(): c(input_ids=ids)
out = {}
for name, step in (("train", train), ("infer", infer)):
    for m, c in ((stock, cs), (patched, cp)):
        for _ in range(3): step(m, c)
    ratios, times = [], {"stock": [], "patched": []}
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 15):
        per = {}
        for impl, m, c in (("stock", stock, cs), ("patched", patched, cp)):
            ts = []
            for _ in range(5):
                t = time.perf_counter(); step(m, c); ts.append(time.perf_counter() - t)
            per[impl] = statistics.median(ts); times[impl] += ts
        ratios.append(per["patched"] / per["stock"])
    out[name] = dict(stock_ms=round(1e3 * statistics.median(times["stock"]), 3),
                     patched_ms=round(1e3 * statistics.median(times["patched"]), 3),
                     ratio_paired=round(statistics.median(ratios), 3))
print(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(), stats=T.dispatch_stats(), **out)))
