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
the only one applied); the composite class reaches it as its `language_model` sub-model, scoped to that prefix.
Conversions are reversed by `save_pretrained`, which thus writes a release-loaded model back in the release layout.
The names come from one table, the release name map below, from which `convert/name_map.py` generates the
converter's rules as well; `tests/test_release_loading.py` runs both on every release tensor name pattern.
"""

import contextlib
import contextvars
import copy
import functools
import gc
import json
import math
import os
import re
import stat
import struct

import torch
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)

from .configuration_kimi_k3 import DEFAULT_EXPERTS_FORMAT, check_experts_format
from .ops_kimi_k3 import _E2M1_VALUES, MXFP4_GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4


try:  # transformers 5.0-5.24
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
except ImportError:  # pragma: no cover - a transformers without checkpoint conversion mappings
    register_checkpoint_conversion_mapping = None

# ------------------------------------------------------------------------------------------------------------------
# The release name map: the one table of how the release's tensor names become ours. The transforms below are built
# from it, and so are the converter's rules (`convert/name_map.py` imports these names and generates its rules of the
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
RELEASE_EXPERT_SUFFIXES = {"dense": ("weight",), "mxfp4": ("weight_packed", "weight_scale")}
OUR_PACKED_SUFFIXES = {"weight_packed": "_packed", "weight_scale": "_scale"}
# The release stores A_log zero-padded to this many heads (96 real); save pads back to max(this, heads).
RELEASE_A_LOG_LENGTH = 128
# The children as one regex group. `[.]`, not `\.`: transformers 5.17 unescapes `\.` inside the group when it
# reverses the pattern for save_pretrained.
MOE_CHILDREN = "(" + "|".join(child.replace(".", "[.]") for child in MOE_CHILD_PREFIXES) + ")"
# E8M0 byte 255 decodes to 2^128 (inf): never a real scale.
E8M0_INF = 255

# Errors raised by the ops during one from_pretrained: transformers records an op's exception in its load report and
# raises a generic RuntimeError; `check_release_load` turns these into the error the user sees.
_OP_ERRORS: list[str] = []


class KimiK3LoadError(ValueError):
    """A release tensor that cannot be loaded, named in the message."""


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


@functools.lru_cache(maxsize=None)
def _first_overflowing_byte(limit: float) -> int:
    """The smallest E8M0 byte whose group can decode past `limit` (the largest code, 6.0, times 2^(byte - 127))."""
    byte = 0
    while byte < E8M0_INF and 6.0 * 2.0 ** (byte - 127) <= limit:
        byte += 1
    return byte


def mxfp4_overflow(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """The first MXFP4 group that decodes to a non-finite value in `dtype`: (index into `scale`, its byte, the signed
    code that overflows), or None. A valid scale byte can still overflow: 0xFE with code 6.0 is 1.5 x 2^129, inf in
    bf16 and f32 (the decode multiplies in f32), and fp16 overflows from byte 0x8D on. Only groups whose byte is high
    enough for the largest code to overflow are decoded here, so a finite checkpoint costs one comparison per scale
    byte. packed u8 [..., N, K/2], scale u8 [..., N, K/32]."""
    limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    low = _first_overflowing_byte(limit)
    if scale.numel() == 0 or int(scale.max()) < low:  # a reduction, no mask: the usual case
        return None
    risky = scale >= low
    where = risky.nonzero()
    groups = packed.reshape(*scale.shape, MXFP4_GROUP_SIZE // 2)[risky]  # [n, 16] bytes, two codes each
    codes = torch.stack([groups & 0xF, groups >> 4], dim=-1).reshape(groups.shape[0], -1).long()
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float64, device=codes.device)
    values = table[codes]  # [n, 32] signed code values
    largest = values.abs().argmax(dim=-1, keepdim=True)
    code = values.gather(-1, largest).squeeze(-1)
    bytes_ = scale[risky].long()
    over = (code.abs() * torch.pow(2.0, (bytes_ - 127).double()) > limit) | (bytes_ == E8M0_INF)
    if not bool(over.any()):
        return None
    first = int(over.nonzero()[0, 0])
    return [int(i) for i in where[first]], int(bytes_[first]), float(code[first])


def mxfp4_overflow_message(index, byte: int, code: float, dtype: torch.dtype) -> str:
    result = "nan" if byte == E8M0_INF and code == 0 else ("-inf" if code < 0 else "inf")
    return (f"E8M0 scale byte 0x{byte:02X} at {list(index)} with code {code} gives {result} in "
            f"{str(dtype).removeprefix('torch.')}: a valid scale byte, but the weight it scales does not fit the "
            "dtype; refusing non-finite weights")


def check_packed_experts(model) -> None:
    """Kept-packed MXFP4 experts are dequantised to the compute dtype at every forward: each group must decode to
    finite values in it (the floating dtype of the model's parameters), checked once at load. Errors name the release
    tensor and our fused one."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    for name, module in model.named_modules():
        if not getattr(module, "packed", False):
            continue
        for fused in EXPERT_PARTS:
            packed, scale = getattr(module, f"{fused}_packed", None), getattr(module, f"{fused}_scale", None)
            if packed is None or scale is None or packed.device.type == "meta" or scale.dim() != 3:
                continue
            found = mxfp4_overflow(packed, scale, dtype)
            if found is None:
                continue
            (expert, row, group), byte, code = found
            parts = EXPERT_PARTS[fused]
            part_rows = scale.shape[1] // len(parts)
            part = parts[row // part_rows]
            ours = f"{name}.{fused}_scale"
            raise KimiK3LoadError(
                f"`{_release_expert_name(ours, expert, part, 'weight_scale')}` (our `{ours}`): "
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
                overflow = mxfp4_overflow(codes, scale, dtype)
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
    length >= H is accepted; a non-zero tail would mean a per-channel reading of the tensor, an error."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, config=None, full_layer_name=None, **kwargs):
        tensor = _tensors(next(iter(input_dict.values())))[0]
        heads = config.get_text_config().linear_num_heads
        name = full_layer_name or target_patterns[0]
        local = _tensor_parallel_length(kwargs.get("model"), full_layer_name)
        if local is not None:
            # tensor parallel: the loader read this rank's slice along the heads, which is only this rank's heads when
            # the file is unpadded
            if tensor.dim() == 1 and tensor.shape[0] == local:
                return {target_patterns[0]: tensor.clone()}
            _fail(f"`{name}`: tensor-parallel loading reads this rank's slice of the {heads}-head A_log; found a slice "
                  f"of shape {list(tensor.shape)} instead of [{local}] (a zero-padded A_log cannot be sliced by head: "
                  "convert the release with `kimik3 convert` first)")
        if tensor.dim() != 1 or tensor.shape[0] < heads:
            _fail(f"`{name}`: expected a 1-D tensor of length >= {heads} (one entry per head, zero-padded), found "
                  f"shape {list(tensor.shape)}")
        tail = tensor[heads:]
        if bool((tail != 0).any()) or bool(torch.signbit(tail).any()):
            _fail(f"`{name}`: entries {heads}..{tensor.shape[0] - 1} must be the +0.0 padding of a {heads}-head "
                  "A_log, found other values")
        return {target_patterns[0]: tensor[:heads].clone()}

    @property
    def reverse_op(self) -> ConversionOps:
        return PadHeads()


def _tensor_parallel_length(model, name) -> int | None:
    """The local length of a tensor-parallel (DTensor) parameter `name` of `model`; None for a plain parameter."""
    if model is None or not name:
        return None
    try:
        parameter = model.get_parameter(name)
    except AttributeError:
        return None
    to_local = getattr(parameter, "to_local", None)
    return None if to_local is None else to_local().shape[0]


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


def release_conversions(experts_format: str = DEFAULT_EXPERTS_FORMAT) -> list:
    """The transforms from the release layout to ours, relative to the text model (`KimiK3ForCausalLM`).
    `experts_format` picks what MXFP4 experts become: "dense" (dequantised) or "mxfp4" (kept packed)."""
    conversions = [
        WeightRenaming("^" + re.escape(RELEASE_TEXT_PREFIX), ""),
        WeightRenaming(re.escape(RELEASE_MOE_BLOCK + ".") + MOE_CHILDREN, OUR_MOE_BLOCK + r".\1"),
        WeightConverter("self_attn.A_log", "self_attn.A_log", [UnpadHeads()]),
    ]
    (plain,), packed = RELEASE_EXPERT_SUFFIXES["dense"], RELEASE_EXPERT_SUFFIXES["mxfp4"]
    for fused, parts in EXPERT_PARTS.items():
        merge = [MergeModulelist(dim=0)] + ([Concatenate(dim=1)] if len(parts) > 1 else [])
        # plain bf16 experts (a dense export, or a Kimi-Linear style checkpoint)
        conversions.append(WeightConverter(_expert_sources(parts, plain), _fused_target(fused), merge))
        if experts_format == "mxfp4":
            for suffix in packed:  # codes, then scales (whose infinite bytes are refused)
                checks = [RejectInfiniteScales()] if suffix == "weight_scale" else []
                conversions.append(WeightConverter(_expert_sources(parts, suffix),
                                                   _fused_target(fused + OUR_PACKED_SUFFIXES[suffix]),
                                                   copy.deepcopy(merge) + checks))
        else:
            sources = [s for part in parts for suffix in packed for s in _expert_sources((part,), suffix)]
            conversions.append(WeightConverter(sources, _fused_target(fused), [DequantizeMxfp4Experts()]))
    return conversions


def register_release_conversions(experts_format: str = DEFAULT_EXPERTS_FORMAT) -> None:
    """Registers the transforms for `KimiK3ForCausalLM` (and so for the composite model's `language_model`) and for
    `KimiK3TextBackbone` (the multimodal base model's `language_model`: the same tensors without the head)."""
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
    one converted layer whatever the model's size (tests/test_release_loading.py). A user's own setting wins."""
    if not enabled or "HF_DEACTIVATE_ASYNC_LOAD" in os.environ:
        yield
        return
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)


def check_release_load(load, model_class, pretrained, *args, experts_format=None, **kwargs):
    """`from_pretrained` with the `experts_format` load option and errors that name the release tensor: a missing,
    unexpected or wrongly shaped tensor, a bad A_log padding or expert count, and any NaN/Inf."""
    check_pretrained_folder(pretrained, kwargs)
    fmt, release_quantization = _resolve_config(model_class, pretrained, kwargs, experts_format)
    register_release_conversions(fmt)
    want_info = kwargs.pop("output_loading_info", False)
    user_ignores_sizes = kwargs.get("ignore_mismatched_sizes", False)
    kwargs["ignore_mismatched_sizes"] = True  # report mismatches ourselves, by release name
    _OP_ERRORS.clear()
    try:
        with _reading_in_step_with_the_conversions(release_quantization is not None):
            model, info = load(pretrained, *args, output_loading_info=True, **kwargs)
    except RuntimeError as exc:
        if _OP_ERRORS:
            raise KimiK3LoadError(f"{pretrained}: " + "; ".join(_OP_ERRORS)) from exc
        raise
    finally:
        errors, _OP_ERRORS[:] = list(_OP_ERRORS), []
    if errors:
        raise KimiK3LoadError(f"{pretrained}: " + "; ".join(errors))
    problems = []
    if info.get("mismatched_keys") and not user_ignores_sizes:
        problems += [f"`{release_name(k)}` has shape {list(found)}, the config needs {list(wanted)}"
                     for k, found, wanted in sorted(info["mismatched_keys"])]
    # a missing tensor of a release-layout load is an error; a checkpoint in our layout keeps transformers' rule
    # (warned, re-initialised by _init_weights)
    if info.get("missing_keys") and getattr(model, "_weight_conversions", None):
        problems.append("missing tensor(s): " + ", ".join(f"`{release_name(k)}`" for k in sorted(info["missing_keys"])))
    if info.get("unexpected_keys"):
        problems.append("unknown tensor(s) (no rule maps them): "
                        + ", ".join(f"`{release_name(k)}`" for k in sorted(info["unexpected_keys"])))
    if problems:
        raise KimiK3LoadError(f"{pretrained}: " + "; ".join(problems))
    _check_finite(model)
    check_packed_experts(model)
    generation_config = getattr(model, "generation_config", None)
    if getattr(model, "_weight_conversions", None) and generation_config is not None \
            and generation_config.max_length == model.config.get_text_config().max_position_embeddings:
        # the release's generation_config.json sets max_length to the context length, which only makes every
        # generate(max_new_tokens=...) warn that both are set; `kimik3 convert` leaves it out, and so does this load
        generation_config.max_length = type(generation_config)().max_length
    if release_quantization is not None:
        # save_pretrained writes the release layout back (MXFP4 experts), so the config describes it again
        model.config.get_text_config().quantization_config = release_quantization
    return (model, info) if want_info else model


# ------------------------------------------------------------------------------------------------------------------
# Which files a folder may name, and a strict read of what it names (docs/bad_inputs.md, "Loading a folder"). One
# rule for `kimik3 convert` / `export` / `verify` (convert/checkpoint.py imports these) and for from_pretrained, which
# runs it before transformers reads anything. Pure Python: remote code cannot import the kimik3 package.

# Names the Hub gives repo ids: `name` or `org/name`, no `--` or `..`, not starting or ending with `-` or `.`
_REPO_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9_][\w.-]*(?<![.-])(/[A-Za-z0-9_][\w.-]*(?<![.-]))?")
# A code reference in auto_map: `module.Class` where module.py sits in the folder
_CODE_REFERENCE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")
# The layers of a checkpoint's text model, in the release's and our names (composite or text-only)
_LAYER_NAMES = re.compile(r"(?m)^(?:[^\n]*\.)?layers\.(\d+)\.")
_VISION_NAMES = ("vision_tower.", "mm_projector.")
# safetensors' dtypes and their element sizes (the converter passes the subset it can read)
SAFETENSORS_ITEMSIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                         "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# safetensors caps the header at 100 MB; anything larger is corruption, not a real header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_HUB_CACHE_KINDS = ("models--", "datasets--", "spaces--")


def load_error(path, message: str, tensor: str | None = None) -> KimiK3LoadError:
    """The loading side's error: `<path>[, tensor `T`]: <message>` (the converter's ConversionError reads the same)."""
    where = f"{path}" if tensor is None else f"{path}, tensor `{tensor}`"
    return KimiK3LoadError(f"{where}: {message}")


def looks_like_local_path(text: str) -> bool:
    """True when `text` can only be a local path, so a missing folder is reported as missing rather than looked up on
    the Hub: it starts with `/`, `.` or `~`, holds a backslash or the platform's separator, more than one `/` or a
    trailing one, is not a valid repo id at all, or is `org/name` whose `org` is a folder here (`models/k3` next to
    a `models/` folder). A valid `org/name` with no such folder is a Hub repo id."""
    if not text or text.startswith(("/", ".", "~")) or "\\" in text or (os.sep != "/" and os.sep in text):
        return True
    if text.count("/") > 1 or text.endswith("/") or not _REPO_ID.fullmatch(text):
        return True
    return "/" in text and os.path.isdir(text.split("/", 1)[0])


def _hub_blobs(real_folder: str) -> str | None:
    """The blobs/ folder of a Hub cache snapshot `.../models--o--n/snapshots/<rev>` (its files link there)."""
    snapshots, repo = os.path.dirname(real_folder), os.path.dirname(os.path.dirname(real_folder))
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(_HUB_CACHE_KINDS):
        return os.path.join(repo, "blobs")
    return None


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_file_name(name, named_by, *, what: str = "file", suffix: str = "", tensor: str | None = None,
                    error=load_error) -> None:
    """A name a folder's file gives another file must be a plain file name of that folder: no path separator (`/`,
    `\\`), no `..`, no drive or stream (`:`), no NUL, not empty."""
    if (not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\:\x00")
            or ".." in name or not name.endswith(suffix)):
        kind = f"plain `*{suffix}` file names" if suffix else "plain file names"
        raise error(named_by, f"refusing {what} name {name!r}: {what}s must be {kind} in the checkpoint folder (no "
                    "path separators, no `..`, no drive or absolute path)", tensor)


def check_inside(folder, path, *, error=load_error) -> None:
    """`path` (in `folder`) must not resolve outside it: a symlink out of the folder is refused; symlinks that stay
    inside are fine, and so are a Hub cache snapshot's links into its own `blobs/`."""
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(path)
    if _within(real, real_folder):
        return
    blobs = _hub_blobs(real_folder)
    if blobs is not None and _within(real, blobs):
        return
    raise error(path, f"is a symlink to {real}, outside the folder {folder}: a folder's files must be in it (a Hub "
                "cache snapshot's links into its own blobs/ are the one exception)")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_json(path, data: bytes | None = None, *, error=load_error, what: str | None = None, strict: bool = False,
              object_pairs_hook=None):
    """A JSON file's value; not UTF-8, not JSON and nesting too deep for the parser (a RecursionError, e.g.
    `[[[[...]]]]`) are errors naming the file. `strict`: NaN / Infinity are not JSON either (the safetensors
    header)."""
    prefix = f"{what}: " if what else ""
    try:
        if data is None:
            with open_regular_file(path, error, kind="JSON") as handle:
                data = handle.read()
        text = data.decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant if strict else None,
                          object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as exc:
        raise error(path, f"{prefix}not UTF-8 ({exc})") from None
    except RecursionError:
        raise error(path, f"{prefix}nested too deeply to parse (JSON arrays or objects inside each other beyond "
                    "Python's recursion limit; a real file nests a few levels)") from None
    except DuplicateKeyError as exc:
        raise error(path, f"{prefix}the key `{exc.key}` appears twice (which value is meant is ambiguous)") from None
    except ValueError as exc:  # JSONDecodeError and rejected constants
        raise error(path, f"{prefix}not JSON ({exc})") from None


class DuplicateKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def dict_without_duplicate_keys(pairs) -> dict:
    """json's object_pairs_hook for config.json and the index: json.loads keeps the last of two equal keys, so a key
    given twice (`num_hidden_layers`, a tensor of weight_map) would be read as whichever came last."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


# --- the safetensors header, as strict as the format --------------------------------------------------------------


def _unique_keys(path, pairs: tuple, tensor, error) -> dict:
    """A JSON object read as a tuple of (key, value) pairs (see `read_safetensors_header`) as a dict, refusing a key
    given twice: json.loads would keep the last, which in a header silently replaces one tensor by another."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                if tensor is None:
                    raise error(path, "corrupted safetensors header: the key appears twice in the header (which one "
                                "is meant is ambiguous)", key)
                raise error(path, f"corrupted safetensors header: its entry has the key {key!r} twice", tensor)
            seen.add(key)
    return obj


def _counts(values) -> bool:
    """A JSON list of non-negative whole numbers (`type() is int`: not a bool, not a float). Written as a loop: a
    release header has half a million entries and this runs for each."""
    if type(values) is not list:
        return False
    for value in values:
        if type(value) is not int or value < 0:
            return False
    return True


_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _parse_entry(path, name, raw, data_start: int, data_size: int, itemsizes, error):
    bad = lambda message: error(path, f"corrupted safetensors header: {message}", name)  # noqa: E731
    if type(raw) is tuple:
        raw = _unique_keys(path, raw, name, error)
    if type(raw) is not dict or raw.keys() != _ENTRY_KEYS:
        raise bad(f"an entry needs exactly dtype, shape and data_offsets, found {raw!r}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in itemsizes:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(itemsizes)})")
    if not _counts(shape):
        raise bad(f"bad shape {shape!r} (a list of non-negative integers)")
    if not _counts(offsets) or len(offsets) != 2:
        raise bad(f"bad data_offsets {offsets!r} (two non-negative integers)")
    if offsets[0] > offsets[1]:
        raise bad(f"data_offsets {offsets} end before they begin")
    expected = math.prod(shape) * itemsizes[dtype]
    if offsets[1] - offsets[0] != expected:
        raise bad(f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype} {shape} needs {expected}")
    if offsets[1] > data_size:
        raise error(path, f"file is truncated: the tensor's data ends at byte {data_start + offsets[1]} but the file "
                    f"has only {data_start + data_size} bytes", name)
    return dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1]


