"""The patcher on real transformers model families built from tiny configs (nothing
downloaded), and a survey of every transformers ``*RMSNorm`` / ``*T5LayerNorm`` class:
each is swapped with semantics that compute what its own forward computes, or reported
with the reason; never silently changed."""

import copy
import importlib
import inspect
import os
import re
import sys

import pytest
import torch
from checks import assert_computes_like, compiling_afresh
from tolerances import MODEL, few_roundings
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import torch_rmsnorm_op as T
from torch_rmsnorm_op.patch import PatchedGatedRMSNorm, PatchedRMSNorm

transformers = pytest.importorskip("transformers", reason="transformers is not installed here")

# fp32 on CPU: the kernels reduce in another order than the modules, so outputs agree to a few
# units of fp32 and gradients (summed over rows and through the layers) as a whole model's.
OUTPUT_TOL = few_roundings(torch.float32)
GRAD_TOL = MODEL[torch.float32]

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=8)
T5_SMALL = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0)
COHERE_NORM = "computes none of torch, llama, gemma, t5, centered, input_scaled"  # Cohere's LayerNorm subtracts the mean

# id: (config class, model class, config overrides, semantics counts, skipped reason or None, compiled)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {"llama": 3}, None, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {"llama": 3}, None, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, {"llama": 5}, None, True),  # q_norm, k_norm
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, {"llama": 3}, None, True),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, {"gemma": 3}, None, True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}, {"gemma": 5}, None, True),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, {"gemma": 7}, None, True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, {"torch": 5}, None, True),
    "t5": ("T5Config", "T5EncoderModel", T5_SMALL, {"t5": 3}, None, True),
    # Families beyond the ones above: Llama 4 text has a weightless L2Norm for q and k;
    # EXAONE 4 normalizes q and k on transposed (B, H, S, D) views; Helium and OLMo3 round
    # once, as OLMo2 (eager only: their graphs hold the same calls); Cohere's norms are
    # LayerNorms by name and by what they compute.
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(num_local_experts=2, num_experts_per_tok=1,
               intermediate_size_mlp=64, interleave_moe_layer_step=1), {"llama": 3, "torch": 1}, None, True),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {}, {"llama": 5}, None, True),
    # GLM 4 normalizes the attention's and the MLP's outputs before the residual adds (sandwich
    # norms, Llama's order: rounded before the weight); compiled in test_family_under_inductor.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(pad_token_id=None, eos_token_id=None), {"llama": 5}, None, False),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {}, {"torch": 3}, None, False),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}, {"torch": 5}, None, False),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}, {}, COHERE_NORM, False),
    # DeepSeek V3's latent attention normalizes its q and kv projections' low-rank halves, its
    # MoE layers follow a dense one; Granite scales the residual branches and the embeddings;
    # Falcon-H1 runs attention and Mamba side by side in each layer.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        moe_intermediate_size=32, n_group=1, topk_group=1,
        # every expert as one batched matmul: on CUDA the grouped matmul's fallback backward (transformers
        # 5.17, fp32) and the experts' loop hold data-dependent shapes that fullgraph cannot compile
        experts_implementation="batched_mm"), {"llama": 9}, None, True),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(residual_multiplier=0.5, embedding_multiplier=2.0),
                {"llama": 3}, None, True),
    # Mixtures of experts after Mistral's and Qwen3's attention: the norm after the experts reads a
    # sum with their combined rows, which Inductor computes in the norm's kernel (FAMILY_SITES).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                experts_implementation="batched_mm"), {"llama": 3}, None, True),  # as DeepSeek V3's, above
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, experts_implementation="batched_mm"), {"llama": 5}, None, True),
    # Qwen2-MoE: the experts beside a shared expert scaled by a sigmoid gate of its own, so five
    # gradients reach each post-attention norm (summed in our backward kernel on CUDA).
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32, experts_implementation="batched_mm"),
                  {"llama": 3}, None, True),
    # Qwen3-Next: Gemma's `1 + weight` norms, a gated norm in its linear-attention layer
    # (forward(hidden_states, gate), Llama's norm then the gate), and q/k norms in its attention layer, the q
    # norm's rows a strided half of each head's projection (q beside its output gate); compiled under Inductor
    # only, since aot_eager's backward of the unpatched model's linear attention fails a view (torch 2.13).
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], use_cache=False,
        experts_implementation="batched_mm"),  # as DeepSeek V3's, above
        {"gemma": 7, "llama*silu(gate)": 1}, None, False),
    # Gemma 3n: twelve norms, among them q, k and a weightless v norm, AltUp's router norm and
    # LAuReL's, and a norm, residual add and norm that Inductor's pass joins into one op.
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
        pad_token_id=0, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, laurel_rank=4,
        altup_num_inputs=2, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0],
        layer_types=["full_attention"]), {"torch": 12}, None, False),
    # BitNet: a norm inside the attention and one inside the MLP, before their output projections.
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", dict(bos_token_id=None, eos_token_id=None), {"llama": 5}, None,
               True),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                  mamba_d_state=16, mamba_chunk_size=8), {"llama": 3}, None, True),
    # NemotronH: a block of Mamba, attention or MLP each behind one norm, of one rounding, read
    # through hidden_states.to(dtype=self.norm.weight.dtype), a cast that changes nothing here (the
    # residual rewrite looks through it); its Mamba mixer's gated norm normalizes x * silu(gate) in
    # two groups.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        num_hidden_layers=3, layers_block_type=["mamba", "attention", "mlp"], mamba_num_heads=4, mamba_head_dim=8,
        ssm_state_size=8, n_groups=2, chunk_size=8),
        # transformers 5.17 rounds NemotronH's and DeepSeek V4's normalized rows before the weight (Llama's
        # order), later releases after it (torch's): a tuple of counts is one per release
        ({"torch": 4, "llama(x*silu(gate)), groups of 16": 1}, {"llama": 4, "llama(x*silu(gate)), groups of 16": 1}),
        None, True),
    # Families of later transformers releases (skipped where the installed one lacks them). Gemma 4:
    # ten norms of one rounding, weightless v norms among them; Qwen 3.5: Qwen3-Next's `1 + weight`
    # norms and gated norm; DeepSeek V4: weightless norms that round rstd to the input's dtype
    # first (reported and left in place) beside six it swaps, one of them in its kv compressor,
    # which these short inputs never reach (compiled in test_family_under_inductor; its experts as
    # DeepSeek V3's).
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {}, {"torch": 10}, None, True),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(use_cache=False), {"gemma": 3, "llama*silu(gate)": 1},
                None, True),
    # the k norm's rows: the transpose of a short convolution's output, split into heads (copied)
    "inkling": ("InklingTextConfig", "InklingForCausalLM", dict(
        swa_head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, d_rel=8, sliding_window_size=16,
        rel_extent=16), {"llama": 6}, None, True),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, experts_implementation="batched_mm"),
        ({"torch": 6}, {"llama": 6}), COHERE_NORM, False),
    # Qwen4Exp: hyper-connections, four residual streams side by side in a row, each normalized apart
    # (groups of the hidden size) and scaled by its part of one weight; a linear-attention layer
    "qwen4_exp": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", dict(
        layer_types=["linear_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, hc_lowrank=8, use_cache=False, experts_implementation="batched_mm"),
        {"gemma, groups of 32": 3, "llama*silu(gate)": 1}, None, True),
    # MuseSpark's text model: the layers' input norms add their offset to the weight in its own dtype
    # (centered); its post-feedforward and experts' output norms scale the input by that weight first
    "muse_spark": ("MuseSparkTextConfig", "MuseSparkTextModel", dict(
        moe_intermediate_size=16, moe_hidden_size=16, num_local_experts=4, num_experts_per_tok=2, bos_token_id=None,
        eos_token_id=None, experts_implementation="batched_mm"), {"torch": 5, "centered": 3, "input_scaled": 2},
        None, True),
}


