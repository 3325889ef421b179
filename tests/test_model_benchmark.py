"""The model benchmark's machinery: smoke runs end to end (eager and compiled, float8), the
generic builder over model types, the byte floor from the probed norm calls, kernel
attribution, the swaps, the clear messages."""

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
from torch import nn

from torch_rmsnorm_op.tools import hf_configs
from torch_rmsnorm_op.tools import model_benchmark as mb

ROW_FIELDS = {"model", "hidden", "layers", "tokens", "mode", "float8", "pass", "impl", "step_ms", "step_ms_rounds",
              "gpu_ms", "step_peak_extra_GiB", "norm_kernels", "norm_calls", "reference", "matches_reference",
              "norm_modules", "norm_modules_swapped", "norm_floor_bytes", "norm_floor_bytes_without_adds", "copy_GBs",
              "compile_s", "class", "attention", "backend"}
TRAIN_FIELDS = {"loss", "loss_abs_err", "loss_rel_err", "grad_rel_l2_err"}
INFER_FIELDS = {"logits_max_abs_err", "logits_max_rel_err", "logits_rel_l2_err"}
CPU = torch.device("cpu")


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


def _bench_models(out_dir, *args, timeout=600):
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "bench-models", "--smoke", "--steps", "1",
                          "--warmup", "1", "--out", str(out_dir), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture
def smoke(tmp_path_factory):
    """One ``bench-models --smoke`` run of two selections (Llama compiled, and a type without a
    causal-LM class; Llama eager), read by every test here: its JSON's path and content, and what
    it printed."""
    out_dir, stdout = run_once(tmp_path_factory, "bench-models-smoke", lambda out: _bench_models(
        out, "--models", "llama,clip", "--and", "--modes", "eager", "--models", "llama"))
    (path,) = out_dir.glob("*-models-smoke.json")
    return path, json.loads(path.read_text()), stdout


def test_smoke_run_writes_the_declared_schema(smoke):
    path, result, _ = smoke
    assert {"gpu", "torch", "triton", "transformers", "liger_kernel", "torchao", "date", "static_launch", "copy_GBs",
            "timing", "tolerances", "selections", "notes", "unfinished", "rows"} <= set(result)
    assert result["static_launch"] == os.environ.get(mb.STATIC_LAUNCH_ENV, "1") and result["unfinished"] == []
    assert [(s["models"], s["modes"]) for s in result["selections"]] == [(["llama", "clip"], ["default"]),
                                                                          (["llama"], ["eager"])]
    cpu = result["gpu"] == "cpu-interpreter"
    impls = {"stock", "patched"} | ({"liger"} if result["liger_kernel"] and not cpu else set())
    measured = [r for r in result["rows"] if r["pass"] is not None]
    assert {(r["model"], r["mode"], r["pass"], r["impl"]) for r in measured} == {
        ("llama", m, p, i) for m in ("eager", "default") for p in ("train", "infer") for i in impls}
    (clip,) = [r for r in result["rows"] if r["model"] == "clip"]  # one line, the run went on
    assert "model 'clip' has no causal-LM class in transformers" in clip["error"], clip
    assert (clip["tokens"], clip["mode"], clip["pass"], clip["impl"]) == (None, None, None, None)
    for row in measured:
        assert "error" not in row, row
        assert ROW_FIELDS | (TRAIN_FIELDS if row["pass"] == "train" else INFER_FIELDS) <= set(row), row
        assert (row["tokens"], row["float8"], row["hidden"], row["layers"]) == ("1x8", None, 64, 2)
        assert (row["class"], row["attention"]) == ("LlamaForCausalLM", "sdpa")
        assert row["backend"] == (None if row["mode"] == "eager" else "aot_eager")
        assert row["step_ms"] > 0 and row["matches_reference"], row
        assert row["reference"] == ("eager" if row["impl"] == "stock" else "stock")
        assert (row["gpu_ms"] is None) if cpu else (row["gpu_ms"] > 0), row
        assert (row["step_peak_extra_GiB"] is None) if cpu else (row["step_peak_extra_GiB"] >= 0), row
        calls = mb.norm_calls_of(row)
        assert sum(c.count for c in calls) == row["norm_modules"] == 5
        assert row["norm_floor_bytes"] == mb.norm_byte_floor(calls, row["pass"])
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
    assert "| model | hidden×layers | tokens | mode | float8 | pass | stock ms | patched ms |" in md
    # each ratio column per impl (with Liger installed, its columns follow patched's of each kind)
    assert all(f"| patched/stock{kind} |" in md for kind in ("", " paired rounds", " alternating steps"))
    assert "| stock peak GiB | patched peak GiB |" in md
    for mode in ("eager", "default"):
        for pass_ in ("train", "infer"):
            assert f"| llama | 64×2 | 1x8 | {mode} | – | {pass_} |" in md
    assert "Errors:" in md and "- clip 64 2: `model 'clip' has no causal-LM class" in md
    png = path.with_suffix(".png")
    assert png.stat().st_size > 0
    assert _png_text(png)["Description"] == result["timing"]
    if result["gpu"] == "cpu-interpreter":
        assert "not GPU timings" in md and "not GPU timings" in result["timing"]
        assert "liger_kernel runs on a GPU only: no liger rows" in md or not result["liger_kernel"]
    assert "rounds of stock, patched" in stdout and "wrote " in stdout