def _check_layout(path, entries: dict, data_start: int, data_size: int, error) -> None:
    """The format indexes the byte buffer fully: sorted by offset, each tensor starts where the previous one ended,
    and the last one ends at the end of the file. Overlaps would let two names share bytes (`k_proj` reading
    `q_proj`'s values); holes or a tail would be bytes that belong to no tensor."""
    ordered = sorted(entries.items(), key=lambda item: (item[1][2], item[1][3]))
    for (before, (_, _, _, before_end)), (after, (_, _, begin, end)) in zip(ordered, ordered[1:]):
        if begin < before_end:
            raise error(path, f"corrupted safetensors header: its data overlaps `{before}` (bytes {begin - data_start}"
                        f"..{min(end, before_end) - data_start} of the data section belong to both)", after)
    position = data_start
    for name, (_, _, begin, end) in ordered:
        if begin > position:
            raise error(path, f"corrupted safetensors header: bytes {position - data_start}..{begin - data_start} of "
                        "the data section before this tensor belong to no tensor (the format allows no holes)", name)
        position = end
    if position != data_start + data_size:
        raise error(path, f"corrupted safetensors header: the last {data_start + data_size - position} bytes of the "
                    "file belong to no tensor (the format allows no trailing data)")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def open_regular_file(path, error=load_error, kind: str = "shard"):
    """Opens `path` for reading only if it is a regular file (a symlink to one is fine: Hub caches use them).
    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer (reading one would wait forever);
    on a regular file it does nothing. `kind` names the file in the messages."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(path, f"{kind} file is missing") from None
    except IsADirectoryError:
        raise error(path, f"is a directory, not a {kind} file") from None
    except OSError as exc:
        raise error(path, f"cannot be opened for reading ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        regular = "a regular `.safetensors` file" if kind == "shard" else "a regular file"
        raise error(path, f"is {_file_kind(mode)}, not a {kind} file ({regular})")
    return os.fdopen(fd, "rb")


def read_safetensors_header(path, *, error=load_error, itemsizes=SAFETENSORS_ITEMSIZES):
    """Parses and validates a shard's header as strictly as the format, reading only the header: returns
    ({name: (dtype, shape, first byte, end byte)}, metadata); offsets are absolute file positions."""
    with open_regular_file(path, error) as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise error(path, f"file is truncated: {size} bytes, not even the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            limit = "more than the format's 100 MB limit" if header_len > MAX_HEADER_BYTES else "beyond the end"
            raise error(path, f"truncated or corrupted safetensors header: it claims {header_len} header bytes "
                        f"({limit}), the file has {size} bytes in total")
        raw = handle.read(header_len)
    # objects as tuples of pairs (a C call per object, where a Python hook per object took seconds on a release
    # header of thousands of entries), arrays stay lists: duplicates are then found per object, as dicts are made
    header = read_json(path, raw, error=error, what="corrupted safetensors header", strict=True,
                       object_pairs_hook=tuple)
    if type(header) is not tuple:
        raise error(path, f"corrupted safetensors header: not a JSON object (found {type(header).__name__})")
    header = _unique_keys(path, header, None, error)
    metadata = header.pop("__metadata__", None)
    if type(metadata) is tuple:
        metadata = _unique_keys(path, metadata, "__metadata__", error)
    if metadata is not None and (not isinstance(metadata, dict) or not all(isinstance(v, str) for v in
                                                                           metadata.values())):
        raise error(path, f"corrupted safetensors header: __metadata__ must map strings to strings, found "
                    f"{metadata!r}"[:300])
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries = {name: _parse_entry(path, name, raw_entry, data_start, data_size, itemsizes, error)
               for name, raw_entry in header.items()}
    _check_layout(path, entries, data_start, data_size, error)
    return entries, metadata or {}


# --- what a folder names ------------------------------------------------------------------------------------------


def check_shards_against_index(headers: dict, weight_map: dict, index_path, error=load_error,
                               listed: bool = True, names_of=None) -> None:
    """Every tensor comes from one place: a tensor in a shard's header that the index does not list, or lists in
    another shard that holds it too (the same name in two shards), is refused naming both files; the index may not
    name a tensor its shard lacks (`listed=False` leaves that to the reader, which refuses such a tensor when it is
    read). `headers`: {shard name: (path, {tensor: entry})} of the shards read; `names_of(shard)`: the tensor names in
    another shard's header (default: from `headers`)."""
    if names_of is None:
        names_of = lambda shard: headers[shard][1] if shard in headers else None  # noqa: E731
    for shard, (path, entries) in headers.items():
        for tensor in entries:
            owner = weight_map.get(tensor)
            if owner == shard:
                continue
            if owner is None:
                raise error(path, f"the shard's header holds this tensor, but it is missing from the index "
                            f"{index_path} (a tensor must come from one place: list it, or remove it from the shard)",
                            tensor)
            owner_path = os.path.join(os.path.dirname(path), owner)
            owner_names = names_of(owner)
            if owner_names is not None and tensor not in owner_names:
                raise error(owner_path, f"the index names this tensor but the shard's header lacks it (it is in "
                            f"{path})", tensor)
            raise error(path, f"the tensor is also in {owner_path}, which the index {index_path} names for it (a "
                        "tensor must come from one shard)", tensor)
    for tensor, shard in weight_map.items() if listed else ():
        if shard in headers and tensor not in headers[shard][1]:
            raise error(headers[shard][0], "the index names this tensor but the shard's header lacks it", tensor)


