"""The declarative name map between the release checkpoint and our transformers layout.

Everything the converter knows about names lives in the two tables below; the engines (`plan.py`) only evaluate
them. How release names become ours (the text prefix, the MoE block's rename, the expert parts and their storage
suffixes, A_log's padding) is the release name map of the remote code (`modeling_kimik3/release_layout_kimi_k3.py`),
from which the loader's transforms are built too: the rules of the MoE block and the experts below are generated
from it, so `convert` and `from_pretrained` name every release tensor alike. A rule gives the release name pattern, our name pattern, the release dtype and shape (in config symbols), the
condition under which the tensor exists, and the named transform. The same rows drive `convert` (release -> ours),
`export` (ours -> release) and `verify`.

Name patterns: text rules are relative to the text model (`model.` / `lm_head.`); the release adds `language_model.`
to every text name, our composite model also adds `language_model.`, our text-only model adds nothing. Vision rules
are at the root in both layouts. `{L}` is a 0-based decoder layer, `{E}` an expert, `{B}` a vision block.

Symbols (see `dims()`): D hidden, V vocab, H/Dk/K KDA heads/head dim/conv kernel, A the usual stored A_log length
(max(128, H): the release zero-pads 96 heads to 128; convert accepts any length >= H and records it for export), HM MLA heads, QL/KVL q/kv LoRA ranks, NOPE/ROPE/VD MLA head dims,
F dense MLP width, I expert width, DL latent width (hidden size when the MoE is not latent), E experts, S shared
expert width, and vision VH/VI/VQ/VP/PH/PW/MM/VT.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Iterator

from kimik3.modeling.release_layout_kimi_k3 import (
    EXPERT_PARTS,
    MOE_CHILD_PREFIXES,
    OUR_MOE_BLOCK,
    RELEASE_A_LOG_LENGTH,
    RELEASE_MOE_BLOCK,
)
from kimik3.modeling.experts_format_kimi_k3 import DENSE, RELEASE

# ------------------------------------------------------------------------------------------------------------------
# Conditions: a rule exists only where all of its conditions hold. Layer conditions read the layer's types; feature
# conditions read the text config.

LAYER_CONDITIONS = {
    "kda": lambda attn, mlp: attn == "linear_attention",
    "mla": lambda attn, mlp: attn == "full_attention",
    "dense": lambda attn, mlp: mlp == "dense",
    "sparse": lambda attn, mlp: mlp == "sparse",
}
FEATURE_CONDITIONS = {
    "full_rank_gate": lambda c: c.use_full_rank_gate,
    "low_rank_gate": lambda c: not c.use_full_rank_gate,
    "q_lora": lambda c: c.q_lora_rank is not None,
    "no_q_lora": lambda c: c.q_lora_rank is None,
    "mla_gate": lambda c: bool(c.mla_use_output_gate),
    "attn_res": lambda c: c.attn_res_block_size is not None,
    "latent": lambda c: c.routed_expert_hidden_size is not None,
    "latent_norm": lambda c: c.routed_expert_hidden_size is not None and bool(c.latent_moe_use_norm),
    "shared": lambda c: bool(c.num_shared_experts),
    "untied": lambda c: not c.tie_word_embeddings,
}


@dataclass(frozen=True)
class TensorRule:
    release: str
    ours: str
    shape: tuple[str, ...]  # release shape, each entry a product of symbols / integers ("H*Dk")
    dtype: str = "BF16"
    when: tuple[str, ...] = ()
    # copy: same bytes. unpad_heads: release [A] zero-padded (any A >= H) -> ours [H] (export pads back to the
    # length recorded at conversion).
    # first_experts: keep the first E' rows (router rows / correction biases) when experts are sliced.
    transform: str = "copy"
    scope: str = "text"  # "text" or "vision"

    @property
    def is_layer_rule(self) -> bool:
        return "{L}" in self.release


@dataclass(frozen=True)
class ExpertRule:
    """Per-expert release tensors fused into one of our 3-D expert tensors (expert-major, parts stacked on dim 1).

    Release: `...block_sparse_moe.experts.{E}.{part}.weight` (bf16, [out, in]) or `.weight_packed` (u8,
    [out, in/2]) + `.weight_scale` (u8 E8M0, [out, in/32]). Ours: `{ours}` [E, sum(out), in] dense, or `{ours}_packed`
    [E, sum(out), in/2] + `{ours}_scale` [E, sum(out), in/32] when the experts are kept MXFP4.
    """

    ours: str
    parts: tuple[str, ...]
    part_shape: tuple[str, str]  # logical [out, in] of one part, in symbols
    release: str = "model.layers.{L}." + RELEASE_MOE_BLOCK + ".experts.{E}.{W}"
    when: tuple[str, ...] = ("sparse",)


# Release layer prefix and ours (the only layer-level rename is the MoE block's, block_sparse_moe -> mlp).
LAYER_PREFIX = "model.layers.{L}."  # our layer tensors (and the release's) sit under it
_LY = LAYER_PREFIX
_ATT = _LY + "self_attn."
_MOE = _LY + RELEASE_MOE_BLOCK + "."
_MLP = _LY + OUR_MOE_BLOCK + "."


def _same(name, shape, dtype="BF16", when=(), transform="copy", scope="text"):
    return TensorRule(name, name, shape, dtype, when, transform, scope)


def _moe(suffix, shape, dtype="BF16", when=("sparse",), transform="copy"):
    if not suffix.startswith(MOE_CHILD_PREFIXES):  # the loader would not rename it: the two would disagree
        raise AssertionError(f"{RELEASE_MOE_BLOCK}.{suffix}: not a child of the MoE block in the release name map "
                             f"(release_layout_kimi_k3.MOE_CHILD_PREFIXES = {MOE_CHILD_PREFIXES})")
    return TensorRule(_MOE + suffix, _MLP + suffix, shape, dtype, when, transform)


TENSOR_RULES: tuple[TensorRule, ...] = (
    # model level
    _same("model.embed_tokens.weight", ("V", "D")),
    _same("lm_head.weight", ("V", "D"), when=("untied",)),
    _same("model.norm.weight", ("D",)),
    _same("model.output_attn_res_norm.weight", ("D",), when=("attn_res",)),
    _same("model.output_attn_res_proj.weight", ("1", "D"), when=("attn_res",)),
    # every layer
    _same(_LY + "input_layernorm.weight", ("D",)),
    _same(_LY + "post_attention_layernorm.weight", ("D",)),
    _same(_LY + "self_attention_res_norm.weight", ("D",), when=("attn_res",)),
    _same(_LY + "self_attention_res_proj.weight", ("1", "D"), when=("attn_res",)),
    _same(_LY + "mlp_res_norm.weight", ("D",), when=("attn_res",)),
    _same(_LY + "mlp_res_proj.weight", ("1", "D"), when=("attn_res",)),
    # KDA
    _same(_ATT + "q_proj.weight", ("H*Dk", "D"), when=("kda",)),
    _same(_ATT + "k_proj.weight", ("H*Dk", "D"), when=("kda",)),
    _same(_ATT + "v_proj.weight", ("H*Dk", "D"), when=("kda",)),
    _same(_ATT + "q_conv1d.weight", ("H*Dk", "1", "K"), "F32", when=("kda",)),
    _same(_ATT + "k_conv1d.weight", ("H*Dk", "1", "K"), "F32", when=("kda",)),
    _same(_ATT + "v_conv1d.weight", ("H*Dk", "1", "K"), "F32", when=("kda",)),
    _same(_ATT + "f_a_proj.weight", ("Dk", "D"), when=("kda",)),
    _same(_ATT + "f_b_proj.weight", ("H*Dk", "Dk"), when=("kda",)),
    _same(_ATT + "A_log", ("A",), "F32", when=("kda",), transform="unpad_heads"),
    _same(_ATT + "dt_bias", ("H*Dk",), "F32", when=("kda",)),
    _same(_ATT + "b_proj.weight", ("H", "D"), when=("kda",)),
    # `g_proj` is one release name with two meanings, told apart by the layer type (KDA gate vs MLA output gate)
    _same(_ATT + "g_proj.weight", ("H*Dk", "D"), when=("kda", "full_rank_gate")),
    _same(_ATT + "g_a_proj.weight", ("Dk", "D"), when=("kda", "low_rank_gate")),
    _same(_ATT + "g_b_proj.weight", ("H*Dk", "Dk"), when=("kda", "low_rank_gate")),
    _same(_ATT + "o_norm.weight", ("Dk",), "F32", when=("kda",)),
    _same(_ATT + "o_proj.weight", ("D", "H*Dk"), when=("kda",)),
    # MLA (NoPE, gated)
    _same(_ATT + "q_a_proj.weight", ("QL", "D"), when=("mla", "q_lora")),
    _same(_ATT + "q_a_layernorm.weight", ("QL",), when=("mla", "q_lora")),
    _same(_ATT + "q_b_proj.weight", ("HM*NOPE+HM*ROPE", "QL"), when=("mla", "q_lora")),
    _same(_ATT + "q_proj.weight", ("HM*NOPE+HM*ROPE", "D"), when=("mla", "no_q_lora")),
    _same(_ATT + "kv_a_proj_with_mqa.weight", ("KVL+ROPE", "D"), when=("mla",)),
    _same(_ATT + "kv_a_layernorm.weight", ("KVL",), when=("mla",)),
    _same(_ATT + "kv_b_proj.weight", ("HM*NOPE+HM*VD", "KVL"), when=("mla",)),
    _same(_ATT + "g_proj.weight", ("HM*VD", "D"), when=("mla", "mla_gate")),
    _same(_ATT + "o_proj.weight", ("D", "HM*VD"), when=("mla",)),
    # dense MLP
    _same(_LY + "mlp.gate_proj.weight", ("F", "D"), when=("dense",)),
    _same(_LY + "mlp.up_proj.weight", ("F", "D"), when=("dense",)),
    _same(_LY + "mlp.down_proj.weight", ("D", "F"), when=("dense",)),
    # latent MoE (block_sparse_moe -> mlp)
    _moe("gate.weight", ("E", "D"), transform="first_experts"),
    _moe("gate.e_score_correction_bias", ("E",), "F32", transform="first_experts"),
    _moe("routed_expert_down_proj.weight", ("DL", "D"), when=("sparse", "latent")),
    _moe("routed_expert_norm.weight", ("DL",), when=("sparse", "latent_norm")),
    _moe("routed_expert_up_proj.weight", ("D", "DL"), when=("sparse", "latent")),
    _moe("shared_experts.gate_proj.weight", ("S", "D"), when=("sparse", "shared")),
    _moe("shared_experts.up_proj.weight", ("S", "D"), when=("sparse", "shared")),
    _moe("shared_experts.down_proj.weight", ("D", "S"), when=("sparse", "shared")),
    # vision tower and projector: carried unchanged (composite output only)
    _same("vision_tower.patch_embed.proj.weight", ("VH", "3", "VP", "VP"), scope="vision"),
    _same("vision_tower.patch_embed.pos_emb.weight", ("PH", "PW", "VH"), scope="vision"),
    _same("vision_tower.encoder.blocks.{B}.norm0.weight", ("VH",), scope="vision"),
    _same("vision_tower.encoder.blocks.{B}.norm1.weight", ("VH",), scope="vision"),
    _same("vision_tower.encoder.blocks.{B}.wqkv.weight", ("3*VQ", "VH"), scope="vision"),
    _same("vision_tower.encoder.blocks.{B}.wo.weight", ("VH", "VQ"), scope="vision"),
    _same("vision_tower.encoder.blocks.{B}.mlp.fc0.weight", ("VI", "VH"), scope="vision"),
    _same("vision_tower.encoder.blocks.{B}.mlp.fc1.weight", ("VH", "VI"), scope="vision"),
    _same("vision_tower.encoder.final_layernorm.weight", ("VH",), scope="vision"),
    _same("mm_projector.proj.0.weight", ("MM", "MM"), scope="vision"),
    _same("mm_projector.proj.2.weight", ("VT", "MM"), scope="vision"),
    _same("mm_projector.post_norm.weight", ("VT",), scope="vision"),
)

# The logical [out, in] of one part of each fused expert tensor: gate_up_proj [E, 2I, DL] (rows [0:I] = w1, the gate;
# rows [I:2I] = w3, the up projection), down_proj [E, DL, I] = w2. Which parts, in which order: EXPERT_PARTS.
_EXPERT_PART_SHAPES = {"gate_up_proj": ("I", "DL"), "down_proj": ("DL", "I")}
if _EXPERT_PART_SHAPES.keys() != EXPERT_PARTS.keys():  # a fused tensor the two tables name differently
    raise AssertionError(f"expert part shapes for {sorted(_EXPERT_PART_SHAPES)}, but the release name map fuses "
                         f"{sorted(EXPERT_PARTS)} (release_layout_kimi_k3.EXPERT_PARTS)")
EXPERT_RULES: tuple[ExpertRule, ...] = tuple(
    ExpertRule(_MLP + "experts." + fused, parts, _EXPERT_PART_SHAPES[fused]) for fused, parts in EXPERT_PARTS.items()
)

# Release suffixes of one expert part, by storage format; the suffixes of our fused tensor kept coded (in the order
# of PACKED_SUFFIXES); our fused expert tensors relative to a layer (`mlp.experts.gate_up_proj`, ...). The engines
# (plan.py, verifier.py) spell none of these names.
PACKED_SUFFIXES = RELEASE.release_suffixes
PLAIN_SUFFIXES = DENSE.release_suffixes
FUSED_PACKED_SUFFIXES = RELEASE.suffixes
FUSED_EXPERTS = tuple(rule.ours.removeprefix(_LY) for rule in EXPERT_RULES)


# ------------------------------------------------------------------------------------------------------------------
# Symbols


def dims(text_config, vision_config=None) -> dict[str, int]:
    c = text_config
    values = {
        "D": c.hidden_size,
        "V": c.vocab_size,
        "H": c.linear_num_heads,
        "Dk": c.linear_head_dim,
        "K": c.linear_conv_kernel_size,
        "A": max(RELEASE_A_LOG_LENGTH, c.linear_num_heads),
        "HM": c.num_attention_heads,
        "QL": c.q_lora_rank or 0,
        "KVL": c.kv_lora_rank,
        "NOPE": c.qk_nope_head_dim,
        "ROPE": c.qk_rope_head_dim,
        "VD": c.v_head_dim,
        "F": c.intermediate_size,
        "I": c.moe_intermediate_size,
        "DL": c.routed_expert_hidden_size or c.hidden_size,
        "E": c.num_experts or 0,
        "S": (c.moe_intermediate_size or 0) * (c.num_shared_experts or 0),
    }
    if vision_config is not None and hasattr(vision_config, "vt_hidden_size"):
        v = vision_config
        merge = math.prod(getattr(v, "merge_kernel_size", [2, 2]))
        values.update(
            VH=v.vt_hidden_size,
            VI=v.vt_intermediate_size,
            VQ=v.qkv_hidden_size,
            VP=v.patch_size,
            PH=v.init_pos_emb_height,
            PW=v.init_pos_emb_width,
            MM=merge * v.mm_hidden_size,
            VT=v.text_hidden_size,
            VB=v.vt_num_hidden_layers,
        )
    return values


def evaluate(expr: str, symbols: dict[str, int]) -> int:
    """A sum of products of symbols and integers ("HM*NOPE+HM*ROPE")."""
    total = 0
    for term in expr.split("+"):
        product = 1
        for factor in term.split("*"):
            product *= int(factor) if factor.isdigit() else symbols[factor]
        total += product
    return total


def shape_of(shape: tuple[str, ...], symbols: dict[str, int]) -> tuple[int, ...]:
    return tuple(evaluate(e, symbols) for e in shape)


# ------------------------------------------------------------------------------------------------------------------
# Matching names against the tables


def _compile(pattern: str, names: dict[str, str]) -> re.Pattern:
    regex = re.escape(pattern)
    for placeholder, group in names.items():
        regex = regex.replace(re.escape("{" + placeholder + "}"), group)
    return re.compile(regex + r"\Z")


_INDEX = r"(?P<{}>0|[1-9][0-9]*)"
_GROUPS = {"L": _INDEX.format("L"), "E": _INDEX.format("E"), "B": _INDEX.format("B")}
_RELEASE_TENSOR_RE = [(_compile(r.release, _GROUPS), r) for r in TENSOR_RULES]
_OURS_TENSOR_RE = [(_compile(r.ours, _GROUPS), r) for r in TENSOR_RULES]
def _alternatives(names) -> str:
    return "|".join(re.escape(name) for name in names)


_RELEASE_EXPERT_RE = re.compile(
    r"model\.layers\." + _INDEX.format("L") + re.escape(f".{RELEASE_MOE_BLOCK}.experts.") + _INDEX.format("E")
    + r"\.(?P<W>" + _alternatives(sorted({p for parts in EXPERT_PARTS.values() for p in parts})) + r")\."
    + "(?P<Q>" + _alternatives(PLAIN_SUFFIXES + PACKED_SUFFIXES) + r")\Z"
)
# our fused names, plain or with the `_packed` / `_scale` suffix of kept-MXFP4 experts
_OURS_EXPERT_RE = [
    (re.compile(_compile(r.ours, _GROUPS).pattern.removesuffix(r"\Z")
                + "(?P<Q>|" + _alternatives(FUSED_PACKED_SUFFIXES) + r")\Z"), r)
    for r in EXPERT_RULES
]
_LAYER_RE = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.")


@dataclass(frozen=True)
class Match:
    rule: TensorRule | ExpertRule
    layer: int | None = None
    expert: int | None = None
    block: int | None = None
    part: str | None = None  # expert part (w1/w2/w3)
    suffix: str | None = None  # release expert storage suffix, or our "", "_packed", "_scale"
    extra: dict = field(default_factory=dict)


def layer_of(relative_name: str) -> int | None:
    m = _LAYER_RE.match(relative_name)
    return int(m.group(1)) if m else None


def conditions_hold(when: tuple[str, ...], text_config, attn: str | None, mlp: str | None) -> bool:
    for cond in when:
        if cond in LAYER_CONDITIONS:
            if attn is None or not LAYER_CONDITIONS[cond](attn, mlp):
                return False
        elif not FEATURE_CONDITIONS[cond](text_config):
            return False
    return True


def _layer_types(text_config, layer):
    if layer is None or layer >= text_config.num_hidden_layers:
        return None, None
    return text_config.layer_types[layer], text_config.mlp_layer_types[layer]


def _tensor_match(regexes, relative_name, text_config, scope) -> list[Match]:
    found = []
    for regex, rule in regexes:
        if rule.scope != scope:
            continue
        m = regex.match(relative_name)
        if not m:
            continue
        groups = m.groupdict()
        layer = int(groups["L"]) if "L" in groups else None
        attn, mlp = _layer_types(text_config, layer)
        if rule.is_layer_rule and attn is None:
            continue
        if conditions_hold(rule.when, text_config, attn, mlp):
            found.append(Match(rule, layer=layer, block=int(groups["B"]) if "B" in groups else None))
    return found


def match_release(relative_name: str, text_config, scope: str = "text") -> Match | None:
    """The rule a release name (text names relative to `language_model.`) falls under, or None if it has none."""
    if scope == "text":
        m = _RELEASE_EXPERT_RE.match(relative_name)
        if m:
            layer, part = int(m.group("L")), m.group("W")
            attn, mlp = _layer_types(text_config, layer)
            for rule in EXPERT_RULES:
                if part in rule.parts and conditions_hold(rule.when, text_config, attn, mlp):
                    return Match(rule, layer=layer, expert=int(m.group("E")), part=part, suffix=m.group("Q"))
            return None
    found = _tensor_match(_RELEASE_TENSOR_RE, relative_name, text_config, scope)
    if len(found) > 1:
        raise AssertionError(f"name map is ambiguous for {relative_name}: {[f.rule for f in found]}")
    return found[0] if found else None


def match_ours(relative_name: str, text_config, scope: str = "text") -> Match | None:
    """The rule one of our names (text names relative to the text model) falls under, or None."""
    if scope == "text":
        for regex, rule in _OURS_EXPERT_RE:
            m = regex.match(relative_name)
            if m:
                layer = int(m.group("L"))
                attn, mlp = _layer_types(text_config, layer)
                if conditions_hold(rule.when, text_config, attn, mlp):
                    return Match(rule, layer=layer, suffix=m.group("Q"))
                return None
    found = _tensor_match(_OURS_TENSOR_RE, relative_name, text_config, scope)
    if len(found) > 1:
        raise AssertionError(f"name map is ambiguous for {relative_name}: {[f.rule for f in found]}")
    return found[0] if found else None


def fill(pattern: str, **values) -> str:
    for key, value in values.items():
        pattern = pattern.replace("{" + key + "}", str(value))
    return pattern


def expected_layer_rules(text_config, layer: int) -> list[TensorRule]:
    attn, mlp = _layer_types(text_config, layer)
    return [
        r for r in TENSOR_RULES
        if r.scope == "text" and r.is_layer_rule and conditions_hold(r.when, text_config, attn, mlp)
    ]


def expected_layer_expert_rules(text_config, layer: int) -> list[ExpertRule]:
    attn, mlp = _layer_types(text_config, layer)
    return [r for r in EXPERT_RULES if conditions_hold(r.when, text_config, attn, mlp)]


def expected_model_rules(text_config) -> list[TensorRule]:
    return [
        r for r in TENSOR_RULES
        if r.scope == "text" and not r.is_layer_rule and conditions_hold(r.when, text_config, None, None)
    ]


def vision_rules() -> list[TensorRule]:
    return [r for r in TENSOR_RULES if r.scope == "vision"]


# ------------------------------------------------------------------------------------------------------------------
# Walking the tables: one walk for every direction


@dataclass(frozen=True)
class Site:
    """A rule placed in a checkpoint: its full name in both layouts and the release shard group it belongs to.

    For an ExpertRule `release` is the per-expert pattern with `{E}` (expert) and `{W}` (part) still open.
    """

    rule: TensorRule | ExpertRule
    release: str
    ours: str
    group: str  # "layer:<our layer>", "model", "projector" or "vision"
    why: str  # what the tensor belongs to, for error messages
    layer: int | None = None  # our layer
    release_layer: int | None = None

    def release_expert(self, expert: int, part: str) -> str:
        return fill(self.release, E=expert, W=part)


def walk(text_config, symbols: dict[str, int], layer_map: list[int], release_prefix: str, our_prefix: str,
         vision: bool) -> Iterator[Site]:
    """Every tensor the name map expects, in checkpoint order: for each of our layers (our layer i is release layer
    layer_map[i]) its tensor rules then its expert rules, then the model-level rules, then, with `vision`, the
    vision tower and projector. Convert reads the release side of each site and writes ours; export and the fixture
    writer go the other way."""
    for layer, release_layer in enumerate(layer_map):
        why = (f"{text_config.layer_types[release_layer]} / {text_config.mlp_layer_types[release_layer]} layer "
               f"{release_layer}")
        rules = expected_layer_rules(text_config, release_layer)
        rules += expected_layer_expert_rules(text_config, release_layer)
        for rule in rules:
            release, ours = release_prefix + fill(rule.release, L=release_layer), our_prefix + fill(rule.ours, L=layer)
            yield Site(rule, release, ours, f"layer:{layer}", why, layer, release_layer)
    for rule in expected_model_rules(text_config):
        yield Site(rule, release_prefix + rule.release, our_prefix + rule.ours, "model", "model level")
    if vision:
        for rule in vision_rules():
            blocks = range(symbols["VB"]) if "{B}" in rule.release else [None]
            for block in blocks:
                release, ours = (rule.release, rule.ours) if block is None else \
                    (fill(rule.release, B=block), fill(rule.ours, B=block))
                group = "projector" if release.startswith("mm_projector.") else "vision"
                yield Site(rule, release, ours, group, "vision tower / projector")