def test_an_eager_run_compiles_nothing(tmp_path, monkeypatch):
    """An eager-only run neither compiles nor installs the library's Inductor passes; a run past
    ``stop_after`` starts nothing more and says what it left."""
    def refuse(*args, **kwargs):
        raise AssertionError("an eager run compiled")

    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setattr(mb, "install_library_passes", refuse)
    monkeypatch.delenv(mb.STATIC_LAUNCH_ENV, raising=False)  # the run sets it for its process: undone after
    sel = mb.Selection(models=("llama",), tokens=((1, 4),), modes=("eager",), passes=("infer",), impls=("stock",),
                       steps=1, warmup=1, profile_steps=1, rounds=1, smoke=True)
    result = json.loads(open(mb.run(sel, str(tmp_path)) + ".json").read())
    (row,) = result["rows"]
    assert (row["mode"], row["backend"], row["matches_reference"]) == ("eager", None, True) and row["step_ms"] > 0
    assert sel.compiles() == 0 and mb.worker_commands(sel) == []
    stopped = json.loads(open(mb.run(mb.dataclasses.replace(sel, stop_after=1e-9), str(tmp_path / "stopped"))
                              + ".json").read())
    assert stopped["rows"] == [] and stopped["unfinished"] == ["llama 64x2"]


@pytest.mark.skipif(mb.torchao_available() is None, reason="needs torchao")
def test_float8_smoke_run_converts_every_linear_but_the_head(tmp_path):
    """torchao's float8 training on CPU (eager): every Linear of the tiny Llama but the LM head
    converted, in stock's and the patched model alike, each checked against its own eager float8
    reference."""
    _bench_models(tmp_path, "--modes", "eager", "--float8", "tensorwise", "--passes", "infer", "--rounds", "1")
    (path,) = tmp_path.glob("*-models-smoke.json")
    rows = json.loads(path.read_text())["rows"]
    assert {(r["float8"], r["impl"]) for r in rows} == {("tensorwise", i) for i in ("stock", "patched")}
    for row in rows:
        assert "error" not in row and row["matches_reference"], row
        assert row["float8_linears"] == 14, row  # 2 layers x (q, k, v, o, gate, up, down); the head stays bf16
    assert "| llama | 64×2 | 1x8 | eager | tensorwise | infer |" in path.with_suffix(".md").read_text()


def test_float8_filter_leaves_the_head_and_dims_float8_cannot_take():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.odd, self.head = nn.Linear(32, 64), nn.Linear(32, 40), nn.Linear(64, 128)

        def get_output_embeddings(self):
            return self.head

    model = Tiny()
    keep = mb.float8_filter(model)
    assert [name for name, m in model.named_modules() if keep(m, name)] == ["up"]
    assert not keep(nn.ReLU(), "act")


def test_float8_says_what_is_missing(monkeypatch, capsys, tmp_path):
    """Without torchao, or on a GPU without float8 matmuls, a run asked for float8 stops before it
    measures anything and says why; the CLI exits 2 with that message."""
    real = mb.importlib.import_module

    def without_torchao(name, *args):
        if name.startswith("torchao"):
            raise ModuleNotFoundError("No module named 'torchao'")
        return real(name, *args)

    monkeypatch.setattr(mb.importlib, "import_module", without_torchao)
    why = mb.float8_unavailable(CPU)
    assert "float8 needs torchao's float8 training (pip install 'torch_rmsnorm_op[float8]'" in why
    assert "No module named 'torchao'" in why
    sel = mb.Selection(models=("llama",), float8=(None, "rowwise"), smoke=True)
    with pytest.raises(ValueError, match=r"--float8 none,rowwise: float8 needs torchao"):
        mb._check_float8(sel, CPU)
    mb._check_float8(mb.Selection(smoke=True), CPU)  # no float8 asked: nothing to check
    monkeypatch.setattr(mb.importlib, "import_module", real)
    if mb.torchao_available():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
        assert mb.float8_unavailable(torch.device("cuda")) == (
            "float8 needs a GPU of compute capability 8.9 or later (float8 matmuls); NVIDIA A100 is 8.0")
    from torch_rmsnorm_op.cli import main

    monkeypatch.setattr(mb, "float8_unavailable", lambda device: "float8 needs torchao (a stand-in)")
    monkeypatch.delenv(mb.STATIC_LAUNCH_ENV, raising=False)  # the command sets it for its process: undone after
    out = tmp_path / "out"
    assert main(["bench-models", "--smoke", "--float8", "none,tensorwise", "--out", str(out)]) == 2
    assert "bench-models: error: --float8 none,tensorwise: float8 needs torchao (a stand-in)" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


