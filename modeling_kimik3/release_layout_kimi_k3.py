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
"""Loading the release checkpoint as it is on disk, through transformers' own loading machinery.

The release differs from our layout in four ways (docs/architecture.md, The release's files), each a transform below:
  * the MoE block is `block_sparse_moe` (ours `mlp`; the dense layer is `mlp` in both);
  * routed experts are per-expert `experts.{E}.w1/w3/w2` (ours fused: gate_up_proj [E, 2I, Dl] = w1 rows then w3
    rows, down_proj [E, Dl, I] = w2), stored MXFP4 (`weight_packed` + `weight_scale`) or plain bf16 (`weight`);
    MXFP4 experts are kept packed (`experts_format="mxfp4"`) or dequantised exactly (the default, "dense");
  * `A_log` is zero-padded from H heads to 128;
  * the composite model nests the text model under `language_model.` (a text-only model strips it).
The transforms are registered for `KimiK3ForCausalLM` (5.17+ applies no library mapping to custom code, so this is
the only one applied) by the first from_pretrained (`check_release_load`), not at import; the composite class
reaches it as its `language_model` sub-model, scoped to that prefix.
Conversions are reversed by `save_pretrained`, which thus writes a release-loaded model back in the release layout.
The names come from one table, the release name map below, from which `kimik3/name_map.py` generates the
converter's rules as well; `tests/test_release_loading.py` runs both on every release tensor name pattern.
"""

import contextlib
import copy
import os
import re

import torch
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)

from .compat_kimi_k3 import register_checkpoint_conversion_mapping
from .configuration_kimi_k3 import DEFAULT_EXPERTS_FORMAT, check_experts_format
from .experts_format_kimi_k3 import DENSE, E8M0_INF, EXPERTS_FORMATS, is_experts_module
from .experts_format_kimi_k3 import experts_format as format_named
from .experts_format_kimi_k3 import RELEASE as RELEASE_FORMAT
from .files_kimi_k3 import KimiK3LoadError, check_pretrained_folder, weight_files
from .ops_kimi_k3 import dequantize_mxfp4, quantize_mxfp4
from .parallel_kimi_k3 import (
    PARALLEL_LOAD_KWARGS,
    compact_local_shards,
    gather_read_shards,
    global_index,
    local_part,
    local_shard,
    register_shard_styles,
)
from .saving_kimi_k3 import loaded_release_layout



# ------------------------------------------------------------------------------------------------------------------
# The release name map: the one table of how the release's tensor names become ours. The transforms below are built
# from it, and so are the converter's rules (`kimik3/name_map.py` imports these names and generates its rules of the
# MoE block, the experts and A_log from them).

# The composite release nests the text model under this prefix (our composite model too; a text-only model drops it).
RELEASE_TEXT_PREFIX = "language_model."
# The MoE block: the release's `block_sparse_moe.<child>` is our `mlp.<child>` for exactly these children (the dense
# layer's `mlp.gate_proj` etc. is `mlp` in both and must not match).
RELEASE_MOE_BLOCK, OUR_MOE_BLOCK = "block_sparse_moe", "mlp"
MOE_CHILD_PREFIXES = ("gate.", "experts.", "routed_expert_", "shared_experts.")
# Fused expert tensors and the release parts stacked into them (rows: parts in this order). The release holds one
# tensor per expert and part, `<block>.experts.{E}.{part}.<suffix>`, with these suffixes by experts format; a fused
# tensor kept packed is our `<fused>` + the suffix of each packed part.
EXPERT_PARTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
# Each format's per-expert release suffixes, and the release's stored (packed) suffixes -> ours (experts_format_kimi_k3)
RELEASE_EXPERT_SUFFIXES = {name: fmt.release_suffixes for name, fmt in EXPERTS_FORMATS.items()}
OUR_PACKED_SUFFIXES = dict(zip(RELEASE_FORMAT.release_suffixes, RELEASE_FORMAT.suffixes))
# The release stores A_log zero-padded to this many heads (96 real); save pads back to max(this, heads).
RELEASE_A_LOG_LENGTH = 128
# The children as one regex group. `[.]`, not `\.`: transformers 5.17 unescapes `\.` inside the group when it
# reverses the pattern for save_pretrained.
MOE_CHILDREN = "(" + "|".join(child.replace(".", "[.]") for child in MOE_CHILD_PREFIXES) + ")"

