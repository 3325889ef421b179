"""Model benchmark: Hugging Face decoders compiled stock, patched with our ops, and with Liger's RMSNorm.

Every model is a transformers class built from a config (no downloads), in
bf16, with ``attn_implementation="sdpa"``, vocabulary 32000, random weights
(RMSNorm weights drawn from U(0.5, 1.5)) and random token ids. One
configuration is (model, hidden, layers, tokens, mode, pass, impl):

- ``impl``: ``stock`` is ``torch.compile(model)``; ``patched`` is
  ``torch_rmsnorm_op.patch_rmsnorm(model)`` then ``torch.compile``, run under
  the ``"error"`` fallback policy (a norm the kernels do not serve fails the
  row instead of timing the reference); a run with ``patched`` sets Inductor's static
  launch of user-defined Triton kernels (``torch_rmsnorm_op.static_launch``) before its
  first compile, as patching before compiling does (Liger's kernels, launched by the same
  generated code, are launched statically too); ``liger`` swaps each RMSNorm module of
  this model instance for ``liger_kernel``'s ``LigerRMSNorm`` holding the same
  weight Parameter (no global class is touched), then compiles; it runs only
  where ``liger_kernel`` imports. Each impl runs on its own deep copy of one
  model (the same weights), so all of a configuration's impls are compiled
  and alive together and are timed in turn (below).
- ``mode``: ``torch.compile``'s ``default`` or ``reduce-overhead`` (CUDA graphs;
  each step then begins with ``torch.compiler.cudagraph_mark_step_begin()``).
- ``pass``: ``train`` is a forward with ``labels`` (the model's own loss) and
  ``loss.backward()``, the parameters' grads set to None before each step
  (outside the timed span); ``infer`` is a forward under ``torch.no_grad()``.
  One compiled model serves both passes (Dynamo compiles a graph for each
  grad mode); ``torch.compiler.reset()`` runs between configurations
  (model, tokens, mode).
- Interleaving: a pass is measured in ``rounds`` rounds; in each round every
  impl times ``steps`` steps and profiles ``profile_steps``, the impls taken in
  turn (in reverse order every other round). Measured one after the other in
  one process, the same GEMM and attention kernels ran 0.4-4.6% slower in the
  second impl's steps (profiling/results/models/2026-12-01-h200-models-interleaved/),
  as much as the differences this benchmark exists to measure.

What each number is:

- ``step_ms``: median over all rounds' timed steps (``steps`` in the row: their
  count) of the time between two CUDA events recorded on the stream around
  each step, after ``warmup`` steps (the first of which compiles). It
  includes the host time of a step where the GPU waits for the host (small
  token counts). In a ``--smoke`` run on CPU it is wall
  time through the Triton interpreter: **not a GPU timing**. ``step_ms_rounds``:
  the median step of each round.
- ``step_ratio_paired`` (rows other than stock's): the median over rounds of the
  row's round median over stock's in the same round (``paired_step_ratio``). Where
  the step waits on the host (1×16 tokens in default mode) one impl's steps
  spread over 2× within a run and its median moves between runs by more than the
  impls differ, while the impls of one round run next to each other: this ratio
  is the step comparison to read there.
- ``step_ms_alternating``: after each round's windows, ``steps`` more steps of
  every impl, one step of each in turn (stock, patched, stock, patched, ...,
  in the round's order), with nothing synchronized between them; each step's
  time as ``step_ms`` times it. ``step_ratio_alternating`` (rows other than
  stock's): the median over those turns of the row's step over stock's step of
  the same turn (``alternating_step_ratio``). The host's state moves a host-bound
  step's time from one window to the next (1.7 against 3.2 ms a step within
  one run at 1×16 tokens, ``profiling/results/models/2026-12-04-h200-models-4x2048-1x16/``);
  two steps a few milliseconds apart share it.
- ``gpu_ms``: GPU time per step: the sum of the device durations of every
  kernel, memset and memcpy over a ``torch.profiler`` window, divided by its
  steps; idle gaps are not counted. The median of the rounds' windows;
  ``gpu_ms_rounds`` lists each round's.
- ``gpu_ratio_library_at_stock`` (rows other than stock's): ``gpu_ms`` over stock's with
  the library kernels (cuBLAS, cuDNN, CUTLASS, aten) that both launch alike counted at
  stock's time in both (``gpu_ratio_library_at_reference``): the matmuls and attention are
  most of a step and move with the GPU's clock between rounds by as much as the differences
  measured, while the impls launch them alike. Both sides are the mean of the rounds' windows.
- ``kernels``: every device kernel, ``{"us", "calls"}`` per step averaged over the rounds'
  windows (names cut at ``KERNEL_NAME_CHARS``); ``top_kernels`` the costliest of them.
- ``norm_kernels``: the norm-related device kernels by name, averaged over the rounds' windows,
  ``{"us": time per step, "calls": launches per step, "source": ...}``: ours
  and Liger's by their Triton names (``_rms_norm*``; Liger's
  ``_rms_norm_forward_kernel`` / ``_rms_norm_backward_kernel`` and their
  ``_block_`` variants), Inductor's as the fused kernels whose names hold
  ``rsqrt`` or ``pow`` (nothing else in these models computes either, the
  marker list of ``trace_summary.NORM_MARKERS``). Inductor fuses neighbours
  into them (residual adds, casts, the embedding, RoPE in Qwen3's q/k norms):
  their whole time counts as the norm's. Not counted: memsets, and weight
  gradients reduced by kernels that hold neither marker (Liger's ``dW`` sum,
  Inductor's ``..._mul_sum`` reductions where the scheduler splits them off, and
  the aten ``reduce_kernel`` sums and bf16 casts stock's Llama training
  graph reduces them with: 124 µs of a step at 4x2048 tokens,
  profiling/results/models/2026-12-01-h200-gradient-sums/llama-train-stock-kernels.txt).
  ``norm_us`` is their sum.
- ``norm_floor_bytes``: the least bytes all RMSNorm sites of one step must move
  (``norm_byte_floor``), counting the residual add as part of the norm where
  the decoder adds a residual just before it (every norm but layer 0's input
  norm and Qwen3's q/k norms): forward plain x→y ``2·M·N·e``, forward with the
  residual (read x and the residual, write y and the sum) ``4·M·N·e``;
  backward plain (read dy and x, write dx) ``3·M·N·e``, backward with the
  residual (read dy, the sum and the gradient arriving at the sum, write dx)
  ``4·M·N·e``. ``e`` is the activation's element size; weights, rstd and
  dweight are not counted. The final norm's sum feeds nothing else (a kernel
  could skip writing it, and no gradient arrives at it); it is counted like
  the other residual sites all the same, as the floor is defined; so are Gemma 3's
  norms before a residual add and the norm after it, which the patched graph runs as one op
  (``rmsnorm::norm_add_fwd``, 4 passes where the two sites count 6 forward).
  ``norm_floor_bytes_without_adds`` counts every site as plain. ``norm_pct_of_copy``
  (and ``..._without_adds``) is that floor over
  ``norm_us`` over the copy ceiling ``copy_GBs`` (a 2 GiB bf16
  device-to-device copy, read + write counted, measured in the same run as
  ``tools/benchmark.py`` does): the first is meaningful for kernels that do
  the residual add, the second for kernels that only normalize. Train rows also
  give ``norm_floor_bytes_with_grad_terms`` / ``norm_pct_of_copy_with_grad_terms``:
  the backward's dy read as the gradients it sums (three at an input norm, two
  at a post-attention norm; ``NormSite.grad_terms``), for kernels that sum them
  (stock Inductor's and ours with ``fusion.fuse_gradient_sums``).
- ``ours_us``, ``ours_floor_bytes``, ``ours_pct_of_copy`` (and
  ``..._with_grad_terms`` in train rows): the same for the library's kernels
  alone (``source`` ``"ours"``) against the floor of the residual sites they
  serve (``ours_byte_floor``), where their forward launches a step are as many
  as those sites (a patched Llama, Qwen2/3, Mistral: the other norms are left
  to Inductor, whose kernels do other work with them: the embedding and its
  gradient, RoPE); else ``ours_floor_note`` says why there is no figure.
- Correctness against the reference: ``reference`` is ``stock`` (the stock
  compiled model in the same mode) for the other impls, ``eager`` (the
  uncompiled stock model) for stock itself. Train rows: ``loss``,
  ``loss_abs_err``, ``loss_rel_err`` and ``grad_rel_l2_err`` (over all RMSNorm
  weights' gradients); infer rows: ``logits_max_abs_err``,
  ``logits_max_rel_err`` (max abs error over the reference's max ``|logit|``)
  and ``logits_rel_l2_err``, taken from the first (compiling) step.
  ``matches_reference``: stock within ``TOLERANCES`` of eager; another impl
  within ``TOLERANCES`` of stock, or within twice stock's own distance from
  eager (``judge``: the two compiled models are as far apart as compiling
  moves a model at all). In a mixture of experts (``mixtral``, ``qwen3_moe``, ``qwen2_moe``,
  ``deepseek_v3``, ``qwen3_next``) a rounding that moves one router logit can send a token to another expert,
  so compiling alone moves bf16 logits and gradients past those tolerances
  (stock against eager on the H200, 4x2048 tokens: logits 0.11-0.18,
  gradients 0.16-0.22 relative L2); there stock's row is marked as differing
  and the patched row is held to stock's own distance. Where compiling happens
  to keep eager's choices, that distance is small and one changed choice in the
  patched graph fails the row; ``profiling/router_flips.py`` measures how far
  one changed choice moves the model.

Also in each row: the model's shape (``intermediate``, ``heads``,
``kv_heads``, ``head_dim``, ``vocab``), ``norm_modules`` (RMSNorm modules in
the model) and ``norm_modules_swapped`` (by the impl), ``compile_s`` (the
pass's first step, compiling included), ``step_ms_min`` / ``step_ms_max``,
``step_peak_extra_GiB`` (``max_memory_allocated`` over the impl's timed and
profiled steps, above what was allocated before them: the step's
activations and gradients), ``top_kernels`` (the costliest device kernels,
µs per step, averaged over the rounds), ``commit``, ``run_started`` and ``backend``; ``error`` instead of
the measurements where the configuration failed.

Output: ``<out>/<date>-<gpu>-models.json`` with ``gpu``, ``torch``,
``triton``, ``transformers``, ``liger_kernel``, ``date``, ``copy_GBs``,
``timing``, ``tolerances``, ``selection`` (of the latest run) and ``rows``, a
Markdown table (``.md``) and a PNG chart (``.png``) beside it, all rewritten
after every row. A run merges into
the file of its date and GPU: rows of configurations it does not measure are
kept (each row carries its run's ``commit``, ``run_started`` and
``copy_GBs``), so a matrix can be measured in several runs. Compile time
dominates a run; ``compile_s`` records each pass's first step, and
``--compile-jobs`` fills Inductor's on-disk caches from parallel worker
processes before the serial timing (the timing process then loads compiled
graphs from the cache).

How long a run takes: on the H200 (torch 2.11, Triton 3.6, caches cold) a
training graph of these models compiles in 13–26 s and an inference graph in
5–14 s, so a compiled model costs about 35 s with its timing; the default
matrix (3 models x 2 sizes x 2 token counts x 2 modes x 3 impls = 72 compiled
models, 144 compiles) takes about 45 minutes. One model at one size (12
compiled models) takes about 8 minutes: run the matrix in such pieces, which
merge into one file (``--plan`` prints a selection's compile count).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import importlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

import torch_rmsnorm_op as T
from torch_rmsnorm_op._torch_compat import inductor_cache_dir
from torch_rmsnorm_op.recognize import EPS_ATTRIBUTES, recognize

# family -> (config class, model class) in transformers
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "helium": ("HeliumConfig", "HeliumForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
}
DEFAULT_MODELS = ("llama", "qwen3", "mistral")
# Phi3's and GLM 4's defaults put pad and eos at ids outside a 32000-token vocabulary. Granite's
# defaults scale nothing (every multiplier 1, attention's too, where its models take 1/head_dim):
# it takes Granite 3.0 8B's, whose head_dim of 128 every size here has.
FAMILY_CONFIG_OVERRIDES: dict[str, dict] = {
    "phi3": {"pad_token_id": None, "eos_token_id": None},
    "glm4": {"pad_token_id": None, "eos_token_id": None},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                "logits_scaling": 16.0},
}
# Mixture-of-experts families: the config keys of the expert count and of one expert's MLP width.
# Every MoE layer has MOE_EXPERTS experts, MOE_TOP_K of them per token, each as wide as the size's
# dense MLP (SIZES), so a token's MLP work is MOE_TOP_K dense MLPs'. A post-attention norm's output
# feeds the router and the experts: two gradient terms, as a dense MLP's gate and up.
MOE_FAMILIES: dict[str, tuple[str, str]] = {
    "mixtral": ("num_local_experts", "intermediate_size"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size"),
    "qwen3_next": ("num_experts", "moe_intermediate_size"),
}
MOE_EXPERTS = 8
MOE_TOP_K = 2
# Mixtures of experts with a shared expert as wide as a routed one, scaled by a sigmoid gate of
# its own (``shared_expert_gate``; Qwen1.5-MoE's and Qwen2-57B-A14B's layers): a post-attention
# norm's output feeds the router, the experts, the shared expert's gate and up and its gate: five
# gradient terms.
SHARED_EXPERT_FAMILIES = frozenset({"qwen2_moe"})
# Families with DeepSeek V3's layers: multi-head latent attention, whose q and kv pass through
# low-rank projections normalized on the way (q_a_layernorm, kv_a_layernorm: ranks of 3/4 and 1/4
# of hidden, DeepSeek V3's 1,536 and 512 at hidden 2,048; each head's q and k of head_dim columns
# plus head_dim / 2 of RoPE, v of head_dim, as DeepSeek V3's 128 + 64 and 128); the first
# MLA_DENSE_LAYERS layers dense, the others mixtures of experts with one shared expert as wide as
# a routed one, whose output the experts' is added to. A post-attention norm of a MoE layer feeds
# the router, the experts and the shared expert's gate and up: four gradient terms.
MLA_FAMILIES = frozenset({"deepseek_v3"})
MLA_DENSE_LAYERS = 1
# Families whose attention normalizes q and k per head (rows of head_dim).
QK_NORM_FAMILIES = frozenset({"qwen3", "gemma3", "exaone4", "qwen3_moe"})
# Hybrid families: layers of linear attention or Mamba beside attention, whose mixers end in a
# gated RMSNorm (``forward(hidden_states, gate)``). Qwen3-Next (Qwen3-Next-80B's linear
# attention: 16 key and 32 value heads of 128, its gated norm over each value head; one layer in
# four full attention with q and k norms per head; Gemma's ``1 + weight`` norms, mixtures of
# experts with a shared expert). NemotronH (Nemotron-H's Mamba 2 mixer: heads of 64 over twice
# hidden, 8 groups, state 128, its gated norm over each group; layers Mamba, MLP, Mamba,
# attention in turn, each behind one norm). Without flash-linear-attention, causal-conv1d and
# mamba-ssm installed, the mixers run transformers' torch implementations, stock and patched alike.
HYBRID_FAMILIES = frozenset({"qwen3_next", "nemotron_h"})
NEMOTRON_H_PATTERN = "M-M*"  # Mamba, MLP, Mamba, attention; repeated to the layer count
# Families whose layers also normalize the attention's and the MLP's outputs before the
# residual add (Gemma 3's four norms a layer: input, post-attention, pre- and post-feedforward;
# GLM 4's input, post-self-attention, post-attention and post-MLP).
SANDWICH_NORM_FAMILIES = frozenset({"gemma3", "glm4"})
# Their names: the MLP's input norm, the attention's output norm, the MLP's output norm.
SANDWICH_NORM_NAMES: dict[str, tuple[str, str, str]] = {
    "gemma3": ("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
    "glm4": ("post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"),
}
# Families with norms after attention and MLP only (no input norms): the final norm is the only
# one a residual add feeds. Their q and k norms are over all heads at once (OLMo 2 and 3), or
# per head where the family is in QK_NORM_FAMILIES (EXAONE 4).
POST_NORM_FAMILIES = frozenset({"olmo2", "olmo3", "exaone4"})
# The projections an attention input norm's and an MLP input norm's output feed, where not
# (q, k, v) and (gate, up): one fused qkv_proj / gate_up_proj each. A norm's backward receives
# the sum of their gradients.
# ``SHARED_EXPERT_FAMILIES``' MLP input norm feeds five (the router, the experts, the shared
# expert's gate and up and its gate).
PROJECTIONS: dict[str, tuple[int, int]] = {"phi3": (1, 1), "glm4": (3, 1), "qwen2_moe": (3, 5)}

VOCAB = 32000
EPS = 1e-6
MODES = ("default", "reduce-overhead")
PASSES = ("train", "infer")
IMPLS = ("stock", "patched", "liger")
DEFAULT_TOKENS = ((4, 2048), (1, 16))
SMOKE_TOKENS = ((1, 8),)


@dataclass(frozen=True)
class Size:
    """The layer shape of one hidden size: the same for every family, so rows compare across families."""

    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


# 2048: TinyLlama's MLP width, 16 heads of 128, grouped-query attention with 8 kv heads.
# 4096: Llama-3-8B's and Mistral-7B's layer, 2 layers.
# Hidden sizes that are not powers of two, each a released model's layer: 1536 Qwen2-1.5B's,
# 3584 Qwen2-7B's, 5120 Qwen2.5-14B's (and Mistral-Nemo's width).
SIZES: dict[int, Size] = {
    1536: Size(layers=4, intermediate=8960, heads=12, kv_heads=2, head_dim=128),
    2048: Size(layers=4, intermediate=5632, heads=16, kv_heads=8, head_dim=128),
    3584: Size(layers=2, intermediate=18944, heads=28, kv_heads=4, head_dim=128),
    4096: Size(layers=2, intermediate=14336, heads=32, kv_heads=8, head_dim=128),
    5120: Size(layers=2, intermediate=13824, heads=40, kv_heads=8, head_dim=128),
}
# What a run measures unless told (--hidden).
DEFAULT_HIDDENS = (2048, 4096)
SMOKE_HIDDEN = 64
SMOKE_SIZE = Size(layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16)
SMOKE_VOCAB = 256

# Declared before any comparison. bf16 through a whole model: every implementation rounds
# differently at each norm (and Inductor fuses differently), and the difference grows with
# depth; a wrong norm (a missing weight, a wrong eps or mean) is off by far more. The logits'
# bound is what compiling alone moves 4 layers of random bf16 weights by: stock compiled
# against eager, 1.8e-2 to 2.4e-2 on the H200 (profiling/results/models/2026-12-01-h200-gradient-sums/).
TOLERANCES: dict[str, float] = {
    "loss_rel": 5e-3,  # |loss - ref| / |ref|; the loss is computed in fp32 from bf16 logits
    "grad_rel_l2": 5e-2,  # ||g - g_ref|| / ||g_ref|| over all RMSNorm weights' gradients
    "logits_rel_l2": 3e-2,  # ||l - l_ref|| / ||l_ref||
}

COPY_NUMEL = 1 << 30  # 2 GiB of bf16, as tools/benchmark.py
KERNEL_NAME_CHARS = 120  # top_kernels keys (GEMM template names run long); norm kernels keep full names
TOP_KERNELS = 12


def nemotron_h_pattern(layers: int) -> str:
    """NemotronH's layer pattern of ``layers`` layers: ``NEMOTRON_H_PATTERN`` repeated."""
    return "".join(NEMOTRON_H_PATTERN[i % len(NEMOTRON_H_PATTERN)] for i in range(layers))


