# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Configuration classes for Kimi K3.

`KimiK3TextConfig` reads the release's nested `text_config` (model_type `kimi_linear`, 1-based layer lists inside
`linear_attn_config`) and Kimi-Linear style configs; `KimiK3Config` reads the released top-level `config.json`
unchanged. Our own model types (`kimik3`, `kimik3_text`) cannot collide with transformers' in-tree `kimi_linear`.
"""

import copy
import math
import os

from transformers.configuration_utils import PretrainedConfig

from .compat_kimi_k3 import HAS_EP_DISPATCH
from .experts_format_kimi_k3 import DEFAULT as DEFAULT_FORMAT
from .experts_format_kimi_k3 import EXPERTS_FORMATS as FORMATS
from .experts_format_kimi_k3 import RELEASE as RELEASE_FORMAT
from .experts_format_kimi_k3 import experts_format
from .files_kimi_k3 import check_auto_map


# The release's nested text_config was written by transformers 4.56.2 (`to_dict()`): these 50 boilerplate keys are
# accepted and ignored on load, and written back verbatim by `KimiK3Config.to_release_dict()` (export).
_RELEASE_TEXT_BOILERPLATE = {
    "_name_or_path": "", "add_cross_attention": False, "bad_words_ids": None, "begin_suppress_tokens": None,
    "chunk_size_feed_forward": 0, "cross_attention_hidden_size": None, "decoder_start_token_id": None,
    "diversity_penalty": 0.0, "do_sample": False, "early_stopping": False, "encoder_no_repeat_ngram_size": 0,
    "exponential_decay_length_penalty": None, "finetuning_task": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "initializer_range": 0.02,
    "is_decoder": False, "is_encoder_decoder": False, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "length_penalty": 1.0, "max_length": 20, "min_length": 0, "no_repeat_ngram_size": 0, "num_beam_groups": 1,
    "num_beams": 1, "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False,
    "output_scores": False, "prefix": None, "problem_type": None, "pruned_heads": {}, "remove_invalid_values": False,
    "repetition_penalty": 1.0, "return_dict": True, "return_dict_in_generate": False, "sep_token_id": None,
    "suppress_tokens": None, "task_specific_params": None, "temperature": 1.0, "tf_legacy_loss": False,
    "tie_encoder_decoder": False, "tokenizer_class": None, "top_k": 50, "top_p": 1.0, "torchscript": False,
    "typical_p": 1.0, "use_bfloat16": False, "use_cache": True,
}
# Tensor parallel (`tp_plan="auto"`), by head for attention: KDA q/k/v/f_b/b/g colwise with its per-head A_log,
# dt_bias and short-conv channels sharded alike (`kimi_k3_heads`, parallel_kimi_k3.py), so the recurrent state is
# sharded by head too; MLA q_b/kv_b/g colwise by head with the shared latent kv_a_proj_with_mqa replicated (its k_pe
# part bypasses kv_b, hence `mla_kv_a_proj` for its gradient). o_proj rowwise (one all-reduce per attention). The
# dense and shared-expert MLPs colwise/rowwise; routed experts sharded along their intermediate width, with the
# styles their format names (`ExpertsFormat.tp_styles`). The router, the LatentMoE down/norm/up projections, every RMSNorm and the Block AttnRes
# pseudo-queries are replicated.
_KDA_HEAD_PARAMETERS = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
KIMI_K3_TP_PLAN = {
    **{f"layers.*.self_attn.{name}": "colwise"
       for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_proj", "g_b_proj", "q_b_proj", "kv_b_proj")},
    **{f"layers.*.self_attn.{name}": "kimi_k3_heads" for name in _KDA_HEAD_PARAMETERS},
    "layers.*.self_attn.o_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "layers.*.mlp.shared_experts.gate_proj": "colwise",
    "layers.*.mlp.shared_experts.up_proj": "colwise",
    "layers.*.mlp.shared_experts.down_proj": "rowwise",
    **{f"layers.*.mlp.experts.{stack}{suffix}": style for fmt in FORMATS.values() if fmt.tp_styles
       for stack, style in fmt.tp_styles.items() for suffix in fmt.suffixes},
    "layers.*.mlp.experts": "moe_tp_experts",
}
# Expert parallel: whole experts per rank (Shard(0)), dense or packed (codes and scales), every rank running the
# replicated router on the same tokens, with the dispatch this transformers has (compat_kimi_k3.HAS_EP_DISPATCH).
# KimiK3Experts skips the masked routes either way.
_EXPERT_PARAMETERS = {f"layers.*.mlp.experts.{name}{part}": "grouped_gemm" for name in ("gate_up_proj", "down_proj")
                      for part in dict.fromkeys(s for fmt in FORMATS.values() for s in fmt.suffixes)}
if HAS_EP_DISPATCH:
    KIMI_K3_EP_PLAN = {**_EXPERT_PARAMETERS, "layers.*.mlp.experts": "ep_dispatch_experts"}
else:
    KIMI_K3_EP_PLAN = {"layers.*.mlp.gate": "ep_router", **_EXPERT_PARAMETERS, "layers.*.mlp.experts": "moe_tp_experts"}
# Pipeline stages pass the running block sum; Block AttnRes also needs the banked blocks, so K3 has no
# `base_model_pp_plan` (device_map splits the model at whole decoder layers instead).

# Architecture keys of the release's text_config, in our attribute names (identical to the release's).
_RELEASE_TEXT_KEYS = (
    "activation_situ_beta", "activation_situ_linear_beta", "attn_res_block_size", "bos_token_id",
    "eos_token_id", "first_k_dense_replace", "hidden_act", "hidden_size", "intermediate_size", "kv_lora_rank",
    "latent_moe_use_norm", "linear_attn_config", "max_position_embeddings", "mla_use_nope", "mla_use_output_gate",
    "moe_intermediate_size", "moe_layer_freq", "moe_renormalize", "moe_router_activation_func",
    "num_attention_heads", "num_expert_group", "num_experts", "num_experts_per_token", "num_hidden_layers",
    "num_key_value_heads", "num_nextn_predict_layers", "num_shared_experts", "pad_token_id", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "routed_expert_hidden_size", "routed_scaling_factor",
    "tie_word_embeddings", "topk_group", "topk_method", "use_grouped_topk", "v_head_dim", "vocab_size",
)
_RELEASE_TEXT_MODEL_TYPE = "kimi_linear"
_RELEASE_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
}
_RELEASE_TEXT_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
    "AutoModel": "modeling_kimi_linear.KimiLinearModel",
    "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM",
}
_SUPPORTED_ACTIVATIONS = ("situ", "silu")
# `model_type` values each class reads: the release's and ours (a config of another model is refused, not
# reinterpreted). The release's vision_config has none; the release's own class re-saves it as "".
_TEXT_MODEL_TYPES = (_RELEASE_TEXT_MODEL_TYPE, "kimik3_text")
_COMPOSITE_MODEL_TYPES = ("kimi_k3", "kimik3")
_VISION_MODEL_TYPES = ("", "kimik3_vision")
# A bound far above any real model (the release has 93 layers): a corrupted or hostile layer count is refused before
# anything is derived from it (layer schedules, per-layer modules, caches).
MAX_HIDDEN_LAYERS = 4096
# A bound on the vocabulary a config may ask for (the release has 163,840; the largest vocabularies in use are near
# a million): past it the embedding table alone is terabytes, and the allocator's error names no key.
MAX_VOCAB_SIZE = 1 << 24
# The router the model implements: sigmoid scores, the correction bias used for selection only (docs/architecture.md)
SUPPORTED_TOPK_METHODS = ("noaux_tc",)
# `dtype` / `torch_dtype` name a torch floating dtype; transformers turns the string into `getattr(torch, name)`.
_DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
# How the routed experts are stored: the formats of experts_format_kimi_k3 (the one vocabulary of the config key
# `experts_format`, the load option of the same name, `kimik3 convert --experts-format` and `kimik3 memory
# --experts-format`). Our configs and conversions default to dense; the release itself ships mxfp4 (what `kimik3
# memory --plan` and export assume).
EXPERTS_FORMATS = FORMATS  # the registry itself (name -> format): a format registered there is a value here
DEFAULT_EXPERTS_FORMAT = DEFAULT_FORMAT.name
RELEASE_EXPERTS_FORMAT = RELEASE_FORMAT.name


def check_experts_format(value, what: str = "experts_format") -> str:
    """`value` if it names an experts format, else a ValueError naming `what` and the formats there are."""
    return experts_format(value, what).name


# The release's experts format (docs/architecture.md, The release's files); the experts are always decoded as MXFP4
# groups of 32.
_QUANT_METHOD = "compressed-tensors"
_QUANT_FORMAT = "mxfp4-pack-quantized"
_QUANT_GROUP_SIZE = RELEASE_FORMAT.group_size


def _config_error(key: str, message: str) -> ValueError:
    return ValueError(f"Kimi K3 config, key `{key}`: {message}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# What a field must be, checked before anything is derived from it (a string where a dict belongs, or a zero where a
# divisor belongs, would otherwise surface as an AttributeError / ZeroDivisionError deep inside __init__, and a NaN
# eps would pass silently into every norm).
_RULES = {
    "a positive integer": lambda v: _is_int(v) and v > 0,
    "a non-negative integer": lambda v: _is_int(v) and v >= 0,
    "a finite positive number": lambda v: _is_finite_number(v) and v > 0,
    "a finite non-negative number": lambda v: _is_finite_number(v) and v >= 0,
    "a finite negative number": lambda v: _is_finite_number(v) and v < 0,
    "a JSON object": lambda v: isinstance(v, dict),
    "true or false": lambda v: isinstance(v, bool),
    "a list of 1-based layer indices": lambda v: isinstance(v, (list, tuple)),
}
# key -> (rule, whether None / absent is allowed)
_TEXT_FIELD_RULES = {
    "vocab_size": ("a positive integer", False),
    "hidden_size": ("a positive integer", False),
    "intermediate_size": ("a positive integer", False),
    "num_hidden_layers": ("a positive integer", False),
    "num_attention_heads": ("a positive integer", False),
    "num_key_value_heads": ("a positive integer", False),
    "max_position_embeddings": ("a positive integer", False),
    "q_lora_rank": ("a positive integer", True),
    "kv_lora_rank": ("a positive integer", False),
    "qk_nope_head_dim": ("a positive integer", False),
    "qk_rope_head_dim": ("a non-negative integer", False),
    "v_head_dim": ("a positive integer", False),
    "mla_prefill_block_size": ("a positive integer", False),
    "kda_chunk_size": ("a positive integer", False),
    "attn_res_block_size": ("a positive integer", True),
    "num_experts": ("a non-negative integer", True),
    "num_experts_per_token": ("a positive integer", False),
    "num_shared_experts": ("a non-negative integer", False),
    "moe_intermediate_size": ("a positive integer", False),
    "routed_expert_hidden_size": ("a positive integer", True),
    "first_k_dense_replace": ("a non-negative integer", False),
    "moe_layer_freq": ("a positive integer", False),
    "num_expert_group": ("a positive integer", False),
    "topk_group": ("a positive integer", False),
    "quantile_balancing_bins": ("a positive integer", False),
    "num_nextn_predict_layers": ("a non-negative integer", False),
    "rms_norm_eps": ("a finite positive number", False),
    "mla_rms_norm_eps": ("a finite positive number", False),
    "routed_scaling_factor": ("a finite positive number", False),
    "activation_situ_beta": ("a finite positive number", True),
    "activation_situ_linear_beta": ("a finite positive number", True),
    "initializer_range": ("a finite non-negative number", False),
    "attention_dropout": ("a finite non-negative number", False),
    "linear_attn_config": ("a JSON object", True),
    # a string such as "no" or "yes" was kept and read as true wherever Python tested it
    "use_cache": ("true or false", False),
    "tie_word_embeddings": ("true or false", False),
    "use_grouped_topk": ("true or false", False),
    "quantile_balancing": ("true or false", False),
}
_LINEAR_ATTN_FIELD_RULES = {
    "num_heads": ("a positive integer", True),
    "head_dim": ("a positive integer", True),
    "short_conv_kernel_size": ("a positive integer", True),
    "gate_lower_bound": ("a finite negative number", True),  # a bound on the log-decay
    "kda_layers": ("a list of 1-based layer indices", True),
    "full_attn_layers": ("a list of 1-based layer indices", True),
}


def _check_model_type(kwargs: dict, allowed: tuple[str, ...], key: str = "model_type") -> None:
    model_type = kwargs.pop("model_type", None)
    if model_type is not None and model_type not in allowed:
        raise _config_error(key, f"{model_type!r} is not a Kimi K3 config (expected one of {list(allowed)})")


def _check_dtype(kwargs: dict) -> None:
    """`dtype` / `torch_dtype` must name a floating torch dtype (transformers would raise an AttributeError from
    `getattr(torch, name)`, or carry an integer dtype into from_pretrained)."""
    import torch

    for key in ("dtype", "torch_dtype"):
        value = kwargs.get(key)
        # the model runs in these four only (a float8 dtype is floating but has no matmul or norm kernels)
        allowed = tuple(getattr(torch, name) for name in _DTYPE_NAMES)
        if value is None or value in allowed:
            continue
        if not (isinstance(value, str) and value in _DTYPE_NAMES):
            raise _config_error(key, f"{value!r} is not a floating dtype (expected one of {list(_DTYPE_NAMES)})")


# transformers' "never stop" (its generation tests set it): an eos id no token has
NEVER_STOP_EOS = -1


def _token_id_problem(key: str, value, vocab_size: int) -> str | None:
    def bad(token) -> bool:
        if key == "eos_token_id" and _is_int(token) and token == NEVER_STOP_EOS:
            return False
        return not _is_int(token) or not 0 <= token < vocab_size

    if value is None:
        return None
    if key in _ID_LIST_KEYS and isinstance(value, (list, tuple)):
        wrong = [token for token in value if bad(token)]
        if not value or wrong:
            return (f"the list {list(value)!r} must hold token ids in [0, vocab_size={vocab_size})"
                    + (f"; {wrong!r} are not" if wrong else ""))
        return None
    if bad(value):
        kind = "a token id or a list of token ids" if key in _ID_LIST_KEYS else "a token id"
        never = f", {NEVER_STOP_EOS} (never stop)" if key == "eos_token_id" else ""
        return f"{value!r} must be {kind} in [0, vocab_size={vocab_size}){never} or null"
    return None


_ID_LIST_KEYS = ("eos_token_id", "forced_eos_token_id")
_UNSET = object()  # a token id argument not given
RELEASE_TOKEN_IDS = {"pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586}


def text_token_ids(given: dict, vocab_size: int) -> dict:
    """pad/bos/eos ids of a text config: those given (checked against the vocabulary), else the release's where the
    vocabulary holds them, else null, as transformers' configs leave ids unset (a small test or new vocabulary)."""
    given = {key: value for key, value in given.items() if value is not _UNSET}
    check_token_ids(given, vocab_size)
    return {key: given.get(key, default if _is_int(vocab_size) and default < vocab_size else None)
            for key, default in RELEASE_TOKEN_IDS.items()}