def check_layer_count(config: dict, weight_map: dict, config_path, index_path, error=load_error) -> None:
    """config.json's layer count must match the layers whose tensors the checkpoint holds (every layer 0..L-1 has
    some `...layers.N.` tensor): checked on the raw JSON, before a config is built, since building one for a count
    like 10^9 would take hours. A count that is not a positive whole number is left to the config's own check (which
    names the key), and a checkpoint without any `layers.N.` name is not counted."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    key = "text_config.num_hidden_layers" if text is not config else "num_hidden_layers"
    count = text.get("num_hidden_layers")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return
    names = "\n".join(tensor for tensor in weight_map if not tensor.startswith(_VISION_NAMES))
    held = {int(layer) for layer in set(_LAYER_NAMES.findall(names))}
    if not held:
        return  # names of another kind (no `layers.N.`): nothing to count
    missing = next((layer for layer in range(count) if layer not in held), None)
    if missing is not None:
        found = f"layers 0..{max(held)} ({len(held)} layer(s))" if held else "no layer"
        raise error(config_path, f"key `{key}` = {count:,}, but {index_path} holds tensors of {found}, none of layer "
                    f"{missing}: the layer count must match the checkpoint's tensors")


def check_auto_map(folder, config: dict, config_path, error=load_error) -> None:
    """A local folder's auto_map (top level and text_config) may name code only as `module.Class` with module.py in
    the folder: no path, no `..`, and no `repo--module.Class` reference to another Hub repo's code."""
    maps = [config.get("auto_map")] + [sub.get("auto_map") for sub in (config.get("text_config"),
                                                                        config.get("vision_config"))
                                       if isinstance(sub, dict)]
    for auto_map in maps:
        if auto_map is None:
            continue
        if not isinstance(auto_map, dict):
            raise error(config_path, f"auto_map must be a JSON object mapping auto classes to `module.Class`, found "
                        f"{type(auto_map).__name__}")
        for auto_class, references in auto_map.items():
            for reference in references if isinstance(references, list) else [references]:
                if reference is None:
                    continue
                if isinstance(reference, str) and "--" in reference:
                    raise error(config_path, f"auto_map.{auto_class} = {reference!r} names code from another Hub "
                                "repo (`repo--module.Class`); a local folder may only name its own files "
                                "(`module.Class`)")
                match = _CODE_REFERENCE.fullmatch(reference) if isinstance(reference, str) else None
                if match is None:
                    raise error(config_path, f"auto_map.{auto_class} = {reference!r}: code must be named as "
                                "`module.Class`, with module.py a plain file of the folder (no path, no `..`)")
                path = os.path.join(folder, match.group(1) + ".py")
                if os.path.lexists(path):
                    check_inside(folder, path, error=error)


