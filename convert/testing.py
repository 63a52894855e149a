"""Testing support: a tiny random checkpoint in exactly the release's on-disk form, for tests, benchmarks and the
demo.

Same as `moonshotai/Kimi-K3` except for the sizes: the composite config.json is the released one with shrunk
numbers (1-based layer lists, nested text_config with its quantization_config), tensor names and dtypes as the
release (F32 A_log / dt_bias / convs / o_norm / router bias, BF16 elsewhere, routed experts MXFP4 `weight_packed` +
`weight_scale`), A_log zero-padded to 128, one decoder layer per shard named `model-XXXXX-of-0000NN` (6-digit
total), then the embed/head shard, the projector shard and the vision shard. Written with the `safetensors` library
(not our writer), so tests of our reader are not circular.

MXFP4 experts are random E2M1 codes with one code of magnitude 6 in every group of 32 (so re-quantising their
dequantised values reproduces the same bytes) and E8M0 scales near 2^-7; their exact dense values are returned.

The tokenizer is a working one in the release's form: `tiktoken.model` with the synthetic BPE ranks `kimik3 tiny`
uses (kimik3/tokenizer_files.py: vocab_size - 256 ranks, then the 256 reserved specials) and `tokenizer_config.json`
with the release's auto_map, so a conversion of the fixture chats. A vocabulary the synthetic ranks cannot fill
(fewer than 256 + 256 entries, or more ranks than the training text gives) gets a 2-rank stub instead.
"""

import copy
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from kimik3.configuration import release_layer_schedule, released_config_dict
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
from kimik3.modeling.experts_format_kimi_k3 import RELEASE
from kimik3.tokenizer_files import ranks_file_text, special_token_ids, tokenizer_config, train_ranks

from kimik3 import name_map as nm
from .checkpoint import INDEX_NAME, RELEASE_TOTAL_DIGITS, shard_file_name
from .mxfp4 import MXFP4_GROUP_SIZE, dequantize_mxfp4, pack_codes
from .plan import TEXT_PREFIX, streamed_format

# The tokenizer's ranks (the size `kimik3 tiny` uses); the vocabulary adds the 256 reserved specials.
TINY_TOKENIZER_RANKS = 512
_TINY_IDS = special_token_ids(TINY_TOKENIZER_RANKS)  # [BOS], <|end_of_msg|>, [PAD]
TINY_TEXT = {
    "hidden_size": 64,
    "vocab_size": TINY_TOKENIZER_RANKS + 256,
    "intermediate_size": 96,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,  # MXFP4 groups of 32 along the input dim: latent and intermediate multiples of 32
    "routed_expert_hidden_size": 32,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "attn_res_block_size": 2,
    "max_position_embeddings": 4096,
    **_TINY_IDS,
}
TINY_LINEAR = {"num_heads": 2, "head_dim": 16}
TINY_VISION = {
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "qkv_hidden_size": 32,
    "vt_num_hidden_layers": 2,
    "patch_size": 4,
    "init_pos_emb_height": 4,
    "init_pos_emb_width": 4,
    "mm_hidden_size": 32,
}
# <|media_pad|> is the 22nd reserved special, as 163605 = 163584 + 21 in the release
TINY_TOP = {**_TINY_IDS, "media_placeholder_token_id": TINY_TOKENIZER_RANKS + 21}


@dataclass
class ReleaseFixture:
    path: Path
    config: dict  # the config.json written
    dense: dict = field(default_factory=dict)  # release name -> exact dense value (experts as `...{w}.weight`)
    shards: list = field(default_factory=list)




def tiny_release_config(num_layers: int = 6, num_experts: int = 8, config_overrides: dict | None = None,
                        vision_overrides: dict | None = None, linear_overrides: dict | None = None) -> dict:
    config = released_config_dict()
    text = config["text_config"]
    text.update(TINY_TEXT)
    kda, full = release_layer_schedule(num_layers)
    text["linear_attn_config"].update(TINY_LINEAR, kda_layers=kda, full_attn_layers=full)
    text["linear_attn_config"].update(linear_overrides or {})
    text["num_hidden_layers"] = num_layers
    text["num_experts"] = num_experts
    text.update(config_overrides or {})
    config.update(TINY_TOP)
    config["vision_config"].update(TINY_VISION, text_hidden_size=text["hidden_size"])
    config["vision_config"].update(vision_overrides or {})
    return config