@dataclass(frozen=True)
class ModelSpec:
    """One decoder: a family from ``FAMILIES`` and its shape."""

    family: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = VOCAB

    @classmethod
    def of(cls, family: str, hidden: int, layers: int | None = None, smoke: bool = False) -> ModelSpec:
        """The benchmark's shape for ``hidden`` (``SIZES``; ``smoke``: the tiny one), ``layers`` overriding."""
        if family not in FAMILIES:
            raise ValueError(f"model must be one of {sorted(FAMILIES)}, got {family!r}")
        if smoke:
            size, vocab = SMOKE_SIZE, SMOKE_VOCAB
        elif hidden in SIZES:
            size, vocab = SIZES[hidden], VOCAB
        else:
            raise ValueError(f"hidden must be one of {sorted(SIZES)}, got {hidden}")
        return cls(family, hidden, size.layers if layers is None else layers, size.intermediate, size.heads,
                   size.kv_heads, size.head_dim, vocab)

    def config(self):
        """The transformers config (sdpa attention, no KV cache, untied embeddings)."""
        config_cls = transformers_class(self.family, FAMILIES[self.family][0])
        kwargs = dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                      num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, rms_norm_eps=EPS,
                      max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False,
                      attn_implementation="sdpa")
        if self.family in MOE_FAMILIES:
            experts_key, width_key = MOE_FAMILIES[self.family]
            kwargs.update({experts_key: MOE_EXPERTS, width_key: self.intermediate, "num_experts_per_tok": MOE_TOP_K})
        if self.family in SHARED_EXPERT_FAMILIES:
            kwargs.update(shared_expert_intermediate_size=self.intermediate)
        if self.family in MLA_FAMILIES:
            q_rank, kv_rank = self.mla_ranks()
            # the config's head_dim is the RoPE columns of a head (DeepSeek V3's rotary embedding width)
            kwargs.update(q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_nope_head_dim=self.head_dim,
                          qk_rope_head_dim=self.head_dim // 2, v_head_dim=self.head_dim, head_dim=self.head_dim // 2,
                          num_key_value_heads=self.heads, first_k_dense_replace=MLA_DENSE_LAYERS,
                          n_shared_experts=1, n_group=1, topk_group=1)
        if self.family in HYBRID_FAMILIES:
            kwargs.update(self.hybrid_config())
        kwargs.update(FAMILY_CONFIG_OVERRIDES.get(self.family, {}))
        return config_cls(**kwargs)

    def hybrid_config(self) -> dict:
        """The mixer keys of a family in ``HYBRID_FAMILIES`` (``HYBRID_FAMILIES`` says which
        model's they follow; a smoke-sized model's are scaled down)."""
        smoke = self.hidden == SMOKE_HIDDEN
        if self.family == "qwen3_next":
            return dict(linear_num_key_heads=2 if smoke else 16, linear_num_value_heads=4 if smoke else 32,
                        linear_key_head_dim=16 if smoke else 128, linear_value_head_dim=16 if smoke else 128,
                        shared_expert_intermediate_size=self.intermediate)
        heads = 2 * self.hidden // 64
        return dict(hybrid_override_pattern=nemotron_h_pattern(self.layers),
                    mamba_num_heads=heads, mamba_head_dim=64, n_groups=min(8, heads),
                    ssm_state_size=16 if smoke else 128)

    def mla_ranks(self) -> tuple[int, int]:
        """The q and kv low ranks of a family in ``MLA_FAMILIES``: 3/4 and 1/4 of hidden."""
        return self.hidden * 3 // 4, self.hidden // 4