def _index_name(variant: str | None) -> tuple[str, str]:
    if variant:
        return f"model.safetensors.index.{variant}.json", f"model.{variant}.safetensors"
    return "model.safetensors.index.json", "model.safetensors"


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off while a folder's headers are parsed: the half million small objects of a
    release's headers would trigger a full collection again and again, which halved the check's time when paused."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _weights_files(folder, config: dict | None, config_path, variant: str | None, use_safetensors, error):
    """The index and single-file names transformers would read the weights from, as it picks them: config.json's
    `transformers_weights` names the file outright (an index or a shard); otherwise `model.safetensors` wins over
    the index, so a folder holding both has two sources for its weights and is refused. A pickled checkpoint
    (`pytorch_model.bin`, chosen with use_safetensors=False or when no safetensors weights exist) is refused: it
    would be unpickled."""
    explicit = config.get("transformers_weights") if isinstance(config, dict) else None
    if explicit is not None:
        check_file_name(explicit, config_path, what="`transformers_weights` file", error=error)
        if explicit.endswith(".safetensors.index.json"):
            return explicit, None
        if not explicit.endswith(".safetensors"):
            raise error(config_path, f"key `transformers_weights` = {explicit!r}: a `*.safetensors` file or a "
                        "`*.safetensors.index.json` index of the folder")
        return None, explicit
    index_name, single_name = _index_name(variant)
    pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")
               if os.path.lexists(os.path.join(folder, name))]
    has_safetensors = any(os.path.lexists(os.path.join(folder, n)) for n in (index_name, single_name))
    if pickled and (use_safetensors is False or not has_safetensors):
        raise error(os.path.join(folder, pickled[0]), "a pickled checkpoint is never loaded (unpickling a file can "
                    "run code): Kimi K3 folders hold safetensors weights; convert it to safetensors"
                    + (" (use_safetensors=False asks for it)" if use_safetensors is False else ""))
    if os.path.lexists(os.path.join(folder, index_name)) and os.path.lexists(os.path.join(folder, single_name)):
        raise error(folder, f"holds both {single_name} and {index_name}: two sources for the weights (transformers "
                    f"would read {single_name} and ignore the index); remove the one that does not belong")
    return index_name, single_name