def _build(family):
    config_cls, model_cls, overrides, *_ = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**(overrides if family == "t5" else {**SMALL, **overrides}))
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norm weights: Llama's ones and Gemma's zeros hide nothing then
        for m in model.modules():
            if type(m).__name__.lower().endswith("norm") and isinstance(getattr(m, "weight", None), nn.Parameter):
                m.weight.uniform_(-1.0, 1.0)
    return model


def _output(model, **inputs):
    out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _inputs(family):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 6), generator=gen)
    return dict(input_ids=ids)


def _outputs_and_grads(forward, model, inputs):
    model.zero_grad(set_to_none=True)
    out = forward(**inputs)
    weights = torch.linspace(-1.0, 1.0, out.numel(), device=out.device).view(out.shape)  # every output matters
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got, want):
    out, grads = got
    torch.testing.assert_close(out, want[0], **OUTPUT_TOL)
    assert grads.keys() == want[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[1][name], **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_patched_eager_and_compiled(device, family):
    """Patched vs unpatched: outputs and gradients of every parameter, eager and under
    ``torch.compile(fullgraph=True, backend="aot_eager")`` (fullgraph raises on any graph
    break); the compiled graph holds one ``rmsnorm.fwd`` per norm call; the report lists
    every RMSNorm-like module, swapped with its semantics or skipped with the reason."""
    *_, counts, skipped_reason, compiled = FAMILIES[family]
    model = _build(family).to(device)
    inputs = {k: v.to(device) for k, v in _inputs(family).items()}
    reference = copy.deepcopy(model)
    want = _outputs_and_grads(lambda **kw: _output(reference, **kw), reference, inputs)

    report = T.patch_rmsnorm(model)
    assert report.semantics_counts() in (counts if isinstance(counts, tuple) else (counts,)), report
    if skipped_reason is None:
        assert report.skipped == [], report
    else:
        assert report.skipped and all(skipped_reason in why for *_, why in report.skipped), report
    patched = [m for m in model.modules() if isinstance(m, PatchedRMSNorm)]
    calls = []
    hooks = [m.register_forward_hook(lambda *args: calls.append(1)) for m in patched]
    _assert_close(_outputs_and_grads(lambda **kw: _output(model, **kw), model, inputs), want)
    for h in hooks:
        h.remove()
    assert T.dispatch_stats()["fallback"] == {}  # every swapped norm ran the kernels, both directions

    if compiled:
        _assert_compiles(model, inputs, want, len(calls), len(patched), reference)
    assert T.unpatch_rmsnorm(model) == len(report.swapped)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]


