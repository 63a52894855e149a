import hashlib
import json

import pytest

from kimik3.configuration import RELEASED_CONFIG_PATH, kimi_linear_style_text_config_dict, tiny_text_config_dict
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

RELEASED_SHA256 = "9710e121a58d03ac92c8d6da287a19541994319afbbe6d6202af001ffd379213"


def test_released_config_file_is_the_release():
    assert hashlib.sha256(RELEASED_CONFIG_PATH.read_bytes()).hexdigest() == RELEASED_SHA256


def test_released_config_loads_with_derived_schedule():
    config = KimiK3Config(**json.loads(RELEASED_CONFIG_PATH.read_text()))
    text = config.text_config
    assert isinstance(text, KimiK3TextConfig) and text.model_type == "kimik3_text" != "kimi_linear"
    assert config.model_type == "kimik3"
    assert text.mla_layer_indices == [3 + 4 * j for j in range(23)] + [92]
    assert len(text.kda_layer_indices) == 69 and text.layer_types[0] == "linear_attention"
    assert text.mlp_layer_types[0] == "dense" and set(text.mlp_layer_types[1:]) == {"sparse"}
    assert text.gate_lower_bound == -5.0 and text.use_full_rank_gate
    assert (text.linear_num_heads, text.linear_head_dim, text.linear_conv_kernel_size) == (96, 128, 4)
    assert text.qk_head_dim == 192 and text.mla_cache_dim == 576 and text.latent_size == 3584
    assert (text.num_experts, text.num_experts_per_token, text.num_shared_experts) == (896, 16, 2)
    assert text.activation_situ_beta == 4.0 and text.activation_situ_linear_beta == 25.0
    assert text.rms_norm_eps == 1e-5 and text.mla_rms_norm_eps == 1e-6
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (163839, 163584, 163586)
    assert text.quantization_config["format"] == "mxfp4-pack-quantized"
    # the quantizer must not see it at the top level: our converter handles MXFP4, not transformers' CT path
    assert getattr(config, "quantization_config", None) is None


def test_released_config_round_trips_byte_for_byte(tmp_path):
    raw = RELEASED_CONFIG_PATH.read_bytes()
    config = KimiK3Config(**json.loads(raw))
    assert json.dumps(config.to_release_dict(), indent=2, sort_keys=True).encode() == raw
    config.save_pretrained(tmp_path)
    again = KimiK3Config.from_pretrained(tmp_path)
    assert json.dumps(again.to_release_dict(), indent=2, sort_keys=True).encode() == raw
    assert again.text_config.layer_types == config.text_config.layer_types


def test_text_config_usable_alone(tmp_path):
    text = KimiK3TextConfig(**json.loads(RELEASED_CONFIG_PATH.read_text())["text_config"])
    text.save_pretrained(tmp_path)
    again = KimiK3TextConfig.from_pretrained(tmp_path)
    assert again.layer_types == text.layer_types and again.num_experts == 896


def test_kimi_linear_style_defaults():
    text = KimiK3TextConfig(**kimi_linear_style_text_config_dict())
    assert text.gate_lower_bound is None and not text.use_full_rank_gate
    assert text.attn_res_block_size is None and text.routed_expert_hidden_size is None
    assert text.hidden_act == "silu" and text.latent_size == text.hidden_size


def _bad(**changes):
    cfg = tiny_text_config_dict()
    lac = changes.pop("lac", None)
    if lac:
        cfg["linear_attn_config"].update(lac)
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    "cfg, key",
    [
        (_bad(lac={"kda_layers": [1, 2, 3, 4]}), "kda_layers/full_attn_layers"),
        (_bad(lac={"kda_layers": [1, 2]}), "kda_layers/full_attn_layers"),
        (_bad(lac={"kda_layers": [0, 1, 2]}), "linear_attn_config.kda_layers"),
        (_bad(lac={"gate_lower_bound": 0.0}), "gate_lower_bound"),
        (_bad(lac={"gate_lower_bound": 2.5}), "gate_lower_bound"),
        (_bad(num_experts_per_token=9), "num_experts_per_token"),
        (_bad(num_key_value_heads=3), "num_key_value_heads"),
        (_bad(num_expert_group=3), "num_expert_group"),
        (_bad(hidden_act="gelu"), "hidden_act"),
        (_bad(attn_res_block_size=0), "attn_res_block_size"),
        (_bad(layer_types=["full_attention"] * 4), "layer_types"),
        (_bad(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    ],
)
def test_inconsistent_configs_name_the_key(cfg, key):
    with pytest.raises(ValueError, match=key.replace("/", ".")):
        KimiK3TextConfig(**cfg)
