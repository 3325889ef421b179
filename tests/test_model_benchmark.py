"""The model benchmark's machinery: a smoke run end to end, the byte floor, kernel attribution, the swaps."""

import contextlib
import json
import os
import struct
import subprocess
import sys
import types

import pytest
import torch
from checks import run_once

from torch_rmsnorm_op.tools import model_benchmark as mb

ROW_FIELDS = {"model", "hidden", "layers", "tokens", "mode", "pass", "impl", "step_ms", "step_ms_rounds", "gpu_ms",
              "norm_kernels",
              "reference", "matches_reference", "norm_modules", "norm_modules_swapped", "norm_floor_bytes",
              "norm_floor_bytes_without_adds", "copy_GBs", "compile_s"}
TRAIN_FIELDS = {"loss", "loss_abs_err", "loss_rel_err", "grad_rel_l2_err"}
INFER_FIELDS = {"logits_max_abs_err", "logits_max_rel_err", "logits_rel_l2_err"}


def _png_text(path) -> dict[str, str]:
    """The tEXt chunks of a PNG file."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = {}, 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    return chunks


def _run_smoke(out_dir):
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "bench-models", "--smoke", "--steps", "1", "--warmup",
                          "1", "--out", str(out_dir)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture
def smoke(tmp_path_factory):
    """One ``bench-models --smoke`` run, read by every test here: its JSON's path and content, and
    what it printed."""
    out_dir, stdout = run_once(tmp_path_factory, "bench-models-smoke", _run_smoke)
    (path,) = out_dir.glob("*-models-smoke.json")
    return path, json.loads(path.read_text()), stdout


def test_smoke_run_writes_the_declared_schema(smoke):
    path, result, _ = smoke
    assert {"gpu", "torch", "triton", "transformers", "liger_kernel", "date", "copy_GBs", "timing", "tolerances",
            "rows"} <= set(result)
    cpu = result["gpu"] == "cpu-interpreter"
    impls = {"stock", "patched"} | ({"liger"} if result["liger_kernel"] and not cpu else set())
    assert {(r["model"], r["pass"], r["impl"]) for r in result["rows"]} == {
        ("llama", p, i) for p in ("train", "infer") for i in impls}
    for row in result["rows"]:
        assert "error" not in row, row
        assert ROW_FIELDS | (TRAIN_FIELDS if row["pass"] == "train" else INFER_FIELDS) <= set(row), row
        assert (row["tokens"], row["mode"], row["hidden"], row["layers"]) == ("1x8", "default", 64, 2)
        assert row["step_ms"] > 0 and row["matches_reference"], row
        assert row["reference"] == ("eager" if row["impl"] == "stock" else "stock")
        assert (row["gpu_ms"] is None) if cpu else (row["gpu_ms"] > 0), row
        spec = mb.ModelSpec.of(row["model"], 64, smoke=True)
        assert row["norm_floor_bytes"] == mb.norm_byte_floor(spec, 8, row["pass"])
        assert row["norm_modules"] == 5
        assert len(row["step_ms_rounds"]) == row["rounds"], row
        assert (row["impl"] == "stock") == ("step_ratio_paired" not in row), row
        assert len(row["step_ms_alternating"]) == row["steps"], row  # as many as the windows' steps
        assert (row["impl"] == "stock") == ("step_ratio_alternating" not in row), row
        if row["impl"] == "patched":
            assert row["norm_modules_swapped"] == row["norm_modules"]
            ours = {name: k for name, k in row["norm_kernels"].items() if k["source"] == "ours"}
            if cpu:  # our ops, once per norm and direction
                want = {"rmsnorm::fwd"} | ({"rmsnorm::bwd"} if row["pass"] == "train" else set())
                assert set(ours) == want, row["norm_kernels"]
                assert all(k["calls"] == row["norm_modules"] for k in ours.values()), ours
            else:
                assert any(name.startswith("_rms_norm_fwd") for name in ours), ours


def test_smoke_run_writes_markdown_and_chart(smoke):
    path, result, stdout = smoke
    md = path.with_suffix(".md").read_text()
    assert "| model | hidden×layers | tokens | mode | pass | stock ms | patched ms |" in md
    # each ratio column per impl (with Liger installed, its columns follow patched's of each kind)
    assert all(f"| patched/stock{kind} |" in md for kind in ("", " paired rounds", " alternating steps"))
    for pass_ in ("train", "infer"):
        assert f"| llama | 64×2 | 1x8 | default | {pass_} |" in md
    assert "error" not in md.split("|---|")[-1]
    png = path.with_suffix(".png")
    assert png.stat().st_size > 0
    assert _png_text(png)["Description"] == result["timing"]
    if result["gpu"] == "cpu-interpreter":
        assert "not GPU timings" in md and "not GPU timings" in result["timing"]
    assert "rounds of stock, patched" in stdout and "wrote " in stdout


def test_norm_byte_floor_by_hand():
    """Llama, hidden 64, 2 layers, 10 tokens, bf16 (2 bytes); a site is 10 x 64 = 640 elements, 1280 bytes.
    Sites: layer 0's input norm plain; 4 with a residual (2 post-attention, layer 1's input, final).
    Forward: 1 x 2 x 1280 + 4 x 4 x 1280 = 23040. Backward: 1 x 3 x 1280 + 4 x 4 x 1280 = 24320.
    Without the adds: forward 5 x 2 x 1280 = 12800, backward 5 x 3 x 1280 = 19200.
    Qwen3 adds per layer q_norm (10 x 4 heads rows of 16) and k_norm (10 x 2 kv heads rows of 16), plain:
    2 layers x 960 elements x 2 bytes = 3840 bytes a direction-element: forward +2 x 3840, backward +3 x 3840."""
    llama = mb.ModelSpec("llama", hidden=64, layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)
    assert mb.norm_byte_floor(llama, 10, "infer") == 23040
    assert mb.norm_byte_floor(llama, 10, "train") == 23040 + 24320
    assert mb.norm_byte_floor(llama, 10, "infer", with_adds=False) == 12800
    assert mb.norm_byte_floor(llama, 10, "train", with_adds=False) == 12800 + 19200
    qwen3 = mb.ModelSpec("qwen3", hidden=64, layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)
    assert mb.norm_byte_floor(qwen3, 10, "infer") == 23040 + 7680
    assert mb.norm_byte_floor(qwen3, 10, "train") == 23040 + 24320 + 7680 + 11520
    assert mb.norm_byte_floor(llama, 10, "train", elem_bytes=4) == 2 * (23040 + 24320)
    with pytest.raises(ValueError, match="pass must be one of"):
        mb.norm_byte_floor(llama, 10, "backward")


def test_hybrid_sites_and_gated_floor_by_hand():
    """Hybrid decoders, 4 layers, hidden 64, 10 tokens. Nemotron-H's layers are Mamba, MLP, Mamba,
    attention, each behind one norm; each Mamba mixer ends in a gated norm over its 2 heads of 64
    (rows of 128, 2560 bytes). Forward: layer 0's norm plain (2 x 1280), three later block norms
    and norm_f with their adds (4 x 4 x 1280), two gated norms reading x and the gate, writing y
    (2 x 3 x 2560): 38400. Backward: 3 x 1280 + 4 x 4 x 1280 + 2 x 5 x 2560 (dy, x and the gate
    read, dx and the gate's gradient written) = 49920. Qwen3-Next's layers are linear attention
    thrice, then attention with q and k norms per head; the gated norm is over each value head."""
    def sites(family):
        spec = mb.ModelSpec(family, hidden=64, layers=4, intermediate=176, heads=4, kv_heads=2, head_dim=16)
        return [(s.name, s.rows, s.cols, s.residual, s.grad_terms, s.count, s.gated) for s in mb.norm_sites(spec, 10)]

    assert sites("nemotron_h") == [
        ("norm (layer 0, mamba)", 10, 64, False, 1, 1, False), ("norm (layers 1.., mlp)", 10, 64, True, 1, 1, False),
        ("norm (layers 1.., mamba)", 10, 64, True, 1, 1, False),
        ("norm (layers 1.., attention)", 10, 64, True, 3, 1, False), ("norm_f", 10, 64, True, 1, 1, False),
        ("mixer.norm (gated)", 10, 128, False, 1, 2, True)]
    assert sites("qwen3_next") == [
        ("input_layernorm (layer 0, linear)", 10, 64, False, 2, 1, False),
        ("input_layernorm (layers 1.., linear)", 10, 64, True, 2, 2, False),
        ("input_layernorm (layers 1.., attention)", 10, 64, True, 3, 1, False),
        ("post_attention_layernorm", 10, 64, True, 5, 4, False), ("norm", 10, 64, True, 1, 1, False),
        ("linear_attn.norm (gated)", 40, 16, False, 1, 3, True), ("q_norm", 40, 16, False, 1, 1, False),
        ("k_norm", 20, 16, False, 1, 1, False)]
    nemotron = mb.ModelSpec("nemotron_h", hidden=64, layers=4, intermediate=176, heads=4, kv_heads=2, head_dim=16)
    assert mb.norm_byte_floor(nemotron, 10, "infer") == 38400
    assert mb.norm_byte_floor(nemotron, 10, "train") == 38400 + 49920


def test_norm_byte_floor_with_gradient_terms_by_hand():
    """The same Llama (a site is 1280 bytes), its backward's dy read as the gradients it sums:
    layer 0's input norm 3 terms + x + dx = 5; layer 1's input norm 3 + sum + its gradient + dx
    = 6; the 2 post-attention norms 2 + 3 = 5 each; the final norm 1 + 3 = 4: 25 x 1280 = 32000.
    Phi3's fused projections give every site one term: the floor without terms."""
    llama = mb.ModelSpec("llama", hidden=64, layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)
    assert mb.norm_byte_floor(llama, 10, "train", with_grad_terms=True) == 23040 + 32000
    assert mb.norm_byte_floor(llama, 10, "infer", with_grad_terms=True) == 23040
    phi3 = mb.ModelSpec("phi3", hidden=64, layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)
    assert mb.norm_byte_floor(phi3, 10, "train", with_grad_terms=True) == mb.norm_byte_floor(phi3, 10, "train")


def test_ours_byte_floor_by_hand():
    """The same Llama (a site is 1280 bytes): the library's kernels serve its 4 sites after a residual
    add. Forward 4 x 4 x 1280 = 20480; backward as many without the terms; with them layer 1's
    input norm 3 + 3 = 6, the post-attention norms 2 + 3 = 5 each, the final norm 1 + 3 = 4:
    20 x 1280 = 25600."""
    llama = mb.ModelSpec("llama", hidden=64, layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)
    assert mb.ours_byte_floor(llama, 10, "infer") == (20480, 4)
    assert mb.ours_byte_floor(llama, 10, "train") == (40960, 4)
    assert mb.ours_byte_floor(llama, 10, "train", with_grad_terms=True) == (20480 + 25600, 4)
    with pytest.raises(ValueError, match="pass must be one of"):
        mb.ours_byte_floor(llama, 10, "backward")


def test_ours_floor_counts_the_library_kernels_where_they_serve_every_residual_site():
    """``ours_pct_of_copy``: the library's kernels alone against their sites' floor, at a copy
    ceiling of 1 GB/s (40960 bytes in 40.96 µs is 100%); no figure where the forward launches a
    step are not the residual sites, and none without GPU time."""
    llama = mb.ModelSpec("llama", hidden=64, layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)

    def row(forwards: int, gpu_ms=1.0) -> dict:
        return {"gpu_ms": gpu_ms, "norm_kernels": {
            "_rms_norm_fwd_rows": {"us": 20480.0, "calls": forwards, "source": "ours"},
            "_rms_norm_bwd_rows": {"us": 16384.0, "calls": 4, "source": "ours"},
            "_rms_norm_dw_reduce": {"us": 4096.0, "calls": 8, "source": "ours"},
            "triton_red_fused_add_embedding_mean_mul_pow_rsqrt_0": {"us": 999.0, "calls": 1, "source": "inductor"}}}

    train = row(4)
    mb._add_ours_floor(train, llama, 10, "train", copy_gbs=1e-3)
    assert train["ours_us"] == 40960.0 and train["ours_floor_bytes"] == 40960
    assert (train["ours_pct_of_copy"], train["ours_pct_of_copy_with_grad_terms"]) == (100.0, 112.5)
    infer = row(4)
    del infer["norm_kernels"]["_rms_norm_bwd_rows"], infer["norm_kernels"]["_rms_norm_dw_reduce"]
    mb._add_ours_floor(infer, llama, 10, "infer", copy_gbs=1e-3)
    assert infer["ours_pct_of_copy"] == 100.0 and "ours_pct_of_copy_with_grad_terms" not in infer
    fewer = row(3)
    mb._add_ours_floor(fewer, llama, 10, "train", copy_gbs=1e-3)
    assert "ours_pct_of_copy" not in fewer and "3 forward launches a step, 4 residual sites" in fewer["ours_floor_note"]
    cpu = row(4, gpu_ms=None)
    mb._add_ours_floor(cpu, llama, 10, "train", copy_gbs=1e-3)
    assert not any(key.startswith("ours") for key in cpu)


def test_norm_sites_say_what_each_norm_reads_and_feeds():
    """By hand, per site (name, rows, residual add before it, gradient terms): GLM 4's sandwich
    norms (the MLP input norm after the residual add, feeding one fused gate-up projection),
    EXAONE 4's post norms with q/k norms per head (rows of head_dim), DeepSeek V3's latent
    attention and mixture of experts, Qwen2-MoE's shared expert."""
    def sites(family):
        spec = mb.ModelSpec(family, hidden=64, layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)
        return [(s.name, s.rows, s.residual, s.grad_terms, s.count) for s in mb.norm_sites(spec, 10)]

    assert sites("glm4") == [
        ("input_layernorm (layer 0)", 10, False, 3, 1), ("input_layernorm (layers 1..)", 10, True, 3, 1),
        ("post_attention_layernorm", 10, True, 1, 2), ("norm", 10, True, 1, 1),
        ("post_self_attn_layernorm", 10, False, 1, 2), ("post_mlp_layernorm", 10, False, 1, 2)]
    assert sites("exaone4") == [
        ("post_attention_layernorm", 10, False, 1, 2), ("post_feedforward_layernorm", 10, False, 1, 2),
        ("norm", 10, True, 1, 1), ("q_norm", 40, False, 1, 2), ("k_norm", 20, False, 1, 2)]
    assert sites("olmo3") == sites("olmo2")
    # DeepSeek V3: input norms feed q's and kv's low-rank projections, a dense layer's post-attention
    # norm gate and up, an experts' layer's the router, the experts and the shared expert's gate and up
    assert sites("deepseek_v3") == [
        ("input_layernorm (layer 0)", 10, False, 2, 1), ("input_layernorm (layers 1..)", 10, True, 2, 1),
        ("post_attention_layernorm (dense layers)", 10, True, 2, 1),
        ("post_attention_layernorm (experts' layers)", 10, True, 4, 1), ("norm", 10, True, 1, 1),
        ("q_a_layernorm", 10, False, 1, 2), ("kv_a_layernorm", 10, False, 1, 2)]
    # Qwen2-MoE: a post-attention norm feeds the router, the experts, the shared expert's gate and
    # up and its gate
    assert sites("qwen2_moe") == [
        ("input_layernorm (layer 0)", 10, False, 3, 1), ("input_layernorm (layers 1..)", 10, True, 3, 1),
        ("post_attention_layernorm", 10, True, 5, 2), ("norm", 10, True, 1, 1)]


@pytest.mark.parametrize("family", sorted(mb.FAMILIES))
def test_norm_sites_match_the_models_modules(family):
    """The floor's site list has one site per RMSNorm module the transformers class builds, with its width."""
    spec = mb.ModelSpec.of(family, mb.SMOKE_HIDDEN, layers=3, smoke=True)
    model = mb.build_model(spec, torch.device("cpu"), torch.float32)
    widths = sorted(m.weight.shape[0] for m in mb.norm_modules(model))
    assert widths == sorted(site.cols for site in mb.norm_sites(spec, 5) for _ in range(site.count))
    weights = [m.weight for m in mb.norm_modules(model)]
    assert all(0.5 <= w.min() and w.max() <= 1.5 and w.std() > 0 for w in weights)  # random, not ones


def test_norm_kernels_are_attributed_by_name():
    """Names as the H200 profiler reports them (torch 2.11, Triton 3.6, liger_kernel 0.8.5)."""
    cases = {
        "triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_10": "inductor",
        "triton_red_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0": "inductor",
        "triton_per_fused__to_copy_add_div_expand_mul_pow_sum_view_1": "inductor",  # a norm's backward
        "_rms_norm_fwd": "ours",
        "_rms_norm_bwd": "ours",
        "_rms_norm_dw_reduce": "ours",
        "_rms_norm_forward_kernel": "liger",
        "_rms_norm_backward_kernel": "liger",
        "_block_rms_norm_forward_kernel": "liger",
        "triton_red_fused_sum_8": None,
        "triton_poi_fused__unsafe_view_mul_silu_5": None,
        "Memset (Device)": None,
        "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNT": None,
    }
    assert {name: mb.norm_kernel_source(name) for name in cases} == cases


def test_implementations_swap_and_restore():
    spec = mb.ModelSpec.of("qwen3", mb.SMOKE_HIDDEN, smoke=True)
    model = mb.build_model(spec, torch.device("cpu"))
    before = [(name, type(m)) for name, m in model.named_modules()]
    weights = {id(m.weight) for m in mb.norm_modules(model)}
    impls = ["stock", "patched"] + (["liger"] if mb.liger_available() else [])
    for impl in impls:
        with mb.implementation(model, impl) as (swapped, _):
            assert swapped == (0 if impl == "stock" else 9)
            norm_params = {id(p) for name, p in model.named_parameters() if "norm" in name}
            assert norm_params == weights  # the same Parameters, whoever holds them
            if impl == "liger":
                from liger_kernel.transformers.rms_norm import LigerRMSNorm

                assert sum(isinstance(m, LigerRMSNorm) for m in model.modules()) == 9
        assert [(name, type(m)) for name, m in model.named_modules()] == before, impl
    with pytest.raises(ValueError, match="impl must be one of"):
        with mb.implementation(model, "apex"):
            pass


class _LigerRMSNormStub(torch.nn.Module):
    """Records the settings Liger's RMSNorm would be built with (liger_kernel needs a GPU)."""

    def __init__(self, hidden_size, eps=1e-6, **settings):
        super().__init__()
        self.hidden_size, self.eps, self.settings = hidden_size, eps, settings


@pytest.mark.parametrize("family,settings", [
    ("llama", {"offset": 0.0, "casting_mode": "llama", "in_place": True}),
    ("gemma3", {"offset": 1.0, "casting_mode": "gemma", "in_place": False}),  # 1 + weight, fp32 throughout
    ("olmo2", {"offset": 0.0, "casting_mode": "gemma", "in_place": False}),  # rounded once, at the end
])
def test_liger_takes_what_each_norm_computes(monkeypatch, family, settings):
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.rms_norm"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["liger_kernel.transformers.rms_norm"].LigerRMSNorm = _LigerRMSNormStub
    spec = mb.ModelSpec.of(family, mb.SMOKE_HIDDEN, smoke=True)
    model = mb.build_model(spec, torch.device("cpu"), torch.float32)
    norms = mb.norm_modules(model)
    with mb._liger_swapped(model) as count:
        stubs = [m for m in model.modules() if isinstance(m, _LigerRMSNormStub)]
        assert count == len(stubs) == len(norms) == sum(site.count for site in mb.norm_sites(spec, 1))
        assert all(m.settings == settings and m.eps == mb.EPS for m in stubs)
        assert {id(m.weight) for m in stubs} == {id(m.weight) for m in norms}
    assert mb.norm_modules(model) == norms


def test_every_size_is_a_consistent_layer():
    """Each hidden size's heads of head_dim make up the hidden size and share the kv heads
    evenly; the default run measures sizes the table holds."""
    for hidden, size in mb.SIZES.items():
        assert size.heads * size.head_dim == hidden and size.heads % size.kv_heads == 0, hidden
        spec = mb.ModelSpec.of("qwen2", hidden)
        assert (spec.hidden, spec.layers, spec.intermediate) == (hidden, size.layers, size.intermediate)
    assert set(mb.DEFAULT_HIDDENS) <= set(mb.SIZES) and mb.Selection().hiddens == mb.DEFAULT_HIDDENS


def test_selection_rejects_bad_input():
    with pytest.raises(ValueError, match="models must be"):
        mb.Selection(models=("gpt2",))
    with pytest.raises(ValueError, match="hidden must be"):
        mb.Selection(hiddens=(1024,))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        mb.Selection(steps=0)
    with pytest.raises(ValueError, match="need the inductor backend"):
        mb.Selection(backend="aot_eager", modes=("default", "reduce-overhead"))
    full = mb.Selection()
    assert full.compiles() == 3 * 2 * 2 * 2 * 3 * 2
    # a family whose classes the installed transformers lacks: named, with the release
    with pytest.raises(RuntimeError, match=r"model 'nemotron_h' needs transformers\.NoSuchForCausalLM, which "
                                           r"transformers \S+ does not have"):
        mb.transformers_class("nemotron_h", "NoSuchForCausalLM")


def test_results_merge_only_with_the_same_versions(tmp_path):
    header = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0",
              "liger_kernel": "0.8.5"}
    stem = str(tmp_path / "run")
    assert mb.previous_rows(stem, header, fresh=False) == []
    rows = [{"model": "llama", "step_ms": 1.0}]
    (tmp_path / "run.json").write_text(json.dumps({**header, "rows": rows}))
    assert mb.previous_rows(stem, header, fresh=False) == rows
    assert mb.previous_rows(stem, header, fresh=True) == []
    with pytest.raises(ValueError, match="other torch: pass --fresh"):
        mb.previous_rows(stem, {**header, "torch": "2.12.0"}, fresh=False)


