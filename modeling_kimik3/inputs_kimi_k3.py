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
"""The checks of what a forward and generate() are given (docs/bad_inputs.md, "Calls" and "Model inputs"): ids,
embeddings, masks, caches and labels that would fail deep inside a layer with an unrelated message, or silently give
wrong outputs, refused by name before the first layer. The model calls them; they read the model's config and
embedding, never its layers."""

import torch

from .cache_kimi_k3 import KimiK3Cache
from .dispatch_kimi_k3 import capturing


def check_model_inputs(model, input_ids, inputs_embeds, attention_mask, cache) -> None:
    """Reject inputs that would otherwise fail deep inside a layer with an unrelated message, or silently give
    wrong outputs. Shape, dtype and cache-config checks cost nothing (under torch.compile they are decided at trace
    time); the value checks read the inputs once, in a single host read, and are skipped while compiling or
    capturing a CUDA graph, so the static decode step stays one graph with no host synchronisation."""
    for key, value in (("input_ids", input_ids), ("inputs_embeds", inputs_embeds),
                       ("attention_mask", attention_mask)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{key} must be a torch.Tensor, got {type(value).__name__} (a tokenizer gives "
                             "tensors with return_tensors='pt')")
    if inputs_embeds is not None and inputs_embeds.dtype != model.embed_tokens.weight.dtype:
        # an integer tensor was taken as embeddings silently, another float dtype failed in the first matmul
        raise ValueError(f"inputs_embeds must have the model's dtype {model.embed_tokens.weight.dtype}; got "
                         f"{inputs_embeds.dtype} (shape {tuple(inputs_embeds.shape)})")
    if input_ids is not None and input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, length]; got shape {tuple(input_ids.shape)}")
    if input_ids is not None and input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids (torch.long or torch.int32); got dtype "
                         f"{input_ids.dtype} (shape {tuple(input_ids.shape)})")
    hidden_size = model.config.hidden_size
    if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size):
        raise ValueError(
            f"inputs_embeds must be [batch, length, hidden_size={hidden_size}]; got shape "
            f"{tuple(inputs_embeds.shape)}"
        )
    name, inputs = ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
    batch, seq_len = inputs.shape[:2]
    if batch == 0 or seq_len == 0:
        raise ValueError(
            f"{name} has shape {tuple(inputs.shape)}: Kimi K3 needs at least one sequence of at least one token"
        )
    if cache is not None:
        check_cache_config(model.config, cache)
    has_past = cache is not None and cache.has_previous_state()
    if has_past and not torch.compiler.is_compiling() and cache.batch_size != batch:
        raise ValueError(
            f"The cache holds {cache.batch_size} sequences but {name} has batch size {batch} (shape "
            f"{tuple(inputs.shape)}); continue a cache with the batch it was filled with, or start a new cache"
        )
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
            raise ValueError(
                f"Kimi K3 takes a 2-D padding attention_mask [batch={batch}, length]; got shape "
                f"{tuple(attention_mask.shape)} for {name} of shape {tuple(inputs.shape)}"
            )
        # generate() passes the mask of the whole sequence (cached + new tokens). A static decode step does not
        # read the mask (the cache's key_valid is the mask) and its cached length lives on the device, so the
        # length is checked everywhere but there.
        static_decode = has_past and cache.is_static and cache.is_fixed_shape_step(seq_len)
        if not static_decode:
            past_len = cache.get_seq_length() if has_past else 0
            if attention_mask.shape[1] != past_len + seq_len:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but {name} has shape "
                    f"{tuple(inputs.shape)} and the cache holds {past_len} tokens: the mask must cover the "
                    f"cached and the new tokens, length {past_len} + {seq_len} = {past_len + seq_len}"
                )
    if torch.compiler.is_compiling() or capturing():
        return
    # Every value check below is one flag (or the id range) in a single host read per forward: [low id, high id,
    # mask values other than 0/1, rows without a real token, media placeholders, non-finite real embeddings].
    flags = []
    if input_ids is not None:
        flags += [input_ids.min().long(), input_ids.max().long()]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        # a padding mask says which tokens are real: 0.5 or 2.0 (or NaN) is neither, and `.bool()` would read
        # them as real
        flags.append(((attention_mask != 0) & (attention_mask != 1)).any().long())
    if attention_mask is not None:
        # a row with no real token (in the cached part or the new one) has no defined output: every MLA query
        # would attend to nothing
        flags.append((~attention_mask.bool().any(dim=1)).any().long())
        # a padded position between real tokens (a hole, or a right-padded prompt continued by generate): the KDA
        # conv window and recurrence read the tokens in order, so that is not the sequence without the token
        flags.append(mask_holes(attention_mask).any().long())
    # only a prompt marks images: a decode step's ids are generated tokens (a model may emit the placeholder's id;
    # images are read in the prefill only)
    placeholder = None if has_past else model.media_placeholder_token_id
    if input_ids is not None and placeholder is not None:
        flags.append((input_ids == placeholder).any().long())
    non_finite = None
    if inputs_embeds is not None:
        # Real (unmasked) positions of user-given embeddings must be finite; padded ones may hold anything, they
        # are replaced by zeros before the first layer.
        non_finite = ~torch.isfinite(inputs_embeds).all(dim=-1)
        if attention_mask is not None:
            non_finite &= attention_mask[:, -seq_len:].bool()
        flags.append(non_finite.any().long())
    if not flags:
        return
    values = torch.stack(flags).tolist()
    if input_ids is not None:
        (low, high), values = values[:2], values[2:]
        vocab_size = model.embed_tokens.num_embeddings
        if low < 0 or high >= vocab_size:
            # without it: an opaque IndexError on CPU and a device-side assert that ends the CUDA context on GPU
            raise ValueError(
                f"input_ids (shape {tuple(input_ids.shape)}) hold ids from {low} to {high}, outside the "
                f"vocabulary [0, vocab_size={vocab_size})"
            )
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        bad_values, values = values[0], values[1:]
        if bad_values:
            seen = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
            raise ValueError(
                f"attention_mask (shape {tuple(attention_mask.shape)}, dtype {attention_mask.dtype}) must hold "
                f"only 0 (padding) and 1 (a real token); it holds {seen[0].item()!r} ({seen.numel()} such "
                "entries)"
            )
    if attention_mask is not None:
        empty_rows, values = values[0], values[1:]
        if empty_rows:
            rows = (~attention_mask.bool().any(dim=1)).nonzero()[:, 0].tolist()
            raise ValueError(
                f"attention_mask (shape {tuple(attention_mask.shape)}) has no real token in batch row(s) {rows}: "
                "a sequence of padding only has no defined output; leave such rows out of the batch"
            )
        holes, values = values[0], values[1:]
        if holes:
            raise mask_hole_error(attention_mask, "the cached and the new tokens")
    if input_ids is not None and placeholder is not None:
        media, values = values[0], values[1:]
        if media:
            row, position = (input_ids == placeholder).nonzero()[0].tolist()
            raise ValueError(
                f"input_ids hold the media placeholder `<|media_pad|>` (id {placeholder}) at batch {row}, "
                f"position {position}, but no pixel_values were given: the image it marks is missing (pass "
                "the image processor's pixel_values and grid_thws to the model with a vision tower)"
            )
    if non_finite is not None and values[0]:
        row, position = non_finite.nonzero()[0].tolist()
        raise ValueError(
            f"inputs_embeds (shape {tuple(inputs_embeds.shape)}) has non-finite values at a real (unmasked) "
            f"token: batch {row}, position {position} ({int(non_finite.sum())} such tokens in all)"
        )