def test_float8_conversion_counts_what_it_converts():
    pytest.importorskip("torchao.float8")
    spec = mb.ModelSpec.of("qwen3_moe", mb.SMOKE_HIDDEN, smoke=True)
    model = mb.build_model(spec, CPU)
    keep = mb.float8_filter(model)
    want = sum(keep(m, name) for name, m in model.named_modules())
    assert want > 0 and mb.convert_float8(model, "rowwise") == want
    assert type(model.lm_head) is nn.Linear  # the head stays
    assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == want
    with pytest.raises(ValueError, match="float8 must be one of"):
        mb.convert_float8(model, "mxfp8")


def _calls(*specs):
    return [mb.NormCall(f"n{i}", *spec) for i, spec in enumerate(specs)]


def test_norm_byte_floor_by_hand():
    """Llama's calls, hidden 64, 2 layers, 10 tokens, bf16 (2 bytes); a call is 10 x 64 = 640 elements, 1280 bytes.
    Layer 0's input norm plain; 4 with a residual (2 post-attention, layer 1's input, final).
    Forward: 1 x 2 x 1280 + 4 x 4 x 1280 = 23040. Backward: 1 x 3 x 1280 + 4 x 4 x 1280 = 24320.
    Without the adds: forward 5 x 2 x 1280 = 12800, backward 5 x 3 x 1280 = 19200.
    Qwen3 adds per layer q_norm (10 x 4 heads rows of 16) and k_norm (10 x 2 kv heads rows of 16), plain:
    2 layers x 960 elements x 2 bytes = 3840 bytes a direction-element: forward +2 x 3840, backward +3 x 3840."""
    llama = _calls((10, 64, 2, False, False, 1), (10, 64, 2, True, False, 4))
    assert mb.norm_byte_floor(llama, "infer") == 23040
    assert mb.norm_byte_floor(llama, "train") == 23040 + 24320
    assert mb.norm_byte_floor(llama, "infer", with_adds=False) == 12800
    assert mb.norm_byte_floor(llama, "train", with_adds=False) == 12800 + 19200
    qwen3 = llama + _calls((40, 16, 2, False, False, 2), (20, 16, 2, False, False, 2))
    assert mb.norm_byte_floor(qwen3, "infer") == 23040 + 7680
    assert mb.norm_byte_floor(qwen3, "train") == 23040 + 24320 + 7680 + 11520
    fp32 = _calls((10, 64, 4, False, False, 1), (10, 64, 4, True, False, 4))
    assert mb.norm_byte_floor(fp32, "train") == 2 * (23040 + 24320)
    with pytest.raises(ValueError, match="pass must be one of"):
        mb.norm_byte_floor(llama, "backward")


def test_gated_floor_by_hand():
    """Nemotron-H's layers Mamba, MoE, attention, MLP at hidden 64, 10 tokens: layer 0's norm
    plain (2 x 1280), three later block norms and norm_f with their adds (4 x 4 x 1280), one gated
    norm over the Mamba mixer's 2 heads of 64 (rows of 128, 2560 bytes) reading x and the gate,
    writing y (3 x 2560): 30720. Backward: 3 x 1280 + 4 x 4 x 1280 + 5 x 2560 (dy, x and the gate
    read, dx and the gate's gradient written) = 37120."""
    calls = _calls((10, 64, 2, False, False, 1), (10, 64, 2, True, False, 4), (10, 128, 2, False, True, 1))
    assert mb.norm_byte_floor(calls, "infer") == 30720
    assert mb.norm_byte_floor(calls, "train") == 30720 + 37120


def test_ours_byte_floor_by_hand():
    """The same Llama (a call is 1280 bytes): the library's kernels serve its 4 calls after a
    residual add. Forward 4 x 4 x 1280 = 20480; backward as many."""
    llama = _calls((10, 64, 2, False, False, 1), (10, 64, 2, True, False, 4))
    assert mb.ours_byte_floor(llama, "infer") == (20480, 4)
    assert mb.ours_byte_floor(llama, "train") == (40960, 4)
    with pytest.raises(ValueError, match="pass must be one of"):
        mb.ours_byte_floor(llama, "backward")