def check_folder(folder, *, variant: str | None = None, complete: bool = True, error=load_error,
                 use_safetensors=None) -> None:
    """The checks `from_pretrained` runs on a local folder before transformers reads it: config.json, the index and
    every shard it names stay in the folder, parse (the shard headers strictly, read-only, so it is cheap), and every
    tensor comes from one place; config.json's layer count matches the tensors and its auto_map names code in the
    folder. `complete=False` (a Hub cache snapshot) skips the shards not downloaded yet."""
    folder = os.fspath(folder)
    config, config_path = None, os.path.join(folder, "config.json")
    if os.path.lexists(config_path):
        check_inside(folder, config_path, error=error)
        config = read_json(config_path, error=error, object_pairs_hook=dict_without_duplicate_keys)
        if not isinstance(config, dict):
            raise error(config_path, f"must hold a JSON object, not a {type(config).__name__}")
        check_auto_map(folder, config, config_path, error)
    for name in ("generation_config.json",):
        if os.path.lexists(os.path.join(folder, name)):
            check_inside(folder, os.path.join(folder, name), error=error)
    index_name, single_name = _weights_files(folder, config, config_path, variant, use_safetensors, error)
    index_path = os.path.join(folder, index_name) if index_name else None
    single_path = os.path.join(folder, single_name) if single_name else None
    if index_path is not None and os.path.lexists(index_path):
        check_inside(folder, index_path, error=error)
        index = read_json(index_path, error=error, object_pairs_hook=dict_without_duplicate_keys)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise error(index_path, "not a safetensors index (needs a `weight_map` object mapping tensor names to "
                        "shard file names)")
        first_tensor = {}
        for tensor, shard in weight_map.items():
            if type(shard) is not str or shard not in first_tensor:  # each name once (thousands of tensors a shard)
                check_file_name(shard, index_path, what="shard", suffix=".safetensors", tensor=tensor, error=error)
                first_tensor[shard] = tensor
    elif single_path is not None and os.path.lexists(single_path):
        index_path, weight_map, first_tensor = single_path, None, {single_name: None}
    else:
        return
    headers = {}
    with _collector_paused():
        for shard, tensor in first_tensor.items():
            path = os.path.join(folder, shard)
            if not os.path.lexists(path) and not complete:
                continue
            check_inside(folder, path, error=error)
            if not os.path.exists(path):
                raise error(path, "shard file is missing" + (f" (the index names it for `{tensor}`)" if tensor else
                                                             ""))
            headers[shard] = (path, read_safetensors_header(path, error=error)[0])
    if weight_map is None:
        weight_map = {tensor: single_name for tensor in headers[single_name][1]}
    else:
        check_shards_against_index(headers, weight_map, index_path, error)
    if config is not None:
        check_layer_count(config, weight_map, config_path, index_path, error)


