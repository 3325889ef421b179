"""Transformers configs shrunk to a chosen size, for any model type, from the config's own attributes.

``shrink_config(default, sizes)`` takes a config (usually a config class's defaults) and sets
every attribute named in ``sizes`` that the config has and does not derive from others (a
``property``), passing them to the config's constructor so that the attributes derived from
them follow (a latent-attention config's ``qk_head_dim``, a hybrid's layer counts). On top:

- per-layer kind lists (``layer_types``, ``layers_block_type``, ``mlp_layer_types``, ...) are
  repeated or cut to the layer count where the constructor did not make them that long (from
  ``first_k_dense_replace`` and the like), so a hybrid keeps its pattern of layers;
- latent attention (a config with ``qk_rope_head_dim``): ``head_dim`` is the rotary part of a
  head where the default has it so, else it follows the parts; key/value heads as query heads;
- every config the config holds (a multimodal model's text and vision configs, a hybrid's parts)
  is shrunk alike: the one ``get_text_config(decoder=True)`` names with ``sizes``, the others
  with ``others`` (default: ``sizes``);
- dropout probabilities are 0.

A value in ``sizes`` is either the value itself or a callable of the default's value that
returns the new one, for caps (``at_most(8)``) and for values that depend on the default (a
token id kept where the vocabulary still holds it).

``TINY`` is width 64 and two layers, for surveys of every model class
(``profiling/family_survey.py``); ``tools.model_benchmark`` builds its own table per size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=128, max_position_embeddings=256, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, shared_expert_intermediate_size=48,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
    topk_group=1, first_k_dense_replace=1, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    sliding_window=64, d_model=64, d_ff=96, num_layers=2, num_heads=4, d_kv=16, expand=1,
    n_shared_experts=1, num_kv_shared_layers=0, index_n_heads=4, index_head_dim=16, n_groups=1)

# Layer counts of a config's parts (an encoder-decoder's, a vision tower's), set to the layer count.
PART_LAYER_KEYS = ("depth", "encoder_layers", "decoder_layers", "num_decoder_layers")
# Lists of one kind per layer, repeated or cut to the layer count (``mtp_*``: the extra layers
# of multi-token prediction, not decoder layers, keep theirs); also strings of one character per
# layer (``hybrid_override_pattern``, as some releases hold a hybrid's layers).
LAYER_KIND_SUFFIXES = ("layer_types", "layers_block_type", "block_types")
LAYER_PATTERN_SUFFIX = "_pattern"


def at_most(limit: int) -> Callable[[Any], Any]:
    """A ``sizes`` value: the default where it is an int no larger than ``limit``, else ``limit``
    (a default of ``None`` stays ``None``: the feature is off in that config)."""
    return lambda value: None if value is None else min(value, limit) if isinstance(value, int) else limit


def derived(config, key: str) -> bool:
    """Whether ``config.key`` is a property derived from other attributes (those are set instead)."""
    return isinstance(getattr(type(config), config.attribute_map.get(key, key), None), property)


def _layer_kind_keys(config, patterns: bool = True) -> list[str]:
    """The attributes of ``config`` that hold one kind per layer: lists of strings, and (unless
    not ``patterns``) strings of one character per layer."""
    return [key for key, value in vars(config).items() if not key.startswith("mtp") and value and (
        (key.endswith(LAYER_KIND_SUFFIXES) and isinstance(value, list) and all(isinstance(v, str) for v in value))
        or (patterns and key.endswith(LAYER_PATTERN_SUFFIX) and isinstance(value, str)))]


def shrink_config(default, sizes: Mapping[str, Any], own: Mapping[str, Any] | None = None, *,
                  others: Mapping[str, Any] | None = None):
    """``default`` shrunk to ``sizes`` as the module docstring says, with ``own`` on top (set
    as given, after everything else but dropout); the configs it holds shrunk alike (the text
    decoder's with ``sizes``, the others with ``others``, default ``sizes``). Returns a new
    config; ``default`` is not changed."""
    from transformers import PretrainedConfig

    others = sizes if others is None else others
    cls = type(default)
    try:
        text = default.get_text_config(decoder=True)
    except ValueError:  # several text configs: none is the decoder's by name
        text = None
    small: dict[str, Any] = {
        key: shrink_config(value, sizes if value is text else others, others=others)
        for key, value in vars(default).items() if isinstance(value, PretrainedConfig)}
    layers = sizes.get("num_hidden_layers")
    for key in PART_LAYER_KEYS:
        if isinstance(layers, int) and isinstance(getattr(default, key, None), int) and not derived(default, key):
            small[key] = layers
    for key, value in sizes.items():
        try:
            if not hasattr(default, key) or derived(default, key):
                continue
            small[key] = value(getattr(default, key)) if callable(value) else value
        except (AttributeError, RuntimeError):  # a per-layer attribute of this config: its layers' configs keep theirs
            pass
    if hasattr(default, "qk_rope_head_dim"):  # latent attention: head_dim is its rotary part or follows its parts
        rotary = getattr(default, "head_dim", None) == default.qk_rope_head_dim
        small.pop("head_dim", None)
        if rotary and "qk_rope_head_dim" in small:
            small["head_dim"] = small["qk_rope_head_dim"]
        if "num_attention_heads" in small:
            small["num_key_value_heads"] = small["num_attention_heads"]
    layer_types = getattr(default, "layer_types", None)  # passed in, for constructors that check its length
    if (isinstance(layer_types, list) and layer_types and "num_hidden_layers" in small
            and not derived(default, "layer_types")):
        n = small["num_hidden_layers"]
        small["layer_types"] = (layer_types * n)[:n]
    if isinstance(layers, int):  # a string pattern is passed in too: its constructor reads the layers from it
        for key in set(_layer_kind_keys(default)) - set(_layer_kind_keys(default, patterns=False)):
            if not derived(default, key):
                small[key] = (getattr(default, key) * layers)[:layers]
    small.update(own or {})
    small.update({key: 0.0 for key, value in default.to_dict().items()
                  if "dropout" in key and isinstance(value, float)})
    try:  # through the constructor, so that attributes derived from these follow them
        config = cls(**small)
    except Exception:  # noqa: BLE001 (a value this config's own validation refuses: set what it takes)
        config = cls()
        for key, value in small.items():
            try:
                setattr(config, key, value)
            except (AttributeError, TypeError, ValueError):  # a derived property of this config
                pass
    n = layers if isinstance(layers, int) else getattr(config, "num_hidden_layers", None)
    for key in _layer_kind_keys(config) if isinstance(n, int) and n > 0 else ():
        kinds = getattr(config, key)
        if len(kinds) != n:
            try:
                setattr(config, key, (kinds * n)[:n])
            except (AttributeError, TypeError, ValueError):  # derived from other attributes in this config
                pass
    return config
