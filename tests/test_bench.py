"""The benchmark's machinery at tiny sizes (CPU smoke; real numbers come from the GPU)."""

import functools
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_smoke_writes_the_declared_schema(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "bench", "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert {"gpu", "torch", "triton", "date", "copy_GBs", "rows"} <= set(result)
    impls = {(r["impl"], r["pass"]) for r in result["rows"]}
    assert impls == {(i, p) for i in ("ours", "inductor", "eager") for p in ("fwd", "fwd+bwd")}
    for row in result["rows"]:
        assert {"M", "N", "dtype", "impl", "pass", "us", "GBs", "pct_of_copy"} <= set(row), row
        assert row["us"] > 0
    assert path.with_suffix(".md").exists() and path.with_suffix(".png").exists()
    if result["gpu"] == "cpu-interpreter":
        assert "not GPU timings" in path.with_suffix(".md").read_text()
        assert not any("kernels_us" in row for row in result["rows"])
    else:  # the breakdown names our kernels and adds up to the step's time
        for row in result["rows"]:
            kernels = row["kernels_us"]
            assert abs(sum(kernels.values()) - row["us"]) <= 0.05 * row["us"] + 0.1, row
            if row["impl"] == "ours":
                want = {"_rms_norm_fwd"} | ({"_rms_norm_bwd", "_rms_norm_dw_reduce"} if row["pass"] == "fwd+bwd" else set())
                assert want <= {name.split("(")[0] for name in kernels}, row



def test_tune_refuses_two_candidate_sets():
    """``--table`` with ``--override`` once timed the table's config alone (session 16): the
    candidate sets exclude each other, and saying two is an error before any GPU work."""
    out = subprocess.run([sys.executable, "profiling/tune.py", "--table", "--override", "block_n=4096"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "not allowed with argument" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("merge", [False, True])
def test_table_fits_in_registers(merge):
    """``profiling/resource_usage.py`` compiles the table's configs for the H200 without a GPU:
    the 2-byte forward configs at the benchmark's N and the 2-byte split-mode backward ones must
    not spill (split backward 16384 columns x 8 warps, session 5: 255 registers and 544 B of
    stack under Triton 3.6, 36% of copy against 70% for 8192 x 8); nor must the split-mode
    backward with its dweight partials merged in pairs (``--merge``, as at 128 MiB shapes)."""
    jobs = [] if merge else [f"fwd:{dtype}:{n}" for dtype in ("bfloat16", "float16")
                             for n in (256, 1024, 4096, 8192, 16384, 32768, 65536, 262144)]
    jobs += [f"bwd:{dtype}:{n}" for dtype in ("bfloat16", "float16") for n in (32768, 65536, 262144)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it compiles, not interprets
    out = subprocess.run([sys.executable, "profiling/resource_usage.py", "--jobs", ",".join(jobs)]
                         + (["--merge"] if merge else []), capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if " table " in line]
    assert len(rows) == len(jobs), out.stdout
    for line in rows:
        regs, stack = map(int, re.search(r"(\d+) registers, +(\d+) B stack", line).groups())
        assert 0 < regs <= 255 and stack == 0, line


def test_split_loop_probe_computes_what_it_says(device):
    """``profiling/tma_probe.py``'s loops (NOTES.md, session 15) write what their rows are
    labelled with, checked where they run: own-chunk partials (``OWN``), copies (``COPY``), the
    package's row-ahead structure and w read per row, TMA loads and stores, and on CUDA the
    package's exchange (``EXCHANGE``: real RMSNorm results)."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "profiling"))
    try:
        import tma_probe as probe
    finally:
        sys.path.pop(0)
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n, blk, split = 7, 1024, 256, 4
    grid, rows = probe._grid(m, n, device, split, 2)  # two interleaved groups, a phantom row
    consts = dict(BLOCK_N=blk, SPLIT=split, STAGES=2)
    loops = [spec for spec in probe.LOOPS.values() if device.type == "cuda" or spec[2] != probe.EXCHANGE.value]
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
        x, dy = (torch.randn(m, n, generator=gen).to(device, dtype) for _ in range(2))
        w = torch.randn(n, generator=gen).to(device, dtype)
        rstd = torch.rand(m, generator=gen).to(device) + 0.5
        y, dx = torch.zeros_like(x), torch.zeros_like(x)
        partial = torch.zeros(grid, blk, device=device)
        slots = torch.zeros(grid // split * rows, split, dtype=torch.int64, device=device)
        r = rstd.view(m, 1, 1)
        for forward, backward, mode, more in loops:
            width = n if mode == probe.EXCHANGE.value else blk  # the row, or each program's own chunk
            xc, u = x.float().view(m, -1, width), (dy.float() * w.float()).view(m, -1, width)
            if forward is not None:
                slots.zero_()
                y.zero_()
                probe._loop_fwd[(grid,)](x, y, slots, n, m, n, 1e-6, rows, MODE=mode, **more, **consts)
                want = x.float() if mode == probe.COPY.value else xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)
                torch.testing.assert_close(y.float(), want.view(m, n), atol=tol, rtol=tol,
                                           msg=functools.partial("{}: {}".format, forward))
            if backward is not None:
                slots.zero_()
                dx.zero_()
                probe._loop_bwd[(grid,)](x, dy, dx, w, rstd, partial, slots, n, m, n, rows, MODE=mode, **more,
                                         **consts)
                want = (x.float() + dy.float() if mode == probe.COPY.value
                        else (u - xc * (r * r * (u * xc).mean(-1, keepdim=True))) * r)
                torch.testing.assert_close(dx.float(), want.view(m, n), atol=tol * 10, rtol=tol,
                                           msg=functools.partial("{}: {}".format, backward))
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
            continue  # tensor descriptors need Hopper
        inner = probe.INNER * 2 // x.element_size()
        box = [1, blk // inner, inner]
        descs = [TensorDescriptor.from_tensor(t.view(m, n // inner, inner), box) for t in (x, y)]
        xc = x.float().view(m, -1, blk)
        want = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-6)).view(m, n)
        for tma_store in (False, True):
            y.zero_()
            probe._loop_tma[(grid,)](*descs, y, n, m, n, rows, INNER_N=inner, TMA_STORE=tma_store, **consts)
            torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)