# Errors raised by the ops during one from_pretrained: transformers records an op's exception in its load report and
# raises a generic RuntimeError; `check_release_load` turns these into the error the user sees.
_OP_ERRORS: list[str] = []


def _fail(message: str):
    _OP_ERRORS.append(message)
    raise KimiK3LoadError(message)


def _tensors(values) -> list[torch.Tensor]:
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _release_expert_name(fused_name: str, expert, part: str, suffix: str) -> str:
    """Our fused name (`...mlp.experts.gate_up_proj`) -> one release tensor (`...block_sparse_moe.experts.3.w1.weight`)."""
    prefix = fused_name.rsplit(f"{OUR_MOE_BLOCK}.experts.", 1)[0]
    return f"{prefix}{RELEASE_MOE_BLOCK}.experts.{expert}.{part}.{suffix}"


def _as_codes(tensor: torch.Tensor) -> torch.Tensor:
    # The loader casts every source to its target's dtype before the ops run: u8 codes arrive as bf16/f32 integers
    # 0..255, which both represent exactly.
    return tensor if tensor.dtype == torch.uint8 else tensor.to(torch.uint8)


def _check_expert_count(found: int, config, fused_name: str, part: str, suffix: str) -> None:
    expected = config.get_text_config().num_experts
    if found != expected:
        _fail(f"`{_release_expert_name(fused_name, '{E}', part, suffix)}`: found {found} experts, config.json has "
              f"num_experts={expected} (a missing or extra per-expert tensor)")


def mxfp4_overflow_message(index, byte: int, code: float, dtype: torch.dtype) -> str:
    result = "nan" if byte == E8M0_INF and code == 0 else ("-inf" if code < 0 else "inf")
    return (f"E8M0 scale byte 0x{byte:02X} at {list(index)} with code {code} gives {result} in "
            f"{str(dtype).removeprefix('torch.')}: a valid scale byte, but the weight it scales does not fit the "
            "dtype; refusing non-finite weights")


def check_stored_experts(model) -> None:
    """Experts kept in a coded format (packed MXFP4) are decoded to the compute dtype at every forward: each value
    must decode to a finite one in it (the floating dtype of the model's parameters), checked once at load; the format
    says which do not. Errors name the release tensor and our fused one. Under tensor or expert parallelism each rank
    checks its own share, with no collective, and names the whole tensor's index."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        fmt = module.format
        for fused in module.STACKS:
            tensors = module.stored(fused)
            if any(t.device.type == "meta" for t in tensors) or tensors[-1].dim() != 3:
                continue
            found = fmt.first_overflow(tuple(local_shard(t) for t in tensors), dtype)
            if found is None:
                continue
            local_index, byte, code = found
            expert, row, group = global_index(tensors[-1], local_index)
            parts = EXPERT_PARTS[fused]
            part = parts[row // (tensors[-1].shape[1] // len(parts))]
            ours = f"{name}.{fused}{fmt.suffixes[-1]}"
            raise KimiK3LoadError(
                f"`{_release_expert_name(ours, expert, part, fmt.release_suffixes[-1])}` (our `{ours}`): "
                + mxfp4_overflow_message([expert, row, group], byte, code, dtype)
            )


class DequantizeMxfp4Experts(ConversionOps):
    """Per-expert MXFP4 parts (sources: packed, scale of each part in turn) -> one fused dense tensor [E, rows, K] in
    the parameter's dtype, exact (E2M1 x 2^k is representable in bf16/f32). Fills the output an expert at a time, so
    the only extra memory is one expert's values. An infinite value (scale byte 255) is an error naming the expert."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, model=None, config=None, full_layer_name=None,
                **kwargs):
        fused = full_layer_name or target_patterns[0]
        parts = EXPERT_PARTS[fused.rsplit(".", 1)[-1]]
        packed = [_tensors(input_dict.pop(p)) for p in source_patterns[0::2]]
        scales = [_tensors(input_dict.pop(s)) for s in source_patterns[1::2]]
        for part, part_packed, part_scales in zip(parts, packed, scales):
            _check_expert_count(len(part_packed), config, fused, part, "weight_packed")
            _check_expert_count(len(part_scales), config, fused, part, "weight_scale")
        try:
            dtype = model.get_parameter(fused).dtype
        except (AttributeError, TypeError):
            dtype = torch.bfloat16
        first = packed[0][0]
        rows = sum(p[0].shape[0] for p in packed)
        out = torch.empty(len(packed[0]), rows, first.shape[-1] * 2, dtype=dtype, device=first.device)
        for expert in range(out.shape[0]):
            row = 0
            for part, part_packed, part_scales in zip(parts, packed, scales):
                codes, scale = _as_codes(part_packed[expert]), _as_codes(part_scales[expert])
                if bool((scale == E8M0_INF).any()):
                    _fail(f"`{_release_expert_name(fused, expert, part, 'weight_scale')}` has the E8M0 byte 255 "
                          "(2^128 = inf): non-finite weights")
                overflow = RELEASE_FORMAT.first_overflow((codes, scale), dtype)
                if overflow is not None:
                    _fail(f"`{_release_expert_name(fused, expert, part, 'weight_scale')}`: "
                          + mxfp4_overflow_message(*overflow, dtype))
                values = dequantize_mxfp4(codes, scale, dtype)
                out[expert, row:row + values.shape[0]] = values
                row += values.shape[0]
                part_packed[expert] = part_scales[expert] = None  # free the sources as we go
        return {target_patterns[0]: out}

    @property
    def reverse_op(self) -> ConversionOps:
        return QuantizeMxfp4Experts()