def check_token_ids(values, vocab_size: int, prefix: str = "") -> None:
    """`pad/bos/eos_token_id` of a config or a generation config (a dict or an object), and a generation config's
    `forced_bos/forced_eos_token_id`: each null, or an id inside the vocabulary (eos and forced eos also a non-empty
    list of them). An id outside it would index past the embedding table or the logits (an IndexError in generate)."""
    get = values.get if isinstance(values, dict) else lambda key: getattr(values, key, None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "forced_bos_token_id", "forced_eos_token_id"):
        problem = _token_id_problem(key, get(key), vocab_size)
        if problem is not None:
            raise _config_error(prefix + key, problem)


def _check_quantization_config(quant) -> None:
    """The release's compressed-tensors MXFP4 description is read, not followed: the experts are decoded as MXFP4
    with groups of 32 whatever it says, so another format or group size would be decoded wrongly; refused."""
    if quant is None:
        return
    if not isinstance(quant, dict):
        raise _config_error("quantization_config", f"must be a JSON object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method is not None and method != _QUANT_METHOD:
        raise _config_error("quantization_config.quant_method",
                            f"{method!r}: Kimi K3 reads only the release's {_QUANT_METHOD!r} MXFP4 experts")
    formats = [("quantization_config.format", quant.get("format"))]
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise _config_error("quantization_config.config_groups", f"must be a JSON object, got {groups!r:.80}")
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise _config_error(where, f"must be a JSON object, got {group!r:.80}")
        formats.append((f"{where}.format", group.get("format")))
        weights = group.get("weights") or {}
        if not isinstance(weights, dict):
            raise _config_error(f"{where}.weights", f"must be a JSON object, got {weights!r:.80}")
        bits = weights.get("num_bits")
        if bits is not None and (not _is_int(bits) or bits != 4):
            raise _config_error(f"{where}.weights.num_bits", f"{bits!r}: the experts are decoded as MXFP4, 4 bits a "
                                "value; another width would be decoded wrongly")
        size = weights.get("group_size")
        if size is not None and size != _QUANT_GROUP_SIZE:
            raise _config_error(f"{where}.weights.group_size",
                                f"{size!r}: the MXFP4 experts are decoded in groups of {_QUANT_GROUP_SIZE} (the MX "
                                "format's block size); another group size would be decoded wrongly")
    for key, value in formats:
        if value is not None and value != _QUANT_FORMAT:
            raise _config_error(key, f"{value!r} is not a format Kimi K3 decodes (only {_QUANT_FORMAT!r})")


def _check_fields(values, rules: dict, prefix: str = "") -> None:
    for key, (rule, optional) in rules.items():
        value = values.get(key)
        if value is None and optional:
            continue
        if not _RULES[rule](value):
            raise _config_error(prefix + key, f"must be {rule}, got {value!r}")


class _FolderCodeOnly:
    """A local folder's config names only the folder's own code: its `auto_map` is checked when the config is read
    (`files_kimi_k3.check_auto_map`: `module.Class`, module.py in the folder defining Class; no path, no `..`, no other
    repo), before transformers imports the model class it names. Python's import runs a file as it loads it, so a
    check after that would come too late."""

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, rest = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        source = pretrained_model_name_or_path
        if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
            folder = os.path.join(os.fspath(source), kwargs.get("subfolder") or "")
            check_auto_map(folder, config_dict, os.path.join(folder, "config.json"))
        return config_dict, rest


class KimiK3TextConfig(_FolderCodeOnly, PretrainedConfig):
    r"""Configuration of the Kimi K3 text backbone (KDA + gated NoPE-MLA, Block Attention Residuals, Stable LatentMoE).

    Field names follow the release (`num_experts`, `num_experts_per_token`, `linear_attn_config`, ...). Optional K3
    features fall back to Kimi Linear behaviour when absent: no `gate_lower_bound` gives the softplus decay, no
    `use_full_rank_gate` gives the low-rank `g_a/g_b` output gate, no `attn_res_block_size` gives a plain residual
    stream, no `routed_expert_hidden_size` gives experts at full width.

    Derived (not stored in the release): `layer_types` (`linear_attention` for KDA, `full_attention` for MLA) and
    `mlp_layer_types` (`dense` / `sparse`).
    """

    model_type = "kimik3_text"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    base_model_tp_plan = KIMI_K3_TP_PLAN
    base_model_ep_plan = KIMI_K3_EP_PLAN
    attribute_map = {
        "num_local_experts": "num_experts",
        "n_routed_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "n_group": "num_expert_group",
        "norm_topk_prob": "moe_renormalize",
    }

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 33792,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 96,
        num_key_value_heads: int | None = None,
        hidden_act: str = "situ",
        activation_situ_beta: float | None = None,
        activation_situ_linear_beta: float | None = None,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        mla_rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = _UNSET,
        bos_token_id: int | None = _UNSET,
        eos_token_id: int | list[int] | None = _UNSET,
        tie_word_embeddings: bool = False,
        max_position_embeddings: int = 1048576,
        # MLA
        q_lora_rank: int | None = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = False,
        attention_dropout: float = 0.0,
        mla_prefill_block_size: int = 16384,
        # KDA
        linear_attn_config: dict | None = None,
        kda_chunk_size: int = 64,
        # Block Attention Residuals
        attn_res_block_size: int | None = None,
        # MoE
        num_experts: int | None = 896,
        num_experts_per_token: int = 16,
        num_shared_experts: int = 2,
        moe_intermediate_size: int = 3072,
        routed_expert_hidden_size: int | None = None,
        latent_moe_use_norm: bool = False,
        experts_format: str = DEFAULT_EXPERTS_FORMAT,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        routed_scaling_factor: float = 1.0,
        num_expert_group: int = 1,
        topk_group: int = 1,
        use_grouped_topk: bool = True,
        topk_method: str = "noaux_tc",
        # Quantile Balancing (training only, docs/architecture.md)
        quantile_balancing: bool = False,
        quantile_balancing_bins: int = 512,
        num_nextn_predict_layers: int = 0,
        layer_types: list[str] | None = None,
        mlp_layer_types: list[str] | None = None,
        **kwargs,
    ):
        # The nested release dict says `kimi_linear`; it is the same schema, read by this class.
        _check_model_type(kwargs, _TEXT_MODEL_TYPES)
        _check_dtype(kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.mla_rms_norm_eps = mla_rms_norm_eps
        self.use_cache = use_cache
        self.max_position_embeddings = max_position_embeddings

        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.attention_dropout = attention_dropout
        self.mla_prefill_block_size = mla_prefill_block_size

        self.linear_attn_config = copy.deepcopy(linear_attn_config) if linear_attn_config is not None else None
        self.kda_chunk_size = kda_chunk_size
        self.attn_res_block_size = attn_res_block_size

        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.experts_format = experts_format
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.routed_scaling_factor = routed_scaling_factor
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.use_grouped_topk = use_grouped_topk
        self.topk_method = topk_method
        self.quantile_balancing = quantile_balancing
        self.quantile_balancing_bins = quantile_balancing_bins
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.tie_word_embeddings = tie_word_embeddings

        _check_fields(vars(self), _TEXT_FIELD_RULES)
        if vocab_size > MAX_VOCAB_SIZE:
            raise _config_error("vocab_size", f"{vocab_size:,} is more than the {MAX_VOCAB_SIZE:,} token ids a Kimi K3 "
                                "config may have (the release has 163,840)")
        if topk_method not in SUPPORTED_TOPK_METHODS:
            raise _config_error("topk_method", f"{topk_method!r} is not one the model implements "
                                f"{list(SUPPORTED_TOPK_METHODS)} (sigmoid scores, bias for selection only)")
        if num_hidden_layers > MAX_HIDDEN_LAYERS:
            raise _config_error("num_hidden_layers", f"{num_hidden_layers} is more than the {MAX_HIDDEN_LAYERS} layers "
                                "a Kimi K3 config may have (the release has 93)")
        ids = text_token_ids({"pad_token_id": pad_token_id, "bos_token_id": bos_token_id,
                              "eos_token_id": eos_token_id}, vocab_size)
        pad_token_id, bos_token_id, eos_token_id = (ids[key] for key in RELEASE_TOKEN_IDS)
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        _check_fields(self._lac(), _LINEAR_ATTN_FIELD_RULES, "linear_attn_config.")
        derived_layer_types = self._derive_layer_types()
        if layer_types is not None and list(layer_types) != derived_layer_types:
            raise _config_error(
                "layer_types",
                "does not match linear_attn_config.kda_layers / full_attn_layers "
                f"(given {list(layer_types)}, derived {derived_layer_types})",
            )
        self.layer_types = derived_layer_types
        derived_mlp_types = self._derive_mlp_layer_types()
        if mlp_layer_types is not None and list(mlp_layer_types) != derived_mlp_types:
            if num_experts == 0 and "sparse" in mlp_layer_types:
                raise _config_error(
                    "num_experts", "0 leaves no routed experts, so every MLP is dense, yet mlp_layer_types marks "
                    f"layers {[i for i, t in enumerate(mlp_layer_types) if t == 'sparse']} sparse: give the experts "
                    "their number, or drop mlp_layer_types")
            raise _config_error(
                "mlp_layer_types",
                f"does not match first_k_dense_replace / moe_layer_freq (given {list(mlp_layer_types)}, "
                f"derived {derived_mlp_types})",
            )
        self.mlp_layer_types = derived_mlp_types
        super().__init__(**kwargs)
        # transformers 5.x strips generation keys of the release's boilerplate into a generation config; the
        # token ids are model facts and must stay.
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        self._validate()

    # ----------------------------------------------------------------------------------------------------------
    # Derived quantities
    @property
    def linear_num_heads(self) -> int:
        return int(self._lac().get("num_heads", self.num_attention_heads))

    @property
    def linear_head_dim(self) -> int:
        return int(self._lac().get("head_dim", self.qk_nope_head_dim))

    @property
    def linear_conv_kernel_size(self) -> int:
        return int(self._lac().get("short_conv_kernel_size", 4))

    @property
    def gate_lower_bound(self) -> float | None:
        value = self._lac().get("gate_lower_bound")
        return None if value is None else float(value)

    @property
    def use_full_rank_gate(self) -> bool:
        return bool(self._lac().get("use_full_rank_gate", False))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Values cached per token per MLA layer: normalised latent followed by the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def mla_prefill_key_block(self, queries: int) -> int:
        """Cached keys the blockwise MLA prefill of a chunk of `queries` expands at a time. Each block costs one
        merge into the chunk's f32 output whatever its size, so a block holds at least twice the chunk's queries: a
        32K chunk over 256K cached keys ran at 609 TFLOP/s with 64K-key blocks, 572 with 16K (docs/benchmarks.md,
        1M-token prompt), and the expanded block's workspace stays of the order of the merge's own."""
        return max(self.mla_prefill_block_size, 2 * queries)

    @property
    def latent_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def kda_layer_indices(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def mla_layer_indices(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def _lac(self) -> dict:
        return self.linear_attn_config or {}

    def _derive_layer_types(self) -> list[str]:
        n = self.num_hidden_layers
        lac = self._lac()
        if not lac:
            return ["full_attention"] * n
        kda = lac.get("kda_layers") or []
        full = lac.get("full_attn_layers") or []
        for key, values in (("kda_layers", kda), ("full_attn_layers", full)):
            for v in values:
                if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= n:
                    raise _config_error(
                        f"linear_attn_config.{key}",
                        f"entry {v!r} is not a 1-based layer index in 1..num_hidden_layers={n}",
                    )
            if len(set(values)) != len(values):
                raise _config_error(f"linear_attn_config.{key}", "lists a layer twice")
        both = sorted(set(kda) & set(full))
        if both:
            raise _config_error(
                "linear_attn_config.kda_layers/full_attn_layers",
                f"1-based layer(s) {both} are in both lists",
            )
        listed = set(kda) | set(full)
        neither = [i for i in range(1, n + 1) if i not in listed]
        if neither:
            raise _config_error(
                "linear_attn_config.kda_layers/full_attn_layers",
                f"1-based layer(s) {neither} are in neither list",
            )
        kda_set = set(kda)
        return ["linear_attention" if (i + 1) in kda_set else "full_attention" for i in range(n)]

    def _derive_mlp_layer_types(self) -> list[str]:
        if not self.num_experts:
            return ["dense"] * self.num_hidden_layers
        return [
            "sparse" if (i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0) else "dense"
            for i in range(self.num_hidden_layers)
        ]

    def _validate(self) -> None:
        """Relations between fields (each field's own type and range is checked by `_check_fields` first)."""
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise _config_error(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
            )
        if self.hidden_act not in _SUPPORTED_ACTIVATIONS:
            raise _config_error("hidden_act", f"{self.hidden_act!r} is not one of {_SUPPORTED_ACTIVATIONS}")
        if self.num_experts:
            if self.num_experts_per_token > self.num_experts:
                raise _config_error(
                    "num_experts_per_token",
                    f"top-k {self.num_experts_per_token} is larger than num_experts={self.num_experts}",
                )
            if self.quantile_balancing and self.num_experts_per_token + 1 > self.num_experts:
                raise _config_error(
                    "quantile_balancing", "needs num_experts_per_token + 1 <= num_experts (top-(k+1) routing)"
                )
            if self.num_experts % self.num_expert_group != 0:
                raise _config_error(
                    "num_expert_group", f"{self.num_expert_group} does not divide num_experts={self.num_experts}"
                )
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise _config_error("topk_group", f"must be in 1..num_expert_group, got {self.topk_group}")
            if self.moe_router_activation_func != "sigmoid":
                raise _config_error(
                    "moe_router_activation_func", f"only 'sigmoid' is supported, got {self.moe_router_activation_func!r}"
                )
        fmt = FORMATS.get(self.experts_format) if isinstance(self.experts_format, str) else None
        if fmt is None:
            allowed = " or ".join(repr(name) for name in FORMATS)
            raise _config_error("experts_format", f"must be {allowed}, got {self.experts_format!r}")
        problem = fmt.size_problem({key: getattr(self, key) for key in ("moe_intermediate_size", "latent_size")}) \
            if self.num_experts else None
        if problem:
            raise _config_error("experts_format", problem)
        if self.mla_use_nope is False:
            raise _config_error("mla_use_nope", "Kimi K3 MLA has no positional encoding; rotary MLA is not supported")
        quant = getattr(self, "quantization_config", None)
        _check_quantization_config(quant)
        if quant is not None and self.num_experts:
            for key in ("moe_intermediate_size", "routed_expert_hidden_size"):
                value = getattr(self, key)
                if value is not None and value % _QUANT_GROUP_SIZE != 0:
                    raise _config_error(key, f"{value} is not a multiple of the MXFP4 group size {_QUANT_GROUP_SIZE}")


# Vision settings the tower divides by or builds from, checked where present (a config without `vt_hidden_size`
# describes no tower; a tower config missing one of them is refused when the tower is built, naming it).
_VISION_FIELD_RULES = {
    "patch_size": "a positive integer",
    "vt_hidden_size": "a positive integer",
    "vt_num_attention_heads": "a positive integer",
    "vt_num_hidden_layers": "a non-negative integer",
    "vt_intermediate_size": "a positive integer",
    "qkv_hidden_size": "a positive integer",
    "mm_hidden_size": "a positive integer",
    "text_hidden_size": "a positive integer",
    "init_pos_emb_height": "a positive integer",
    "init_pos_emb_width": "a positive integer",
    "init_pos_emb_time": "a positive integer",
    "projector_ln_eps": "a finite positive number",
}


def _check_vision_fields(values: dict) -> None:
    prefix = ""  # inside the composite config, _sub_config names the key `vision_config.<key>`
    for key, rule in _VISION_FIELD_RULES.items():
        if key in values and not _RULES[rule](values[key]):
            raise _config_error(prefix + key, f"must be {rule}, got {values[key]!r}")
    if "merge_kernel_size" in values:
        kernel = values["merge_kernel_size"]
        sides = [kernel] if _is_int(kernel) else kernel
        if not isinstance(sides, (list, tuple)) or len(sides) not in (1, 2) or not all(
                _is_int(side) and side > 0 for side in sides):
            raise _config_error(prefix + "merge_kernel_size",
                                f"must be a positive integer or a list of two, got {kernel!r}")
    heads = values.get("vt_num_attention_heads")
    # the attention width is qkv_hidden_size when given (the release: 1536 = 12 heads x 128), else the tower width
    width_key = "qkv_hidden_size" if values.get("qkv_hidden_size") is not None else "vt_hidden_size"
    width = values.get(width_key)
    if heads is not None and width is not None:
        if width % heads:
            raise _config_error(prefix + "vt_num_attention_heads",
                                f"{heads} heads do not divide {width_key}={width}")
        if (width // heads) % 4:
            # the 2-D rotary embedding rotates channel pairs for rows and columns: head_dim / 4 frequencies
            raise _config_error(prefix + "vt_num_attention_heads",
                                f"{heads} heads give a head dim of {width // heads} ({width_key}={width}); the 2-D "
                                "rotary embedding needs a multiple of 4")


class KimiK3VisionConfig(_FolderCodeOnly, PretrainedConfig):
    """MoonViT-3d tower + PatchMergerMLPV2 projector settings, carried unchanged in the release's keys (`vt_*`,
    `patch_size`, `merge_kernel_size`, `mm_hidden_size`, `text_hidden_size`, `projector_ln_eps`, ...; see
    vision_kimi_k3.py). A vision config without them (`vision_config=None`) describes a model with no tower."""

    model_type = "kimik3_vision"

    def __init__(self, **kwargs):
        _check_model_type(kwargs, _VISION_MODEL_TYPES)
        _check_dtype(kwargs)
        _check_vision_fields(kwargs)
        attn = kwargs.pop("_attn_implementation", None)
        self._release_vision_keys = sorted(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)
        super().__init__()
        if attn is not None:
            self.release_attn_implementation = attn

    @property
    def describes_tower(self) -> bool:
        """Whether these settings define a vision tower (the release's do; an empty vision config does not)."""
        return getattr(self, "vt_hidden_size", None) is not None



def _sub_config(key: str, value, config_class):
    """None -> defaults, a dict -> `config_class(**dict)`; errors inside it name `key.field`."""
    if value is None:
        return config_class()
    if isinstance(value, config_class):
        return value
    if not isinstance(value, dict):
        raise _config_error(key, f"must be a JSON object, got {type(value).__name__} {value!r:.80}")
    try:
        return config_class(**value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("config, key `", f"config, key `{key}.", 1)) from None


class KimiK3Config(_FolderCodeOnly, PretrainedConfig):
    r"""The released top-level (multimodal) Kimi K3 configuration.

    Loads the release's `config.json` unchanged: `text_config` becomes a `KimiK3TextConfig` (the nested
    `quantization_config` stays on it, describing the release's MXFP4 experts), `vision_config` a `KimiK3VisionConfig`.
    """

    model_type = "kimik3"
    sub_configs = {"text_config": KimiK3TextConfig, "vision_config": KimiK3VisionConfig}

    def __init__(
        self,
        text_config: dict | KimiK3TextConfig | None = None,
        vision_config: dict | KimiK3VisionConfig | None = None,
        ignore_index: int = -100,
        media_placeholder_token_id: int = 163605,
        image_placeholder: str = "<|kimi_image_placeholder|>",
        pad_token_id: int | None = _UNSET,
        bos_token_id: int | None = _UNSET,
        eos_token_id: int | list[int] | None = _UNSET,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        _check_model_type(kwargs, _COMPOSITE_MODEL_TYPES)
        _check_dtype(kwargs)
        given_ids = {key: value for key, value in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id),
                                                   ("eos_token_id", eos_token_id)) if value is not _UNSET}
        pad_token_id, bos_token_id, eos_token_id = (given_ids.get(key, default) for key, default in
                                                    RELEASE_TOKEN_IDS.items())
        text_config = _sub_config("text_config", text_config, KimiK3TextConfig)
        # ids given here index the text model's vocabulary (the defaults, the release's, are only checked when given:
        # a composite built around a small text config keeps them unread)
        check_token_ids(given_ids, text_config.vocab_size)
        if media_placeholder_token_id is not None and not _is_int(media_placeholder_token_id):
            # compared with input_ids in every prefill: a string failed there, True matched id 1
            raise _config_error("media_placeholder_token_id", f"{media_placeholder_token_id!r} must be a token id "
                                "(a whole number) or null")
        vision_config = _sub_config("vision_config", vision_config, KimiK3VisionConfig)
        self.text_config = text_config
        self.vision_config = vision_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.image_placeholder = image_placeholder
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        # the release names this config `kimi_k3`; read as ours, so loading a release folder does not warn that the
        # checkpoint is of another model type
        config_dict, kwargs = super().get_config_dict(*args, **kwargs)
        if config_dict.get("model_type") == "kimi_k3":
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    def get_text_config(self, *args, **kwargs) -> KimiK3TextConfig:
        return self.text_config

    def to_release_dict(self) -> dict:
        """The config in the release's schema (what `moonshotai/Kimi-K3` ships), for export.

        `json.dumps(config.to_release_dict(), indent=2, sort_keys=True)` of the released config reproduces the
        released file byte for byte.
        """
        text = self.text_config
        text_dict = dict(_RELEASE_TEXT_BOILERPLATE)
        text_dict["initializer_range"] = text.initializer_range
        for key in _RELEASE_TEXT_KEYS:
            text_dict[key] = copy.deepcopy(getattr(text, key))
        text_dict.update(
            architectures=["KimiLinearForCausalLM"],
            auto_map=dict(_RELEASE_TEXT_AUTO_MAP),
            dtype="bfloat16",
            model_type=_RELEASE_TEXT_MODEL_TYPE,
            transformers_version="4.56.2",
        )
        quant = getattr(text, "quantization_config", None)
        if quant is not None:
            text_dict["quantization_config"] = copy.deepcopy(quant)
        vision = self.vision_config
        vision_dict = {key: copy.deepcopy(getattr(vision, key)) for key in vision._release_vision_keys}
        if getattr(vision, "release_attn_implementation", None) is not None:
            vision_dict["_attn_implementation"] = vision.release_attn_implementation
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "auto_map": dict(_RELEASE_AUTO_MAP),
            "bos_token_id": self.bos_token_id,
            "dtype": "bfloat16",
            "eos_token_id": self.eos_token_id,
            "ignore_index": self.ignore_index,
            "image_placeholder": self.image_placeholder,
            "media_placeholder_token_id": self.media_placeholder_token_id,
            "model_type": "kimi_k3",
            "pad_token_id": self.pad_token_id,
            "text_config": text_dict,
            "tie_word_embeddings": self.tie_word_embeddings,
            "vision_config": vision_dict,
        }


__all__ = ["KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig"]
