"""Released configuration files (byte for byte) and small presets for tests and demos."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RELEASED_CONFIG_PATH = HERE / "kimi_k3_config.json"
RELEASED_GENERATION_CONFIG_PATH = HERE / "kimi_k3_generation_config.json"
TENSOR_PATTERNS_PATH = HERE / "kimi_k3_tensor_patterns.json"
CHAT_TEMPLATE_PATH = HERE / "chat_template.jinja"


def released_config_dict() -> dict:
    """The released `config.json` of moonshotai/Kimi-K3 as a dict."""
    return json.loads(RELEASED_CONFIG_PATH.read_text())


def released_text_config_dict() -> dict:
    return released_config_dict()["text_config"]


def release_layer_schedule(num_hidden_layers: int) -> tuple[list[int], list[int]]:
    """The release's layer pattern for a depth (1-based, as config.json lists them): MLA at every 4th layer and at
    the last one, KDA elsewhere. Returns (kda_layers, full_attn_layers)."""
    full = [i for i in range(1, num_hidden_layers + 1) if i % 4 == 0 or i == num_hidden_layers]
    kda = [i for i in range(1, num_hidden_layers + 1) if i not in full]
    return kda, full


def tiny_text_config_dict(
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    head_dim: int = 16,
    num_experts: int = 8,
    top_k: int = 2,
    attn_res_block_size: int | None = 2,
    vocab_size: int = 128,
    latent: int | None = 32,
    moe_intermediate_size: int = 32,
) -> dict:
    """A small K3 text config with every K3 mechanism switched on (KDA with the lower-bounded gate and full-rank
    output gate, gated NoPE-MLA, Block AttnRes, latent MoE with norm, SiTU), in the release's schema
    (1-based layer lists, release key names). The schedule is the release's: KDA, KDA, KDA, MLA repeated, and the
    last layer is MLA."""
    kda, full = release_layer_schedule(num_hidden_layers)
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": head_dim,
        "qk_rope_head_dim": head_dim // 2,
        "v_head_dim": head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": kda,
            "gate_lower_bound": -5.0,
            "head_dim": head_dim,
            "num_heads": num_heads,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
        "attn_res_block_size": attn_res_block_size,
        "num_experts": num_experts,
        "num_experts_per_token": top_k,
        "num_shared_experts": 2,
        "moe_intermediate_size": moe_intermediate_size,
        "routed_expert_hidden_size": latent,
        "latent_moe_use_norm": latent is not None,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "num_expert_group": 1,
        "topk_group": 1,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "kda_chunk_size": 16,
    }


def kimi_linear_style_text_config_dict(num_hidden_layers: int = 4, hidden_size: int = 64) -> dict:
    """A Kimi-Linear-48B-style config (softplus decay, low-rank output gate, no AttnRes, plain MoE, SiLU)."""
    cfg = tiny_text_config_dict(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size)
    cfg["linear_attn_config"].pop("gate_lower_bound")
    cfg["linear_attn_config"]["use_full_rank_gate"] = False
    for key in ("activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size",
                "routed_expert_hidden_size", "latent_moe_use_norm", "mla_use_output_gate"):
        cfg.pop(key)
    cfg.update(hidden_act="silu", q_lora_rank=None, num_shared_experts=1, routed_scaling_factor=2.446)
    return cfg