def test_ours_floor_counts_the_library_kernels_where_they_serve_every_residual_call():
    """``ours_pct_of_copy``: the library's kernels alone against their calls' floor, at a copy
    ceiling of 1 GB/s (40960 bytes in 40.96 µs is 100%); no figure where the forward launches a
    step are not the residual calls, and none without GPU time."""
    llama = _calls((10, 64, 2, False, False, 1), (10, 64, 2, True, False, 4))

    def row(forwards: int, gpu_ms=1.0) -> dict:
        return {"gpu_ms": gpu_ms, "norm_kernels": {
            "_rms_norm_fwd_rows": {"us": 20480.0, "calls": forwards, "source": "ours"},
            "_rms_norm_bwd_rows": {"us": 16384.0, "calls": 4, "source": "ours"},
            "_rms_norm_dw_reduce": {"us": 4096.0, "calls": 8, "source": "ours"},
            "triton_red_fused_add_embedding_mean_mul_pow_rsqrt_0": {"us": 999.0, "calls": 1, "source": "inductor"}}}

    train = row(4)
    mb._add_ours_floor(train, llama, "train", copy_gbs=1e-3)
    assert train["ours_us"] == 40960.0 and train["ours_floor_bytes"] == 40960 and train["ours_pct_of_copy"] == 100.0
    infer = row(4)
    del infer["norm_kernels"]["_rms_norm_bwd_rows"], infer["norm_kernels"]["_rms_norm_dw_reduce"]
    mb._add_ours_floor(infer, llama, "infer", copy_gbs=1e-3)
    assert infer["ours_pct_of_copy"] == 100.0
    fewer = row(3)
    mb._add_ours_floor(fewer, llama, "train", copy_gbs=1e-3)
    assert "ours_pct_of_copy" not in fewer and "3 forward launches a step, 4 residual calls" in fewer["ours_floor_note"]
    cpu = row(4, gpu_ms=None)
    mb._add_ours_floor(cpu, llama, "train", copy_gbs=1e-3)
    assert not any(key.startswith("ours") for key in cpu)


def _probed(model_type, layers=3, tokens=10):
    spec = mb.ModelSpec.of(model_type, mb.SMOKE_HIDDEN, layers=layers, smoke=True)
    model = mb.build_model(spec, CPU, torch.float32)
    calls = mb.probe_norm_calls(model, torch.randint(0, spec.vocab, (1, tokens)))
    return model, [(c.name, c.rows, c.cols, c.residual, c.gated, c.count) for c in calls]


def test_probe_says_what_each_norm_reads():
    """Per call, by hand (name, rows, cols, a residual add before it, gated, count), 3 layers, 10
    tokens: Llama's input norms (layer 0's of the embedding), post-attention and final norms;
    Qwen3's q/k norms per head (rows of head_dim); Gemma 3's sandwich norms (the MLP's input norm
    after the residual add); OLMo 2's post norms and q/k norms over all heads; Nemotron-H's gated
    Mamba norm (rows of its 2 heads of 64)."""
    _, llama = _probed("llama")
    assert llama == [("model.layers.*.input_layernorm", 10, 64, False, False, 1),
                     ("model.layers.*.post_attention_layernorm", 10, 64, True, False, 3),
                     ("model.layers.*.input_layernorm", 10, 64, True, False, 2), ("model.norm", 10, 64, True, False, 1)]
    _, qwen3 = _probed("qwen3")
    assert ("model.layers.*.self_attn.q_norm", 40, 16, False, False, 3) in qwen3
    assert ("model.layers.*.self_attn.k_norm", 20, 16, False, False, 3) in qwen3
    _, gemma3 = _probed("gemma3_text")
    assert ("model.layers.*.pre_feedforward_layernorm", 10, 64, True, False, 3) in gemma3
    assert ("model.layers.*.post_feedforward_layernorm", 10, 64, False, False, 3) in gemma3
    _, olmo2 = _probed("olmo2")
    assert olmo2 == [("model.layers.*.self_attn.q_norm", 10, 64, False, False, 3),
                     ("model.layers.*.self_attn.k_norm", 10, 32, False, False, 3),
                     ("model.layers.*.post_attention_layernorm", 10, 64, False, False, 3),
                     ("model.layers.*.post_feedforward_layernorm", 10, 64, False, False, 3),
                     ("model.norm", 10, 64, True, False, 1)]
    _, nemotron = _probed("nemotron_h")
    assert ("model.layers.*.mixer.norm", 10, 128, False, True, 1) in nemotron


