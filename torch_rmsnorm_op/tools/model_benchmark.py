"""Model benchmark: any transformers causal LM, eager or compiled: stock, patched with our ops, and Liger's.

Models. ``--models`` takes transformers model types (a config's ``model_type``: ``llama``,
``qwen3``, ``gemma2``, ``qwen3_moe``, ``nemotron_h``, ...; ``DEFAULT_MODELS`` unless told). Each
is the type's causal-LM class (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, built with
``AutoModelForCausalLM.from_config``; no downloads) on its config class's defaults shrunk to one
size (``SIZES``: hidden, layers, MLP width, heads, kv heads, head_dim; vocabulary 32000) by
``tools.hf_configs.shrink_config`` from the config's own attributes (``ModelSpec.attributes``):
mixtures of experts capped at ``MOE_EXPERTS`` experts, ``MOE_TOP_K`` per token, each as wide as
the size's dense MLP; latent attention's q and kv ranks 3/4 and 1/4 of hidden; linear
attention's heads as the size's (value heads twice as many); Mamba mixers of heads of
``MAMBA_HEAD_DIM`` over twice hidden; per-layer kind lists cut to the layer count; a multimodal
model's text config at the size and its other configs tiny (token ids alone do not reach them).
bf16, ``attn_implementation="sdpa"`` (``"eager"`` for a class without it: the row's
``attention``), no KV cache, untied embeddings, random weights (RMSNorm weights drawn from U(0.5,
1.5)), random token ids. A type that is not one, or has no causal-LM class, and a shrunk config
that does not build or run, give a row with a one-line ``error`` and the run goes on. No table
here names a family: what is reported is derived from the built model.

One configuration is (model, hidden, layers, tokens, mode, float8, pass, impl):

- ``impl``: ``stock`` is the model as built; ``patched`` is
  ``torch_rmsnorm_op.patch_rmsnorm(model)`` (which installs what compiling it needs), run under
  the ``"error"`` fallback policy (a norm the kernels do not serve fails the row instead of
  timing the reference); ``liger`` swaps each RMSNorm module of this model instance for
  ``liger_kernel``'s ``LigerRMSNorm`` holding the same weight Parameter (no global class is
  touched; ``liger_plan``). Liger runs only where ``liger_kernel`` imports and on a GPU (its
  kernels do not run through the Triton interpreter), and only for a model whose every RMSNorm
  ``LigerRMSNorm`` can express (not a gated norm, nor semantics other than Llama's, Gemma's
  ``1 + weight`` and ``F.rms_norm``'s): else a row with ``skipped`` says why. Each impl runs on
  its own deep copy of one model (the same weights), so all of a configuration's impls are set
  up and alive together and are timed in turn (below).
- ``mode``: ``eager`` runs the models uncompiled (nothing is compiled in an eager-only run);
  ``default`` and ``reduce-overhead`` are ``torch.compile``'s modes (``reduce-overhead``: CUDA
  graphs; each step then begins with ``torch.compiler.cudagraph_mark_step_begin()``).
- ``float8`` (null, or a recipe of ``FLOAT8_RECIPES``): torchao's
  ``convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
  module_filter_fn=float8_filter(model))`` on every ``nn.Linear`` but the LM head
  (``get_output_embeddings()``) and those whose dims are not multiples of 16, before the impl is
  set up (the row's ``float8_linears``: how many); the same for every impl, and for the eager
  reference. It needs torchao (``pip install 'torch_rmsnorm_op[float8]'``) and, on a GPU, compute
  capability 8.9 or later: a run asked for float8 without them stops with that said before it
  measures anything.
- ``pass``: ``train`` is a forward with ``labels`` (the model's own loss) and
  ``loss.backward()``, the parameters' grads set to None before each step (outside the timed
  span); ``infer`` is a forward under ``torch.no_grad()``. One compiled model serves both passes
  (Dynamo compiles a graph for each grad mode); ``torch.compiler.reset()`` runs between
  configurations (model, tokens, float8, mode).
- Interleaving: a pass is measured in ``rounds`` rounds; in each round every impl times
  ``steps`` steps and profiles ``profile_steps``, the impls taken in turn (in reverse order
  every other round). Measured one after the other in one process, the same GEMM and attention
  kernels run slower in the second impl's steps, by as much as the differences this benchmark
  exists to measure.

What each number is:

- ``step_ms``: median over all rounds' timed steps (``steps`` in the row: their count) of the
  time between two CUDA events recorded on the stream around each step, after ``warmup`` steps
  (the first of which compiles). It includes the host time of a step where the GPU waits for
  the host (small token counts). In a ``--smoke`` run on CPU it is wall time through the Triton
  interpreter: **not a GPU timing**. ``step_ms_rounds``: the median step of each round.
- ``step_ratio_paired`` (rows other than stock's): the median over rounds of the row's round
  median over stock's in the same round (``paired_step_ratio``). Where the step waits on the
  host (1×16 tokens in default mode) one impl's steps spread over 2× within a run and its
  median moves between runs by more than the impls differ, while the impls of one round run
  next to each other: this ratio is the step comparison to read there.
- ``step_ms_alternating``: after each round's windows, ``steps`` more steps of every impl, one
  step of each in turn (stock, patched, stock, patched, ..., in the round's order), with nothing
  synchronized between them; each step's time as ``step_ms`` times it.
  ``step_ratio_alternating`` (rows other than stock's): the median over those turns of the
  row's step over stock's step of the same turn (``alternating_step_ratio``). The host's state
  moves a host-bound step's time from one window to the next (up to 2× within one run at 1×16
  tokens); two steps a few milliseconds apart share it.
- ``step_peak_extra_GiB``: ``torch.cuda.max_memory_allocated`` over the impl's timed and
  profiled steps, above what was allocated before them (the step's activations and gradients;
  null on CPU). A CUDA graph replayed under ``reduce-overhead`` allocates nothing (its memory is
  the graph pool's, taken when it was recorded during the warm-up): there the field counts only
  what the step allocates outside the graphs.
- ``gpu_ms``: GPU time per step: the sum of the device durations of every kernel, memset and
  memcpy over a ``torch.profiler`` window, divided by its steps; idle gaps are not counted. The
  median of the rounds' windows; ``gpu_ms_rounds`` lists each round's.
- ``gpu_ratio_library_at_stock`` (rows other than stock's): ``gpu_ms`` over stock's with the
  library kernels (cuBLAS, cuDNN, CUTLASS, aten) that both launch alike counted at stock's time
  in both (``gpu_ratio_library_at_reference``): the matmuls and attention are most of a step
  and move with the GPU's clock between rounds by as much as the differences measured, while
  the impls launch them alike. Both sides are the mean of the rounds' windows.
- ``kernels``: every device kernel, ``{"us", "calls"}`` per step averaged over the rounds'
  windows (names cut at ``KERNEL_NAME_CHARS``); ``top_kernels`` the costliest of them.
- ``norm_kernels``: the norm-related device kernels by name, averaged over the rounds' windows,
  ``{"us": time per step, "calls": launches per step, "source": ...}``: ours and Liger's by
  their Triton names (``_rms_norm*``; Liger's ``_rms_norm_forward_kernel`` /
  ``_rms_norm_backward_kernel`` and their ``_block_`` variants), Inductor's as the fused kernels
  whose names hold ``rsqrt`` or ``pow`` (the marker list of ``trace_summary.NORM_MARKERS``).
  Inductor fuses neighbours into them (residual adds, casts, the embedding, RoPE after q/k
  norms): their whole time counts as the norm's. Not counted: memsets, and weight gradients
  reduced by kernels that hold neither marker (Liger's ``dW`` sum, Inductor's ``..._mul_sum``
  reductions where the scheduler splits them off, aten ``reduce_kernel`` sums). In eager mode
  stock's norms run as aten kernels without those markers: ``norm_kernels`` holds ours and
  Liger's there. ``norm_us`` is their sum.
- ``norm_calls``: every RMSNorm call of one forward of the stock eager model on the row's
  tokens, as forward hooks on its RMSNorm modules saw them (``probe_norm_calls``), grouped:
  ``{"name"`` (the module's path, layer indices as ``*``), ``"rows"``, ``"cols"``, ``"bytes"``
  (the input's element size), ``"residual"`` (its input is the sum a same-shaped add just
  formed: a residual add feeds it), ``"gated"`` (it also reads a gate), ``"count"}``.
  ``norm_floor_bytes``: the least bytes those calls must move in one step (``norm_byte_floor``),
  counting the residual add as part of the norm where one feeds it: forward plain x→y
  ``2·M·N·e``, forward with the residual (read x and the residual, write y and the sum)
  ``4·M·N·e``; backward plain (read dy and x, write dx) ``3·M·N·e``, backward with the residual
  (read dy, the sum and the gradient arriving at the sum, write dx) ``4·M·N·e``; a gated call
  also reads the gate (and in the backward writes its gradient). Weights, rstd and dweight are
  not counted. ``norm_floor_bytes_without_adds`` counts every call as plain.
  ``norm_pct_of_copy`` (and ``..._without_adds``) is that floor over ``norm_us`` over the copy
  ceiling ``copy_GBs`` (a 2 GiB bf16 device-to-device copy, read + write counted, measured in
  the same run as ``tools/benchmark.py`` does): the first is meaningful for kernels that do the
  residual add, the second for kernels that only normalize.
- ``ours_us``, ``ours_floor_bytes``, ``ours_pct_of_copy``: the same for the library's kernels
  alone (``source`` ``"ours"``) against the floor of the residual calls they serve
  (``ours_byte_floor``), where their forward launches a step are as many as those calls (else
  ``ours_floor_note`` says why there is no figure).
- Correctness against the reference: ``reference`` is ``stock`` (the stock model in the same
  mode and float8 recipe) for the other impls, ``eager`` (the uncompiled stock model, converted
  to the same float8 recipe) for stock itself. Train rows: ``loss``, ``loss_abs_err``,
  ``loss_rel_err`` and ``grad_rel_l2_err`` (over all RMSNorm weights' gradients); infer rows:
  ``logits_max_abs_err``, ``logits_max_rel_err`` (max abs error over the reference's max
  ``|logit|``) and ``logits_rel_l2_err``, taken from the first (compiling) step.
  ``matches_reference``: stock within ``TOLERANCES`` of eager; another impl within
  ``TOLERANCES`` of stock, or within twice stock's own distance from eager (``judge``: the two
  compiled models are as far apart as compiling moves a model at all). In a mixture of experts
  a rounding that moves one router logit can send a token to another expert, so compiling alone
  moves bf16 logits and gradients past those tolerances (stock against eager on the H200, 4x2048
  tokens: logits 0.11-0.18, gradients 0.16-0.22 relative L2); there stock's row is marked as
  differing and the patched row is held to stock's own distance. ``profiling/router_flips.py``
  measures how far one changed choice moves the model.

Also in each row: the model's class and shape (``intermediate``, ``heads``, ``kv_heads``,
``head_dim``, ``vocab``), ``norm_modules`` (RMSNorm modules in the model) and
``norm_modules_swapped`` (by the impl), ``compile_s`` (the pass's first step, compiling
included where the mode compiles), ``step_ms_min`` / ``step_ms_max``, ``commit``,
``run_started`` and ``backend`` (null in eager mode); ``error`` instead of the measurements
where the configuration failed.

Output: ``<out>/<date>-<gpu>-models.json`` (``--out``; default ``runs/bench-models``, which git
ignores: results are committed only where a run is pointed at a folder for them) with ``gpu``,
``torch``, ``triton``, ``transformers``, ``liger_kernel``, ``torchao``, ``date``,
``static_launch``, ``copy_GBs``, ``timing``, ``tolerances``, ``selections`` (of the latest run),
``notes``, ``unfinished`` and ``rows``, a Markdown table (``.md``) and a PNG chart (``.png``)
beside it, all rewritten after every row: a run stopped part-way keeps every row it finished.
Every row holds the ``ROW_KEY`` fields and ``MEASURED_FIELDS`` (null where it measured nothing).
A run merges into the file of its date and GPU: rows of configurations it does not measure are
kept (each row carries its run's ``commit``, ``run_started`` and ``copy_GBs``), so a matrix can
be measured in several runs. One run may also measure several selections one after the other
(``run``'s list; ``bench-models ... --and ...``): a matrix that is not one cross product (float8
rows for some models, Liger in eager mode only) in one command.

Inductor's static launch: a run sets ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1``
for its own process when it starts (``use_static_launch``; a value already in the environment
stands), so that Inductor launches user-defined Triton kernels (ours, Liger's) through its static
launcher in every impl alike: its compile worker processes read the variable when they start,
which may be before anything is patched. The header's ``static_launch`` records the value.

How long a run takes: on the H200 (torch 2.11, Triton 3.6, caches cold) a training graph of
these models compiles in 13–26 s and an inference graph in 5–14 s, so a compiled model costs
about 35 s with its timing; ``--plan`` prints a run's compile count. ``--compile-jobs N``
fills Inductor's on-disk caches from ``N`` parallel worker processes before the serial timing
(the timing process then loads compiled graphs from the cache); ``--rounds``, ``--steps``,
``--warmup`` and ``--profile-steps`` trade precision for time; ``--stop-after S`` starts no new
configuration once ``S`` seconds have passed (the JSON's ``unfinished`` lists what was left).
An eager configuration compiles nothing and costs its steps alone. A matrix of nine types in
default mode, float8 rows for three of them, and every type eager with Liger, as one command
(96 compiles; ``--plan`` says so before anything runs)::

    python -m torch_rmsnorm_op bench-models \\
        --models llama,qwen3,mistral,qwen2,phi3,gemma3_text,glm4,qwen3_moe,nemotron_h --hidden 2048 \\
        --tokens 4x2048,1x16 --modes default --impls stock,patched --compile-jobs 12 --rounds 2 --steps 5 \\
        --stop-after 540 --and --models llama,qwen3,mistral --float8 rowwise \\
        --and --modes eager --impls stock,patched,liger
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import gc
import importlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from torch_rmsnorm_op._torch_compat import inductor_cache_dir
from torch_rmsnorm_op.recognize import EPS_ATTRIBUTES, recognize
from torch_rmsnorm_op.tools.hf_configs import TINY, at_most, shrink_config

DEFAULT_MODELS = ("llama", "qwen3", "mistral")
SMOKE_MODELS = ("llama",)
VOCAB = 32000
MAX_POSITIONS = 4096  # the longest sequence a run takes
# Mixtures of experts: every MoE layer has at most MOE_EXPERTS experts, at most MOE_TOP_K of them
# per token and at most SHARED_EXPERTS shared ones, each as wide as the size's dense MLP, so a
# token's MLP work is MOE_TOP_K dense MLPs'.
MOE_EXPERTS = 8
MOE_TOP_K = 2
SHARED_EXPERTS = 1
# Mamba mixers: heads of MAMBA_HEAD_DIM over MAMBA_EXPAND x hidden (Mamba 2's), at most
# MAMBA_GROUPS groups, a state of at most the size's ssm_state.
MAMBA_HEAD_DIM = 64
MAMBA_EXPAND = 2
MAMBA_GROUPS = 8
MODES = ("eager", "default", "reduce-overhead")
COMPILED_MODES = ("default", "reduce-overhead")
DEFAULT_MODES = COMPILED_MODES
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
FLOAT8_MIN_CAPABILITY = (8, 9)
PASSES = ("train", "infer")
IMPLS = ("stock", "patched", "liger")
DEFAULT_TOKENS = ((4, 2048), (1, 16))
SMOKE_TOKENS = ((1, 8),)
DEFAULT_OUT = os.path.join("runs", "bench-models")
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


@dataclass(frozen=True)
class Size:
    """The layer shape of one hidden size: the same for every model type, so rows compare across types."""

    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    ssm_state: int = 128  # the most a Mamba mixer's state holds (Mamba 2's and Nemotron-H's 128)


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
SMOKE_SIZE = Size(layers=2, intermediate=176, heads=4, kv_heads=2, head_dim=16, ssm_state=16)
SMOKE_VOCAB = 256

# Declared before any comparison. bf16 through a whole model: every implementation rounds
# differently at each norm (and Inductor fuses differently), and the difference grows with
# depth; a wrong norm (a missing weight, a wrong eps or mean) is off by far more. The logits'
# bound sits just above what compiling alone moves 4 layers of random bf16 weights by (stock
# compiled against eager).
TOLERANCES: dict[str, float] = {
    "loss_rel": 5e-3,  # |loss - ref| / |ref|; the loss is computed in fp32 from bf16 logits
    "grad_rel_l2": 5e-2,  # ||g - g_ref|| / ||g_ref|| over all RMSNorm weights' gradients
    "logits_rel_l2": 3e-2,  # ||l - l_ref|| / ||l_ref||
}

COPY_NUMEL = 1 << 30  # 2 GiB of bf16, as tools/benchmark.py
KERNEL_NAME_CHARS = 120  # top_kernels keys (GEMM template names run long); norm kernels keep full names
TOP_KERNELS = 12
ERROR_CHARS = 500
# In every row (with the ROW_KEY fields), null where the row measured nothing (an error, a skipped impl).
MEASURED_FIELDS = ("step_ms", "gpu_ms", "step_peak_extra_GiB")


class ModelTypeError(ValueError):
    """A model type the installed transformers does not know, or knows without a causal-LM class."""


class ModelBuildError(RuntimeError):
    """A model type whose config, shrunk to the chosen size, does not build or does not run."""


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def causal_lm_class_name(model: str) -> str:
    """The name of transformers' causal-LM class for the model type ``model``
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``); a ``ModelTypeError`` naming the type and the
    installed release where it is not a model type, has no causal-LM class, or its class does
    not import here."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    release = f"transformers {transformers.__version__}"
    if model not in CONFIG_MAPPING:
        raise ModelTypeError(f"model {model!r} is not a model type of {release} (a config's model_type, such as "
                             f"{', '.join(DEFAULT_MODELS)})")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model)
    if name is None:
        raise ModelTypeError(f"model {model!r} has no causal-LM class in {release} (no entry in "
                             "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES): the benchmark needs one")
    try:
        getattr(transformers, name)
    except Exception as e:  # a class whose module needs what is not installed
        raise ModelTypeError(f"model {model!r}: transformers.{name} does not import here: {_one_line(e)}") from None
    return name