def test_cli_rejects_bad_lists_before_running(capsys):
    from torch_rmsnorm_op.cli import main

    for args, message in ((["--tokens", "4x"], "argument --tokens"), (["--modes", "max-autotune"], "argument --modes"),
                          (["--hidden", "2048,1000"], "argument --hidden")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench-models", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert main(["bench-models", "--models", "llama", "--hidden", "2048", "--tokens", "1x16", "--plan"]) == 0
    assert "12 compiles" in capsys.readouterr().out  # 2 modes x 3 impls x 2 passes


def test_compile_workers_each_get_one_model(capsys):
    """Each worker's command line parses and selects exactly one compiled model of the run."""
    from torch_rmsnorm_op.cli import main

    for smoke in (False, True):
        sel = mb.Selection(models=("llama", "qwen3"), tokens=((1, 16),), impls=("stock", "patched"),
                           modes=("default",) if smoke else mb.MODES, backend="aot_eager" if smoke else "inductor",
                           smoke=smoke, layers=3)
        cmds = mb.worker_commands(sel)
        assert len(cmds) == sel.compiles() // len(sel.passes)
        for cmd, _ in cmds:
            assert cmd[3:5] == ["bench-models", "--compile-only"]
            assert main(cmd[3:] + ["--plan"]) == 0
            out = capsys.readouterr().out
            assert f"{len(sel.passes)} compiles" in out and ", 3 layers," in out, out


def test_warm_caches_removes_the_configurations_its_workers_autotuned(tmp_path, monkeypatch, capsys):
    """The workers share the GPU: the timing process tunes Inductor's kernels again, alone. A
    configuration recorded before the workers ran stays."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    earlier = tmp_path / "ab" / "earlier.best_config"
    earlier.parent.mkdir()
    earlier.write_text("{}")
    kernel = tmp_path / "cd" / "kernel.py"
    kernel.parent.mkdir()
    kernel.write_text("")
    recorded = tmp_path / "cd" / "kernel.best_config"
    write = f"import pathlib; pathlib.Path({str(recorded)!r}).write_text('{{}}')"
    monkeypatch.setattr(mb, "worker_commands", lambda sel: [([sys.executable, "-c", write], "worker")])
    before = earlier.stat().st_mtime
    os.utime(earlier, (before - 60, before - 60))
    mb.warm_caches(mb.Selection(models=("llama",), smoke=True), jobs=1)
    assert not recorded.exists() and earlier.exists() and kernel.exists()
    assert "removed 1 autotuned configurations the workers recorded" in capsys.readouterr().out


def test_compile_only_compiles_without_timing(capsys):
    """A cache-warming worker of stock alone installs the library's Inductor passes before it
    compiles, as the timing process has them once a patched impl is set up: they are part of
    Inductor's cache key, so the timing process then finds stock's graphs in the cache."""
    from torch._inductor import config

    from torch_rmsnorm_op import fusion

    sel = mb.Selection(models=("llama",), tokens=((1, 8),), modes=("default",), passes=("infer",),
                       impls=("stock",), backend="aot_eager", smoke=True)
    with config.patch(pre_grad_custom_pass=None, post_grad_custom_post_pass=None):
        mb.compile_only(sel)
        passes = (config.pre_grad_custom_pass, config.post_grad_custom_post_pass)
    assert "llama 64 1x8 default stock infer: compiled in" in capsys.readouterr().out
    assert [type(p) for p in passes] == [fusion.fusion_pass_class()] * 2


def test_judge_takes_the_tolerances_or_twice_stocks_own_distance():
    stock = {"reference": "eager", "logits_rel_l2_err": 0.025}
    assert not mb.judge(stock | {"logits_rel_l2_err": 0.031})  # stock against eager: the declared 3e-2
    assert mb.judge(stock)
    patched = {"reference": "stock", "logits_rel_l2_err": 0.045}
    assert mb.judge(patched, stock)  # within twice stock's 0.025
    assert not mb.judge(patched | {"logits_rel_l2_err": 0.06}, stock)
    assert not mb.judge(patched | {"logits_rel_l2_err": float("nan")}, stock)
    assert not mb.judge({"reference": "stock", "loss_rel_err": 0.02, "grad_rel_l2_err": 0.0}, {"loss_rel_err": 1e-4})


def test_arms_are_timed_in_turn_reversed_every_other_round():
    """Each round times every impl's steps, the impls in turn, in reverse order every other
    round, then one step of each impl in turn as many times; a row gathers all of its impl's
    rounds."""
    log = []

    class FakeSteps:
        def __init__(self, impl):
            self.impl, self.model = impl, torch.nn.Linear(1, 1)

        def infer(self):
            log.append(self.impl)

        def clear_grads(self):
            pass

    arms = [mb.Arm(impl, FakeSteps(impl), contextlib.nullcontext, 0) for impl in ("stock", "patched")]
    sel = mb.Selection(steps=2, profile_steps=1, rounds=3, smoke=True)
    rows = mb.measure_arms(arms, "infer", sel, torch.device("cpu"))
    def round_of(first, second):  # 2 timed + 1 profiled step each, then 2 turns of alternating steps
        return [first] * 3 + [second] * 3 + [first, second] * 2

    assert log == round_of("stock", "patched") + round_of("patched", "stock") + round_of("stock", "patched")
    assert {impl: (r["steps"], r["rounds"], r["profile_steps"], len(r["step_ms_alternating"]))
            for impl, r in rows.items()} == {"stock": (6, 3, 3, 6), "patched": (6, 3, 3, 6)}


def _timed(rounds, kernels):
    return {"gpu_ms_rounds": rounds, "kernels": {k: {"us": us, "calls": calls} for k, (us, calls) in kernels.items()}}


def test_library_kernels_at_the_references_time_take_out_the_clock():
    """Stock's matmul ran 300 µs slower (its rounds were slower by as much); the patched step's
    Triton kernels saved 50 µs. The ratio with library kernels at stock's time shows the 50 µs
    alone; a library kernel launched a different number of times, Triton kernels, memsets and
    our kernels keep their own times."""
    stock = _timed([10.30, 10.30], {"nvjet_gemm": (8300.0, 4), "cudnn_sdpa": (1000.0, 2), "aten_fill": (5.0, 1),
                                    "triton_red_fused_mean_rsqrt": (700.0, 9), "Memset (Device)": (20.0, 8)})
    patched = _timed([9.95, 9.95], {"nvjet_gemm": (8000.0, 4), "cudnn_sdpa": (1000.0, 2), "aten_fill": (9.0, 2),
                                    "_rms_norm_fwd_rows": (650.0, 9), "Memset (Device)": (25.0, 8)})
    want = (9950.0 + 300.0) / 10300.0  # aten_fill: launched twice, not alike; the rest at their own time
    assert mb.gpu_ratio_library_at_reference(patched, stock) == round(want, 4)
    assert mb.gpu_ratio_library_at_reference(stock, stock) == 1.0
    assert mb.gpu_ratio_library_at_reference({"gpu_ms_rounds": []}, stock) is None
    # Rows written before "kernels": their top_kernels, whose launch counts are not known.
    old = {"gpu_ms_rounds": [9.95], "top_kernels": {"nvjet_gemm": 8000.0, "triton_x": 1.0}}
    assert mb.gpu_ratio_library_at_reference(old, {"gpu_ms_rounds": [10.3], "top_kernels": {"nvjet_gemm": 8300.0}}) \
        == round(10250.0 / 10300.0, 4)


def test_merged_windows_keep_every_kernel_with_its_launches():
    windows = [{"gpu_ms": g, "norm_kernels": {}, "top_kernels": {"a": us}, "kernels": {"a": {"us": us, "calls": 2.0}}}
               for g, us in ((1.0, 10.0), (2.0, 30.0))]
    merged = mb.merge_profiles(windows)
    assert merged["kernels"] == {"a": {"us": 20.0, "calls": 2.0}} and merged["gpu_ms_rounds"] == [1.0, 2.0]


def test_paired_step_ratio_takes_the_median_of_each_rounds_ratio():
    stock = {"step_ms_rounds": [1.0, 2.0, 4.0]}
    assert mb.paired_step_ratio({"step_ms_rounds": [2.0, 4.0, 3.0]}, stock) == 2.0  # 2, 2, 0.75
    assert mb.paired_step_ratio({"step_ms_rounds": [2.0, 4.0]}, stock) is None  # other rounds
    assert mb.paired_step_ratio({"step_ms": 1.0}, stock) is None  # a file from before the rounds


def test_alternating_step_ratio_pairs_each_step_with_stocks_step_of_the_same_turn():
    stock = {"step_ms_alternating": [1.0, 3.0, 3.0, 1.0]}
    # Each turn's ratio 1.1, 1.0, 1.1, 0.9: the median 1.05; the medians of the steps (3.3/2.0) would say 1.65.
    assert mb.alternating_step_ratio({"step_ms_alternating": [1.1, 3.0, 3.3, 0.9]}, stock) == 1.05
    assert mb.alternating_step_ratio({"step_ms_alternating": [1.0]}, stock) is None  # other turns
    assert mb.alternating_step_ratio({"step_ms": 1.0}, stock) is None  # a file from before the field


def test_alternating_steps_take_each_arm_in_turn_in_its_context():
    calls = []

    def arm(name):
        @contextlib.contextmanager
        def context():
            calls.append(f"enter {name}")
            yield
            calls.append(f"exit {name}")

        return (lambda: calls.append(f"step {name}")), (lambda: calls.append(f"before {name}")), context

    times = mb.time_alternating([arm("a"), arm("b")], 2, torch.device("cpu"))
    assert [len(t) for t in times] == [2, 2] and all(v >= 0 for t in times for v in t)
    turn = ["enter a", "before a", "step a", "exit a", "enter b", "before b", "step b", "exit b"]
    assert calls == turn * 2


def test_rederive_adds_the_ratio_to_a_results_file(tmp_path, smoke):
    """``bench-models --rederive FILE`` recomputes the ratio of a file's rows against their
    run's stock row and writes the file's JSON and Markdown again."""
    _, result, _ = smoke
    for row in result["rows"]:
        row.pop("gpu_ratio_library_at_stock", None)
        row.pop("step_ratio_paired", None)
        row["gpu_ms_rounds"] = [2.0] if row["impl"] == "stock" else [1.0]
        row["step_ms_rounds"] = [4.0] if row["impl"] == "stock" else [1.0]
        row.pop("step_ratio_alternating", None)
        row["step_ms_alternating"] = [4.0, 4.0] if row["impl"] == "stock" else [1.0, 2.0]
        # No library kernels to count at stock's time (on a GPU the smoke run records real ones).
        row["kernels"], row["top_kernels"] = {}, {}
        if row["impl"] == "patched":  # as a GPU run records them: 4 residual sites at 1x8 tokens
            row["gpu_ms"] = 1.0
            row["norm_kernels"] = {"_rms_norm_fwd_rows": {"us": 2.0, "calls": 4, "source": "ours"}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "bench-models", "--rederive", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(path.read_text())["rows"]
    assert {r["impl"]: r.get("gpu_ratio_library_at_stock") for r in rows if r["pass"] == "train"} == {
        "stock": None, **{i: 0.5 for i in {r["impl"] for r in rows} - {"stock"}}}
    assert {r["impl"]: r.get("step_ratio_paired") for r in rows if r["pass"] == "train"} == {
        "stock": None, **{i: 0.25 for i in {r["impl"] for r in rows} - {"stock"}}}
    assert {r["impl"]: r.get("step_ratio_alternating") for r in rows if r["pass"] == "train"} == {
        "stock": None, **{i: 0.375 for i in {r["impl"] for r in rows} - {"stock"}}}
    assert "library kernels at stock's" in path.with_suffix(".md").read_text()
    patched = [r for r in rows if r["impl"] == "patched"]
    assert patched and all(r["ours_us"] == 2.0 and r["ours_floor_bytes"] > 0 for r in patched)


def test_rederive_rejects_what_is_not_a_results_file(tmp_path, capsys):
    from torch_rmsnorm_op import cli

    other = tmp_path / "other.json"
    other.write_text("[]")
    for path in (tmp_path / "missing.json", tmp_path, other):
        assert cli.main(["bench-models", "--rederive", str(path)]) == 2
        assert "--rederive" in capsys.readouterr().err


def test_router_flips_measures_the_patched_model_and_each_close_choice(capsys):
    """``profiling/router_flips.py --smoke``: the patched model's distance from the unpatched one,
    then the rows whose k-th and (k+1)-th router logits are closest, smallest margin first, each
    run again with another expert chosen, which moves the gradients; a model without a softmax
    top-k router is refused by name."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "profiling"))
    try:
        import router_flips
    finally:
        sys.path.remove(os.path.join(root, "profiling"))
    router_flips.main(["--smoke", "--model", "qwen3_next", "--rows", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("qwen3_next hidden 64 x 2 layers, 16 tokens, cpu"), lines
    assert "patched (7 norms swapped), eager" in lines[1] and "of 32 (layer, token) rows" in lines[1], lines
    margins = [float(line.split("margin to the next ")[1].split(";")[0]) for line in lines[2:]]
    assert margins == sorted(margins), lines
    for line in lines[2:]:
        assert float(line.split("gradients by ")[1].split(" ")[0]) > 0, line
    for family, why in (("llama", "has no top-k router"), ("deepseek_v3", "is not one of")):
        with pytest.raises(ValueError, match=why):
            router_flips.main(["--smoke", "--model", family])