def _assert_compiles(model, inputs, want, calls, patched, reference):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(lambda **kw: _output(model, **kw), fullgraph=True, backend=backend)
    try:
        got = _outputs_and_grads(compiled, model, inputs)
    except Exception as e:  # only where the unpatched model fails alike (Qwen 3.5's linear attention, torch 2.11)
        torch._dynamo.reset()
        stock = torch.compile(lambda **kw: _output(reference, **kw), fullgraph=True, backend="aot_eager")
        try:
            _outputs_and_grads(stock, reference, inputs)
        except type(e) as stock_error:
            pytest.skip(f"the unpatched model fails alike under torch {torch.__version__}'s aot_eager: {stock_error}")
        raise
    _assert_close(got, want)
    assert len(graphs) == 1
    assert sum("rmsnorm.fwd" in str(n.target) for n in graphs[0].graph.nodes) == calls >= patched


# The norms of each family's compiled training graph by the compile rule's choice (passes/rule.py):
# ours where the norm's input is a residual sum of stored tensors (or a stored tensor only it
# reads) and only matmuls read its output; Inductor's where an elementwise op reads the output
# (q/k norms before RoPE, sandwich and post-norms before a residual add, gated norms, the weight's
# multiply of grouped norms) or makes the input (the embeddings, a scaled branch, a mixture of
# experts' rows, another norm's output left to Inductor).
FAMILY_SITES = {
    "gemma2": {"inductor": 5}, "gemma3": {"inductor": 7}, "gemma3n": {"inductor": 12, "ours": 1},
    "glm4": {"inductor": 5}, "olmo2": {"inductor": 5}, "granite": {"inductor": 3}, "qwen3_next": {"inductor": 8},
    "mixtral": {"inductor": 3}, "qwen3_moe": {"inductor": 5}, "qwen2_moe": {"inductor": 3},
    "deepseek_v3": {"inductor": 6, "ours": 3}, "gemma4": {"inductor": 9, "ours": 1},
    "deepseek_v4": {"inductor": 4, "ours": 1}, "nemotron_h": {"inductor": 3, "ours": 2},
    "bitnet": {"inductor": 3, "ours": 2}, "muse_spark": {"inductor": 11}, "qwen4_exp": {"inductor": 4},
}


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma3n", "glm4", "olmo2", "granite", "qwen3_next", "mixtral",
                                    "qwen3_moe", "qwen2_moe", "deepseek_v3", "gemma4", "deepseek_v4", "nemotron_h",
                                    "bitnet", "muse_spark", "qwen4_exp"])