# What a cache's layers hold follows from these settings of the config it was made for: another config's cache
# has layers of other kinds, counts or widths, and would be read at the wrong shapes (or silently misread).
CACHE_SETTINGS = ("layer_types", "kv_lora_rank", "qk_rope_head_dim", "linear_num_heads", "linear_head_dim",
                   "linear_conv_kernel_size")

def check_cache_config(config, cache) -> None:
    made_for = getattr(cache, "_text_config", None)
    if made_for is None or made_for is config:
        return
    different = [key for key in CACHE_SETTINGS if getattr(made_for, key) != getattr(config, key)]
    if different:
        def shown(config, key):
            value = getattr(config, key)
            if key == "layer_types":
                mla = [i for i, kind in enumerate(value) if kind == "full_attention"]
                return f"{len(value)} layers, MLA at {mla}"
            return value

        details = ", ".join(f"{key} {shown(made_for, key)} (this model: {shown(config, key)})"
                            for key in different)
        raise ValueError(f"The cache was made for a model of another config: {details}; make the cache with "
                         "this model's config (KimiK3Cache(model.config)) or let the model create it")


def mask_hole_error(attention_mask: torch.Tensor, what: str) -> ValueError:
    row, position = mask_holes(attention_mask).nonzero()[0].tolist()
    shown = attention_mask[row].long().tolist()
    shown = shown if len(shown) <= 16 else shown[:16] + ["..."]
    return ValueError(
        f"attention_mask row {row} has padding at position {position} between real tokens ({shown}, {what}): "
        "Kimi K3's KDA layers read the tokens in order (a short conv and a recurrence), so a hole is not the "
        "sequence without that token, and tokens generated after a right-padded prompt would follow its padding. "
        "Pad on the left (padding_side='left'); a right-padded batch is exact in a forward that is not continued"
    )