class QuantizeMxfp4Experts(ConversionOps):
    """The reverse for save_pretrained: fused dense experts -> per-expert MXFP4 parts (targets: packed, scale of each
    part). Round-to-nearest with the OCP scale rule: bit-exact for weights that were dequantised from MXFP4 and not
    changed; weights changed since (fine-tuning) are rounded to MXFP4, as the release format requires."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        fused = _tensors(next(iter(input_dict.values())))[0]
        parts = len(target_patterns) // 2
        rows = fused.shape[1] // parts
        out = {}
        for expert in range(fused.shape[0]):
            for index in range(parts):
                packed, scale = quantize_mxfp4(fused[expert, index * rows:(index + 1) * rows])
                out[target_patterns[2 * index].replace("*", str(expert))] = packed
                out[target_patterns[2 * index + 1].replace("*", str(expert))] = scale
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return DequantizeMxfp4Experts()


class RejectInfiniteScales(ConversionOps):
    """Kept-packed scales: the fused E8M0 bytes pass through unchanged unless one is 255 (inf), an error naming the
    release tensor. Its own reverse (a pass-through on save)."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        for name, values in list(input_dict.items()):
            scale = _tensors(values)[0]
            if full_layer_name is not None and scale.dim() == 2:
                # transformers 5.17's SplitModulelist (save) squeezes every size-1 dim: per-expert [rows, 1]
                # scales (input dim 32) were written as [rows]
                scale = input_dict[name] = scale.unsqueeze(-1)
            if full_layer_name is not None and scale.dim() == 3 and bool((scale == E8M0_INF).any()):
                expert, row = (int(i) for i in (scale == E8M0_INF).nonzero()[0, :2])
                fused = full_layer_name.removesuffix("_scale")
                parts = EXPERT_PARTS[fused.rsplit(".", 1)[-1]]
                part = parts[row * len(parts) // scale.shape[1]]
                _fail(f"`{_release_expert_name(fused, expert, part, 'weight_scale')}` has the E8M0 byte 255 "
                      "(2^128 = inf): non-finite weights")
        return input_dict

    @property
    def reverse_op(self) -> ConversionOps:
        return self


class UnpadHeads(ConversionOps):
    """A_log: the release stores [128] for 96 heads, the tail exactly +0.0 (docs/architecture.md, Release traps). Any
    length >= H is accepted; a non-zero tail would mean a per-channel reading of the tensor, an error.

    Under tensor parallelism transformers' shard-on-read loader has cut the file's tensor by the parameter's
    placements over the file's length (its [128], not the H heads), so this rank holds a share of the file, not its
    heads: the shares are all-gathered (`gather_read_shards`, a few hundred bytes a layer) and the whole tensor is
    checked as in one process, every rank alike, before this rank keeps its heads (docs/design.md, Parallelism)."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, config=None, full_layer_name=None, **kwargs):
        tensor = _tensors(next(iter(input_dict.values())))[0]
        heads = config.get_text_config().linear_num_heads
        name = full_layer_name or target_patterns[0]
        sharded = _sharded_parameter(kwargs.get("model"), full_layer_name)
        if sharded is not None:
            if tensor.dim() != 1:  # the same on every rank (one file), so no rank waits in the gather below
                _fail(f"`{name}`: expected a 1-D tensor of length >= {heads} (one entry per head, zero-padded), "
                      f"found a {tensor.dim()}-D one")
            tensor = gather_read_shards(tensor, sharded)
        if tensor.dim() != 1 or tensor.shape[0] < heads:
            _fail(f"`{name}`: expected a 1-D tensor of length >= {heads} (one entry per head, zero-padded), found "
                  f"shape {list(tensor.shape)}")
        tail = tensor[heads:]
        if bool((tail != 0).any()) or bool(torch.signbit(tail).any()):
            _fail(f"`{name}`: entries {heads}..{tensor.shape[0] - 1} must be the +0.0 padding of a {heads}-head "
                  "A_log, found other values")
        live = tensor[:heads]
        return {target_patterns[0]: (live if sharded is None else local_part(live, sharded)).clone()}

    @property
    def reverse_op(self) -> ConversionOps:
        return PadHeads()


def _sharded_parameter(model, name):
    """The parameter `name` of `model` when it is a DTensor split along its heads (tensor parallel); else None."""
    if model is None or not name:
        return None
    try:
        parameter = model.get_parameter(name)
    except AttributeError:
        return None
    placements = getattr(parameter, "placements", ())
    return parameter if any(getattr(p, "dim", None) is not None for p in placements) else None


class PadHeads(ConversionOps):
    """The reverse for save_pretrained: A_log [H] -> [max(128, H)] with a +0.0 tail, as the release stores it."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensor = _tensors(next(iter(input_dict.values())))[0]
        padded = tensor.new_zeros(max(RELEASE_A_LOG_LENGTH, tensor.shape[0]))
        padded[: tensor.shape[0]] = tensor
        return {target_patterns[0]: padded}

    @property
    def reverse_op(self) -> ConversionOps:
        return UnpadHeads()


def _expert_sources(parts, suffix: str) -> list[str]:
    # `(?!_)`: `w1.weight` must not match `w1.weight_packed` (transformers 5.17 matches patterns as plain substrings;
    # the lookahead is dropped when transformers reverses the pattern into a name for save_pretrained)
    return [f"experts.*.{part}.{suffix}" + ("(?!_)" if suffix == "weight" else "") for part in parts]


def _fused_target(name: str) -> str:
    # Reversed (save_pretrained), the target is a source pattern: it must not match the shared experts'
    # `shared_experts.down_proj` nor, on 5.17 (substring matching), `down_proj_packed`. Lookarounds are dropped
    # when transformers turns the pattern into a name.
    return f"(?<!shared_)experts.{name}(?![_a-z])"


def release_conversions(experts_format_name: str = DEFAULT_EXPERTS_FORMAT) -> list:
    """The transforms from the release layout to ours, relative to the text model (`KimiK3ForCausalLM`).
    `experts_format_name` picks what the release's packed experts become: kept as stored (its own format) or
    decoded to dense."""
    conversions = [
        WeightRenaming("^" + re.escape(RELEASE_TEXT_PREFIX), ""),
        WeightRenaming(re.escape(RELEASE_MOE_BLOCK + ".") + MOE_CHILDREN, OUR_MOE_BLOCK + r".\1"),
        WeightConverter("self_attn.A_log", "self_attn.A_log", [UnpadHeads()]),
    ]
    (plain,), packed = DENSE.release_suffixes, RELEASE_FORMAT.release_suffixes
    kept_as_stored = format_named(experts_format_name) is RELEASE_FORMAT
    for fused, parts in EXPERT_PARTS.items():
        merge = [MergeModulelist(dim=0)] + ([Concatenate(dim=1)] if len(parts) > 1 else [])
        # plain bf16 experts (a dense export, or a Kimi-Linear style checkpoint)
        conversions.append(WeightConverter(_expert_sources(parts, plain), _fused_target(fused), merge))
        if kept_as_stored:
            for suffix in packed:  # codes, then scales (whose infinite bytes are refused)
                checks = [RejectInfiniteScales()] if suffix == "weight_scale" else []
                conversions.append(WeightConverter(_expert_sources(parts, suffix),
                                                   _fused_target(fused + OUR_PACKED_SUFFIXES[suffix]),
                                                   copy.deepcopy(merge) + checks))
        else:
            sources = [s for part in parts for suffix in packed for s in _expert_sources((part,), suffix)]
            conversions.append(WeightConverter(sources, _fused_target(fused), [DequantizeMxfp4Experts()]))
    return conversions


def dense_experts_conversions(applied: list) -> list:
    """The conversions a release load records, as the load would have recorded them had it dequantised the experts
    (`experts_format="dense"`): what save_pretrained reverses once packed experts became dense (a LoRA merged into
    them), so that the release layout is written again, its experts quantised back to MXFP4."""
    packed_targets = tuple(OUR_PACKED_SUFFIXES.values())
    kept = [c for c in applied
            if not any(t.endswith(packed_targets) for t in getattr(c, "target_patterns", None) or ())]
    if len(kept) == len(applied):
        return list(applied)
    return kept + [c for c in release_conversions(DENSE.name)
                   if any(isinstance(op, DequantizeMxfp4Experts) for op in getattr(c, "operations", ()))]


def register_release_conversions(experts_format: str = DEFAULT_EXPERTS_FORMAT) -> None:
    """Registers the transforms for `KimiK3ForCausalLM` (and so for the composite model's `language_model`) and for
    `KimiK3TextBackbone` (the multimodal base model's `language_model`: the same tensors without the head). Called by
    each `check_release_load`, before transformers looks the mapping up, never at import: a load replaces the mapping
    with the one of its `experts_format`, so registering again is harmless."""
    if register_checkpoint_conversion_mapping is not None:
        for class_name in ("KimiK3ForCausalLM", "KimiK3TextBackbone"):
            register_checkpoint_conversion_mapping(class_name, release_conversions(experts_format), overwrite=True)


# ------------------------------------------------------------------------------------------------------------------
# from_pretrained: the load option and the checks


def release_name(our_name: str) -> str:
    """The release name of one of our tensor names, for messages (fused experts keep their fused name)."""
    return re.sub(re.escape(f".{OUR_MOE_BLOCK}.") + MOE_CHILDREN, f".{RELEASE_MOE_BLOCK}." + r"\1", our_name)


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies",
               "trust_remote_code")