# Model types of every kind the builder shrinks: dense (one with a Gemma-style norm, one with eager
# attention only), fused projections, post norms, mixtures of experts, latent attention, hybrids.
BUILT = ["llama", "qwen3", "gemma2", "glm", "ernie4_5", "olmo2", "mixtral", "qwen3_moe", "deepseek_v3", "qwen3_next",
         "nemotron_h"]


@pytest.mark.parametrize("model_type", BUILT)
def test_any_model_type_builds_shrunk_and_its_probe_sees_every_norm(model_type):
    """Built from its config class shrunk generically (hidden 64, 3 layers, vocabulary 256, at most
    8 experts and 2 a token), random norm weights; every RMSNorm module is called once a forward,
    with its width."""
    model, calls = _probed(model_type)
    config = model.config.get_text_config(decoder=True)
    assert (config.hidden_size, config.vocab_size) == (64, mb.SMOKE_VOCAB)
    assert getattr(config, "num_hidden_layers", 3) == 3
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        assert getattr(config, key, None) in (None, 8), key
    assert getattr(config, "num_experts_per_tok", None) in (None, 2)
    norms = mb.norm_modules(model)
    assert sum(count for *_, count in calls) == len(norms) > 0
    assert sorted(m.weight.shape[0] for m in norms) == sorted(cols for _, _, cols, *_, count in calls
                                                             for _ in range(count))
    assert all(0.5 <= m.weight.min() and m.weight.max() <= 1.5 and m.weight.std() > 0 for m in norms)
    assert mb.attention_of(model) in (("sdpa", "eager") if model_type == "gemma2" else ("sdpa",))


def test_full_sizes_are_taken_from_each_configs_own_attributes():
    """At hidden 2048 (no model built): experts capped, latent attention's ranks, linear attention's
    heads and Mamba's widths follow the size; per-layer kinds are cut to the layer count; a
    multimodal config's text part takes the size and its vision part the tiny one."""
    def config(model_type, layers=None):
        return mb.ModelSpec.of(model_type, 2048, layers).config()

    moe = config("qwen3_moe")
    assert (moe.hidden_size, moe.num_hidden_layers, moe.vocab_size, moe.num_experts, moe.num_experts_per_tok,
            moe.moe_intermediate_size) == (2048, 4, 32000, 8, 2, 5632)
    mla = config("deepseek_v3")
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim,
            mla.num_key_value_heads, mla.n_routed_experts) == (1536, 512, 64, 128, 128, 16, 8)
    nxt = config("qwen3_next")
    assert (nxt.linear_num_key_heads, nxt.linear_num_value_heads, nxt.linear_key_head_dim, nxt.head_dim) == (
        16, 32, 128, 128)
    assert nxt.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    nemotron = config("nemotron_h", layers=2)
    assert (nemotron.mamba_num_heads, nemotron.mamba_head_dim, nemotron.n_groups, nemotron.ssm_state_size) == (
        64, 64, 8, 128)
    assert len(nemotron.layers_block_type) == 2
    phi3 = config("phi3")  # its default pad id lies outside a 32000-token vocabulary
    assert phi3.pad_token_id == 0
    gemma3 = config("gemma3")
    assert gemma3.text_config.hidden_size == 2048
    assert gemma3.vision_config.hidden_size == hf_configs.TINY["hidden_size"]


def test_clear_messages_for_types_that_cannot_be_built(monkeypatch):
    with pytest.raises(mb.ModelTypeError, match=r"model 'gpt9' is not a model type of transformers \S+ \("):
        mb.causal_lm_class_name("gpt9")
    with pytest.raises(mb.ModelTypeError, match=r"model 'clip' has no causal-LM class in transformers"):
        mb.build_model(mb.ModelSpec.of("clip", 64, smoke=True), CPU)
    assert mb.causal_lm_class_name("llama") == "LlamaForCausalLM"
    spec = mb.ModelSpec.of("llama", 64, smoke=True)
    monkeypatch.setattr(mb.ModelSpec, "attributes", lambda self: {"hidden_size": 64, "num_attention_heads": 5,
                                                                  "head_dim": None})
    with pytest.raises(mb.ModelBuildError) as info:
        mb.build_model(spec, CPU)
    message = str(info.value)
    assert message.startswith("model 'llama' (LlamaForCausalLM) does not build from its config shrunk to hidden 64 "
                              "x 2 layers: ") and "\n" not in message, message


