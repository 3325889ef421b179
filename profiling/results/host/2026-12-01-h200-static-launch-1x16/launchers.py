"""Which launcher Inductor gives each kernel of a compiled patched model: a Llama (hidden 2048)
patched, compiled (default mode, Inductor's compile workers) and run for one training step at
1x16 tokens; prints the compile results' types of our kernels (``_rms_norm_*``) and a count of
(ours, types) over every kernel of the loaded output code. ``StaticTritonCompileResult``:
Inductor's static launcher; ``TritonCompileResult``: Triton's.

Run from the repository root on a CUDA machine, with the library at the commit given in the
README, without and with ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1``:
``python profiling/results/host/2026-12-01-h200-static-launch-1x16/launchers.py``.
"""

import collections
import os
import sys

import torch
from torch._inductor.codecache import PyCodeCache
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

sys.path.insert(0, ".")
import torch_rmsnorm_op as T  # noqa: E402
from torch_rmsnorm_op.tools import model_benchmark as mb  # noqa: E402


def main() -> None:
    print("env", os.environ.get("TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"),
          "cfg", torch._inductor.config.static_launch_user_defined_triton_kernels)
    device = torch.device("cuda")
    spec = mb.ModelSpec.of("llama", 2048)
    model = mb.build_model(spec, device)
    ids = torch.randint(0, spec.vocab, (1, 16), device=device)
    with T.patched_rmsnorm(model):
        loss = torch.compile(model)(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
    kinds = collections.Counter()
    for mod in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        for name, obj in vars(mod).items():
            if isinstance(obj, CachingAutotuner):
                res = [type(r).__name__ for r in obj.compile_results]
                ours = "rms" in name or "_kernel" in name
                kinds[(ours, tuple(res))] += 1
                if ours:
                    print(name, res)
    print(kinds)


if __name__ == "__main__":
    main()