def _resolve_config(model_class, pretrained, kwargs, experts_format):
    """(expert format, the release's quantization_config or None). The config is passed on (kwargs["config"]) only
    when the load changes it: with an `experts_format` option (for the composite config it belongs to the text
    config), or to hide the release's compressed-tensors `quantization_config`, from which transformers would build
    a quantizer, while the transforms here read the MXFP4 experts themselves."""
    config = kwargs.get("config")
    if config is None or isinstance(config, str):
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs and k != "trust_remote_code"}
        source, config_class = config or pretrained, model_class.config_class
        if "text_config" not in getattr(config_class, "sub_configs", {}):
            from .configuration_kimi_k3 import KimiK3Config

            if isinstance(KimiK3Config.get_config_dict(source, **hub)[0].get("text_config"), dict):
                # a text class given a composite config.json (the release's): its text model is the nested
                # text_config, read as the composite class reads it
                kwargs["config"] = KimiK3Config.from_pretrained(source, **hub).text_config
                config_class = None
        config = kwargs["config"] if config_class is None else config_class.from_pretrained(source, **hub)
    _check_device_map(model_class, config, kwargs.get("device_map"))
    release_quantization = getattr(config.get_text_config(), "quantization_config", None)
    if experts_format is None and release_quantization is None:
        return config.get_text_config().experts_format, None
    if experts_format is not None:
        check_experts_format(experts_format)
    config = copy.deepcopy(config)
    text = config.get_text_config()
    if experts_format is not None:
        text.experts_format = experts_format
    if release_quantization is not None:
        del text.quantization_config
    kwargs["config"] = config
    return text.experts_format, release_quantization