@dataclass(frozen=True)
class NormSite:
    """``count`` RMSNorm sites normalizing ``rows`` x ``cols``; ``residual``: a residual add feeds
    it; ``grad_terms``: the ops its output feeds, whose gradients the backward receives summed."""

    name: str
    rows: int
    cols: int
    residual: bool
    count: int
    grad_terms: int = 1
    gated: bool = False  # a gated norm: its forward also reads the gate, its backward writes the gate's gradient


def norm_sites(spec: ModelSpec, tokens: int) -> list[NormSite]:
    """Every RMSNorm site of one forward over ``tokens`` tokens, as the decoder layers run them.

    Layer 0's input norm reads the embedding; every other hidden-size norm (each layer's
    post-attention norm, the input norm of layers 1.., the final norm) reads a residual sum
    the decoder has just formed. ``QK_NORM_FAMILIES`` also normalize q and k per head: rows of
    head_dim. An input norm's output feeds the q, k and v projections, a post-attention norm's
    the MLP's gate and up projections (fused ones in ``PROJECTIONS``), the final norm's the LM
    head. ``SANDWICH_NORM_FAMILIES`` normalize the attention's and MLP's outputs too (their
    norms read no residual); ``POST_NORM_FAMILIES`` have those output norms and no input norms,
    and their q/k norms over all heads unless they normalize per head. ``MLA_FAMILIES`` also
    normalize q's and kv's low-rank projections (no residual); their input norms feed two
    projections, and a post-attention norm of an experts' layer four."""
    attention, mlp = PROJECTIONS.get(spec.family, (3, 2))
    if spec.family in POST_NORM_FAMILIES:
        sites = [
            NormSite("post_attention_layernorm", tokens, spec.hidden, False, spec.layers),
            NormSite("post_feedforward_layernorm", tokens, spec.hidden, False, spec.layers),
            NormSite("norm", tokens, spec.hidden, True, 1),
        ]
        if spec.family not in QK_NORM_FAMILIES:
            return [NormSite("q_norm", tokens, spec.heads * spec.head_dim, False, spec.layers),
                    NormSite("k_norm", tokens, spec.kv_heads * spec.head_dim, False, spec.layers), *sites]
    elif spec.family in HYBRID_FAMILIES:
        return _hybrid_sites(spec, tokens)
    elif spec.family in MLA_FAMILIES:  # q and kv low ranks; dense layers, then experts with a shared one
        q_rank, kv_rank = spec.mla_ranks()
        dense = min(MLA_DENSE_LAYERS, spec.layers)
        return [
            NormSite("input_layernorm (layer 0)", tokens, spec.hidden, False, 1, 2),
            NormSite("input_layernorm (layers 1..)", tokens, spec.hidden, True, spec.layers - 1, 2),
            NormSite("post_attention_layernorm (dense layers)", tokens, spec.hidden, True, dense, 2),
            NormSite("post_attention_layernorm (experts' layers)", tokens, spec.hidden, True, spec.layers - dense, 4),
            NormSite("norm", tokens, spec.hidden, True, 1),
            NormSite("q_a_layernorm", tokens, q_rank, False, spec.layers),
            NormSite("kv_a_layernorm", tokens, kv_rank, False, spec.layers),
        ]
    else:
        sites = [
            NormSite("input_layernorm (layer 0)", tokens, spec.hidden, False, 1, attention),
            NormSite("input_layernorm (layers 1..)", tokens, spec.hidden, True, spec.layers - 1, attention),
            NormSite("post_attention_layernorm", tokens, spec.hidden, True, spec.layers, mlp),
            NormSite("norm", tokens, spec.hidden, True, 1),
        ]
    if spec.family in SANDWICH_NORM_FAMILIES:  # the attention's and MLP's outputs, then the adds
        mlp_input, attention_output, mlp_output = SANDWICH_NORM_NAMES[spec.family]
        sites[2] = NormSite(mlp_input, tokens, spec.hidden, True, spec.layers, mlp)
        sites += [NormSite(attention_output, tokens, spec.hidden, False, spec.layers),
                  NormSite(mlp_output, tokens, spec.hidden, False, spec.layers)]
    if spec.family in QK_NORM_FAMILIES:
        sites += [NormSite("q_norm", tokens * spec.heads, spec.head_dim, False, spec.layers),
                  NormSite("k_norm", tokens * spec.kv_heads, spec.head_dim, False, spec.layers)]
    return sites


