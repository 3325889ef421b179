"""Host time of one kernel launch by the number of its pointer and int arguments, through
Inductor's static launcher (``StaticallyLaunchedCudaKernel.run``, what a compiled graph's
launches go through) and through the compiled kernel's Triton launcher.

Each case is a kernel with ``P`` pointer and ``I`` int parameters whose programs return at
once (its stores sit behind a condition that is never true), compiled by Triton and loaded by
the static launcher. 15 rounds, each timing 2,000 back-to-back launches of every case in
turn; median and fastest window per launch.

Run on a CUDA machine: ``OUT=DIR python launch_args.py`` (writes ``launch-args.txt``).
"""

import importlib.util
import os
import pathlib
import statistics
import tempfile
import time

import torch
from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel

CASES = [(2, 0), (2, 5), (2, 10), (2, 15), (7, 0), (12, 0), (7, 10), (12, 10)]  # (pointers, ints)
ROUNDS, CALLS = 15, 2000
TMP = pathlib.Path(tempfile.mkdtemp())


def kernel(n_ptr: int, n_int: int):
    ptrs, ints = [f"P{i}" for i in range(n_ptr)], [f"i{i}" for i in range(n_int)]
    body = "".join(f"        tl.store(P0 + {a}, 0)\n" for a in ints) + "".join(f"        tl.store({p}, 0)\n"
                                                                              for p in ptrs[1:])
    path = TMP / f"k_{n_ptr}_{n_int}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    f"def k({', '.join(ptrs + ints)}):\n    if tl.program_id(0) < 0:\n{body or '        pass'}\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.k


def main() -> None:
    x = torch.zeros(1024, device="cuda", dtype=torch.int32)
    stream = torch.cuda.current_stream().cuda_stream
    cases = {}
    for n_ptr, n_int in CASES:
        args = [x] * n_ptr + [i + 2 for i in range(n_int)]  # ints of 2 up: none specialized away
        compiled = kernel(n_ptr, n_int)[(1,)](*args)
        compiled._cubin_path = str(TMP / f"k_{n_ptr}_{n_int}.cubin")
        pathlib.Path(compiled._cubin_path).write_bytes(compiled.asm["cubin"])
        static = StaticallyLaunchedCudaKernel(compiled)
        static.load_kernel(torch.cuda.current_device())
        cases[(n_ptr, n_int)] = static, compiled, args
    torch.cuda.synchronize()
    times = {(case, how): [] for case in cases for how in ("static", "triton")}
    for _ in range(ROUNDS):
        for case, (static, compiled, args) in cases.items():
            t = time.perf_counter_ns()
            for _ in range(CALLS):
                static.run(1, 1, 1, stream, *args)
            times[case, "static"].append((time.perf_counter_ns() - t) / CALLS / 1e3)
            launch = compiled[(1, 1, 1)]
            t = time.perf_counter_ns()
            for _ in range(CALLS):
                launch(*args)
            times[case, "triton"].append((time.perf_counter_ns() - t) / CALLS / 1e3)
            torch.cuda.synchronize()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host time per launch, us: median window "
             f"(fastest) of {ROUNDS} x {CALLS} launches"]
    for case in cases:
        lines.append(f"pointers {case[0]:2d}, ints {case[1]:2d}: static launcher "
                     f"{statistics.median(times[case, 'static']):6.3f} ({min(times[case, 'static']):6.3f}); "
                     f"Triton's {statistics.median(times[case, 'triton']):6.3f} ({min(times[case, 'triton']):6.3f})")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    (pathlib.Path(os.environ.get("OUT", ".")) / "launch-args.txt").write_text(text)


if __name__ == "__main__":
    main()