def test_shrink_config_caps_and_keeps_what_a_config_leaves_off():
    from transformers import Qwen3MoeConfig

    default = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=8)
    small = hf_configs.shrink_config(default, {"hidden_size": 32, "num_experts": hf_configs.at_most(8),
                                               "num_experts_per_tok": hf_configs.at_most(2), "not_an_attribute": 1})
    assert (small.hidden_size, small.num_experts, small.num_experts_per_tok) == (32, 4, 2)
    assert not hasattr(small, "not_an_attribute") and default.hidden_size != 32
    assert hf_configs.at_most(8)(None) is None


def test_shrink_config_cuts_per_layer_kinds_to_the_layer_count():
    """A list of one kind per layer the constructor does not derive, and a pattern string of one
    character per layer the constructor checks against the layer count, both follow it."""
    from transformers import PretrainedConfig

    class Hybrid(PretrainedConfig):
        model_type = "hybrid_for_a_test"

        def __init__(self, hidden_size=128, num_hidden_layers=6, hybrid_override_pattern="M-M*M-", mlp_layer_types=None,
                     **kwargs):
            if len(hybrid_override_pattern) != num_hidden_layers:
                raise ValueError("hybrid_override_pattern must have one character per layer")
            self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
            self.hybrid_override_pattern = hybrid_override_pattern
            self.mlp_layer_types = mlp_layer_types or ["dense"] * 7
            super().__init__(**kwargs)

    for layers, pattern in ((4, "M-M*"), (8, "M-M*M-M-")):
        small = hf_configs.shrink_config(Hybrid(), {"hidden_size": 64, "num_hidden_layers": layers})
        assert (small.hidden_size, small.num_hidden_layers, small.hybrid_override_pattern) == (64, layers, pattern)
        assert small.mlp_layer_types == ["dense"] * layers


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


@pytest.mark.parametrize("model_type,settings", [
    ("llama", {"offset": 0.0, "casting_mode": "llama", "in_place": True}),
    ("gemma3_text", {"offset": 1.0, "casting_mode": "gemma", "in_place": False}),  # 1 + weight, fp32 throughout
    ("olmo2", {"offset": 0.0, "casting_mode": "gemma", "in_place": False}),  # rounded once, at the end
])
def test_liger_takes_what_each_norm_computes(monkeypatch, model_type, settings):
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.rms_norm"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["liger_kernel.transformers.rms_norm"].LigerRMSNorm = _LigerRMSNormStub
    spec = mb.ModelSpec.of(model_type, mb.SMOKE_HIDDEN, smoke=True)
    model = mb.build_model(spec, CPU, torch.float32)
    norms = mb.norm_modules(model)
    assert mb.liger_refusal(model) is None
    with mb._liger_swapped(model) as count:
        stubs = [m for m in model.modules() if isinstance(m, _LigerRMSNormStub)]
        assert count == len(stubs) == len(norms)
        assert all(m.settings == settings for m in stubs)
        assert [m.eps for m in stubs] == [float(getattr(n, "variance_epsilon", getattr(n, "eps", None))) for n in norms]
        assert {id(m.weight) for m in stubs} == {id(m.weight) for m in norms}
    assert mb.norm_modules(model) == norms


def test_liger_rows_are_skipped_where_a_norm_is_gated():
    """Qwen3-Next's linear attention ends in a gated norm, which LigerRMSNorm cannot express."""
    model = mb.build_model(mb.ModelSpec.of("qwen3_next", mb.SMOKE_HIDDEN, smoke=True), CPU, torch.float32)
    why = mb.liger_refusal(model)
    assert why.startswith("LigerRMSNorm cannot express 2 of 7 RMSNorm modules (Qwen3NextRMSNormGated (") and \
        why.endswith("): no liger rows"), why


def test_every_size_is_a_consistent_layer():
    """Each hidden size's heads of head_dim make up the hidden size and share the kv heads
    evenly; the default run measures sizes the table holds."""
    for hidden, size in mb.SIZES.items():
        assert size.heads * size.head_dim == hidden and size.heads % size.kv_heads == 0, hidden
        spec = mb.ModelSpec.of("qwen2", hidden)
        assert (spec.hidden, spec.layers, spec.intermediate) == (hidden, size.layers, size.intermediate)
    assert set(mb.DEFAULT_HIDDENS) <= set(mb.SIZES) and mb.Selection().hiddens == mb.DEFAULT_HIDDENS