def _hybrid_sites(spec: ModelSpec, tokens: int) -> list[NormSite]:
    """``norm_sites`` of a family in ``HYBRID_FAMILIES``, layer by layer of its config. A block's
    input norm feeds its mixer's input projections: Qwen3-Next's linear attention two (qkvz and
    ba), attention three (q with its gate, k, v), Nemotron-H's Mamba one, its MLP one (up, of
    ReLU squared). Qwen3-Next's post-attention norm feeds the router, the experts, the shared
    expert's gate and up and the shared expert's gate: five. The gated norms read no residual."""
    config = spec.config()
    sites: list[NormSite] = []
    if spec.family == "qwen3_next":
        kinds = ["linear" if t == "linear_attention" else "attention" for t in config.layer_types]
        terms = {"linear": 2, "attention": 3}
        name = "input_layernorm"
        post = [NormSite("post_attention_layernorm", tokens, spec.hidden, True, spec.layers, 5)]
        linear, attention = kinds.count("linear"), kinds.count("attention")
        mixers = [NormSite("linear_attn.norm (gated)", tokens * config.linear_num_value_heads,
                           config.linear_value_head_dim, False, linear, gated=True),
                  NormSite("q_norm", tokens * spec.heads, spec.head_dim, False, attention),
                  NormSite("k_norm", tokens * spec.kv_heads, spec.head_dim, False, attention)]
    else:
        kinds = ["mamba" if c == "M" else "attention" if c == "*" else "mlp" for c in nemotron_h_pattern(spec.layers)]
        terms = {"mamba": 1, "attention": 3, "mlp": 1}
        name, post = "norm", []
        mixers = [NormSite("mixer.norm (gated)", tokens, config.mamba_num_heads * config.mamba_head_dim, False,
                           kinds.count("mamba"), gated=True)]
    sites.append(NormSite(f"{name} (layer 0, {kinds[0]})", tokens, spec.hidden, False, 1, terms[kinds[0]]))
    for kind in dict.fromkeys(kinds[1:]):
        sites.append(NormSite(f"{name} (layers 1.., {kind})", tokens, spec.hidden, True, kinds[1:].count(kind),
                              terms[kind]))
    sites += [*post, NormSite("norm_f" if spec.family == "nemotron_h" else "norm", tokens, spec.hidden, True, 1)]
    return sites + [site for site in mixers if site.count]


def norm_byte_floor(spec: ModelSpec, tokens: int, pass_: str, elem_bytes: int = 2, with_adds: bool = True,
                    with_grad_terms: bool = False, residual_only: bool = False) -> int:
    """Least bytes all RMSNorm sites of one step move (``pass_``: ``"infer"`` forward, ``"train"``
    forward and backward). Per site of M x N elements of ``elem_bytes``: forward 2 (read x, write
    y), or 4 with the residual (read x and the residual, write y and the sum); backward 3 (read
    dy and x, write dx), or 4 with the residual (read dy, the sum and the sum's incoming
    gradient, write dx); a gated site also reads the gate (forward and backward) and writes its
    gradient. ``with_adds=False`` counts every site as plain. ``with_grad_terms``
    counts dy as the gradients it sums (``NormSite.grad_terms``), each read: the backward's
    floor where the sum of the projections' gradients is part of the norm's work (stock
    Inductor fuses it into its norm backward, ``fusion.fuse_gradient_sums`` into ours).
    ``residual_only`` counts only the sites a residual add feeds."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    total = 0
    for site in norm_sites(spec, tokens):
        if residual_only and not site.residual:
            continue
        fused = with_adds and site.residual
        dy = site.grad_terms if with_grad_terms else 1
        per_element = (4 if fused else 2) + ((3 if fused else 2) + dy if pass_ == "train" else 0)
        if site.gated:
            per_element += 3 if pass_ == "train" else 1
        total += site.count * per_element * site.rows * site.cols * elem_bytes
    return total


def ours_byte_floor(spec: ModelSpec, tokens: int, pass_: str, elem_bytes: int = 2,
                    with_grad_terms: bool = False) -> tuple[int, int]:
    """``(bytes, sites)``: ``norm_byte_floor`` over the sites a residual add feeds alone (the
    ones ``rmsnorm::add_fwd`` / ``add_bwd`` serve in a patched decoder), and how many they are."""
    floor = norm_byte_floor(spec, tokens, pass_, elem_bytes, with_grad_terms=with_grad_terms, residual_only=True)
    return floor, sum(s.count for s in norm_sites(spec, tokens) if s.residual)


def norm_kernel_source(name: str) -> str | None:
    """Who launched a norm-related device kernel, by its name: ``"liger"``, ``"ours"``,
    ``"inductor"``, or None for a kernel that is not norm-related."""
    from torch_rmsnorm_op.tools.trace_summary import NORM_MARKERS

    if "rms_norm_forward_kernel" in name or "rms_norm_backward_kernel" in name:
        return "liger"
    if name.startswith("_rms_norm") or name.startswith("_add_rms_norm"):
        return "ours"
    if name.startswith("triton_") and any(m in name for m in NORM_MARKERS):
        return "inductor"
    return None


_started: float | None = None  # monotonic time of the first progress line


def _log(msg: str) -> None:
    """A progress line: wall clock, seconds since the first line, the message (flushed)."""
    global _started
    if _started is None:
        _started = time.monotonic()
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _started:5.0f}s] {msg}", flush=True)


def liger_available() -> str | None:
    """``liger_kernel``'s version if its RMSNorm imports here, else None."""
    try:
        importlib.import_module("liger_kernel.transformers.rms_norm")
    except Exception:  # absent, or present without a working Triton: either way, no liger rows
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("liger_kernel")
    except PackageNotFoundError:
        return "unknown"


def _is_hf_rmsnorm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith(("RMSNorm", "RMSNormGated"))
            and any(hasattr(module, a) for a in EPS_ATTRIBUTES) and isinstance(weight, nn.Parameter)
            and weight.dim() == 1)


def norm_modules(model: nn.Module) -> list[nn.Module]:
    """The model's RMSNorm modules (transformers' plain and gated ones, and ``nn.RMSNorm``), each once."""
    return [m for m in model.modules() if _is_hf_rmsnorm(m) or isinstance(m, nn.RMSNorm)]


@contextlib.contextmanager
def _liger_swapped(model: nn.Module) -> Iterator[int]:
    """Each transformers RMSNorm of this model instance replaced by a ``LigerRMSNorm`` holding
    the original weight Parameter, put back after. Liger's settings follow what the module
    computes (``recognize``): Llama's casting in place for Llama's semantics; ``1 + weight``
    with Gemma's casting (fp32 throughout), not in place, as Liger's Gemma patches; Gemma's
    casting without offset for the one-rounding form (OLMo 2's, which Liger's own patch gives
    Llama's casting). Modules of any other semantics keep their own forward."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    settings = {"llama": dict(offset=0.0, casting_mode="llama", in_place=True),
                "gemma": dict(offset=1.0, casting_mode="gemma", in_place=False),
                "torch": dict(offset=0.0, casting_mode="gemma", in_place=False)}
    swapped, cache = [], {}
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            found = recognize(child, cache=cache) if _is_hf_rmsnorm(child) else None
            if found is not None and found.eps is not None and getattr(found.semantics, "name", None) in settings:
                liger = LigerRMSNorm(child.weight.shape[0], eps=float(found.eps), **settings[found.semantics.name])
                liger.weight = child.weight
                liger.train(child.training)
                setattr(parent, attr, liger)
                swapped.append((parent, attr, child))
    try:
        yield len(swapped)
    finally:
        for parent, attr, child in swapped:
            setattr(parent, attr, child)


StepContext = Callable[[], contextlib.AbstractContextManager]  # the context every step of an impl runs in


@contextlib.contextmanager
def implementation(model: nn.Module, impl: str) -> Iterator[tuple[int, StepContext]]:
    """``model`` set up as ``impl`` for the block; yields (norm modules swapped, the context each
    of its steps runs in). The model is restored on exit."""
    import torch_rmsnorm_op as T

    if impl == "stock":
        yield 0, contextlib.nullcontext
    elif impl == "patched":
        with T.patched_rmsnorm(model) as report:
            yield len(report.swapped), lambda: T.fallback_policy("error")
    elif impl == "liger":
        # Dynamo's mutation analysis of Liger's kernels fails (``eps.to(tl.float32)`` on a Python
        # float; torch 2.11, liger_kernel 0.8.5) and logs the traceback as a warning at every kernel
        # it traces (thousands of lines a model) before assuming every argument is mutated.
        analysis_log = logging.getLogger("torch._higher_order_ops.triton_kernel_wrap")
        level = analysis_log.level
        analysis_log.setLevel(logging.ERROR)
        try:
            with _liger_swapped(model) as count:
                yield count, contextlib.nullcontext
        finally:
            analysis_log.setLevel(level)
    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def transformers_class(family: str, name: str) -> type:
    """``transformers.<name>``; a ``RuntimeError`` naming the family and the installed release
    where that release has no such class."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        raise RuntimeError(f"model {family!r} needs transformers.{name}, which transformers "
                           f"{transformers.__version__} does not have: install a release that does")
    return cls


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """``spec``'s causal LM on ``device`` in ``dtype``: transformers' initialization, then every
    RMSNorm weight drawn from U(0.5, 1.5) (so the weight's multiply is exercised)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers_class(spec.family, FAMILIES[spec.family][1])(spec.config())
    model.to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for m in norm_modules(model):
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen, device=device) + 0.5)
    return model


@dataclass(frozen=True)
class Selection:
    """What one run measures, and how."""

    models: tuple[str, ...] = DEFAULT_MODELS
    hiddens: tuple[int, ...] = DEFAULT_HIDDENS
    tokens: tuple[tuple[int, int], ...] = DEFAULT_TOKENS
    modes: tuple[str, ...] = MODES
    passes: tuple[str, ...] = PASSES
    impls: tuple[str, ...] = IMPLS
    layers: int | None = None
    steps: int = 10
    warmup: int = 5
    profile_steps: int = 3
    rounds: int = 4
    backend: str = "inductor"
    smoke: bool = False

    def __post_init__(self) -> None:
        for name, values, allowed in (("models", self.models, tuple(FAMILIES)), ("modes", self.modes, MODES),
                                      ("passes", self.passes, PASSES), ("impls", self.impls, IMPLS)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"{name} must be a non-empty list of {allowed}, got {list(values)}")
        if not self.smoke:
            bad = [h for h in self.hiddens if h not in SIZES]
            if bad or not self.hiddens:
                raise ValueError(f"hidden must be a non-empty list of {tuple(SIZES)}, got {list(self.hiddens)}")
        if not self.tokens or any(b < 1 or s < 1 for b, s in self.tokens):
            raise ValueError(f"tokens must be a non-empty list of BATCHxSEQ with both >= 1, got {self.tokens}")
        if any(s > 4096 for _, s in self.tokens):
            raise ValueError("tokens: the sequence length must be at most 4096 (max_position_embeddings)")
        for name in ("steps", "warmup", "profile_steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.backend != "inductor" and self.modes != ("default",):
            raise ValueError(f"modes other than 'default' need the inductor backend (backend is {self.backend!r})")

    def specs(self) -> list[ModelSpec]:
        hiddens = (SMOKE_HIDDEN,) if self.smoke else self.hiddens
        return [ModelSpec.of(f, h, self.layers, self.smoke) for f in self.models for h in hiddens]

    def compiles(self) -> int:
        """How many graphs the run compiles (one per configuration and pass)."""
        return len(self.specs()) * len(self.tokens) * len(self.modes) * len(self.impls) * len(self.passes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], object], before: Callable[[], None], n: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``n`` calls of ``step`` (``before`` runs ahead of each, untimed): CUDA
    events recorded on the stream around each step on CUDA, wall time elsewhere."""
    return time_alternating([(step, before, contextlib.nullcontext)], n, device)[0]