def test_family_under_inductor(device, family):
    """Patched and compiled with Inductor, whose passes decide each norm by the compile rule
    (``FAMILY_SITES``), against the unpatched model in eager: outputs and every parameter's
    gradient, no graph break; each norm whose forward or backward is ours calls our op once a
    step on CPU."""
    model = _build(family).to(device)
    inputs = {k: v.to(device) for k, v in _inputs(family).items()}
    reference = copy.deepcopy(model)
    want = _outputs_and_grads(lambda **kw: _output(reference, **kw), reference, inputs)
    T.patch_rmsnorm(model)
    torch._dynamo.reset()
    T.reset_dispatch_stats()
    compiled = torch.compile(lambda **kw: _output(model, **kw), fullgraph=True)
    with compiling_afresh():  # sites are counted where a graph is traced, not loaded from a cache
        _assert_close(_outputs_and_grads(compiled, model, inputs), want)
    stats = T.dispatch_stats()
    if device.type == "cpu":  # a compiled CPU graph calls each op of ours once a step
        sites, calls = stats["sites"], stats["kernel"]
        forward = sum(n for choice, n in sites.items() if choice.startswith("forward ours"))
        backward = sum(n for choice, n in sites.items() if choice.endswith("backward ours"))
        assert calls.get("rmsnorm.fwd", 0) + calls.get("rmsnorm.add_fwd", 0) == forward, stats
        assert calls.get("rmsnorm.bwd", 0) + calls.get("rmsnorm.add_bwd", 0) == backward, stats
        assert sites == {f"forward {c}, backward {c}": n for c, n in FAMILY_SITES[family].items()}, stats


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_patched_model_generates_the_unpatched_models_tokens(device, family):
    """Greedy generation, as a model is served: eager with the dynamic cache, then with a static
    cache and the forward compiled with Inductor (a prefill of the prompts, then one row per
    sequence a step). The patched model's tokens are the unpatched model's, and its logits
    agree at every step; every norm runs the kernels (the "error" policy)."""
    model = _build(family).to(device)
    reference = copy.deepcopy(model)
    T.patch_rmsnorm(model)
    prompts = _inputs(family)["input_ids"].to(device)
    # disable_compile: generate compiles a static cache's forward itself on GPUs; here only the
    # patched model's forward is compiled, by the test, on every device.
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                    return_dict_in_generate=True, disable_compile=True)
    torch._dynamo.reset()
    compiles = CompileCounterWithBackend("inductor")
    for cache in ("dynamic", "static"):
        kwargs = dict(settings, cache_implementation="static") if cache == "static" else settings
        if cache == "static":
            model.forward = torch.compile(model.forward, fullgraph=True, backend=compiles)
        want = reference.generate(prompts, **kwargs)
        with T.fallback_policy("error"):
            got = model.generate(prompts, **kwargs)
        assert torch.equal(got.sequences, want.sequences), cache
        for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
            torch.testing.assert_close(a, b, **OUTPUT_TOL, msg=lambda m, step=step, cache=cache: f"{cache} cache, step {step}: {m}")
    assert compiles.frame_count >= 1  # the static cache's steps ran the compiled forward