def _config_summary(config) -> str:
    if config is None:
        return "an unknown config"
    where = getattr(config, "_name_or_path", "") or "a config built in memory"
    return f"{where}: {config.num_hidden_layers} layers, MLA at {config.mla_layer_indices}"


def cache_type_error(cache, config=None) -> TypeError:
    """A cache this model cannot use. A K3 cache of another copy of the code (the installed package's beside a
    folder's, loaded with trust_remote_code, or another K3 model's folder) has the same class name: name both modules
    and the configs the cache and the model were made from."""
    given = type(cache)
    if given.__name__ in ("KimiK3Cache", "KimiK3StaticCache"):
        return TypeError(
            f"the cache is a {given.__name__} of another copy of the Kimi K3 code ({given.__module__}, made for "
            f"{_config_summary(getattr(cache, '_text_config', None))}); this model runs {KimiK3Cache.__module__} "
            f"({_config_summary(config)}) and needs a cache of its own classes: let the model or generate() make "
            "it, or make it from the model's module: "
            "importlib.import_module(type(model).__module__).KimiK3Cache(model.config)")
    return TypeError(f"Kimi K3 needs a KimiK3Cache (MLA latents + KDA states), got {given.__name__}")


def mask_holes(attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch, length] bool: padded positions with a real token before and after them in their row."""
    real = attention_mask.bool()
    before = real.cumsum(dim=1) > 0
    after = real.flip(1).cumsum(dim=1).flip(1) > 0
    return ~real & before & after


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Labels are ids of the vocabulary or `ignore_index` (-100); anything else makes cross-entropy raise an opaque
    IndexError on CPU (a device-side assert on GPU). One host read, only when labels are given (skipped while
    compiling)."""
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids; got dtype {labels.dtype} (shape {tuple(labels.shape)})")
    if torch.compiler.is_compiling() or labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        row, *rest = bad.nonzero()[0].tolist()
        raise ValueError(
            f"labels (shape {tuple(labels.shape)}) hold {labels[bad][0].item()} at {[row, *rest]}: labels must be "
            f"ids in [0, vocab_size={vocab_size}) or {ignore_index} (ignored)"
        )


__all__ = ["CACHE_SETTINGS", "cache_type_error", "check_cache_config", "check_labels", "check_model_inputs",
           "mask_hole_error", "mask_holes"]