def meta_skeleton(model_class, config):
    """The model `config` builds, on the meta device (names and shapes, no memory, no weights read)."""
    with torch.device("meta"):
        return model_class(copy.deepcopy(config))


def _check_device_map(model_class, config, device_map) -> None:
    """A device_map that would load nothing real: the meta device (weights never loaded; transformers then failed
    in its weight conversion naming no option), or a key naming no module of the model (silently ignored)."""
    if device_map is None or isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0",
                                                                            "sequential"):
        return
    places = device_map.values() if isinstance(device_map, dict) else [device_map]
    if any(str(place) == "meta" or str(place).startswith("meta:") for place in places):
        raise ValueError(f"device_map={device_map!r} puts weights on the meta device, where they are never loaded; "
                         "name real devices (\"cpu\", \"cuda:0\", \"disk\"), or build the model on meta from its "
                         "config (with torch.device(\"meta\"): model_class(config)) to inspect it")
    if not isinstance(device_map, dict):
        return
    skeleton = meta_skeleton(model_class, config)
    modules = {name for name, _ in skeleton.named_modules()}
    names = [name for name, _ in skeleton.named_parameters()] + [name for name, _ in skeleton.named_buffers()]
    unknown = [key for key in device_map if key not in modules
               and not any(name == key or name.startswith(key + ".") for name in names)]
    if unknown:
        raise ValueError(f"device_map names {unknown!r}, which {model_class.__name__} does not have (its "
                         f"{config.get_text_config().num_hidden_layers} layers are model.layers.0 to "
                         f"model.layers.{config.get_text_config().num_hidden_layers - 1}; \"\" is the whole model)")