def time_alternating(arms: Sequence[tuple[Callable[[], object], Callable[[], None], StepContext]], n: int,
                     device: torch.device) -> list[list[float]]:
    """Milliseconds of ``n`` steps of each arm (``(step, before, context)``), one step of each
    arm after the other, ``n`` times over: arm 0, arm 1, ..., arm 0, arm 1, ... Each step runs
    in its arm's context, ``before`` ahead of it untimed; CUDA events recorded on the stream
    around it on CUDA, with no synchronization between steps, wall time elsewhere. Returns each
    arm's times in order."""
    cuda = device.type == "cuda"
    times: list[list[float]] = [[] for _ in arms]
    events = []
    for _ in range(n):
        for i, (step, before, context) in enumerate(arms):
            with context():
                before()
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    events.append((i, start, end))
                else:
                    t0 = time.perf_counter()
                    step()
                    times[i].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        for i, start, end in events:
            times[i].append(start.elapsed_time(end))
    return times


def profile_window(step: Callable[[], object], before: Callable[[], None], n: int, device: torch.device) -> dict:
    """Profile ``n`` steps. On CUDA: ``gpu_ms`` (all device kernels, memsets and memcpys per step),
    ``norm_kernels`` and the ``top_kernels`` by time. Elsewhere the norm ``kernels`` are our
    ``rmsnorm::`` CPU ops (their CPU time) and ``gpu_ms`` is None."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            before()
            step()
        _sync(device)
    time_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in prof.events():
        if (e.device_type == torch.autograd.DeviceType.CUDA) == cuda:
            time_us[e.name] = time_us.get(e.name, 0.0) + e.time_range.elapsed_us()
            calls[e.name] = calls.get(e.name, 0) + 1
    if cuda:
        sources = {name: norm_kernel_source(name) for name in time_us}
        gpu_ms = sum(time_us.values()) / n / 1e3 if time_us else None
    else:
        sources = {name: ("ours" if name.startswith("rmsnorm::") else None) for name in time_us}
        gpu_ms = None
    norm = {name: {"us": round(time_us[name] / n, 2), "calls": round(calls[name] / n, 2), "source": src}
            for name, src in sorted(sources.items(), key=lambda kv: -time_us[kv[0]]) if src}
    kernels: dict[str, dict] = {}
    if cuda:
        for name, us in time_us.items():
            slot = kernels.setdefault(name[:KERNEL_NAME_CHARS], {"us": 0.0, "calls": 0.0})
            slot["us"] += us / n
            slot["calls"] += calls[name] / n
    kernels = {k: {"us": round(v["us"], 2), "calls": round(v["calls"], 2)}
               for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]["us"])}
    top = {k: v["us"] for k, v in list(kernels.items())[:TOP_KERNELS]}
    return {"gpu_ms": None if gpu_ms is None else round(gpu_ms, 4), "norm_kernels": norm, "top_kernels": top,
            "kernels": kernels}


@dataclass
class Outputs:
    """What a pass's first step produced, for the correctness check (detached copies, fp32)."""

    loss: Tensor | None = None
    grads: Tensor | None = None  # all RMSNorm weights' gradients, concatenated
    logits: Tensor | None = None


def _norm_grads(weights: Sequence[nn.Parameter]) -> Tensor:
    grads = [w.grad for w in weights]
    if any(g is None for g in grads):
        raise RuntimeError("an RMSNorm weight received no gradient")
    return torch.cat([g.detach().float().flatten() for g in grads])


def _rel_l2(out: Tensor, ref: Tensor) -> float:
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


_ERRORS = {"loss_rel_err": "loss_rel", "grad_rel_l2_err": "grad_rel_l2", "logits_rel_l2_err": "logits_rel_l2"}


def compare(out: Outputs, ref: Outputs) -> dict:
    """Error fields of ``out`` against ``ref``."""
    fields: dict = {}
    if out.loss is not None:
        loss, want = out.loss.item(), ref.loss.item()
        fields.update(loss=round(loss, 6), loss_abs_err=abs(loss - want), loss_rel_err=abs(loss - want) / abs(want))
        fields["grad_rel_l2_err"] = _rel_l2(out.grads, ref.grads)
    if out.logits is not None:
        err = (out.logits - ref.logits).abs()
        scale = ref.logits.abs().max().clamp_min(1e-30)
        fields.update(logits_max_abs_err=err.max().item(), logits_max_rel_err=(err.max() / scale).item(),
                      logits_rel_l2_err=_rel_l2(out.logits, ref.logits))
    return fields


def judge(row: dict, stock: dict | None = None) -> bool:
    """Whether ``row``'s errors pass: each within ``TOLERANCES``, or, for a row compared with
    ``stock`` (its ``reference`` is "stock"), within twice stock's own error against eager. NaN
    fails."""
    ok = True
    for field, tol in _ERRORS.items():
        if field not in row:
            continue
        value = row[field]
        if value != value or abs(value) == float("inf"):
            return False
        bound = TOLERANCES[tol]
        if stock is not None and row.get("reference") == "stock" and field in stock:
            bound = max(bound, 2 * stock[field])
        ok = ok and value <= bound
    return ok


