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
"""PyTorch Kimi K3 with images: the release's top-level class (`KimiK3ForConditionalGeneration`, `KimiK3Config`) and
its base model (`KimiK3MultimodalModel`), the MoonViT-3d tower and patch-merger projector (vision_kimi_k3.py) in front
of the text model (modeling_kimi_k3.py), and the splice of image rows into the token sequence (docs/architecture.md,
Image rows in the token sequence).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import can_return_tuple

from .compat_kimi_k3 import CACHE_FIELD, cache_in, given_cache
from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig
from .files_kimi_k3 import checked_pretrained_folder
from .modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model, KimiK3PreTrainedModel
from .vision_kimi_k3 import (
    KimiK3PatchMergerProjector,
    KimiK3VisionPositionEmbedding,
    KimiK3VisionRMSNorm,
    KimiK3VisionTower,
    check_image_inputs,
)


@dataclass
class KimiK3MultimodalOutputWithPast(MoeCausalLMOutputWithPast):
    """`attention_mask`: after a forward with images, the padding mask of the merged sequence (each media placeholder
    expanded to its image's rows), which the cache now holds; generate() continues from it."""

    attention_mask: torch.Tensor | None = None


def _placeholder_runs(input_ids: torch.Tensor, placeholder_id: int) -> list[tuple[int, int, int]]:
    """(row, start, length) of every maximal run of placeholder tokens, in reading order (rows, then positions)."""
    is_placeholder = input_ids == placeholder_id
    starts = is_placeholder & ~F.pad(is_placeholder[:, :-1], (1, 0), value=False)
    ends = is_placeholder & ~F.pad(is_placeholder[:, 1:], (0, 1), value=False)
    begin, finish = starts.nonzero().tolist(), ends.nonzero().tolist()
    return [(row, start, end - start + 1) for (row, start), (_, end) in zip(begin, finish)]


def merge_image_features(input_ids, inputs_embeds, image_features, placeholder_id, pad_token_id, attention_mask=None,
                         labels=None, ignore_index=-100):
    """Splices image rows into the token embeddings at the media placeholders (the release's merge:
    docs/architecture.md, Image rows in the token sequence).

    Image k (in reading order) takes the k-th run of placeholder tokens: a single `<|media_pad|>` (the release's
    prompt form) is replaced by the image's n_k rows, which lengthens the row; a run of exactly n_k placeholders
    (pre-expanded prompts) is overwritten in place. Rows are re-padded to the longest merged row, on the left when the
    batch is left-padded (its last column is all real tokens) and on the right otherwise. Embeddings of pad tokens
    are zeroed. Returns (embeddings, attention mask, labels) of the merged sequence; image positions are attended and
    carry `ignore_index` labels.
    """
    runs = _placeholder_runs(input_ids, placeholder_id)
    if len(runs) != len(image_features):
        raise ValueError(
            f"input_ids hold {len(runs)} media placeholder run(s) (token {placeholder_id}, `<|media_pad|>`) but "
            f"{len(image_features)} image(s) were given: one placeholder (or one run of one per image token) per image"
        )
    batch, seq_len = input_ids.shape
    widths = torch.ones(batch, seq_len, dtype=torch.long)
    for index, ((row, start, length), feature) in enumerate(zip(runs, image_features)):
        if length == 1:
            widths[row, start] = feature.shape[0]
        elif length != feature.shape[0]:
            raise ValueError(
                f"image {index}: its placeholder run (row {row}, position {start}) has {length} tokens but the image "
                f"gives {feature.shape[0]} rows; use one `<|media_pad|>` or exactly {feature.shape[0]}"
            )
    new_lengths = widths.sum(dim=1)
    merged_len = int(new_lengths.max())
    if attention_mask is not None:
        left_padded = bool(attention_mask[:, -1].bool().all())
    else:
        left_padded = not bool((input_ids[:, -1] == pad_token_id).any())
    offsets = (merged_len - new_lengths) if left_padded else torch.zeros_like(new_lengths)
    destination = (widths.cumsum(dim=1) - widths + offsets[:, None]).to(input_ids.device)

    device = inputs_embeds.device
    embeds = inputs_embeds.new_zeros(batch, merged_len, inputs_embeds.shape[-1])
    mask = torch.zeros(batch, merged_len, dtype=torch.long, device=device)
    merged_labels = None if labels is None else labels.new_full((batch, merged_len), ignore_index)
    text_rows, text_cols = (input_ids != placeholder_id).nonzero(as_tuple=True)
    text_dest = destination[text_rows, text_cols]
    embeds[text_rows, text_dest] = inputs_embeds[text_rows, text_cols]
    mask[text_rows, text_dest] = 1 if attention_mask is None else attention_mask[text_rows, text_cols].long()
    if merged_labels is not None:
        merged_labels[text_rows, text_dest] = labels[text_rows, text_cols]
    for (row, start, _), feature in zip(runs, image_features):
        first = int(destination[row, start])
        embeds[row, first:first + feature.shape[0]] = feature.to(embeds.dtype)
        mask[row, first:first + feature.shape[0]] = 1
    pad_rows, pad_cols = (input_ids == pad_token_id).nonzero(as_tuple=True)
    embeds[pad_rows, destination[pad_rows, pad_cols]] = 0.0
    return embeds, mask, merged_labels


def image_rows_added(input_ids, grid_thws, placeholder_id, merge_kernel: tuple[int, int]) -> int:
    """Positions the splice adds to the longest row: a single placeholder for an image of n rows adds n - 1, a
    pre-expanded run none (what `merge_image_features` will do, computed from the inputs before the model runs)."""
    if input_ids is None or grid_thws is None or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return 0
    grid = torch.as_tensor(grid_thws).reshape(-1, 3)
    rows_per_image = ((grid[:, 1] // merge_kernel[0]) * (grid[:, 2] // merge_kernel[1])).tolist()
    runs = _placeholder_runs(input_ids, placeholder_id)
    if len(runs) != len(rows_per_image):
        return 0  # the forward refuses the mismatch, naming it
    added = [0] * input_ids.shape[0]
    for (row, _, length), rows in zip(runs, rows_per_image):
        if length == 1:
            added[row] += rows - 1
    return max(added)


def _checkpoint_tensor_names(pretrained, kwargs) -> list[str] | None:
    """Tensor names of a checkpoint (index or single file), or None when they cannot be read without loading it."""
    from transformers.utils import cached_file

    hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
           if k in kwargs}
    for file_name in ("model.safetensors.index.json", "model.safetensors"):
        try:
            path = cached_file(pretrained, file_name, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False, **hub)
        except (OSError, ValueError):
            path = None
        if path is None:
            continue
        if file_name.endswith(".json"):
            return list(json.loads(Path(path).read_text(encoding="utf-8")).get("weight_map", {}))
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            return list(handle.keys())
    return None


VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def _vision_option(pretrained, kwargs, vision: bool | None) -> bool:
    """`from_pretrained`'s `vision`: as given, else whether the checkpoint holds vision tensors (True when its names
    cannot be read without loading it)."""
    if vision is not None:
        return vision
    names = _checkpoint_tensor_names(pretrained, kwargs)
    return names is None or any(name.startswith(VISION_PREFIXES) for name in names)


def _add_vision_parts(model: nn.Module, config, vision: bool | None) -> None:
    """The tower and projector of the composite model and its base model (None without a tower), and the media
    placeholder id the text model's input checks look for."""
    model.language_model.model.media_placeholder_token_id = config.media_placeholder_token_id
    vision_config = config.vision_config
    with_tower = getattr(vision_config, "describes_tower", False) if vision is None else vision
    if with_tower and not getattr(vision_config, "describes_tower", False):
        raise ValueError("Kimi K3 config, key `vision_config`: vision=True but it describes no vision tower")
    model.vision_tower = KimiK3VisionTower(vision_config) if with_tower else None
    model.mm_projector = KimiK3PatchMergerProjector(vision_config) if with_tower else None


class KimiK3CompositePreTrainedModel(KimiK3PreTrainedModel):
    """What the two classes of the release's composite schema (`KimiK3Config`) share: `language_model` (of
    `text_model_class`), the vision tower and projector when the config describes one and the checkpoint holds it,
    the `vision` load option, and the tower's initialisation."""

    config_class = KimiK3Config
    base_model_prefix = ""
    _tied_weights_keys = {}
    _no_split_modules = ["KimiK3DecoderLayer", "KimiK3VisionEncoderLayer"]
    text_model_class: type[KimiK3PreTrainedModel]

    def __init__(self, config: KimiK3Config, vision: bool | None = None):
        super().__init__(config)
        self.language_model = self.text_model_class(config.text_config)
        _add_vision_parts(self, config, vision)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, vision: bool | None = None, **kwargs):
        """As the text classes; the vision tower is loaded when the checkpoint holds it (`vision=None`), skipped with
        `vision=False`, and required with `vision=True`."""
        # the folder's files are checked before anything here or in transformers reads them, the index for the
        # vision tensors included (files_kimi_k3.py)
        with checked_pretrained_folder(pretrained_model_name_or_path, kwargs):
            vision = _vision_option(pretrained_model_name_or_path, kwargs, vision)
            model = super().from_pretrained(pretrained_model_name_or_path, *args, vision=vision, **kwargs)
        # transformers also hands the load options __init__ takes to the generation config; `vision` is not one of its
        # settings (it would be saved in generation_config.json)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.__dict__.pop("vision", None)
        return model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, KimiK3VisionRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, KimiK3VisionPositionEmbedding):
            module.weight.normal_()  # the release's initialisation of the position grid

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)