def test_selection_rejects_bad_input():
    with pytest.raises(ValueError, match="models must be a non-empty list of transformers model types"):
        mb.Selection(models=())
    with pytest.raises(ValueError, match="hidden must be"):
        mb.Selection(hiddens=(1024,))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        mb.Selection(steps=0)
    with pytest.raises(ValueError, match=r"float8 must be a non-empty list of \('none', 'tensorwise'"):
        mb.Selection(float8=("mxfp8",))
    with pytest.raises(ValueError, match="modes must be"):
        mb.Selection(modes=("max-autotune",))
    with pytest.raises(ValueError, match="stop_after must be a positive number of seconds"):
        mb.Selection(stop_after=0)
    with pytest.raises(ValueError, match="'reduce-overhead' needs the inductor backend"):
        mb.Selection(backend="aot_eager", modes=("default", "reduce-overhead"))
    mb.Selection(backend="aot_eager", modes=("eager", "default"))
    full = mb.Selection()
    assert full.compiles() == 3 * 2 * 2 * 2 * 3 * 2
    assert mb.Selection(modes=("eager", "default"), float8=(None, "rowwise")).compiles() == 3 * 2 * 2 * 1 * 2 * 3 * 2
    assert mb.Selection(modes=("eager",)).compiles() == 0


def test_results_merge_only_with_the_same_versions(tmp_path):
    header = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0",
              "liger_kernel": "0.8.5", "torchao": "0.18.0"}
    stem = str(tmp_path / "run")
    assert mb.previous_rows(stem, header, fresh=False) == []
    rows = [{"model": "llama", "step_ms": 1.0}]
    (tmp_path / "run.json").write_text(json.dumps({**header, "rows": rows}))
    assert mb.previous_rows(stem, header, fresh=False) == rows
    assert mb.previous_rows(stem, header, fresh=True) == []
    with pytest.raises(ValueError, match="other torch: pass --fresh"):
        mb.previous_rows(stem, {**header, "torch": "2.12.0"}, fresh=False)
    with pytest.raises(ValueError, match="other torchao: pass --fresh"):
        mb.previous_rows(stem, {**header, "torchao": None}, fresh=False)