def test_vision_language_model_with_an_image(device):
    """Qwen2.5-VL on a prompt that holds an image: the vision tower's norms (over its patches,
    rows with no batch dim, and its patch merger's) and the language model's, whose positions
    are multimodal (M-RoPE), all run the kernels; logits and every parameter's gradient, the
    vision tower's included, agree with the unpatched model's."""
    if not hasattr(transformers, "Qwen2_5_VLForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen2_5_VLForConditionalGeneration")
    torch.manual_seed(0)
    text = dict(SMALL, vocab_size=160, num_hidden_layers=2,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]))
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16, fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=150,
                                           video_token_id=151, vision_start_token_id=152)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(device)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.uniform_(-1.0, 1.0)
    reference = copy.deepcopy(model)
    report = T.patch_rmsnorm(model)
    assert len(report.swapped) == 10  # 2 text layers x 2 + final, 2 vision blocks x 2 + the merger's
    gen = torch.Generator().manual_seed(1)
    # One image of 8 x 8 patches, 4 x 4 pixels each over 2 frames, merged 2 x 2 into 16 tokens.
    pixels = torch.randn(64, 3 * 2 * 4 * 4, generator=gen).to(device)
    ids = torch.cat([torch.tensor([[1, 152]]), torch.full((1, 16), 150), torch.randint(0, 140, (1, 6), generator=gen)],
                    dim=1).to(device)
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 8, 8]], device=device))
    want = _outputs_and_grads(lambda **kw: _output(reference, **kw), reference, inputs)
    with T.fallback_policy("error"):
        got = _outputs_and_grads(lambda **kw: _output(model, **kw), model, inputs)
    _assert_close(got, want)
    assert any(name.startswith("model.visual.") and "norm" in name for name in got[1])
    assert T.dispatch_stats()["kernel"]["rmsnorm.fwd"] == 10


# The survey: every RMSNorm class in the installed transformers, found in the source (nothing
# imported at collection). Classes whose source is the same but for their name (most are
# copies: 138 of Llama's) compute the same, so each distinct source is one case, run on the
# first class that has it; the case's id counts the classes it stands for.
_CLASS = re.compile(r"^( *)class (\w*(?:RMSNorm|RmsNorm)\w*|\w*T5LayerNorm)\(")


def _class_sources(text):
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _CLASS.match(line)
        if match is None:
            continue
        indent, name, end = len(match.group(1)), match.group(2), i + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        source = "\n".join(lines[i:end])
        source = re.sub(r'("""|\'\'\')[\s\S]*?\1', "", source)
        source = re.sub(r"#[^\n]*", "", source).replace(name, "CLS")
        yield name, re.sub(r"\s+", " ", source)


def _survey_cases():
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    cases = {}
    for model_dir in sorted(os.listdir(root)):
        folder = os.path.join(root, model_dir)
        if not os.path.isdir(folder):
            continue
        for file in sorted(f for f in os.listdir(folder) if f.startswith("modeling_") and f.endswith(".py")):
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                text = f.read()
            for name, source in _class_sources(text):
                cases.setdefault(source, []).append((f"transformers.models.{model_dir}.{file[:-3]}", name))
    return [pytest.param(classes[0][0], classes[0][1], len(classes), id=f"{classes[0][1]}-x{len(classes)}")
            for classes in cases.values()]


_SIZE_ARGS = {"hidden_size", "dim", "d_model", "normalized_shape", "num_features", "hidden_dim", "embed_dim",
              "size", "n_embd", "features", "d", "channels", "num_channels", "width"}