@dataclass(frozen=True)
class ModelSpec:
    """One decoder: a transformers model type and the shape it is shrunk to."""

    model: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = VOCAB
    ssm_state: int = 128

    @classmethod
    def of(cls, model: str, hidden: int, layers: int | None = None, smoke: bool = False) -> ModelSpec:
        """The benchmark's shape for ``hidden`` (``SIZES``; ``smoke``: the tiny one), ``layers`` overriding."""
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a transformers model type (a non-empty string), got {model!r}")
        if smoke:
            size, vocab = SMOKE_SIZE, SMOKE_VOCAB
        elif hidden in SIZES:
            size, vocab = SIZES[hidden], VOCAB
        else:
            raise ValueError(f"hidden must be one of {sorted(SIZES)}, got {hidden}")
        return cls(model, SMOKE_HIDDEN if smoke else hidden, size.layers if layers is None else layers,
                   size.intermediate, size.heads, size.kv_heads, size.head_dim, vocab, size.ssm_state)

    def attributes(self) -> dict[str, Any]:
        """The config attributes this shape sets where a config has them (``shrink_config``'s
        ``sizes``): attention's, the MLP's, mixtures of experts', latent, linear attention's and
        Mamba's, by the names transformers' configs give them."""
        hidden, heads, hd, inter = self.hidden, self.heads, self.head_dim, self.intermediate
        inner = MAMBA_EXPAND * hidden
        mamba_heads = max(1, inner // MAMBA_HEAD_DIM)
        groups = at_most(min(MAMBA_GROUPS, mamba_heads))
        state = at_most(self.ssm_state)
        experts, top_k, shared = at_most(MOE_EXPERTS), at_most(MOE_TOP_K), at_most(SHARED_EXPERTS)

        def token(small: int) -> Callable[[Any], Any]:  # a special token's id, kept inside the vocabulary
            def within(value):
                if isinstance(value, int) and value >= self.vocab:
                    return small
                if isinstance(value, list):
                    return [v for v in value if v < self.vocab] or [small]
                return value
            return within

        return dict(
            hidden_size=hidden, d_model=hidden, intermediate_size=inter, d_ff=inter,
            num_hidden_layers=self.layers, num_layers=self.layers, num_attention_heads=heads,
            num_key_value_heads=self.kv_heads, head_dim=hd, d_kv=hd, vocab_size=self.vocab,
            max_position_embeddings=MAX_POSITIONS, n_positions=MAX_POSITIONS, use_cache=False,
            tie_word_embeddings=False, pad_token_id=token(0), bos_token_id=token(1), eos_token_id=token(2),
            # mixtures of experts
            num_experts=experts, num_local_experts=experts, n_routed_experts=experts, moe_num_experts=experts,
            num_experts_per_tok=top_k, num_experts_per_token=top_k, moe_k=top_k, n_shared_experts=shared,
            num_shared_experts=shared, moe_num_shared_experts=shared, moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter, moe_shared_expert_intermediate_size=inter,
            shared_intermediate_size=inter, n_group=1, topk_group=1, num_expert_group=1, first_k_dense_replace=1,
            # latent attention (a q rank of None: q is not low-rank in that model)
            q_lora_rank=lambda value: None if value is None else hidden * 3 // 4, kv_lora_rank=hidden // 4,
            qk_nope_head_dim=hd, qk_rope_head_dim=hd // 2, v_head_dim=hd, index_n_heads=heads, index_head_dim=hd,
            # linear attention
            linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=hd,
            linear_value_head_dim=hd, linear_num_heads=heads, linear_head_dim=hd,
            # Mamba
            expand=MAMBA_EXPAND, mamba_expand=MAMBA_EXPAND, mamba_num_heads=mamba_heads, mamba_n_heads=mamba_heads,
            n_mamba_heads=mamba_heads, mamba_head_dim=MAMBA_HEAD_DIM, mamba_d_head=MAMBA_HEAD_DIM,
            mamba_headdim=MAMBA_HEAD_DIM, mamba_d_ssm=inner, n_groups=groups, mamba_n_groups=groups,
            mamba_ngroups=groups, ssm_state_size=state, mamba_d_state=state, state_size=state,
            mamba_dt_rank=max(1, hidden // 16), time_step_rank=max(1, hidden // 16),
        )

    def config(self):
        """The model type's default config shrunk to this shape (``shrink_config``; configs it
        holds other than the text decoder's at ``hf_configs.TINY``)."""
        from transformers import CONFIG_MAPPING

        causal_lm_class_name(self.model)
        return shrink_config(CONFIG_MAPPING[self.model](), self.attributes(), others=TINY)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """``spec``'s causal LM on ``device`` in ``dtype``: transformers' initialization, then every
    RMSNorm weight drawn from U(0.5, 1.5) (so the weight's multiply is exercised). SDPA
    attention where the class has it, else its eager attention. Raises ``ModelTypeError``
    (``causal_lm_class_name``) or a one-line ``ModelBuildError``."""
    from transformers import AutoModelForCausalLM

    name = causal_lm_class_name(spec.model)
    try:
        config = spec.config()
        torch.manual_seed(seed)
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            except ValueError as e:  # a class without SDPA attention says so by the function's name
                if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e):
                    raise
                model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001 (any failure of the type's own config or model code)
        raise ModelBuildError(f"model {spec.model!r} ({name}) does not build from its config shrunk to hidden "
                              f"{spec.hidden} x {spec.layers} layers: {_one_line(e)}") from None
    model.to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for m in norm_modules(model):
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen, device=device) + 0.5)
    return model


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation ``model`` was built with (``"sdpa"`` or ``"eager"``)."""
    return getattr(model.config, "_attn_implementation", None)


@dataclass(frozen=True)
class NormCall:
    """``count`` RMSNorm calls of one forward normalizing ``rows`` x ``cols`` elements of
    ``bytes`` each; ``residual``: a residual add formed the input just before; ``gated``: the
    call also reads a gate of the input's shape. ``name``: the module's path, layer indices as ``*``."""

    name: str
    rows: int
    cols: int
    bytes: int
    residual: bool
    gated: bool = False
    count: int = 1


# The functions a residual add runs through ``__torch_function__``: ``a + b``, ``a += b``, ``torch.add``.
_ADDS = frozenset({torch.add, Tensor.add, Tensor.add_, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__})


class _SumsMode(TorchFunctionMode):
    """Records every tensor an add of two tensors of its shape returns (weakly: an id is looked
    up only while its tensor is alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ADDS and isinstance(out, Tensor):
            operands = [a for a in args[:2] if isinstance(a, Tensor)]
            if len(operands) == 2 and all(a.shape == out.shape for a in operands):
                self.sums[id(out)] = out
        return out

    def formed(self, t: Tensor) -> bool:
        return self.sums.get(id(t)) is t


def probe_norm_calls(model: nn.Module, ids: Tensor) -> list[NormCall]:
    """Every RMSNorm call of one forward of ``model`` on ``ids`` (eval mode, no grad), grouped
    (``NormCall``), in the order first seen: forward hooks on its RMSNorm modules
    (``norm_modules``) read each call's input, and a torch function mode tells whether an add
    of two same-shaped tensors formed it (a residual sum)."""
    names = {m: name for name, m in model.named_modules()}
    sums = _SumsMode()
    seen: dict[tuple, int] = {}

    def hook(module, args, kwargs, output):
        inputs = [*args, *kwargs.values()]
        x = next((a for a in inputs if isinstance(a, Tensor)), None)
        if x is None or x.dim() == 0:
            return
        gated = any(isinstance(a, Tensor) and a is not x and a.shape == x.shape for a in inputs)
        key = (re.sub(r"\.\d+(?=\.|$)", ".*", names.get(module, type(module).__name__)), x.numel() // x.shape[-1],
               x.shape[-1], x.element_size(), sums.formed(x), gated)
        seen[key] = seen.get(key, 0) + 1

    hooks = [m.register_forward_hook(hook, with_kwargs=True) for m in norm_modules(model)]
    training = model.training
    try:
        model.eval()
        with torch.no_grad(), sums:
            model(input_ids=ids)
    finally:
        model.train(training)
        for h in hooks:
            h.remove()
    return [NormCall(*key, count=count) for key, count in seen.items()]


def norm_byte_floor(calls: Sequence[NormCall], pass_: str, with_adds: bool = True, residual_only: bool = False) -> int:
    """Least bytes the RMSNorm ``calls`` of one step move (``pass_``: ``"infer"`` forward,
    ``"train"`` forward and backward). Per call of M x N elements of ``e`` bytes: forward 2·M·N·e
    (read x, write y), or 4·M·N·e with the residual (read x and the residual, write y and the
    sum); backward 3·M·N·e (read dy and x, write dx), or 4·M·N·e with the residual (read dy, the
    sum and the sum's incoming gradient, write dx); a gated call also reads the gate (forward
    and backward) and writes its gradient. ``with_adds=False`` counts every call as plain;
    ``residual_only`` counts only the calls a residual add feeds."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    total = 0
    for call in calls:
        if residual_only and not call.residual:
            continue
        fused = with_adds and call.residual
        per_element = (4 if fused else 2) + ((4 if fused else 3) if pass_ == "train" else 0)
        if call.gated:
            per_element += 3 if pass_ == "train" else 1
        total += call.count * per_element * call.rows * call.cols * call.bytes
    return total


def ours_byte_floor(calls: Sequence[NormCall], pass_: str) -> tuple[int, int]:
    """``(bytes, calls)``: ``norm_byte_floor`` over the calls a residual add feeds alone (the
    ones ``rmsnorm::add_fwd`` / ``add_bwd`` serve in a patched decoder), and how many they are."""
    floor = norm_byte_floor(calls, pass_, residual_only=True)
    return floor, sum(c.count for c in calls if c.residual)


def norm_calls_json(calls: Sequence[NormCall]) -> list[dict]:
    """``calls`` as a row's ``norm_calls``."""
    return [dataclasses.asdict(c) for c in calls]


def norm_calls_of(row: dict) -> list[NormCall] | None:
    """A row's ``norm_calls`` back as ``NormCall``s (None for a row without them)."""
    calls = row.get("norm_calls")
    return None if calls is None else [NormCall(**c) for c in calls]


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
    return _version("liger_kernel")


def torchao_available() -> str | None:
    """torchao's version if its float8 training imports here, else None."""
    try:
        importlib.import_module("torchao.float8")
    except Exception:  # absent, or built for another torch
        return None
    return _version("torchao")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
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


# LigerRMSNorm's settings for what a norm computes (``recognize``'s semantics): Llama's casting in
# place for Llama's semantics; ``1 + weight`` with Gemma's casting (fp32 throughout), not in place,
# as Liger's Gemma patches; Gemma's casting without offset for the one-rounding form (F.rms_norm's,
# OLMo 2's, which Liger's own patch gives Llama's casting).
LIGER_SETTINGS: dict[str, dict] = {"llama": dict(offset=0.0, casting_mode="llama", in_place=True),
                                   "gemma": dict(offset=1.0, casting_mode="gemma", in_place=False),
                                   "torch": dict(offset=0.0, casting_mode="gemma", in_place=False)}


def liger_plan(model: nn.Module) -> tuple[list[tuple[nn.Module, str, nn.Module, float, dict]], list[str]]:
    """How ``LigerRMSNorm`` takes this model's RMSNorms: ``(swaps, kept)``, each swap ``(parent,
    attribute, module, eps, settings)`` (``LIGER_SETTINGS`` by what the module computes,
    ``recognize``), and a description of each RMSNorm module it cannot express (a gated norm,
    other semantics, no weight of one dim, an eps not found)."""
    swaps, kept, cache = [], [], {}
    decided: dict[int, tuple[float, dict] | None] = {}  # a module held by two parents is decided once
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if not (_is_hf_rmsnorm(child) or isinstance(child, nn.RMSNorm)):
                continue
            if id(child) not in decided:
                found = recognize(child, cache=cache)
                semantics = getattr(getattr(found, "semantics", None), "name", None)
                weight = getattr(child, "weight", None)
                if (found is None or found.eps is None or semantics not in LIGER_SETTINGS
                        or not isinstance(weight, nn.Parameter) or weight.dim() != 1):
                    why = "not recognized" if found is None else (semantics or type(found.semantics).__name__)
                    kept.append(f"{type(child).__name__} ({why})")
                    decided[id(child)] = None
                else:
                    decided[id(child)] = (float(found.eps), LIGER_SETTINGS[semantics])
            if decided[id(child)] is not None:
                swaps.append((parent, attr, child, *decided[id(child)]))
    return swaps, kept


def liger_refusal(model: nn.Module) -> str | None:
    """Why Liger's rows of this model are skipped: the RMSNorm modules ``LigerRMSNorm`` cannot
    express (``liger_plan``); None where it expresses every one."""
    _, kept = liger_plan(model)
    if not kept:
        return None
    kinds = sorted(set(kept))
    return (f"LigerRMSNorm cannot express {len(kept)} of {len(norm_modules(model))} RMSNorm modules "
            f"({', '.join(kinds)}): no liger rows")


@contextlib.contextmanager
def _liger_swapped(model: nn.Module) -> Iterator[int]:
    """Each RMSNorm of this model instance that ``liger_plan`` swaps replaced by a
    ``LigerRMSNorm`` holding the original weight Parameter (one for a module held in several
    places), put back after; yields how many modules. Modules it cannot express keep their own
    forward."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    swaps, _ = liger_plan(model)
    swapped, made = [], {}
    for parent, attr, child, eps, settings in swaps:
        if id(child) not in made:
            made[id(child)] = LigerRMSNorm(child.weight.shape[0], eps=eps, **settings)
            made[id(child)].weight = child.weight
            made[id(child)].train(child.training)
        setattr(parent, attr, made[id(child)])
        swapped.append((parent, attr, child))
    try:
        yield len(made)
    finally:
        for parent, attr, child in swapped:
            setattr(parent, attr, child)


def float8_unavailable(device: torch.device) -> str | None:
    """Why float8 rows cannot run here (torchao's float8 training does not import; a GPU below
    compute capability 8.9), or None."""
    try:
        importlib.import_module("torchao.float8")
    except Exception as e:  # absent, or built for another torch
        return (f"float8 needs torchao's float8 training (pip install 'torch_rmsnorm_op[float8]', or torchao), "
                f"which does not import here: {_one_line(e)}")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FLOAT8_MIN_CAPABILITY:
            return (f"float8 needs a GPU of compute capability {'.'.join(map(str, FLOAT8_MIN_CAPABILITY))} or "
                    f"later (float8 matmuls); {torch.cuda.get_device_name(device)} is "
                    f"{'.'.join(map(str, capability))}")
    return None


def float8_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn`` for ``model``: every ``nn.Linear`` but the LM head
    (``get_output_embeddings()``) and those whose in or out features are not multiples of 16
    (what float8 matmuls take)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None

    def convert(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and module is not head and module.in_features % 16 == 0
                and module.out_features % 16 == 0)

    return convert


def convert_float8(model: nn.Module, recipe: str) -> int:
    """Convert ``model`` in place with torchao's ``convert_to_float8_training`` for ``recipe``
    (``FLOAT8_RECIPES``) on the Linears ``float8_filter`` keeps; returns how many."""
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8 must be one of {FLOAT8_RECIPES}, got {recipe!r}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    keep = float8_filter(model)
    count = sum(keep(m, name) for name, m in model.named_modules())
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
    return count


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


def use_static_launch() -> str:
    """Set ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1`` in this process's
    environment unless it holds a value already; returns the value in force. Inductor reads it
    when its config is imported and when its compile worker processes start, so a run calls
    this first, before any model is built (building one imports Inductor's config)."""
    value = os.environ.setdefault(STATIC_LAUNCH_ENV, "1")
    if "torch._inductor.config" in sys.modules:
        _log(f"Inductor's config was imported before {STATIC_LAUNCH_ENV} was set: graphs compiled in this process "
             "keep its option as it was; compile workers started from now on read the variable")
    return value


def install_library_passes() -> None:
    """Install the library's Inductor passes before anything compiles, as patching a model does
    (``torch_rmsnorm_op.install_inductor_passes``). Patching installs them for the rest of the
    process, so in the timing process stock's graphs compile with them installed once a
    patched impl is set up; they change no graph without the library's ops, but they are part of
    Inductor's cache key. Every process of a run installs them first, so that a stock graph
    compiled in a cache-warming worker is the one the timing process finds in the cache."""
    import torch_rmsnorm_op as T

    T.install_inductor_passes()


@dataclass(frozen=True)
class Selection:
    """What one run measures, and how. ``float8``: ``None`` (no conversion) and/or recipes of
    ``FLOAT8_RECIPES``; ``stop_after``: seconds after which no new configuration starts."""

    models: tuple[str, ...] = DEFAULT_MODELS
    hiddens: tuple[int, ...] = DEFAULT_HIDDENS
    tokens: tuple[tuple[int, int], ...] = DEFAULT_TOKENS
    modes: tuple[str, ...] = DEFAULT_MODES
    float8: tuple[str | None, ...] = (None,)
    passes: tuple[str, ...] = PASSES
    impls: tuple[str, ...] = IMPLS
    layers: int | None = None
    steps: int = 10
    warmup: int = 5
    profile_steps: int = 3
    rounds: int = 4
    backend: str = "inductor"
    smoke: bool = False
    stop_after: float | None = None

    def __post_init__(self) -> None:
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ValueError(f"models must be a non-empty list of transformers model types, got {list(self.models)}")
        for name, values, allowed in (("modes", self.modes, MODES), ("passes", self.passes, PASSES),
                                      ("impls", self.impls, IMPLS), ("float8", self.float8, (None, *FLOAT8_RECIPES))):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                shown = tuple("none" if v is None else v for v in allowed)
                raise ValueError(f"{name} must be a non-empty list of {shown}, got {list(values)}")
        if not self.smoke:
            bad = [h for h in self.hiddens if h not in SIZES]
            if bad or not self.hiddens:
                raise ValueError(f"hidden must be a non-empty list of {tuple(SIZES)}, got {list(self.hiddens)}")
        if not self.tokens or any(b < 1 or s < 1 for b, s in self.tokens):
            raise ValueError(f"tokens must be a non-empty list of BATCHxSEQ with both >= 1, got {self.tokens}")
        if any(s > MAX_POSITIONS for _, s in self.tokens):
            raise ValueError(f"tokens: the sequence length must be at most {MAX_POSITIONS} (max_position_embeddings)")
        for name in ("steps", "warmup", "profile_steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.stop_after is not None and not self.stop_after > 0:
            raise ValueError(f"stop_after must be a positive number of seconds, got {self.stop_after}")
        if self.backend != "inductor" and "reduce-overhead" in self.modes:
            raise ValueError(f"mode 'reduce-overhead' needs the inductor backend (backend is {self.backend!r})")

    @property
    def compiled_modes(self) -> tuple[str, ...]:
        return tuple(m for m in self.modes if m != "eager")

    def specs(self) -> list[ModelSpec]:
        hiddens = (SMOKE_HIDDEN,) if self.smoke else self.hiddens
        return [ModelSpec.of(m, h, self.layers, self.smoke) for m in self.models for h in hiddens]

    def compiles(self) -> int:
        """How many graphs the run compiles (one per compiled configuration and pass; none in eager mode)."""
        return (len(self.specs()) * len(self.tokens) * len(self.compiled_modes) * len(self.float8)
                * len(self.impls) * len(self.passes))

    def plan(self) -> list[str]:
        """What the run measures, a line per model and size (its class and shape, or why it
        cannot be built), then the lists and the compile count."""
        lines = []
        for spec in self.specs():
            try:
                name = causal_lm_class_name(spec.model)
            except ModelTypeError as e:
                lines.append(f"{spec.model}: error: {e}")
                continue
            lines.append(f"{spec.model} ({name}): hidden {spec.hidden}, {spec.layers} layers, MLP "
                         f"{spec.intermediate}, {spec.heads} heads ({spec.kv_heads} kv) of {spec.head_dim}, "
                         f"vocab {spec.vocab}")
        lines.append(f"tokens {', '.join(f'{b}x{s}' for b, s in self.tokens)}; modes {', '.join(self.modes)}; "
                     f"float8 {', '.join(r or 'none' for r in self.float8)}; passes {', '.join(self.passes)}; impls "
                     f"{', '.join(self.impls)} (liger where liger_kernel imports, on a GPU): "
                     f"{self.compiles()} compiles")
        return lines


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
    """One impl of a configuration: its own copy of the model, compiled (or not: eager), and its steps."""

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
        row["step_peak_extra_GiB"] = round(peak[arm.impl] / 2**30, 3) if device.type == "cuda" else None
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
    """``model`` as ``mode`` runs it: itself in eager mode, else ``torch.compile``d."""
    if mode == "eager":
        return model
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


ROW_KEY = ("model", "hidden", "layers", "tokens", "mode", "float8", "pass", "impl")


def _key(row: dict) -> tuple:
    """A row's configuration (rows written before a field existed read it as None)."""
    return tuple(row.get(k) for k in ROW_KEY)


def result_stem(out_dir: str, gpu: str, date: str, smoke: bool = False) -> str:
    """``<out_dir>/<date>-<gpu>-models`` (``-models-smoke`` for a smoke run), the GPU name made file-safe."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in gpu)
    return os.path.join(out_dir, f"{date}-{safe}-models" + ("-smoke" if smoke else ""))


VERSION_KEYS = ("gpu", "torch", "triton", "transformers", "liger_kernel", "torchao")


def previous_rows(stem: str, header: dict, fresh: bool) -> list[dict]:
    """Rows of an earlier run into the same file, unless ``fresh``; refuses other versions."""
    if fresh or not os.path.exists(stem + ".json"):
        return []
    with open(stem + ".json") as f:
        old = json.load(f)
    differ = [k for k in VERSION_KEYS if old.get(k) != header.get(k)]
    if differ:
        raise ValueError(f"{stem}.json holds a run with other {', '.join(differ)}: pass --fresh to replace it, "
                         "or --out for another folder")
    return old.get("rows", [])


def _without_missing_liger(sel: Selection, liger: str | None, device: torch.device) -> tuple[Selection, str | None]:
    """``sel`` without liger where it cannot run: ``liger_kernel`` absent, or no GPU (its kernels
    do not run through the Triton interpreter, eager or traced by Dynamo); and why, or None."""
    if "liger" not in sel.impls or (liger and device.type == "cuda"):
        return sel, None
    why = "liger_kernel does not import here" if not liger else "liger_kernel runs on a GPU only"
    impls = tuple(i for i in sel.impls if i != "liger")
    if not impls:
        raise ValueError(f"impls: {why}, and liger is the only impl asked for")
    _log(f"{why}: no liger rows")
    return replace(sel, impls=impls), f"{why}: no liger rows"


def _check_float8(sel: Selection, device: torch.device) -> None:
    """Refuse a run asked for float8 rows that cannot run here, before it measures anything."""
    if any(r is not None for r in sel.float8):
        why = float8_unavailable(device)
        if why is not None:
            raise ValueError(f"--float8 {','.join(r or 'none' for r in sel.float8)}: {why}")


def _model_row(spec: ModelSpec, base: dict, **fields) -> dict:
    """A row about a model as a whole (an ``error`` or a ``skipped`` impl), its configuration
    fields null where it is not about one."""
    return {**{k: None for k in ROW_KEY}, "model": spec.model, "hidden": spec.hidden, "layers": spec.layers,
            **base, **fields}


def make_arms(base: nn.Module, ids: Tensor, mode: str, impls: Sequence[str], backend: str,
              stack: contextlib.ExitStack) -> list[Arm]:
    """One ``Arm`` per impl: a deep copy of ``base`` set up as the impl (undone when ``stack``
    closes) and compiled for ``mode`` (``_compile``)."""
    arms = []
    for impl in impls:
        own = copy.deepcopy(base)  # a model of its own per impl, so the impls can be timed in turn
        weights = [m.weight for m in norm_modules(own)]
        swapped, step_context = stack.enter_context(implementation(own, impl))
        steps = Steps(_compile(own, mode, backend), own, ids, mode == "reduce-overhead", weights)
        arms.append(Arm(impl, steps, step_context, swapped))
    return arms


def float8_model(model: nn.Module, recipe: str | None) -> tuple[nn.Module, int | None]:
    """``model`` itself for ``recipe`` None, else a deep copy converted (``convert_float8``) and
    the count of Linears converted."""
    if recipe is None:
        return model, None
    converted = copy.deepcopy(model)
    return converted, convert_float8(converted, recipe)


def _ids(spec: ModelSpec, batch: int, seq: int, device: torch.device) -> Tensor:
    return torch.randint(0, spec.vocab, (batch, seq), device=device,
                         generator=torch.Generator(device=device).manual_seed(seq))


def _selections(selections: Selection | Sequence[Selection]) -> list[Selection]:
    sels = [selections] if isinstance(selections, Selection) else list(selections)
    if not sels:
        raise ValueError("a run needs at least one selection")
    if any(s.smoke != sels[0].smoke for s in sels):
        raise ValueError("the selections of one run must all be smoke runs, or none")
    return sels


def _selection_json(sel: Selection) -> dict:
    return {**{k: v for k, v in sel.__dict__.items() if k not in ("tokens", "hiddens")},
            "hiddens": sorted({spec.hidden for spec in sel.specs()}), "tokens": [f"{b}x{s}" for b, s in sel.tokens]}


def run(selections: Selection | Sequence[Selection], out_dir: str = DEFAULT_OUT, fresh: bool = False,
        compile_jobs: int = 0) -> str:
    """Measure ``selections`` (one ``Selection``, or several measured one after the other into
    one file: a matrix that is not one cross product), writing the results after every row;
    returns the path stem of the files. ``stop_after`` counts from the run's start."""
    import transformers
    import triton

    started = time.monotonic()
    sels = _selections(selections)
    static_launch = use_static_launch()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not sels[0].smoke:
        raise RuntimeError("the model benchmark needs a CUDA GPU; --smoke runs a tiny model on CPU")
    for sel in sels:
        _check_float8(sel, device)
    liger = liger_available()
    notes: list[str] = []
    for i, sel in enumerate(sels):
        sels[i], note = _without_missing_liger(sel, liger, device)
        if note and note not in notes:
            notes.append(note)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    header = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "liger_kernel": liger, "torchao": torchao_available()}
    date = datetime.date.today().isoformat()
    stem = result_stem(out_dir, gpu, date, sels[0].smoke)
    previous = previous_rows(stem, header, fresh)
    os.makedirs(out_dir, exist_ok=True)

    _log(f"{gpu}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
         f"liger_kernel {liger}, torchao {header['torchao']}; {sum(s.compiles() for s in sels)} compiles")
    if any(s.compiled_modes for s in sels):
        install_library_passes()
        if compile_jobs > 0:
            stop_after = sels[0].stop_after
            warm_caches(sels, compile_jobs, deadline=None if stop_after is None else started + stop_after)
    from torch_rmsnorm_op.tools.benchmark import copy_ceiling

    copy_gbs = copy_ceiling(20, 5, str(device), numel=COPY_NUMEL if device.type == "cuda" else 1 << 22)
    _log(f"copy ceiling {copy_gbs:.0f} GB/s")
    rounds = "/".join(str(r) for r in sorted({s.rounds for s in sels}))
    timing = (f"Impls timed in turn, {rounds} rounds. step_ms: median of CUDA-event step times; gpu_ms: "
              "device time per step from torch.profiler, the median round's."
              if device.type == "cuda" else
              "**Smoke run on CPU (kernels through the Triton interpreter): wall-clock times, not GPU timings.**")
    if sels[0].smoke and device.type == "cuda":
        timing = f"**Smoke run of a tiny model ({sels[0].backend}): not a model benchmark.** " + timing
    result = {**header, "date": date, "static_launch": static_launch, "copy_GBs": round(copy_gbs, 1),
              "timing": timing, "tolerances": TOLERANCES, "selections": [_selection_json(s) for s in sels],
              "notes": notes, "unfinished": [], "rows": []}
    base = {"commit": _commit(), "run_started": datetime.datetime.now().isoformat(timespec="seconds"),
            "copy_GBs": round(copy_gbs, 1)}
    rows: list[dict] = []

    def emit(row: dict) -> None:
        for field in MEASURED_FIELDS:  # every row has them, null where nothing was measured
            row.setdefault(field, None)
        rows.append(row)
        mine = {_key(r) for r in rows}
        result["rows"] = [r for r in previous if _key(r) not in mine] + rows
        write_results(result, stem)

    def emit_pass(sel: Selection, base_row: dict, pass_: str, arms: list[Arm], eager_out: Outputs,
                  calls: list[NormCall]) -> None:
        label = (f"{base_row['model']} {base_row['hidden']}x{base_row['layers']} {base_row['tokens']} "
                 f"{base_row['mode']}{' float8 ' + base_row['float8'] if base_row['float8'] else ''} {pass_}")
        rows_of: dict[str, dict] = {}
        ready: list[Arm] = []
        firsts: dict[str, Outputs] = {}
        for arm in arms:
            row = rows_of[arm.impl] = dict(base_row, impl=arm.impl, norm_modules_swapped=arm.swapped, **{"pass": pass_})
            _log(f"{label} {arm.impl}: {'first step' if base_row['mode'] == 'eager' else 'compile'}")
            try:
                row["compile_s"], firsts[arm.impl] = warm_up(arm, pass_, sel, device)
                ready.append(arm)
            except Exception as e:  # a failing configuration is a result; the run goes on
                row["error"] = f"{type(e).__name__}: {e}"[:ERROR_CHARS]
        _log(f"{label}: {sel.rounds} rounds of {', '.join(a.impl for a in ready)}")
        try:
            measured = measure_arms(ready, pass_, sel, device) if ready else {}
        except Exception as e:
            for arm in ready:
                rows_of[arm.impl]["error"] = f"{type(e).__name__}: {e}"[:ERROR_CHARS]
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
                _add_floor(row, calls, pass_, copy_gbs)
                if stock is not None and arm.impl != "stock":
                    row["gpu_ratio_library_at_stock"] = gpu_ratio_library_at_reference(row, stock)
                    row["step_ratio_paired"] = paired_step_ratio(row, stock)
                    row["step_ratio_alternating"] = alternating_step_ratio(row, stock)
            emit(row)
            _log(f"{label} {arm.impl}: " + _summary(row))

    def over_budget(sel: Selection, what: str) -> bool:
        if sel.stop_after is None or time.monotonic() - started < sel.stop_after:
            return False
        result["unfinished"].append(what)
        _log(f"past --stop-after {sel.stop_after:g} s: not started: {what}")
        return True

    def measure(sel: Selection, spec: ModelSpec) -> None:
        """Every configuration of ``sel`` for the model ``spec``, its rows emitted as they finish."""
        _log(f"build {spec.model} hidden {spec.hidden} x {spec.layers} layers")
        try:
            model = build_model(spec, device)
        except (ModelTypeError, ModelBuildError) as e:
            emit(_model_row(spec, base, error=str(e)))
            _log(f"{spec.model}: ERROR {e}")
            return
        impls = sel.impls
        refusal = liger_refusal(model) if "liger" in impls else None
        if refusal:
            impls = tuple(i for i in impls if i != "liger")
            emit(_model_row(spec, base, impl="liger", skipped=refusal))
            _log(f"{spec.model}: {refusal}")
        shape = {"class": type(model).__name__, "intermediate": spec.intermediate, "heads": spec.heads,
                 "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab,
                 "attention": attention_of(model), "norm_modules": len(norm_modules(model))}
        for batch, seq in sel.tokens:
            tokens = f"{batch}x{seq}"
            if over_budget(sel, f"{spec.model} {spec.hidden}x{spec.layers} {tokens}"):
                continue
            ids = _ids(spec, batch, seq, device)
            try:
                calls = probe_norm_calls(model, ids)
            except Exception as e:  # noqa: BLE001 (the type's own model code)
                emit(_model_row(spec, base, tokens=tokens, error=(
                    f"model {spec.model!r} ({type(model).__name__}) built from its shrunk config does not run: "
                    f"{_one_line(e)}")))
                continue
            for recipe in sel.float8:
                if over_budget(sel, f"{spec.model} {spec.hidden}x{spec.layers} {tokens} float8 {recipe or 'none'}"):
                    continue
                try:
                    converted, linears = float8_model(model, recipe)
                    eager = eager_reference(converted, ids, sel.passes)
                except Exception as e:  # noqa: BLE001
                    emit(_model_row(spec, base, tokens=tokens, float8=recipe,
                                    error=f"float8 {recipe}: {_one_line(e)}" if recipe else _one_line(e)))
                    continue
                for mode in sel.modes:
                    if over_budget(sel, f"{spec.model} {spec.hidden}x{spec.layers} {tokens} {mode} float8 "
                                   f"{recipe or 'none'}"):
                        continue
                    _free(device)
                    base_row = {"model": spec.model, "hidden": spec.hidden, "layers": spec.layers, **shape,
                                "tokens": tokens, "mode": mode, "float8": recipe, "float8_linears": linears,
                                "norm_calls": norm_calls_json(calls), **base,
                                "backend": None if mode == "eager" else sel.backend}
                    with contextlib.ExitStack() as stack:
                        arms = make_arms(converted, ids, mode, impls, sel.backend, stack)
                        for pass_ in sel.passes:
                            emit_pass(sel, base_row, pass_, arms, eager[pass_], calls)
                        del arms
                    _free(device)
                del converted, eager

    for sel in sels:
        for spec in sel.specs():
            if not over_budget(sel, f"{spec.model} {spec.hidden}x{spec.layers}"):
                measure(sel, spec)
                _free(device)
    return write_results(result, stem)


def _add_floor(row: dict, calls: Sequence[NormCall], pass_: str, copy_gbs: float) -> None:
    norm_us = sum(k["us"] for k in row["norm_kernels"].values())
    row["norm_us"] = round(norm_us, 2)
    for suffix, with_adds in (("", True), ("_without_adds", False)):
        floor = norm_byte_floor(calls, pass_, with_adds)
        row["norm_floor_bytes" + suffix] = floor
        if norm_us and row.get("gpu_ms") is not None:
            row["norm_pct_of_copy" + suffix] = round(100 * floor / (norm_us * 1e-6) / 1e9 / copy_gbs, 1)
    _add_ours_floor(row, calls, pass_, copy_gbs)


def _add_ours_floor(row: dict, calls: Sequence[NormCall], pass_: str, copy_gbs: float) -> None:
    ours = {name: k for name, k in row["norm_kernels"].items() if k.get("source") == "ours"}
    if not ours or row.get("gpu_ms") is None:
        return
    row["ours_us"] = round(sum(k["us"] for k in ours.values()), 2)
    forwards = sum(k["calls"] for name, k in ours.items() if name.startswith("_rms_norm_fwd"))
    floor, sites = ours_byte_floor(calls, pass_)
    if forwards != sites:
        row["ours_floor_note"] = f"{forwards:g} forward launches a step, {sites} residual calls: no floor"
        return
    row["ours_floor_bytes"] = floor
    row["ours_pct_of_copy"] = round(100 * floor / (row["ours_us"] * 1e-6) / 1e9 / copy_gbs, 1)


def _summary(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"][:200]
    gpu = f", gpu {row['gpu_ms']:.3f} ms" if row.get("gpu_ms") is not None else ""
    peak = f", peak +{row['step_peak_extra_GiB']:.2f} GiB" if row.get("step_peak_extra_GiB") is not None else ""
    return (f"step {row['step_ms']:.3f} ms{gpu}{peak}, norm {row.get('norm_us', 0):.1f} us, "
            f"first step {row['compile_s']:.1f} s, "
            f"{'matches' if row['matches_reference'] else 'DIFFERS FROM'} {row['reference']}")


def worker_commands(sel: Selection) -> list[tuple[list[str], str]]:
    """One ``bench-models --compile-only`` command line per compiled model of ``sel`` (model,
    tokens, compiled mode, float8 recipe, impl; all passes), with a label. Eager modes compile
    nothing and have none."""
    cmds = []
    for spec in sel.specs():
        for batch, seq in sel.tokens:
            for mode in sel.compiled_modes:
                for recipe in sel.float8:
                    for impl in sel.impls:
                        cmd = [sys.executable, "-m", "torch_rmsnorm_op", "bench-models", "--compile-only",
                               "--models", spec.model, "--layers", str(spec.layers), "--tokens", f"{batch}x{seq}",
                               "--modes", mode, "--float8", recipe or "none", "--impls", impl,
                               "--passes", ",".join(sel.passes), "--backend", sel.backend]
                        cmd += ["--smoke"] if sel.smoke else ["--hidden", str(spec.hidden)]
                        cmds.append((cmd, f"{spec.model} {spec.hidden} {batch}x{seq} {mode} float8 {recipe or 'none'} "
                                          f"{impl}"))
    return cmds


def warm_caches(sel: Selection | Sequence[Selection], jobs: int, deadline: float | None = None) -> None:
    """Compile every compiled model of ``sel`` (a selection or several) in ``jobs`` parallel
    worker processes (``worker_commands``, each once), filling Inductor's and Triton's on-disk
    caches; the timing that follows loads the graphs from there. A worker that fails costs only
    its speed-up: the timing process then compiles that model itself (or records the error).

    The workers share the GPU, so the configurations Inductor's autotuner picks there are picked
    under each other's load; the ones they record (``*.best_config``) are removed afterwards, and
    the timing process autotunes every kernel again on an idle GPU. Stock's and the patched
    model's copies of one kernel carry different names, so they are tuned apart. Every worker
    installs the library's Inductor passes before compiling (``install_library_passes``), as the
    timing process has them, so that stock's graphs carry the timing process's cache key; the
    workers inherit this process's environment, ``STATIC_LAUNCH_ENV`` with it. No worker starts
    after ``deadline`` (a ``time.monotonic()`` value)."""
    cmds = list({tuple(cmd): (cmd, label) for one in _selections(sel) for cmd, label in worker_commands(one)}.values())
    _log(f"compiling {len(cmds)} models in {jobs} worker processes")
    started = time.time()

    def work(item: tuple[list[str], str]) -> None:
        cmd, label = item
        t0 = time.monotonic()
        if deadline is not None and t0 > deadline:
            _log(f"past --stop-after: not compiled ahead: {label}")
            return
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




def compile_only(sel: Selection) -> None:
    """Build and compile every compiled configuration of ``sel`` (one step per pass) and time
    nothing; eager modes are left out (they compile nothing)."""
    use_static_launch()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sel, _ = _without_missing_liger(sel, liger_available(), device)
    if not sel.compiled_modes:
        _log("only eager modes: nothing to compile")
        return
    _check_float8(sel, device)
    install_library_passes()
    for spec in sel.specs():
        model = build_model(spec, device)
        impls = tuple(i for i in sel.impls if i != "liger" or not liger_refusal(model))
        for batch, seq in sel.tokens:
            ids = _ids(spec, batch, seq, device)
            for recipe in sel.float8:
                converted, _ = float8_model(model, recipe)
                for mode in sel.compiled_modes:
                    _free(device)
                    with contextlib.ExitStack() as stack:
                        for arm in make_arms(converted, ids, mode, impls, sel.backend, stack):
                            with arm.step_context():
                                for pass_ in sel.passes:
                                    t0 = time.perf_counter()
                                    arm.steps.first(pass_)
                                    _sync(device)
                                    _log(f"{spec.model} {spec.hidden} {batch}x{seq} {mode} float8 {recipe or 'none'} "
                                         f"{arm.impl} {pass_}: compiled in {time.perf_counter() - t0:.1f} s")
                    _free(device)
                del converted
        del model
        _free(device)


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _ratio(a, b) -> str:
    return "–" if a is None or b is None or not b else f"{a / b:.3f}"


def _configurations(rows: Sequence[dict]) -> list[tuple]:
    """The configurations (``ROW_KEY`` but the impl) of the rows measured, in order."""
    seen: dict[tuple, None] = {}
    for r in rows:
        if r.get("impl") is not None and r.get("pass") is not None:
            seen.setdefault(_key(r)[:-1])
    return list(seen)


def markdown(result: dict) -> str:
    """The results as Markdown: per configuration, stock vs patched vs liger side by side; then
    the errors and the impls skipped."""
    measured = [r for r in result["rows"] if r.get("pass") is not None]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in measured)]
    others = [i for i in impls if i != "stock"]
    lines = [
        f"# Models: {' vs '.join({'liger': 'Liger'}.get(i, i) for i in impls)} on {result['gpu']}", "",
        f"torch {result['torch']}, Triton {result['triton']}, transformers {result['transformers']}, "
        f"liger_kernel {result['liger_kernel']}, torchao {result.get('torchao')}, {result['date']}. "
        f"{result['timing']} Copy ceiling "
        f"**{result['copy_GBs']:.0f} GB/s**. GPU time with library kernels at stock's: the GPU-time ratio with "
        "the library kernels both launch alike (matmuls, attention) counted at stock's time, which takes out the "
        "GPU clock's drift between rounds (gpu_ratio_library_at_reference). Peak: GiB allocated by a step above "
        "what was allocated before it (max_memory_allocated). "
        "Norm % = the step's RMSNorm byte floor (residual adds included) "
        "/ norm kernel time / copy ceiling. ✓ = loss and norm-weight gradients (train) or logits (infer): "
        "stock within the declared tolerances of eager ("
        + ", ".join(f"{k} {v:g}" for k, v in result["tolerances"].items())
        + "), the others within them of stock or within twice stock's own distance from eager.",
        "",
    ]
    head = ["model", "hidden×layers", "tokens", "mode", "float8", "pass"]
    head += [f"{i} ms" for i in impls] + [f"{i}/stock" for i in others]
    head += [f"{i}/stock paired rounds" for i in others]
    head += [f"{i}/stock alternating steps" for i in others]
    head += [f"{i} GPU ms" for i in impls] + [f"{i}/stock GPU" for i in others]
    head += [f"{i}/stock GPU, library kernels at stock's" for i in others]
    head += [f"{i} peak GiB" for i in impls]
    head += [f"{i} norm µs (%)" for i in impls] + ["ok"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed = {_key(r): r for r in measured}
    for k in _configurations(measured):
        cell = {i: keyed.get(k + (i,), {}) for i in impls}

        def get(impl, field, cell=cell):
            return cell[impl].get(field)

        model, hidden, layers, tokens, mode, float8, pass_ = k
        row = [model, f"{hidden}×{layers}", tokens, mode, float8 or "–", pass_]
        row += [_fmt(get(i, "step_ms"), ".3f") if "error" not in cell[i] else "error" for i in impls]
        row += [_ratio(get(i, "step_ms"), get("stock", "step_ms")) for i in others]
        row += [_fmt(get(i, "step_ratio_paired"), ".3f") for i in others]
        row += [_fmt(get(i, "step_ratio_alternating"), ".3f") for i in others]
        row += [_fmt(get(i, "gpu_ms"), ".3f") for i in impls]
        row += [_ratio(get(i, "gpu_ms"), get("stock", "gpu_ms")) for i in others]
        row += [_fmt(get(i, "gpu_ratio_library_at_stock"), ".3f") for i in others]
        row += [_fmt(get(i, "step_peak_extra_GiB"), ".2f") for i in impls]
        row += [f"{_fmt(get(i, 'norm_us'), '.1f')} ({_fmt(get(i, 'norm_pct_of_copy'), '.0f')})" for i in impls]
        row += [" ".join(("✓" if cell[i].get("matches_reference") else "✗") for i in impls if cell[i])]
        lines.append("| " + " | ".join(row) + " |")
    errors = [r for r in result["rows"] if "error" in r]
    if errors:
        lines += ["", "Errors:", ""] + [
            f"- {' '.join(str(v) for v in _key(r) if v is not None)}: `{r['error'][:300]}`" for r in errors]
    skipped = [r for r in result["rows"] if "skipped" in r]
    notes = [*result.get("notes", []),
             *(f"{r['model']} {r['hidden']}×{r['layers']}: {r['skipped']}" for r in skipped),
             *(f"not started (--stop-after): {what}" for what in result.get("unfinished", []))]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
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
    measured = [r for r in result["rows"] if r.get("pass") is not None]
    keyed = {_key(r): r for r in measured}
    configs = _configurations(measured)
    others = [i for i in IMPLS[1:] if any(r["impl"] == i for r in measured)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 1.2 + 0.32 * max(1, len(configs))), sharey=True)
    labels = [f"{m} {h}×{lay} {t} {mode}{' ' + f8 if f8 else ''} {p}" for m, h, lay, t, mode, f8, p in configs]
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
        ax.set_title(f"{title}: ratio to stock (< 1 is faster)")
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
    same run), and the library kernels' floor (``ours_*``) from each row's ``norm_kernels`` and
    ``norm_calls``; write its .json, .md and .png again; returns the stem. For files written
    before the fields existed."""
    if not path.endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"--rederive: {path!r} is not a results file (<date>-<gpu>-models.json)")
    with open(path) as f:
        result = json.load(f)
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise ValueError(f"--rederive: {path!r} holds no model benchmark rows")
    keyed = {_key(r): r for r in result["rows"]}
    for row in result["rows"]:
        if row.get("pass") is None or "error" in row:
            continue
        stock = keyed.get(_key(row)[:-1] + ("stock",))
        if row["impl"] != "stock" and stock and stock.get("run_started") == row.get("run_started"):
            row["gpu_ratio_library_at_stock"] = gpu_ratio_library_at_reference(row, stock)
            paired = paired_step_ratio(row, stock)
            if paired is not None:
                row["step_ratio_paired"] = paired
            alternating = alternating_step_ratio(row, stock)
            if alternating is not None:
                row["step_ratio_alternating"] = alternating
        calls = norm_calls_of(row)
        if "norm_kernels" in row and calls is not None and result.get("copy_GBs"):
            _add_ours_floor(row, calls, row["pass"], result["copy_GBs"])
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