class KimiK3ForConditionalGeneration(KimiK3CompositePreTrainedModel, GenerationMixin):
    """The release's top-level class (`KimiK3Config`): `language_model` is a `KimiK3ForCausalLM` (parameter names
    `language_model.model.*` / `language_model.lm_head.weight`, as the release), `vision_tower` the MoonViT-3d tower
    and `mm_projector` the patch-merger projector (vision_kimi_k3.py).

    Images: `pixel_values` [patches, 3, 14, 14] and `grid_thws` [images, 3] from the image processor, and one
    `<|media_pad|>` per image in `input_ids` (the processor writes it); the merged sequence is what the text model
    and its cache see. The tower is built when the config describes one and the checkpoint holds its tensors
    (`from_pretrained(..., vision=False)` skips it, e.g. to save its memory); without it images are an error."""

    text_model_class = KimiK3ForCausalLM

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def get_image_features(self, pixel_values: torch.Tensor, grid_thws) -> list[torch.Tensor]:
        """Per image [merged tokens, text hidden size]: tower, 2x2 merge, projector."""
        if self.vision_tower is None:
            raise ValueError(
                "pixel_values were given but this model has no vision tower (its config describes none, its "
                "checkpoint holds no `vision_tower.*` tensors, or it was loaded with vision=False)"
            )
        grid = check_image_inputs(pixel_values, grid_thws, self.vision_tower.patch_size,
                                  self.vision_tower.merge_kernel_size)
        weight = self.vision_tower.patch_embed.proj.weight
        merged = self.vision_tower(pixel_values.to(device=weight.device, dtype=weight.dtype), grid)
        return self.mm_projector(merged)

    def _merge_images(self, input_ids, pixel_values, grid_thws, attention_mask, labels, cache):
        if input_ids is None:
            raise ValueError("pixel_values need input_ids: the media placeholder tokens mark where the images go")
        if cache is not None and cache.has_previous_state():
            raise ValueError("images are read in the prefill only; this cache already holds tokens (start a new one)")
        vocab_size = self.get_input_embeddings().num_embeddings
        if input_ids.dim() != 2 or input_ids.numel() == 0 or int(input_ids.min()) < 0 \
                or int(input_ids.max()) >= vocab_size:
            raise ValueError(f"input_ids (shape {tuple(input_ids.shape)}) must be a non-empty 2-D batch of ids in "
                             f"[0, vocab_size={vocab_size})")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}: with images the mask covers the prompt")
        features = self.get_image_features(pixel_values, grid_thws)
        embeds = self.get_input_embeddings()(input_ids)
        return merge_image_features(input_ids, embeds, features, self.config.media_placeholder_token_id,
                                    self.config.text_config.pad_token_id, attention_mask, labels,
                                    self.config.ignore_index)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cache=None, pixel_values=None,
                grid_thws=None, **kwargs) -> KimiK3MultimodalOutputWithPast:
        cache = given_cache(cache, past_key_values)
        merged_mask = None
        if pixel_values is not None:
            if inputs_embeds is not None:
                raise ValueError("pass images with input_ids, not inputs_embeds: the media placeholders in input_ids "
                                 "mark where the images go")
            inputs_embeds, merged_mask, labels = self._merge_images(input_ids, pixel_values, grid_thws,
                                                                    attention_mask, labels, cache)
            # The text model is NoPE: position_ids only mark packed documents, which do not apply to a merged
            # prompt (generate() derives them from the unmerged mask, whose length no longer fits).
            input_ids, attention_mask, position_ids = None, merged_mask, None
        elif grid_thws is not None:
            raise ValueError("grid_thws was given without pixel_values")
        outputs = self.language_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        return KimiK3MultimodalOutputWithPast(**outputs, attention_mask=merged_mask)

    def generate(self, inputs=None, *args, **kwargs):
        # A static cache is sized from the prompt before the prefill; images given as one `<|media_pad|>` each
        # lengthen the merged prompt by their rows - 1, which the cache must hold too (_prepare_cache_for_generation).
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        self._image_rows_added = 0 if self.vision_tower is None else image_rows_added(
            input_ids, kwargs.get("grid_thws"), self.config.media_placeholder_token_id,
            self.vision_tower.merge_kernel_size)
        try:
            return super().generate(inputs, *args, **kwargs)
        finally:
            self._image_rows_added = 0

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length) -> None:
        max_cache_length += getattr(self, "_image_rows_added", 0)
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)

    def prepare_inputs_for_generation(self, *args, pixel_values=None, grid_thws=None, **kwargs):
        """Images go into the prefill only; later steps read the cache (and the merged mask, see below)."""
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        cache = cache_in(inputs)
        if pixel_values is not None and (cache is None or not cache.has_previous_state()):
            inputs["pixel_values"], inputs["grid_thws"] = pixel_values, grid_thws
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        # After an image prefill the cache holds the merged sequence: the mask generate() extends must be its mask.
        merged_mask = getattr(outputs, "attention_mask", None)
        if merged_mask is not None and getattr(outputs, CACHE_FIELD, None) is not None:
            model_kwargs["attention_mask"] = merged_mask
        return super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)