def _hub_snapshot(repo_id: str, kwargs) -> str | None:
    """The local snapshot folder of a Hub repo id when the cache already holds its config.json (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub is a transformers dependency
        return None
    name = "/".join(p for p in (kwargs.get("subfolder") or "", "config.json") if p)
    try:
        found = try_to_load_from_cache(repo_id, name, cache_dir=kwargs.get("cache_dir"),
                                       revision=kwargs.get("revision"))
    except Exception:  # an unusual id or cache: transformers reports what it finds
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


_FOLDER_CHECKED: contextvars.ContextVar = contextvars.ContextVar("kimik3_folder_checked", default=None)


def check_pretrained_folder(pretrained, kwargs) -> None:
    """from_pretrained's first step: a local folder (or the cached snapshot of a Hub repo id) is checked as above; a
    string that can only be a local path but names no folder is an error rather than a Hub lookup."""
    if not isinstance(pretrained, (str, os.PathLike)) or _FOLDER_CHECKED.get() == (os.fspath(pretrained),):
        return
    text, complete = os.fspath(pretrained), True
    for key in ("variant", "gguf_file"):  # each becomes part of a file name in the folder
        value = kwargs.get(key)
        if value is not None and (not isinstance(value, str) or not value or any(c in value for c in "/\\:\x00")
                                  or ".." in value):
            raise load_error(text, f"refusing {key}={value!r}: it names a file of the folder, so it must be a plain "
                             "name (no path separators, no `..`)")
    if os.path.isdir(text):
        folder = text
        subfolder = (kwargs.get("subfolder") or "").rstrip("/")
        if subfolder:
            parts = subfolder.replace("\\", "/").split("/")
            if subfolder.startswith("/") or any(p in ("", "..") or ":" in p or "\x00" in p for p in parts):
                raise load_error(text, f"refusing subfolder {subfolder!r}: a path inside the folder (no `..`, no "
                                 "absolute path)")
            folder = os.path.join(text, subfolder)
            check_inside(text, folder)
        gguf = kwargs.get("gguf_file")
        if gguf and os.path.lexists(os.path.join(folder, gguf)):  # transformers reads it from the folder
            check_inside(folder, os.path.join(folder, gguf))
    elif os.path.exists(text):
        return  # a file: transformers says what it makes of it
    elif looks_like_local_path(text):
        raise load_error(text, "no such folder (a local path: not looked up on the Hub, which only takes repo ids "
                         "`name` or `org/name`)")
    else:
        folder, complete = _hub_snapshot(text, kwargs), False
        if folder is None:
            return
    check_folder(folder, variant=kwargs.get("variant"), complete=complete,
                 use_safetensors=kwargs.get("use_safetensors"))


@contextlib.contextmanager
def checked_pretrained_folder(pretrained, kwargs):
    """Runs `check_pretrained_folder` once for a whole from_pretrained (the composite class reads the index before
    the text class's from_pretrained runs the check again)."""
    check_pretrained_folder(pretrained, kwargs)
    token = _FOLDER_CHECKED.set((os.fspath(pretrained),) if isinstance(pretrained, (str, os.PathLike)) else None)
    try:
        yield
    finally:
        _FOLDER_CHECKED.reset(token)


__all__ = [
    "DequantizeMxfp4Experts",
    "KimiK3LoadError",
    "PadHeads",
    "QuantizeMxfp4Experts",
    "RejectInfiniteScales",
    "UnpadHeads",
    "check_folder",
    "check_pretrained_folder",
    "check_packed_experts",
    "check_release_load",
    "mxfp4_overflow",
    "mxfp4_overflow_message",
    "checked_pretrained_folder",
    "read_safetensors_header",
    "register_release_conversions",
    "release_conversions",
    "release_name",
]