class Steps:
    """The step functions of one (compiled) model on one input; ``norm_weights``: the RMSNorm
    weight Parameters (the same objects whichever impl holds them)."""

    def __init__(self, fn: Callable, model: nn.Module, ids: Tensor, cudagraphs: bool,
                 norm_weights: Sequence[nn.Parameter]) -> None:
        self.fn, self.model, self.ids, self.cudagraphs = fn, model, ids, cudagraphs
        self.norm_weights = norm_weights

    def clear_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def train(self) -> Tensor:
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.fn(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        return loss

    def infer(self) -> Tensor:
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return self.fn(input_ids=self.ids).logits

    def first(self, pass_: str) -> Outputs:
        """Run one step of ``pass_`` (the compiling one) and keep its outputs."""
        if pass_ == "train":
            self.model.train()
            self.clear_grads()
            loss = self.train()
            return Outputs(loss=loss.detach().float().clone(), grads=_norm_grads(self.norm_weights))
        self.model.eval()
        return Outputs(logits=self.infer().detach().float().clone())


def eager_reference(model: nn.Module, ids: Tensor, passes: Sequence[str]) -> dict[str, Outputs]:
    """The uncompiled stock model's outputs for each pass."""
    steps = Steps(model, model, ids, False, [m.weight for m in norm_modules(model)])
    out = {p: steps.first(p) for p in passes}
    model.zero_grad(set_to_none=True)
    return out


@dataclass
class Arm:
    """One impl of a configuration: its own copy of the model, compiled, and its steps."""

    impl: str
    steps: Steps
    step_context: StepContext
    swapped: int


def warm_up(arm: Arm, pass_: str, sel: Selection, device: torch.device) -> tuple[float, Outputs]:
    """Compile ``pass_`` (its first step) and warm it up; (compile seconds, the first step's outputs)."""
    with arm.step_context():
        t0 = time.perf_counter()
        first = arm.steps.first(pass_)
        _sync(device)
        compile_s = time.perf_counter() - t0
        step, before = _step_fns(arm.steps, pass_)
        for _ in range(sel.warmup - 1):
            before()
            step()
    return compile_s, first


def _step_fns(steps: Steps, pass_: str) -> tuple[Callable[[], object], Callable[[], None]]:
    return (steps.train, steps.clear_grads) if pass_ == "train" else (steps.infer, lambda: None)


def measure_arms(arms: Sequence[Arm], pass_: str, sel: Selection, device: torch.device) -> dict[str, dict]:
    """Time and profile every arm's ``pass_`` in ``sel.rounds`` rounds, the arms taken in turn
    within each round (in reverse order every other round), so that clock and thermal drift
    during the run weighs on each arm alike. Each round times ``steps`` steps and profiles
    ``profile_steps`` per arm. Returns each impl's measured fields."""
    times: dict[str, list[float]] = {a.impl: [] for a in arms}
    round_ms: dict[str, list[float]] = {a.impl: [] for a in arms}
    profiles: dict[str, list[dict]] = {a.impl: [] for a in arms}
    peak: dict[str, int] = {a.impl: 0 for a in arms}
    alternating: dict[str, list[float]] = {a.impl: [] for a in arms}
    for r in range(sel.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        for arm in order:
            step, before = _step_fns(arm.steps, pass_)
            with arm.step_context():
                if device.type == "cuda":
                    _sync(device)
                    held = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                timed = time_steps(step, before, sel.steps, device)
                times[arm.impl] += timed
                round_ms[arm.impl].append(round(statistics.median(timed), 4))
                profiles[arm.impl].append(profile_window(step, before, sel.profile_steps, device))
                if device.type == "cuda":
                    peak[arm.impl] = max(peak[arm.impl], torch.cuda.max_memory_allocated(device) - held)
            arm.steps.clear_grads()
        if len(arms) > 1:
            timed = time_alternating([(*_step_fns(a.steps, pass_), a.step_context) for a in order], sel.steps, device)
            for arm, t in zip(order, timed):
                alternating[arm.impl] += [round(v, 4) for v in t]
                arm.steps.clear_grads()
    out = {}
    for arm in arms:
        t = times[arm.impl]
        row = {"step_ms": round(statistics.median(t), 4), "step_ms_min": round(min(t), 4),
               "step_ms_max": round(max(t), 4), "step_ms_rounds": round_ms[arm.impl], "steps": len(t),
               **({"step_ms_alternating": alternating[arm.impl]} if alternating[arm.impl] else {}),
               "rounds": sel.rounds,
               "profile_steps": sel.profile_steps * sel.rounds, **merge_profiles(profiles[arm.impl])}
        if device.type == "cuda":
            row["step_peak_extra_GiB"] = round(peak[arm.impl] / 2**30, 2)
        out[arm.impl] = row
    return out


def merge_profiles(windows: Sequence[dict]) -> dict:
    """``profile_window`` results of several rounds as one: ``gpu_ms`` the median round's (and every
    round's in ``gpu_ms_rounds``), kernel times and calls per step averaged over the rounds."""
    gpu = [w["gpu_ms"] for w in windows if w["gpu_ms"] is not None]

    def mean(field: str) -> dict:
        acc: dict[str, dict] = {}
        for w in windows:
            for name, value in w[field].items():
                if isinstance(value, dict):
                    slot = acc.setdefault(name, {"us": 0.0, "calls": 0.0, **({"source": value["source"]}
                                                                              if "source" in value else {})})
                    slot["us"] += value["us"] / len(windows)
                    slot["calls"] += value["calls"] / len(windows)
                else:
                    acc.setdefault(name, {"us": 0.0})["us"] += value / len(windows)
        if field == "top_kernels":
            ranked = sorted(acc.items(), key=lambda kv: -kv[1]["us"])[:TOP_KERNELS]
            return {k: round(v["us"], 2) for k, v in ranked}
        return {k: {**v, "us": round(v["us"], 2), "calls": round(v["calls"], 2)}
                for k, v in sorted(acc.items(), key=lambda kv: -kv[1]["us"])}

    return {"gpu_ms": round(statistics.median(gpu), 4) if gpu else None,
            "gpu_ms_rounds": [round(g, 4) for g in gpu], "norm_kernels": mean("norm_kernels"),
            "top_kernels": mean("top_kernels"), "kernels": mean("kernels")}


def _library_kernel(name: str) -> bool:
    """A device kernel of a library (cuBLAS, cuDNN, CUTLASS, aten): not Triton (Inductor's
    ``triton_*``, ours, Liger's), not a memset or memcpy."""
    return not (name.startswith(("triton_", "Memset", "Memcpy")) or norm_kernel_source(name))


def gpu_ratio_library_at_reference(row: dict, reference: dict) -> float | None:
    """``row``'s GPU time over ``reference``'s, both the mean of their rounds' windows, with
    every library kernel (``_library_kernel``) that both launch alike (the same name and
    launches per step) counted at ``reference``'s time in both: what the impl changes, without
    the drift of the GPU's clock between rounds, which moves those kernels (the matmuls and
    attention, most of a step) as much as the differences measured. From the rows' ``kernels``;
    rows written before that field have only their ``top_kernels`` (the costliest, without
    launch counts), whose library kernels in both are taken as launched alike. None without
    GPU times."""
    if not row.get("gpu_ms_rounds") or not reference.get("gpu_ms_rounds"):
        return None
    field = "kernels" if row.get("kernels") and reference.get("kernels") else "top_kernels"

    def table(r: dict) -> dict[str, tuple[float, float | None]]:
        return {k: (v["us"], v["calls"]) if isinstance(v, dict) else (v, None) for k, v in r.get(field, {}).items()}

    mine, theirs = table(row), table(reference)
    shift_us = sum(theirs[k][0] - us for k, (us, calls) in mine.items()
                   if _library_kernel(k) and k in theirs and calls == theirs[k][1])
    ms, ref_ms = statistics.mean(row["gpu_ms_rounds"]), statistics.mean(reference["gpu_ms_rounds"])
    return round((ms + shift_us / 1e3) / ref_ms, 4)


def paired_step_ratio(row: dict, reference: dict) -> float | None:
    """The median over rounds of ``row``'s median step time in a round over ``reference``'s in
    the same round (None without both impls' rounds): the impls of a round run next to each
    other, so the host's and the GPU clock's drift over the run cancels in each round's ratio."""
    return _median_ratio(row.get("step_ms_rounds"), reference.get("step_ms_rounds"))


def alternating_step_ratio(row: dict, reference: dict) -> float | None:
    """The median over ``row``'s alternating steps (``step_ms_alternating``) of each step's time
    over ``reference``'s step of the same turn (None without both impls' alternating steps). Two
    steps of a turn run one right after the other, so the host's state, which moves a host-bound
    step by 2× from one window to the next, weighs on both alike."""
    return _median_ratio(row.get("step_ms_alternating"), reference.get("step_ms_alternating"))


def _median_ratio(mine: Sequence[float] | None, theirs: Sequence[float] | None) -> float | None:
    """The median of ``mine[i] / theirs[i]``; None unless both are there, as many."""
    if not mine or not theirs or len(mine) != len(theirs):
        return None
    return round(statistics.median(a / b for a, b in zip(mine, theirs)), 4)


def _free(device: torch.device) -> None:
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _compile(model: nn.Module, mode: str, backend: str):
    if backend == "inductor":
        return torch.compile(model, mode=None if mode == "default" else mode)
    return torch.compile(model, backend=backend)


def _commit() -> str | None:
    """The checkout's short commit, ``+dirty`` where tracked files differ from it; None outside git."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


ROW_KEY = ("model", "hidden", "layers", "tokens", "mode", "pass", "impl")


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in ROW_KEY)


def result_stem(out_dir: str, gpu: str, date: str, smoke: bool = False) -> str:
    """``<out_dir>/<date>-<gpu>-models`` (``-models-smoke`` for a smoke run), the GPU name made file-safe."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in gpu)
    return os.path.join(out_dir, f"{date}-{safe}-models" + ("-smoke" if smoke else ""))


VERSION_KEYS = ("gpu", "torch", "triton", "transformers", "liger_kernel")


def previous_rows(stem: str, header: dict, fresh: bool) -> list[dict]:
    """Rows of an earlier run into the same file, unless ``fresh``; refuses other versions."""
    if fresh or not os.path.exists(stem + ".json"):
        return []
    with open(stem + ".json") as f:
        old = json.load(f)
    differ = [k for k in VERSION_KEYS if old.get(k) != header[k]]
    if differ:
        raise ValueError(f"{stem}.json holds a run with other {', '.join(differ)}: pass --fresh to replace it, "
                         "or --out for another folder")
    return old.get("rows", [])


def _without_missing_liger(sel: Selection, liger: str | None, device: torch.device) -> Selection:
    """``sel`` without liger where it cannot run: ``liger_kernel`` absent, or no GPU (Dynamo cannot
    trace its kernels through the Triton interpreter)."""
    if "liger" not in sel.impls or (liger and device.type == "cuda"):
        return sel
    why = "liger_kernel does not import here" if not liger else "liger_kernel runs on a GPU only"
    impls = tuple(i for i in sel.impls if i != "liger")
    if not impls:
        raise ValueError(f"impls: {why}, and liger is the only impl asked for")
    _log(f"{why}: no liger rows")
    return replace(sel, impls=impls)


def run(sel: Selection, out_dir: str, fresh: bool = False, compile_jobs: int = 0) -> str:
    """Measure ``sel``, writing the results after every row; returns the path stem of the files."""
    import transformers
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not sel.smoke:
        raise RuntimeError("the model benchmark needs a CUDA GPU; --smoke runs a tiny model on CPU")
    liger = liger_available()
    sel = _without_missing_liger(sel, liger, device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    header = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "liger_kernel": liger}
    date = datetime.date.today().isoformat()
    stem = result_stem(out_dir, gpu, date, sel.smoke)
    previous = previous_rows(stem, header, fresh)
    os.makedirs(out_dir, exist_ok=True)

    _log(f"{gpu}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
         f"liger_kernel {liger}; {sel.compiles()} compiles")
    install_rewrites()
    if compile_jobs > 0:
        warm_caches(sel, compile_jobs)
    from torch_rmsnorm_op.tools.benchmark import copy_ceiling

    copy_gbs = copy_ceiling(20, 5, str(device), numel=COPY_NUMEL if device.type == "cuda" else 1 << 22)
    _log(f"copy ceiling {copy_gbs:.0f} GB/s")
    timing = (f"Impls timed in turn, {sel.rounds} rounds. step_ms: median of CUDA-event step times; gpu_ms: "
              "device time per step from torch.profiler, the median round's."
              if device.type == "cuda" else
              "**Smoke run on CPU (kernels through the Triton interpreter): wall-clock times, not GPU timings.**")
    if sel.smoke and device.type == "cuda":
        timing = f"**Smoke run of a tiny model ({sel.backend}): not a model benchmark.** " + timing
    result = {**header, "date": date, "copy_GBs": round(copy_gbs, 1), "timing": timing, "tolerances": TOLERANCES,
              "selection": {**{k: v for k, v in sel.__dict__.items() if k != "tokens"},
                            "tokens": [f"{b}x{s}" for b, s in sel.tokens]},
              "rows": []}
    base = {"commit": _commit(), "run_started": datetime.datetime.now().isoformat(timespec="seconds"),
            "copy_GBs": round(copy_gbs, 1), "backend": sel.backend}
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        mine = {_key(r) for r in rows}
        result["rows"] = [r for r in previous if _key(r) not in mine] + rows
        write_results(result, stem)

    def emit_pass(spec: ModelSpec, batch: int, seq: int, mode: str, pass_: str, arms: list[Arm],
                  eager_out: Outputs, norm_count: int) -> None:
        label = f"{spec.family} {spec.hidden}x{spec.layers} {batch}x{seq} {mode} {pass_}"
        base_row = {"model": spec.family, "hidden": spec.hidden, "layers": spec.layers,
                    "intermediate": spec.intermediate, "heads": spec.heads, "kv_heads": spec.kv_heads,
                    "head_dim": spec.head_dim, "vocab": spec.vocab, "tokens": f"{batch}x{seq}", "mode": mode,
                    "pass": pass_, "norm_modules": norm_count, **base}
        rows_of: dict[str, dict] = {}
        ready: list[Arm] = []
        firsts: dict[str, Outputs] = {}
        for arm in arms:
            row = rows_of[arm.impl] = dict(base_row, impl=arm.impl, norm_modules_swapped=arm.swapped)
            _log(f"{label} {arm.impl}: compile")
            try:
                row["compile_s"], firsts[arm.impl] = warm_up(arm, pass_, sel, device)
                ready.append(arm)
            except Exception as e:  # a failing configuration is a result; the run goes on
                row["error"] = f"{type(e).__name__}: {e}"[:500]
        _log(f"{label}: {sel.rounds} rounds of {', '.join(a.impl for a in ready)}")
        try:
            measured = measure_arms(ready, pass_, sel, device) if ready else {}
        except Exception as e:
            for arm in ready:
                rows_of[arm.impl]["error"] = f"{type(e).__name__}: {e}"[:500]
            measured = {}
        stock = rows_of.get("stock") if "stock" in measured else None
        for arm in sorted(arms, key=lambda a: a.impl != "stock"):  # stock's errors first: judge reads them
            row = rows_of[arm.impl]
            if arm.impl in measured:
                row.update(measured[arm.impl])
                ref_name = "stock" if stock is not None and arm.impl != "stock" else "eager"
                ref = firsts["stock"] if ref_name == "stock" else eager_out
                row.update(reference=ref_name, **compare(firsts[arm.impl], ref))
                row["matches_reference"] = judge(row, stock if arm.impl != "stock" else None)
                _add_floor(row, spec, batch * seq, pass_, copy_gbs)
                if stock is not None and arm.impl != "stock":
                    row["gpu_ratio_library_at_stock"] = gpu_ratio_library_at_reference(row, stock)
                    row["step_ratio_paired"] = paired_step_ratio(row, stock)
                    row["step_ratio_alternating"] = alternating_step_ratio(row, stock)
            emit(row)
            _log(f"{label} {arm.impl}: " + _summary(row))

    for spec in sel.specs():
        _log(f"build {spec.family} hidden {spec.hidden} x {spec.layers} layers")
        model = build_model(spec, device)
        for batch, seq in sel.tokens:
            ids = torch.randint(0, spec.vocab, (batch, seq), device=device,
                                generator=torch.Generator(device=device).manual_seed(seq))
            eager = eager_reference(model, ids, sel.passes)
            for mode in sel.modes:
                _free(device)
                with contextlib.ExitStack() as stack:
                    arms = []
                    for impl in sel.impls:
                        # A model of its own per impl, so the impls can be timed in turn.
                        own = copy.deepcopy(model)
                        weights = [m.weight for m in norm_modules(own)]
                        swapped, step_context = stack.enter_context(implementation(own, impl))
                        steps = Steps(_compile(own, mode, sel.backend), own, ids, mode == "reduce-overhead", weights)
                        arms.append(Arm(impl, steps, step_context, swapped))
                    for pass_ in sel.passes:
                        emit_pass(spec, batch, seq, mode, pass_, arms, eager[pass_], len(norm_modules(model)))
                    del arms
                _free(device)
            del eager, ids
        del model
        _free(device)
    return write_results(result, stem)


def _add_floor(row: dict, spec: ModelSpec, tokens: int, pass_: str, copy_gbs: float) -> None:
    sites = sum(s.count for s in norm_sites(spec, tokens))
    if sites != row["norm_modules"]:  # the decoder is not laid out as norm_sites assumes
        row["norm_floor_note"] = f"{row['norm_modules']} RMSNorm modules, {sites} sites assumed: no floor"
        return
    norm_us = sum(k["us"] for k in row["norm_kernels"].values())
    row["norm_us"] = round(norm_us, 2)
    for suffix, with_adds, with_terms in (("", True, False), ("_without_adds", False, False),
                                          ("_with_grad_terms", True, True)):
        if suffix == "_with_grad_terms" and pass_ != "train":
            continue
        floor = norm_byte_floor(spec, tokens, pass_, 2, with_adds, with_terms)
        row["norm_floor_bytes" + suffix] = floor
        if norm_us and row.get("gpu_ms") is not None:
            row["norm_pct_of_copy" + suffix] = round(100 * floor / (norm_us * 1e-6) / 1e9 / copy_gbs, 1)
    _add_ours_floor(row, spec, tokens, pass_, copy_gbs)


def _add_ours_floor(row: dict, spec: ModelSpec, tokens: int, pass_: str, copy_gbs: float) -> None:
    ours = {name: k for name, k in row["norm_kernels"].items() if k.get("source") == "ours"}
    if not ours or row.get("gpu_ms") is None:
        return
    row["ours_us"] = round(sum(k["us"] for k in ours.values()), 2)
    forwards = sum(k["calls"] for name, k in ours.items() if name.startswith("_rms_norm_fwd"))
    _, sites = ours_byte_floor(spec, tokens, pass_)
    if forwards != sites:
        row["ours_floor_note"] = f"{forwards:g} forward launches a step, {sites} residual sites: no floor"
        return
    for suffix, with_terms in (("", False), ("_with_grad_terms", True)):
        if suffix and pass_ != "train":
            continue
        floor, _ = ours_byte_floor(spec, tokens, pass_, 2, with_terms)
        row["ours_floor_bytes" + suffix] = floor
        row["ours_pct_of_copy" + suffix] = round(100 * floor / (row["ours_us"] * 1e-6) / 1e9 / copy_gbs, 1)


def _summary(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"][:200]
    gpu = f", gpu {row['gpu_ms']:.3f} ms" if row.get("gpu_ms") is not None else ""
    return (f"step {row['step_ms']:.3f} ms{gpu}, norm {row.get('norm_us', 0):.1f} us, "
            f"compile {row['compile_s']:.1f} s, "
            f"{'matches' if row['matches_reference'] else 'DIFFERS FROM'} {row['reference']}")


def worker_commands(sel: Selection) -> list[tuple[list[str], str]]:
    """One ``bench-models --compile-only`` command line per compiled model of ``sel`` (model, tokens,
    mode, impl; all passes), with a label."""
    cmds = []
    for spec in sel.specs():
        for batch, seq in sel.tokens:
            for mode in sel.modes:
                for impl in sel.impls:
                    cmd = [sys.executable, "-m", "torch_rmsnorm_op", "bench-models", "--compile-only",
                           "--models", spec.family, "--layers", str(spec.layers), "--tokens", f"{batch}x{seq}",
                           "--modes", mode, "--impls", impl, "--passes", ",".join(sel.passes),
                           "--backend", sel.backend]
                    cmd += ["--smoke"] if sel.smoke else ["--hidden", str(spec.hidden)]
                    cmds.append((cmd, f"{spec.family} {spec.hidden} {batch}x{seq} {mode} {impl}"))
    return cmds


def warm_caches(sel: Selection, jobs: int) -> None:
    """Compile every compiled model of ``sel`` in ``jobs`` parallel worker processes
    (``worker_commands``), filling Inductor's and Triton's on-disk caches; the timing that follows
    loads the graphs from there. A worker that fails costs only its speed-up: the timing process
    then compiles that model itself.

    The workers share the GPU, so the configurations Inductor's autotuner picks there are picked
    under each other's load; the ones they record (``*.best_config``) are removed afterwards, and
    the timing process autotunes every kernel again on an idle GPU. Stock's and the patched
    model's copies of one kernel carry different names, so they are tuned apart. Every worker
    installs the library's Inductor passes before compiling (``install_rewrites``), as the timing
    process has them, so that stock's graphs carry the timing process's cache key."""
    cmds = worker_commands(sel)
    _log(f"compiling {len(cmds)} models in {jobs} worker processes")
    started = time.time()

    def work(item: tuple[list[str], str]) -> None:
        cmd, label = item
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True)
        tail = "" if out.returncode == 0 else ": FAILED " + (out.stderr or out.stdout)[-300:]
        _log(f"compiled {label} in {time.monotonic() - t0:.0f} s{tail}")

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(work, cmds))
    removed = drop_best_configs(since=started)
    _log(f"removed {removed} autotuned configurations the workers recorded")


def drop_best_configs(since: float) -> int:
    """Remove the autotuned kernel configurations Inductor recorded in its cache directory at or
    after ``since`` (a ``time.time()`` value); return how many."""
    removed = 0
    for path in Path(inductor_cache_dir()).rglob("*.best_config"):
        try:
            if path.stat().st_mtime >= since:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def install_rewrites() -> None:
    """Install the library's Inductor passes (``install_inductor_passes``) before anything compiles.
    Patching a model installs them for the rest of the process, so in the timing process stock's
    graphs compile with them installed once a patched impl is set up; they change no graph
    without the library's ops, but they are part of Inductor's cache key. Every process of a run
    installs them first, so that a stock graph compiled in a cache-warming worker is the one the
    timing process finds in the cache."""
    T.install_inductor_passes()


def compile_only(sel: Selection) -> None:
    """Build and compile every configuration of ``sel`` (one step per pass) and time nothing."""
    install_rewrites()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sel = _without_missing_liger(sel, liger_available(), device)
    for spec in sel.specs():
        model = build_model(spec, device)
        weights = [m.weight for m in norm_modules(model)]
        for batch, seq in sel.tokens:
            ids = torch.randint(0, spec.vocab, (batch, seq), device=device)
            for mode in sel.modes:
                for impl in sel.impls:
                    with implementation(model, impl) as (_, step_context), step_context():
                        _free(device)
                        steps = Steps(_compile(model, mode, sel.backend), model, ids, mode == "reduce-overhead",
                                      weights)
                        for pass_ in sel.passes:
                            t0 = time.perf_counter()
                            steps.first(pass_)
                            _sync(device)
                            _log(f"{spec.family} {spec.hidden} {batch}x{seq} {mode} {impl} {pass_}: "
                                 f"compiled in {time.perf_counter() - t0:.1f} s")
                        del steps
                    _free(device)
        del model
        _free(device)


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _ratio(a, b) -> str:
    return "–" if a is None or b is None or not b else f"{a / b:.3f}"


def markdown(result: dict) -> str:
    """The results as Markdown: per configuration, stock vs patched vs liger side by side."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in result["rows"])]
    others = [i for i in impls if i != "stock"]
    lines = [
        f"# Models: {' vs '.join({'liger': 'Liger'}.get(i, i) for i in impls)} on {result['gpu']}", "",
        f"torch {result['torch']}, Triton {result['triton']}, transformers {result['transformers']}, "
        f"liger_kernel {result['liger_kernel']}, {result['date']}. {result['timing']} Copy ceiling "
        f"**{result['copy_GBs']:.0f} GB/s**. GPU time with library kernels at stock's: the GPU-time ratio with "
        "the library kernels both launch alike (matmuls, attention) counted at stock's time, which takes out the "
        "GPU clock's drift between rounds (gpu_ratio_library_at_reference). "
        "Norm % = the step's RMSNorm byte floor (residual adds included) "
        "/ norm kernel time / copy ceiling. ✓ = loss and norm-weight gradients (train) or logits (infer): "
        "stock within the declared tolerances of eager ("
        + ", ".join(f"{k} {v:g}" for k, v in result["tolerances"].items())
        + "), the others within them of stock or within twice stock's own distance from eager.",
        "",
    ]
    head = ["model", "hidden×layers", "tokens", "mode", "pass"]
    head += [f"{i} ms" for i in impls] + [f"{i}/stock" for i in others]
    head += [f"{i}/stock paired rounds" for i in others]
    head += [f"{i}/stock alternating steps" for i in others]
    head += [f"{i} GPU ms" for i in impls] + [f"{i}/stock GPU" for i in others]
    head += [f"{i}/stock GPU, library kernels at stock's" for i in others]
    head += [f"{i} norm µs (%)" for i in impls] + ["ok"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed = {_key(r): r for r in result["rows"]}
    seen = []
    for r in result["rows"]:
        k = _key(r)[:-1]
        if k in seen:
            continue
        seen.append(k)
        cell = {i: keyed.get(k + (i,), {}) for i in impls}

        def get(impl, field, cell=cell):
            return cell[impl].get(field)

        row = [r["model"], f"{r['hidden']}×{r['layers']}", r["tokens"], r["mode"], r["pass"]]
        row += [_fmt(get(i, "step_ms"), ".3f") if "error" not in cell[i] else "error" for i in impls]
        row += [_ratio(get(i, "step_ms"), get("stock", "step_ms")) for i in others]
        row += [_fmt(get(i, "step_ratio_paired"), ".3f") for i in others]
        row += [_fmt(get(i, "step_ratio_alternating"), ".3f") for i in others]
        row += [_fmt(get(i, "gpu_ms"), ".3f") for i in impls]
        row += [_ratio(get(i, "gpu_ms"), get("stock", "gpu_ms")) for i in others]
        row += [_fmt(get(i, "gpu_ratio_library_at_stock"), ".3f") for i in others]
        row += [f"{_fmt(get(i, 'norm_us'), '.1f')} ({_fmt(get(i, 'norm_pct_of_copy'), '.0f')})" for i in impls]
        row += [" ".join(("✓" if cell[i].get("matches_reference") else "✗") for i in impls if cell[i])]
        lines.append("| " + " | ".join(row) + " |")
    errors = [r for r in result["rows"] if "error" in r]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {' '.join(str(v) for v in _key(r))}: `{r['error'][:300]}`" for r in errors]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
    """Bar chart of patched/stock and liger/stock, step time and GPU time, per configuration;
    False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keyed = {_key(r): r for r in result["rows"]}
    configs = []
    for r in result["rows"]:
        if _key(r)[:-1] not in configs:
            configs.append(_key(r)[:-1])
    others = [i for i in IMPLS[1:] if any(r["impl"] == i for r in result["rows"])]
    fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.32 * max(1, len(configs))), sharey=True)
    labels = [f"{m} {h}×{lay} {t} {mode} {p}" for m, h, lay, t, mode, p in configs]
    height = 0.8 / max(1, len(others))
    for ax, field, title in zip(axes, ("step_ms", "gpu_ms"), ("step time", "GPU time")):
        for j, impl in enumerate(others):
            vals = []
            for c in configs:
                a, b = keyed.get(c + (impl,), {}).get(field), keyed.get(c + ("stock",), {}).get(field)
                vals.append(a / b if a and b else float("nan"))
            bars = ax.barh([i + j * height for i in range(len(configs))], vals, height=height, label=f"{impl} / stock")
            ax.bar_label(bars, fmt="%.3f", fontsize=6, padding=2)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{title}: ratio to stock compile (< 1 is faster)")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks([i + height * (len(others) - 1) / 2 for i in range(len(configs))], labels, fontsize=7)
    axes[0].invert_yaxis()
    if others:
        axes[0].legend(fontsize=8)
    smoke = "" if result["gpu"] != "cpu-interpreter" else " — CPU smoke run: wall times, not GPU timings"
    fig.suptitle(f"Models on {result['gpu']} (torch {result['torch']}, Triton {result['triton']}, "
                 f"transformers {result['transformers']}, {result['date']}){smoke}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": result["timing"]})
    plt.close(fig)
    return True