_EPS_ARGS = {"eps", "epsilon", "variance_epsilon", "layer_norm_eps", "norm_eps", "rms_norm_eps"}
_GROUP_ARGS = {"group_size"}  # a grouped norm (Bamba's, Mamba2's gated one): two groups of the 16 columns
# A config for a norm built only from one: its sizes the ones above, what else it reads small.
_CONFIG_ARGS = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                    rms_norm_eps=1e-6)


def _config_for(cls, parameter):
    """A config for ``cls(config)``: of the class ``parameter`` is annotated with, else of the config
    classes of ``cls``'s module (a text model's first: the norm is a decoder's), the first that
    builds with ``_CONFIG_ARGS`` and builds ``cls``."""
    if isinstance(parameter.annotation, type) and issubclass(parameter.annotation, transformers.PretrainedConfig):
        candidates = [parameter.annotation]
    else:
        module = vars(sys.modules[cls.__module__]).values()
        candidates = sorted((c for c in module if isinstance(c, type) and issubclass(c, transformers.PretrainedConfig)),
                            key=lambda c: ("Text" not in c.__name__, c.__name__))
    errors = []
    for config_cls in candidates:
        try:
            config = config_cls(**_CONFIG_ARGS)
            cls(config)
            return config
        except Exception as e:  # the next candidate may build; if none does, every error is reported
            errors.append(f"{config_cls.__name__}: {e!r}"[:300])
    pytest.fail(f"{cls.__name__} builds from none of its module's configs: {errors}")


def _instantiate(cls):
    kwargs = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in _SIZE_ARGS:
            kwargs[p.name] = 16
        elif p.name in _EPS_ARGS:
            kwargs[p.name] = 1e-6
        elif p.name in _GROUP_ARGS:
            kwargs[p.name] = 8
        elif p.name == "config":
            kwargs[p.name] = _config_for(cls, p)
        elif p.default is inspect.Parameter.empty:
            pytest.fail(f"{cls.__name__}.__init__ needs {p.name!r}: give the survey a value for it")
    return cls(**kwargs)


@pytest.mark.parametrize("module_name, class_name, copies", _survey_cases())
def test_survey_every_transformers_rmsnorm(device, module_name, class_name, copies):
    """Built from its own __init__ (or a config of its model's), patched alone: swapped with
    semantics that compute what it computes for weights and inputs of fp32 and bf16, or reported
    with the reason and left in place (a norm inside it swapped like any other, and the module
    computing what it did); nothing else."""
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:  # an optional dependency of that model (torchaudio, ...)
        pytest.skip(f"{module_name} does not import here: {e}")
    original = _instantiate(cls).to(device)
    before = copy.deepcopy(original)
    container = nn.ModuleList([original])
    report = T.patch_rmsnorm(container)
    reported = [row for row in report.skipped if row[0] == "0"]
    if reported:
        assert reported[0].reason and container[0] is original, report
        assert all(name.startswith("0.") for name, *_ in report.swapped), report
        if report.swapped:  # the module's own norms, swapped: it computes what it did
            x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(3)).to(device)
            torch.testing.assert_close(original(x), before(x), **few_roundings(torch.float32))
        return
    assert len(report.swapped) + len(report.skipped) == 1, f"{class_name} neither swapped nor reported"
    if report.skipped:
        assert report.skipped[0].reason and container[0] is original
        return
    patched = container[0]
    assert isinstance(patched, PatchedRMSNorm) and patched.original is original
    if getattr(patched, "weight", None) is not None:  # the original's attributes: a weightless norm may have none
        with torch.no_grad():
            patched.weight.normal_(generator=torch.Generator(device).manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    gated = isinstance(patched, PatchedGatedRMSNorm)  # forward(hidden_states, gate)
    for w_dtype in (torch.float32, torch.bfloat16):
        container.to(w_dtype)
        for x_dtype in (torch.float32, torch.bfloat16):
            x, gate = (torch.randn(4, 5, 16, generator=gen).to(device=device, dtype=x_dtype) for _ in range(2))
            assert_computes_like(original, patched, x, gate if gated else None)
