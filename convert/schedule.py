"""Layer / expert slicing and the configs written next to the tensors.

`--num-layers N` keeps the first N layers of the schedule. The release ends with an MLA (full-attention) layer
(layers 92 and 93, 1-based, are both MLA), so a kept prefix is re-scheduled the same way: when layer N-1 would be
KDA, output layer N-1 is instead a copy of the *first MLA layer at or after N-1* of the source (its attention, MLP
and AttnRes weights, all from that one source layer), and the source layers between are dropped. Example, release:
`--num-layers 13` keeps layers 0..11 and takes output layer 12 from source layer 15. The layer lists
(`kda_layers` / `full_attn_layers`, 1-based) are recomputed from the kept types; `attn_res_block_size` is unchanged,
so blocks start at the same layers (`layer % block_size == 0`) and stay consistent. When no MLA layer exists at or
after N-1 the prefix is kept as is.
"""

import copy

from kimik3.modeling.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig
from kimik3.modeling.saving_kimi_k3 import COMPOSITE_AUTO_MAP, TEXT_AUTO_MAP

from .errors import ConversionError
from .mxfp4 import MXFP4_GROUP_SIZE

# The release's quantization_config (text_config.quantization_config, exact). Conversion drops it (our experts are
# dense or in our own packed layout, neither is a compressed-tensors checkpoint); export writes it back.
RELEASE_QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": MXFP4_GROUP_SIZE,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "scale_dtype": "torch.uint8",
                "strategy": "group",
                "symmetric": True,
                "type": "float",
                "zp_dtype": None,
            },
        }
    },
    "format": "mxfp4-pack-quantized",
    "global_compression_ratio": None,
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
# Attributes that our config classes derive, or that only describe a particular file layout.
_DERIVED_TEXT_KEYS = ("layer_types", "mlp_layer_types", "quantization_config", "experts_format")


def layer_map(text_config, num_layers: int | None) -> tuple[list[int], str | None]:
    """Output layer i is source layer map[i]. Returns (map, note about re-scheduling or None)."""
    total = text_config.num_hidden_layers
    if num_layers is None or num_layers == total:
        return list(range(total)), None
    if not 1 <= num_layers <= total:
        raise ConversionError(f"--num-layers {num_layers}: the source has {total} layers")
    mapping = list(range(num_layers))
    last = num_layers - 1
    types = text_config.layer_types
    if types[last] == "full_attention":
        return mapping, None
    replacement = next((i for i in range(last, total) if types[i] == "full_attention"), None)
    if replacement is None:
        return mapping, f"kept layers 0..{last} as is: the source has no MLA layer at or after {last}"
    mapping[last] = replacement
    return mapping, (
        f"output layer {last} is source layer {replacement} (the first MLA layer at or after {last}), so the kept "
        "schedule ends with an MLA layer as the release does"
    )


def _text_dict(text_config) -> dict:
    raw = copy.deepcopy(text_config.to_dict())
    for key in _DERIVED_TEXT_KEYS:
        raw.pop(key, None)
    raw.pop("transformers_version", None)
    raw["_name_or_path"] = ""
    return raw


def output_text_config(source_text, mapping: list[int], num_experts: int | None, experts_format: str):
    """Our text config for the kept layers / experts. The layer lists stay 1-based (the config class converts)."""
    raw = _text_dict(source_text)
    kept_types = [source_text.layer_types[i] for i in mapping]
    raw["num_hidden_layers"] = len(mapping)
    if raw.get("linear_attn_config"):
        lac = dict(raw["linear_attn_config"])
        lac["kda_layers"] = [i + 1 for i, t in enumerate(kept_types) if t == "linear_attention"]
        lac["full_attn_layers"] = [i + 1 for i, t in enumerate(kept_types) if t == "full_attention"]
        raw["linear_attn_config"] = lac
    if num_experts is not None and source_text.num_experts:
        raw["num_experts"] = num_experts
        raw["num_experts_per_token"] = min(source_text.num_experts_per_token, num_experts)
    raw["architectures"] = ["KimiK3ForCausalLM"]
    raw["auto_map"] = dict(TEXT_AUTO_MAP)
    raw["dtype"] = "bfloat16"
    raw["experts_format"] = experts_format
    try:
        config = KimiK3TextConfig(**raw)
    except ValueError as exc:
        raise ConversionError(f"the sliced config is not valid: {exc}") from None
    kept_mlp = [source_text.mlp_layer_types[i] for i in mapping]
    if config.mlp_layer_types != kept_mlp:
        raise ConversionError(
            f"cannot keep layers {mapping}: their MLP kinds {kept_mlp} do not match the sliced schedule "
            f"{config.mlp_layer_types} (first_k_dense_replace={config.first_k_dense_replace})"
        )
    return config


def output_config_dict(source_config, text_config, text_only: bool) -> dict:
    """The config.json we write: save_pretrained-style `to_dict()` with our auto_map (the text config carries
    `TEXT_AUTO_MAP` from `output_text_config`)."""
    text_raw = text_config.to_dict()
    text_raw["_name_or_path"] = ""
    if text_only or not hasattr(source_config, "text_config"):
        raw = text_raw
        KimiK3TextConfig(**copy.deepcopy(raw))
        return raw
    raw = copy.deepcopy(source_config.to_dict())
    raw.pop("quantization_config", None)
    raw["text_config"] = text_raw
    raw["_name_or_path"] = ""
    raw["architectures"] = ["KimiK3ForConditionalGeneration"]
    raw["auto_map"] = dict(COMPOSITE_AUTO_MAP)
    raw["dtype"] = "bfloat16"
    KimiK3Config(**copy.deepcopy(raw))
    return raw


def release_config_dict(our_config) -> dict:
    """The release's config.json for one of our configs (export): 1-based lists and the release's schema via the
    config class's `to_release_dict()`, and the release's MXFP4 quantization_config (experts are written packed)."""
    if not hasattr(our_config, "text_config"):
        # the top-level token ids index the text vocabulary: a text-only folder's own ids, not the release's defaults
        our_config = KimiK3Config(text_config=our_config, vision_config={}, pad_token_id=our_config.pad_token_id,
                                  bos_token_id=our_config.bos_token_id, eos_token_id=our_config.eos_token_id)
    text = our_config.text_config
    saved = getattr(text, "quantization_config", None)
    text.quantization_config = copy.deepcopy(RELEASE_QUANTIZATION_CONFIG)
    try:
        return our_config.to_release_dict()
    finally:
        if saved is None:
            del text.quantization_config
        else:
            text.quantization_config = saved
