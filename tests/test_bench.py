"""The benchmark's machinery at tiny sizes (CPU smoke; real numbers come from the GPU)."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from tolerances import TOL

from torch_rmsnorm_op.config import backward_config, forward_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_smoke_writes_the_declared_schema(tmp_path):
    """Run from a folder of its own without ``--out``: the results go to ``runs/bench/`` under it
    (the default, ignored by git), not into the committed ``profiling/results/``."""
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "bench", "--smoke", "--iters", "1", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["runs"], list(tmp_path.iterdir())
    (path,) = (tmp_path / "runs" / "bench").glob("*.json")
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
            if row["impl"] == "ours":  # a forward kernel (rows, looped or split), the backward's stages
                names = {name.split("(")[0] for name in kernels}
                want = ["_rms_norm_fwd_"]
                if row["pass"] == "fwd+bwd":  # over a few rows the backward's own launch writes dweight
                    cfg = backward_config(row["N"], getattr(torch, row["dtype"]), row["M"])
                    want += ["_rms_norm_bwd_"] + ([] if cfg.dw_columns else ["_rms_norm_dw_reduce"])
                assert all(any(name.startswith(prefix) for name in names) for prefix in want), row


def test_tune_builds_candidates_around_every_rung(monkeypatch):
    """``profiling/tune.py``'s candidates are valid configurations around each table rung, the
    backward's variants of the rung's row loop included (a rung that loads its next tile ahead
    gets variants without that, which reload or prefetch through shared memory)."""
    sys.path.insert(0, os.path.join(ROOT, "profiling"))
    try:
        import tune
    finally:
        sys.path.remove(os.path.join(ROOT, "profiling"))
    monkeypatch.setattr(tune, "DEVICE", "cpu")
    for dtype in (torch.bfloat16, torch.float32):
        for n in (128, 1536, 2048, 4096, 5120, 8192, 16384, 65536):
            for pass_name in ("fwd", "add_fwd", "bwd", "add_bwd"):
                job = tune.Job(pass_name, 8192, n, dtype, dtype)
                table = backward_config(n, dtype) if job.backward else forward_config(n, dtype, job.residual)
                for prefetch in (False, True):
                    cfgs = tune.candidates(job, table, False, prefetch=prefetch)
                    assert cfgs[0] == table and len(cfgs) == len(set(cfgs)), (job, table)
                    assert prefetch or len(cfgs) > 1 or table.split > 1, (job, table)
                    assert all(c.prefetch for c in cfgs[1:]) or not (prefetch and job.backward), (job, table)
    assert any(c.reload and not c.prefetch for c in tune.bwd_candidates(8192, backward_config(8192, torch.bfloat16)))


def test_tune_dry_run_checks_every_candidate_and_writes_its_json(tmp_path):
    """``profiling/tune.py --dry-run`` runs each job's table configuration and candidates on CPU
    through the interpreter, checks each against the float64 reference (a backward's dx and
    dweight) and writes the JSON, each candidate timed in two rounds; a backward job here sums
    its dy from several terms (``:3``)."""
    jobs = ["fwd:16:256", "add_bwd:16:256:3"]
    out = subprocess.run([sys.executable, "profiling/tune.py", "--dry-run", "--jobs", ",".join(jobs), "--dtype",
                          "float32", "--wdtype", "float32", "--rounds", "2", "--out", str(tmp_path), "--tag", "dry"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="1"))  # CPU tensors, on a CUDA machine too
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert " failed: " not in out.stdout, out.stdout
    result = json.loads((tmp_path / "dry.json").read_text())
    assert {"gpu", "torch", "triton", "copy_GBs", "jobs"} <= set(result)
    assert [job["job"] for job in result["jobs"]] == jobs
    for job in result["jobs"]:
        assert job["dtype"] == "torch.float32" and len(job["rows"]) > 1, job
        assert sum(row["table"] for row in job["rows"]) == 1, job
        for row in job["rows"]:
            assert {"us", "pct", "cfg", "max_err", "table"} <= set(row) and len(row["us_rounds"]) == 2, row
            assert row["max_err"] < TOL[torch.float32]["atol"], row
            if job["job"].startswith(("bwd", "add_bwd")):
                assert row["dweight_rel_err"] < 1e-5, row


@pytest.mark.parametrize("pass_name, store_rstd", [("fwd", False), ("fwd", True), ("add_bwd", True)])
def test_tune_keeps_inductors_outputs_until_their_input_set_comes_round(monkeypatch, pass_name, store_rstd):
    """``tune.inductor_us`` keeps what each input set's step wrote (a forward's outputs, the
    gradients a backward wrote) until that set's next step, as ours are written into tensors of
    each set: the caching allocator cannot hand a step the block the step before wrote. A
    forward job runs under ``no_grad`` as an inference forward, else with inputs that require
    grad."""
    sys.path.insert(0, os.path.join(ROOT, "profiling"))
    try:
        import tune
    finally:
        sys.path.remove(os.path.join(ROOT, "profiling"))
    import weakref

    monkeypatch.setattr(tune, "DEVICE", "cpu")
    job = tune.Job(pass_name, 4, 8, torch.float32, torch.float32, store_rstd=store_rstd)
    sets = tune.Sets(job, 3)
    steps = []

    def compile_(f, **kwargs):
        def run(x, r, w):
            # what every earlier step wrote (a forward's outputs, a backward's gradients) is alive
            for _, outs, grad in steps:
                if job.backward:
                    assert grad() is not None, "an earlier step's gradient was freed"
                else:
                    assert all(o() is not None for o in outs), "an earlier step's output was freed"
            assert torch.is_grad_enabled() == (job.backward or store_rstd)
            assert x.requires_grad == torch.is_grad_enabled()
            out = f(x, r, w)
            outs = out if isinstance(out, tuple) else (out,)
            steps.append((x, [weakref.ref(o) for o in outs], lambda x=x: x.grad))
            return out

        return run

    monkeypatch.setattr(tune.torch, "compile", compile_)
    assert tune.inductor_us(job, sets) == 1.0  # CPU: the warm-up steps, no timing
    assert len(steps) == 3 and len({id(x) for x, *_ in steps}) == 3
    if job.backward:
        assert all(x.grad is not None for x, *_ in steps)


def test_forward_prefetch_probe_computes_the_norm(device):
    """``profiling/fwd_prefetch_probe.py``'s persistent kernel computes rms_norm(x) * w for
    every row, where tiles and grid leave a partial last tile and programs with one tile more
    than others, with the next tile loaded either way."""
    sys.path.insert(0, os.path.join(ROOT, "profiling"))
    try:
        import fwd_prefetch_probe as probe
    finally:
        sys.path.remove(os.path.join(ROOT, "profiling"))
    g = torch.Generator().manual_seed(0)
    for m, n, rows, pps, ahead in ((37, 64, 2, 2, True), (37, 48, 1, 1, False), (64, 64, 4, 1, True)):
        x = torch.randn(m, n, generator=g, dtype=torch.bfloat16).to(device)
        w = (torch.rand(n, generator=g) + 0.5).to(device, torch.bfloat16)
        y = torch.full_like(x, float("nan"))
        probe.run_probe(x, w, y, rows, 1, pps, ahead)
        want = torch.nn.functional.rms_norm(x.float(), (n,), w.float(), probe.EPS)
        torch.testing.assert_close(y.float(), want, **TOL[torch.bfloat16])


def test_forward_weight_schedule_probe_computes_the_norm(device):
    """``profiling/fwd_weight_schedule_probe.py``'s kernel gives rms_norm(x) * w under every
    variant, over tiles that leave a partial last tile and masked columns, and rstd where the
    variant stores it."""
    sys.path.insert(0, os.path.join(ROOT, "profiling"))
    try:
        import fwd_weight_schedule_probe as probe
    finally:
        sys.path.remove(os.path.join(ROOT, "profiling"))
    from torch_rmsnorm_op.config import KernelConfig

    g = torch.Generator().manual_seed(0)
    for m, n, cfg in ((37, 48, KernelConfig(64, 2, 1)), (32, 64, KernelConfig(64, 4, 1, mask_free=True))):
        x = torch.randn(m, n, generator=g, dtype=torch.bfloat16).to(device)
        w = (torch.rand(n, generator=g) + 0.5).to(device, torch.bfloat16)
        want = torch.nn.functional.rms_norm(x.float(), (n,), w.float(), probe.EPS)
        for variant, (_, _, store) in probe.VARIANTS.items():
            item = dict(x=x, w=w, y=torch.full_like(x, float("nan")),
                        rstd_out=torch.full((m,), float("nan"), device=device))
            probe.run_variant(item, cfg, variant, m, n)
            torch.testing.assert_close(item["y"].float(), want, **TOL[torch.bfloat16])
            if store:
                rstd = torch.rsqrt(x.float().pow(2).mean(-1) + probe.EPS)
                torch.testing.assert_close(item["rstd_out"], rstd)


@pytest.mark.parametrize("merge", [False, True])
def test_table_fits_in_registers(merge):
    """``profiling/resource_usage.py`` compiles the table's configurations for the H200 without a
    GPU, specialized as the launcher specializes them at the benchmark's shapes: the 2-byte
    forward ones at the benchmark's N (rows, looped and split kernels) and at models' N of 1,536,
    5,120 and 6,144, and the 2-byte split-mode backward ones must not spill (a split backward of
    16384 columns x 8 warps, 255 registers and 544 B of stack under Triton 3.6, ran at 36% of copy
    against 70% for 8192 x 8); nor must the split-mode backward with its dweight partials merged
    in pairs (``--merge``, as at 128 MiB shapes)."""
    jobs = [] if merge else [f"fwd:{dtype}:{n}" for dtype in ("bfloat16", "float16")
                             for n in (256, 1024, 4096, 8192, 16384, 32768, 65536, 262144)]
    # the rungs of hidden sizes that are not powers of two, with and without the residual add
    jobs += [] if merge else ["fwd:bfloat16:1536", "fwd:bfloat16:5120", "fwd:bfloat16:6144", "add_fwd:bfloat16:5120"]
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


def test_forward_kernels_compute_in_fp32_when_a_compiled_graph_passes_eps_as_fp64():
    """Inductor's generated code passes a Python float to a Triton kernel as fp64, where
    Triton's own launcher passes fp32. Every forward kernel (rows, looped, split, the norm-add
    pair's), compiled for the H200 with eps typed so, has no fp64 instruction but eps's
    conversion: before ``_rstd`` cast it, the compiled graphs' kernels took rstd, the products
    and their conversions into fp64 (78 such instructions in the N = 2,048 rows kernel, 323 and
    206 registers against 123 in the split one)."""
    jobs = ["fwd:bfloat16:2048", "fwd:bfloat16:8192", "fwd:bfloat16:262144", "add_fwd:bfloat16:5120",
            "fwd:float32:4096", "norm_add_fwd:bfloat16:2048", "norm_add_fwd:bfloat16:4096"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "profiling/resource_usage.py", "--jobs", ",".join(jobs), "--m", "8192",
                          "--float-args", "fp64"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if " table " in line]
    assert [line.split()[0] for line in rows] == jobs, out.stdout
    for line in rows:
        assert re.search(r" 0 fp64,", line), line


@pytest.mark.parametrize("terms", [3, 5])
def test_summing_backward_fits_in_shared_memory(terms):
    """A compiled graph's backward launch that sums gradient terms (a mixture of experts with a
    shared expert sums 5 at its MLP's norm), with the residual's gradient, at every 2-byte rung
    from N = 2,048 and the fp32 ones from 4,096, compiled for the H200: the shared memory its
    row loop's pipeline takes stays within a block's 232,448 B (``launch.summed_gradient_consts``
    takes fewer stages for a split launch; at its rung's stages the bf16 split launch with 3
    terms needed 245,804 B, the fp32 one 327,720 B, and failed to launch)."""
    limit = 232448
    jobs = [f"add_bwd:bfloat16:{n}" for n in (2048, 4096, 8192, 16384, 65536)]
    jobs += [f"add_bwd:float32:{n}" for n in (4096, 8192, 16384, 65536)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def shared(jobs, *more):
        out = subprocess.run([sys.executable, "profiling/resource_usage.py", "--jobs", ",".join(jobs), "--m", "8192",
                              "--terms", str(terms), *more], capture_output=True, text=True, timeout=300, env=env,
                             cwd=ROOT)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        rows = [line for line in out.stdout.splitlines() if " table " in line]
        assert [line.split()[0] for line in rows] == jobs, out.stdout
        return [int(re.search(r"(\d+) B shared", line).group(1)) for line in rows]

    assert all(0 < b <= limit for b in shared(jobs)), jobs
    assert all(b > limit for b in shared(["add_bwd:bfloat16:65536", "add_bwd:float32:65536"], "--keep-stages"))


def test_family_survey_rows_say_what_each_model_got(device):
    """``profiling/family_survey.py``: a family the patcher serves matches its unpatched self
    (compiled training step: logits, gradients, no graph break; eager inference for a latent
    attention family, and an encoder-decoder of another head), a class that does not build and
    one without an RMSNorm say so, and the table holds a line per model."""
    sys.path.insert(0, os.path.join(ROOT, "profiling"))
    try:
        import family_survey
    finally:
        sys.path.remove(os.path.join(ROOT, "profiling"))
    pytest.importorskip("transformers")
    llama = family_survey.survey("LlamaForCausalLM", compiled=True)
    assert llama["status"] == "match" and llama["swapped"] == 5 and llama["graph_breaks"] == 0, llama
    # the norms of a residual sum of stored tensors ours, their adds in them (the first layer's two
    # norms, of the embeddings and of a sum with them, Inductor's)
    assert llama["kernels"] == {"rmsnorm.add_bwd": 3, "rmsnorm.add_fwd": 3} and llama["kernel_calls"] == 6, llama
    missing = family_survey.survey("NotAFamilyForCausalLM")  # no such class in transformers
    assert missing["status"] == "not built" and "AttributeError" in missing["detail"], missing
    # Latent attention's head sizes follow the shrunk ones through the config's constructor.
    latent = family_survey.survey("DeepseekV32ForCausalLM")
    assert latent["status"] == "match" and latent["swapped"] > 0, latent
    # An encoder-decoder of another head, on token ids alone (its decoder gets the same ids).
    t5 = family_survey.survey("T5ForConditionalGeneration")
    assert t5["status"] == "match" and t5["semantics"] == {"t5": 12}, t5
    assert family_survey.model_names("ForConditionalGeneration").count("T5ForConditionalGeneration") == 1
    bart = family_survey.survey("BartForCausalLM")
    assert bart["status"] == "no norm" and bart["swapped"] == 0, bart
    table = family_survey._markdown([llama, missing, bart], dict(compile=True, transformers="t", torch="t",
                                                              device="d", date="x"))
    assert table.count("\n| ") == 4 and "1 match, 1 no norm, 1 not built" in table
    assert "| add_bwd 3, add_fwd 3 |" in table