def test_cli_rejects_bad_lists_before_running(capsys):
    from torch_rmsnorm_op.cli import main

    for args, message in ((["--tokens", "4x"], "argument --tokens"), (["--modes", "max-autotune"], "argument --modes"),
                          (["--hidden", "2048,1000"], "argument --hidden"), (["--float8", "fp4"], "argument --float8")):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench-models", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert main(["bench-models", "--models", "llama", "--hidden", "2048", "--tokens", "1x16", "--plan"]) == 0
    assert "12 compiles" in capsys.readouterr().out  # 2 modes x 3 impls x 2 passes
    assert main(["bench-models", "--models", "llama,gemma2,clip", "--hidden", "2048", "--tokens", "1x16", "--modes",
                 "eager", "--float8", "none,rowwise", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "gemma2 (Gemma2ForCausalLM): hidden 2048, 4 layers, MLP 5632, 16 heads (8 kv) of 128" in out
    assert "clip: error: model 'clip' has no causal-LM class" in out
    assert "float8 none, rowwise;" in out and ": 0 compiles" in out  # eager compiles nothing


def test_cli_runs_several_selections_as_one_matrix(capsys):
    """``--and``: a selection after another, its options over the first one's; the run's
    options stand wherever they are given, once."""
    from torch_rmsnorm_op.cli import main

    assert main(["bench-models", "--models", "llama,qwen3", "--hidden", "2048", "--tokens", "4x2048,1x16", "--modes",
                 "default", "--impls", "stock,patched", "--and", "--modes", "eager", "--impls", "stock,patched,liger",
                 "--and", "--models", "llama", "--float8", "rowwise", "--modes", "default", "--plan"]) == 0
    parts = capsys.readouterr().out.split("and:\n")
    assert len(parts) == 3
    assert "qwen3 (Qwen3ForCausalLM)" in parts[1] and "modes eager;" in parts[1] and ": 0 compiles" in parts[1]
    assert "qwen3" not in parts[2] and "float8 rowwise;" in parts[2] and "impls stock, patched (" in parts[2]
    assert parts[0].endswith(": 16 compiles\n") and parts[2].endswith(": 8 compiles\n24 compiles in all\n")
    assert main(["bench-models", "--out", "a", "--and", "--out", "b", "--plan"]) == 2
    assert "--out is the run's, given two values: 'a' and 'b'" in capsys.readouterr().err


def test_cli_writes_outside_the_committed_results_unless_told(capsys):
    from torch_rmsnorm_op.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench-models", "--help"])
    assert exit_info.value.code == 0 and mb.DEFAULT_OUT == os.path.join("runs", "bench-models")
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: runs/bench-models, which git ignores;" in text
    assert "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1" in text


def test_the_run_sets_inductors_static_launch_for_its_process(monkeypatch):
    monkeypatch.delenv(mb.STATIC_LAUNCH_ENV, raising=False)
    assert mb.use_static_launch() == "1" and os.environ[mb.STATIC_LAUNCH_ENV] == "1"
    monkeypatch.setenv(mb.STATIC_LAUNCH_ENV, "0")  # a value already there stands
    assert mb.use_static_launch() == "0"


def test_compile_workers_each_get_one_model(capsys):
    """Each worker's command line parses and selects exactly one compiled model of the run
    (float8 recipes apart; eager modes have none)."""
    from torch_rmsnorm_op.cli import main

    for smoke in (False, True):
        sel = mb.Selection(models=("llama", "qwen3"), tokens=((1, 16),), impls=("stock", "patched"),
                           modes=("eager", "default") if smoke else mb.MODES, float8=(None, "rowwise"),
                           backend="aot_eager" if smoke else "inductor", smoke=smoke, layers=3)
        cmds = mb.worker_commands(sel)
        assert len(cmds) == sel.compiles() // len(sel.passes)
        for cmd, _ in cmds:
            assert cmd[3:5] == ["bench-models", "--compile-only"]
            assert main(cmd[3:] + ["--plan"]) == 0
            out = capsys.readouterr().out
            assert f"{len(sel.passes)} compiles" in out and ", 3 layers," in out, out
            assert "modes eager" not in out


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
    # past the run's --stop-after no worker starts
    mb.warm_caches(mb.Selection(models=("llama",), smoke=True), jobs=1, deadline=mb.time.monotonic() - 1)
    assert not recorded.exists() and "past --stop-after: not compiled ahead: worker" in capsys.readouterr().out


def test_compile_only_compiles_without_timing(capsys, monkeypatch):
    """A cache-warming worker of stock alone installs the library's Inductor passes before it
    compiles, as the timing process has them once a patched impl is set up: they are part of
    Inductor's cache key, so the timing process then finds stock's graphs in the cache."""
    from torch._inductor import config

    import torch_rmsnorm_op as T
    from torch_rmsnorm_op.passes import pass_class

    monkeypatch.delenv(mb.STATIC_LAUNCH_ENV, raising=False)  # the worker sets it for its process: undone after
    sel = mb.Selection(models=("llama",), tokens=((1, 8),), modes=("eager", "default"), passes=("infer",),
                       impls=("stock",), backend="aot_eager", smoke=True)
    with config.patch(pre_grad_custom_pass=None, post_grad_custom_post_pass=None):
        T.uninstall_inductor_passes()
        mb.compile_only(sel)
        passes = (config.pre_grad_custom_pass, config.post_grad_custom_post_pass)
        T.uninstall_inductor_passes()
    out = capsys.readouterr().out
    assert "llama 64 1x8 default float8 none stock infer: compiled in" in out and " eager " not in out
    assert [type(p) for p in passes] == [pass_class()] * 2


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
        if row["pass"] is None:
            continue
        row.pop("gpu_ratio_library_at_stock", None)
        row.pop("step_ratio_paired", None)
        row["gpu_ms_rounds"] = [2.0] if row["impl"] == "stock" else [1.0]
        row["step_ms_rounds"] = [4.0] if row["impl"] == "stock" else [1.0]
        row.pop("step_ratio_alternating", None)
        row["step_ms_alternating"] = [4.0, 4.0] if row["impl"] == "stock" else [1.0, 2.0]
        # No library kernels to count at stock's time (on a GPU the smoke run records real ones).
        row["kernels"], row["top_kernels"] = {}, {}
        if row["impl"] == "patched":  # as a GPU run records them: 4 residual calls at 1x8 tokens
            row["gpu_ms"] = 1.0
            row["norm_kernels"] = {"_rms_norm_fwd_rows": {"us": 2.0, "calls": 4, "source": "ours"}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = subprocess.run([sys.executable, "-m", "torch_rmsnorm_op", "bench-models", "--rederive", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [r for r in json.loads(path.read_text())["rows"] if r["pass"] == "train"]
    assert {(r["mode"], r["impl"]): r.get("gpu_ratio_library_at_stock") for r in rows} == {
        (r["mode"], r["impl"]): None if r["impl"] == "stock" else 0.5 for r in rows}
    assert {(r["mode"], r["impl"]): r.get("step_ratio_paired") for r in rows} == {
        (r["mode"], r["impl"]): None if r["impl"] == "stock" else 0.25 for r in rows}
    assert {(r["mode"], r["impl"]): r.get("step_ratio_alternating") for r in rows} == {
        (r["mode"], r["impl"]): None if r["impl"] == "stock" else 0.375 for r in rows}
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