@dataclass
class KimiK3MultimodalModelOutputWithPast(MoeModelOutputWithPast):
    """`attention_mask`: after a forward with images, the padding mask of the merged sequence (as
    KimiK3MultimodalOutputWithPast)."""

    attention_mask: torch.Tensor | None = None


class KimiK3TextBackbone(KimiK3PreTrainedModel):
    """`language_model` of the multimodal base model: the text model under `model`, so that its parameters keep the
    names of the composite checkpoint (`language_model.model.*`) without the head (`language_model.lm_head.weight`).
    A model class of its own, so that the release-layout conversions apply to it as to KimiK3ForCausalLM
    (release_layout_kimi_k3.register_release_conversions)."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.post_init()

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class KimiK3MultimodalModel(KimiK3CompositePreTrainedModel):
    """The base model of a composite folder (what AutoModel loads there, as LlavaModel is to
    LlavaForConditionalGeneration): the vision tower, the projector and the text model without its head; its output
    is the text model's last hidden state over the merged sequence. Images and loading options as
    KimiK3ForConditionalGeneration, whose checkpoint it reads (the head is left out)."""

    text_model_class = KimiK3TextBackbone
    _keys_to_ignore_on_load_unexpected = KimiK3PreTrainedModel._keys_to_ignore_on_load_unexpected + [
        r"^language_model\.lm_head\."]

    # the image path is the top-level class's, unchanged (the same checks and the same splice)
    get_image_features = KimiK3ForConditionalGeneration.get_image_features
    _merge_images = KimiK3ForConditionalGeneration._merge_images

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, pixel_values=None, grid_thws=None,
                **kwargs) -> KimiK3MultimodalModelOutputWithPast:
        cache = given_cache(cache, past_key_values)
        merged_mask = None
        if pixel_values is not None:
            if inputs_embeds is not None:
                raise ValueError("pass images with input_ids, not inputs_embeds: the media placeholders in input_ids "
                                 "mark where the images go")
            inputs_embeds, merged_mask, _ = self._merge_images(input_ids, pixel_values, grid_thws, attention_mask,
                                                               None, cache)
            input_ids, attention_mask, position_ids = None, merged_mask, None
        elif grid_thws is not None:
            raise ValueError("grid_thws was given without pixel_values")
        outputs = self.language_model.model(input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                            use_cache=use_cache, **kwargs)
        return KimiK3MultimodalModelOutputWithPast(**outputs, attention_mask=merged_mask)


__all__ = [
    "KimiK3ForConditionalGeneration",
    "KimiK3MultimodalModel",
]