# Elements scanned at once by the finite check: its transient memory (a bool mask and the scan) stays a few MB, well
# below one layer even of small checkpoints, so a load's peak is the model plus the conversion of one tensor.
FINITE_CHECK_BLOCK = 1 << 21


def _check_finite(model) -> None:
    """No NaN/Inf may pass into a model silently: every loaded floating tensor is scanned, a block at a time."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not tensor.is_floating_point() or tensor.device.type == "meta" or hasattr(tensor, "to_local"):
            continue
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), FINITE_CHECK_BLOCK):
            block = flat[start:start + FINITE_CHECK_BLOCK]
            bad = (~torch.isfinite(block)).nonzero()
            if bad.numel():
                raise KimiK3LoadError(_non_finite_message(name, tensor, start + int(bad[0, 0])))


def _non_finite_message(name: str, tensor: torch.Tensor, flat_index: int) -> str:
    index = list(torch.unravel_index(torch.tensor(flat_index), tensor.shape))
    fused = name.rsplit(".", 1)[-1]
    if fused in EXPERT_PARTS and tensor.dim() == 3:
        expert, row = int(index[0]), int(index[1])
        parts = EXPERT_PARTS[fused]
        part = parts[row * len(parts) // tensor.shape[1]]
        where = f"`{_release_expert_name(name, expert, part, 'weight')}` (in our `{name}`)"
    else:
        where = f"`{release_name(name)}`"
    return f"non-finite value in release tensor {where} at index {[int(i) for i in index]}: refusing to load"


@contextlib.contextmanager
def _reading_in_step_with_the_conversions(enabled: bool):
    """transformers' loader reads tensors on a thread pool ahead of the conversion ops: on a release checkpoint that
    is most of the checkpoint again in memory before the experts are dequantised. Read in step with the ops
    (HF_DEACTIVATE_ASYNC_LOAD, the loader's own switch, read when it starts), the memory beyond the model stays below
    one and a half converted layers whatever the model's size (tests/test_release_loading.py). A user's own setting
    wins."""
    if not enabled or "HF_DEACTIVATE_ASYNC_LOAD" in os.environ:
        yield
        return
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)


def _with_files(pretrained, kwargs, messages: list[str]) -> list[str]:
    """The ops' messages, each naming the release tensor it begins with: the weights file holding it appended, when
    the folder is local and its index (or single file) names the tensor (a text-only class drops the prefix)."""
    folder = os.path.join(os.fspath(pretrained), kwargs.get("subfolder") or "") \
        if isinstance(pretrained, (str, os.PathLike)) else None
    files = weight_files(folder, kwargs.get("variant")) if folder is not None and os.path.isdir(folder) else {}
    named = []
    for message in messages:
        tensor = re.match(r"`([^`]+)`", message)
        shard = None if tensor is None else files.get(tensor[1], files.get(RELEASE_TEXT_PREFIX + tensor[1]))
        named.append(message if shard is None else f"{message} (file {shard})")
    return named


def check_release_load(load, model_class, pretrained, *args, experts_format=None, **kwargs):
    """`from_pretrained` with the `experts_format` load option and errors that name the release tensor: a missing,
    unexpected or wrongly shaped tensor, a bad A_log padding or expert count, and any NaN/Inf."""
    check_pretrained_folder(pretrained, kwargs)
    fmt, release_quantization = _resolve_config(model_class, pretrained, kwargs, experts_format)
    register_release_conversions(fmt)
    parallel = any(kwargs.get(key) is not None for key in PARALLEL_LOAD_KWARGS)
    if parallel:
        register_shard_styles()  # the TP plan's styles of ours (parallel_kimi_k3.py)
    want_info = kwargs.pop("output_loading_info", False)
    user_ignores_sizes = kwargs.get("ignore_mismatched_sizes", False)
    kwargs["ignore_mismatched_sizes"] = True  # report mismatches ourselves, by release name
    _OP_ERRORS.clear()
    try:
        with _reading_in_step_with_the_conversions(release_quantization is not None):
            model, info = load(pretrained, *args, output_loading_info=True, **kwargs)
    except RuntimeError as exc:
        if _OP_ERRORS:
            raise KimiK3LoadError(f"{pretrained}: " + "; ".join(_with_files(pretrained, kwargs, _OP_ERRORS))) from exc
        raise
    finally:
        errors, _OP_ERRORS[:] = list(_OP_ERRORS), []
    if errors:
        raise KimiK3LoadError(f"{pretrained}: " + "; ".join(_with_files(pretrained, kwargs, errors)))
    problems = []
    if info.get("mismatched_keys") and not user_ignores_sizes:
        problems += [f"`{release_name(k)}` has shape {list(found)}, the config needs {list(wanted)}"
                     for k, found, wanted in sorted(info["mismatched_keys"])]
    # A missing or unknown tensor of a release-layout load is an error. A checkpoint in our layout keeps
    # transformers' rule, as its in-tree models do (a base model's folder loaded with the head, a head's folder by
    # the base model): missing tensors initialised by _init_weights, both reported in transformers' load report.
    if loaded_release_layout(model):
        if info.get("missing_keys"):
            problems.append("missing tensor(s): "
                            + ", ".join(f"`{release_name(k)}`" for k in sorted(info["missing_keys"])))
        if info.get("unexpected_keys"):
            problems.append("unknown tensor(s) (no rule maps them): "
                            + ", ".join(f"`{release_name(k)}`" for k in sorted(info["unexpected_keys"])))
    if problems:
        raise KimiK3LoadError(f"{pretrained}: " + "; ".join(problems))
    if parallel:
        compact_local_shards(model)
    _check_finite(model)
    check_stored_experts(model)
    generation_config = getattr(model, "generation_config", None)
    if loaded_release_layout(model) and generation_config is not None \
            and generation_config.max_length == model.config.get_text_config().max_position_embeddings:
        # the release's generation_config.json sets max_length to the context length, which only makes every
        # generate(max_new_tokens=...) warn that both are set; `kimik3 convert` leaves it out, and so does this load
        generation_config.max_length = type(generation_config)().max_length
    if release_quantization is not None:
        # save_pretrained writes the release layout back (MXFP4 experts), so the config describes it again
        model.config.get_text_config().quantization_config = release_quantization
    return (model, info) if want_info else model


__all__ = [
    "DequantizeMxfp4Experts",
    "dense_experts_conversions",
    "PadHeads",
    "QuantizeMxfp4Experts",
    "RejectInfiniteScales",
    "UnpadHeads",
    "check_stored_experts",
    "check_release_load",
    "mxfp4_overflow_message",
    "register_release_conversions",
    "release_conversions",
    "release_name",
]