def _random_codes(gen, shape) -> torch.Tensor:
    """Random E2M1 codes with one magnitude-6 code (7 or 15) per group of 32 (round-trip-stable scales)."""
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
    groups = codes.view(*shape[:-1], shape[-1] // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)
    sign = torch.randint(0, 2, groups.shape[:-1], generator=gen, dtype=torch.uint8) * 8
    position = torch.randint(0, MXFP4_GROUP_SIZE, groups.shape[:-1], generator=gen)
    groups.scatter_(-1, position.unsqueeze(-1), (7 + sign).unsqueeze(-1))
    return codes


def random_mxfp4(gen, out_dim: int, in_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes = _random_codes(gen, (out_dim, in_dim))
    scale = torch.randint(118, 123, (out_dim, in_dim // MXFP4_GROUP_SIZE), generator=gen, dtype=torch.uint8)
    return pack_codes(codes), scale


def _value(gen, name: str, shape: tuple[int, ...], dtype: str, heads: int) -> torch.Tensor:
    torch_dtype = torch.float32 if dtype == "F32" else torch.bfloat16
    if name.endswith("A_log"):
        values = torch.zeros(shape, dtype=torch.float32)
        values[:heads] = torch.log(torch.rand(heads, generator=gen) * 15 + 1)
        return values
    if name.endswith("norm.weight"):
        return (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch_dtype)
    if name.endswith(("e_score_correction_bias", "dt_bias")):
        return (0.1 * torch.randn(shape, generator=gen)).to(torch_dtype)
    fan_in = shape[-1] if len(shape) > 1 else 1
    if name.endswith("conv1d.weight"):
        fan_in = shape[-1]
    scale = 1.0 if "embed_tokens" in name else 1 / math.sqrt(fan_in)
    return (scale * torch.randn(shape, generator=gen)).to(torch_dtype)


def _tensor_names(text_cfg, vision_cfg, vision: bool):
    """(group, release name, rule) for every tensor of the checkpoint, from the release side of the name map's walk."""
    symbols = nm.dims(text_cfg, vision_cfg)
    layers = list(range(text_cfg.num_hidden_layers))
    for site in nm.walk(text_cfg, symbols, layers, TEXT_PREFIX, "", vision):
        if isinstance(site.rule, nm.ExpertRule):
            for expert in range(symbols["E"]):
                for part in site.rule.parts:
                    yield site.group, site.release_expert(expert, part), (site.rule, part)
        else:
            yield site.group, site.release, site.rule


def release_preprocessor_config(config: dict) -> dict:
    """The release's preprocessor_config.json as other K3 ports read it (its exact bytes are not on record): the
    release's own processor classes in `auto_map`, and `media_proc_cfg` with the image rules (patch size the tiny
    tower's), the video budgets and the chessboard fill for transparent images."""
    return {
        "auto_map": {"AutoImageProcessor": "kimi_k3_vision_processing.KimiK3VisionProcessor",
                     "AutoProcessor": "kimi_k3_processor.KimiK3Processor"},
        "media_proc_cfg": {
            "in_patch_limit": 65536,
            "patch_size": config["vision_config"]["patch_size"],
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "merge_kernel_size": 2,
            "fixed_output_tokens": None,
            "patch_limit_on_one_side": 512,
            "in_patch_limit_each_frame": 16384,
            "sample_fps": 8.0,
            "temporal_merge_kernel_size": 4,
            "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                      "chessboard_square_on_top_left": True, "chessboard_white_value": 255,
                                      "chessboard_gray_value": 180},
            "transparent_bg_fill_stage": "after_resize",
            "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
        },
    }


@functools.lru_cache(maxsize=4)
def _tokenizer_ranks(num_ranks: int) -> str | None:
    """The ranks file text of the synthetic tokenizer (trained once per size), None where it cannot have that size."""
    try:
        return ranks_file_text(train_ranks(num_ranks))
    except ValueError:  # fewer than the 256 single bytes, or more merges than the training text holds
        return None


def _aux_files(dst: Path, config: dict) -> None:
    text = config["text_config"]
    (dst / "generation_config.json").write_text(
        json.dumps({"max_length": text["max_position_embeddings"], "eos_token_id": text["eos_token_id"]}, indent=2)
    )
    ranks = _tokenizer_ranks(text["vocab_size"] - 256)
    if ranks is None:
        (dst / "tiktoken.model").write_bytes(b"IQ== 0\nIg== 1\n")
        (dst / "tokenizer_config.json").write_text(json.dumps(
            {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}, "bos_token": "[BOS]",
             "eos_token": "<|end_of_msg|>", "model_max_length": 1048576}, indent=2))
    else:
        (dst / "tiktoken.model").write_text(ranks)
        # the release's form: its own slow tokenizer class in auto_map (the converter names ours instead)
        release_tokenizer = tokenizer_config(text["vocab_size"] - 256)
        release_tokenizer.update(auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                                 tokenizer_class="TikTokenTokenizer")
        (dst / "tokenizer_config.json").write_text(json.dumps(release_tokenizer, indent=2))
    (dst / "tokenization_kimi.py").write_text("# release tokenizer (fixture placeholder)\n")
    (dst / "encoding_k3.py").write_text("# release XTML chat encoder (fixture placeholder)\n")
    (dst / "preprocessor_config.json").write_text(json.dumps(release_preprocessor_config(config), indent=2))
    (dst / "LICENSE").write_text("Kimi K3 License (fixture placeholder)\n")
    (dst / "README.md").write_text("# Kimi K3 (fixture placeholder card)\n")
    # the release's own remote code, never copied: placeholders that define the classes its auto_maps name, as the
    # release's files do (a folder's auto_map must name a class its file defines)
    named = {}
    for auto_map in (config.get("auto_map"), text.get("auto_map")):
        for reference in (auto_map or {}).values():
            module, _, name = reference.partition(".")
            named.setdefault(module, []).append(name)
    for module in ("configuration_kimi_k3", "modeling_kimi_k3", "modeling_kimi_linear"):
        classes = "".join(f"\n\nclass {name}:\n    pass\n" for name in sorted(set(named.get(module, []))))
        (dst / f"{module}.py").write_text("# the release's own remote code (fixture placeholder): never copied\n"
                                          + classes)


def write_release_checkpoint(
    dst,
    *,
    seed: int = 0,
    num_layers: int = 6,
    num_experts: int = 8,
    config_overrides: dict | None = None,
    linear_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    vision: bool = True,
    experts_format: str = RELEASE.name,
    return_dense: bool = True,
) -> ReleaseFixture:
    """Writes the checkpoint to `dst` (created) and returns its config and, unless `return_dense=False`, the exact
    dense value of every tensor under its release name (experts as dense `...experts.{E}.{w}.weight`).
    experts_format: the release's (coded, as the release ships them) or "dense" (plain bf16 `.weight` experts)."""
    stored = streamed_format(experts_format)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = tiny_release_config(num_layers, num_experts, config_overrides, vision_overrides, linear_overrides)
    parsed = KimiK3Config(**copy.deepcopy(config))
    text_cfg, vision_cfg = parsed.text_config, parsed.vision_config
    symbols = nm.dims(text_cfg, vision_cfg)
    gen = torch.Generator().manual_seed(seed)

    groups: dict = {}
    for group, name, rule in _tensor_names(text_cfg, vision_cfg, vision):
        groups.setdefault(group, []).append((name, rule))
    order = [f"layer:{i}" for i in range(num_layers)] + ["model"] + (["projector", "vision"] if vision else [])
    total = len(order)
    fixture = ReleaseFixture(dst, config)
    weight_map, total_size = {}, 0
    for k, group in enumerate(order, start=1):
        shard = shard_file_name(k, total, RELEASE_TOTAL_DIGITS)
        tensors = {}
        for name, rule in groups[group]:
            if isinstance(rule, tuple):  # an expert part
                expert_rule, part = rule
                out_dim, in_dim = nm.shape_of(expert_rule.part_shape, symbols)
                if stored is RELEASE:
                    packed, scale = random_mxfp4(gen, out_dim, in_dim)
                    for suffix, value in zip(nm.PACKED_SUFFIXES, (packed, scale)):
                        tensors[f"{name}.{suffix}"] = value
                    if return_dense:
                        fixture.dense[name + ".weight"] = dequantize_mxfp4(packed, scale)
                else:
                    value = (torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)).to(torch.bfloat16)
                    tensors[name + ".weight"] = value
                    if return_dense:
                        fixture.dense[name + ".weight"] = value
                continue
            value = _value(gen, name, nm.shape_of(rule.shape, symbols), rule.dtype, symbols["H"])
            tensors[name] = value
            if return_dense:
                fixture.dense[name] = value
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
        for name, value in tensors.items():
            weight_map[name] = shard
            total_size += value.numel() * value.element_size()
        fixture.shards.append(shard)
        del tensors
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_NAME).write_text(json.dumps(index, indent=2))
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _aux_files(dst, config)
    return fixture