def rederive(path: str) -> str:
    """Recompute ``gpu_ratio_library_at_stock``, and ``step_ratio_paired`` and
    ``step_ratio_alternating`` where the rows hold their rounds and alternating steps, for the
    rows of the results file ``path`` (each against the stock row of its configuration from the
    same run), and the library kernels' floor (``ours_*``) from each
    row's ``norm_kernels``; write its .json, .md and .png again; returns the stem. For files
    written before the fields existed."""
    if not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"--rederive: {path!r} is not a results file (<date>-<gpu>-models.json)")
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise ValueError(f"--rederive: {path!r} holds no model benchmark rows")
    keyed = {_key(r): r for r in result["rows"]}
    for row in result["rows"]:
        stock = keyed.get(_key(row)[:-1] + ("stock",))
        if row["impl"] != "stock" and stock and stock.get("run_started") == row.get("run_started"):
            row["gpu_ratio_library_at_stock"] = gpu_ratio_library_at_reference(row, stock)
            paired = paired_step_ratio(row, stock)
            if paired is not None:
                row["step_ratio_paired"] = paired
            alternating = alternating_step_ratio(row, stock)
            if alternating is not None:
                row["step_ratio_alternating"] = alternating
        if "norm_kernels" in row and result.get("copy_GBs"):
            spec = ModelSpec(row["model"], row["hidden"], row["layers"], row["intermediate"], row["heads"],
                             row["kv_heads"], row["head_dim"], row["vocab"])
            batch, seq = (int(v) for v in row["tokens"].split("x"))
            _add_ours_floor(row, spec, batch * seq, row["pass"], result["copy_GBs"])
    return write_results(result, path.removesuffix(".json"))


def write_results(result: dict, stem: str) -> str:
    """``stem``.json, .md and .png from ``result``; returns ``stem``."""
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    if not plot(result, stem + ".png"):
        print("matplotlib missing: no PNG", file=sys.stderr)
    return stem
