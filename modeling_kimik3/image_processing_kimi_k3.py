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
"""Kimi K3 image processor: the release's NaViT rules (`preprocessor_config.json` -> `media_proc_cfg`).

Per image: keep its size unless it has more than `in_patch_limit` patches or more than `patch_limit_on_one_side`
patches on a side, else scale it down (PIL bicubic) by the largest factor that satisfies both; zero-pad right and
bottom to a multiple of patch * merge (28); scale to [0, 1] and normalise with mean/std (0.5 -> [-1, 1], so the
padding becomes -1); cut into patch x patch squares, row-major. Outputs `pixel_values` f32 [patches, 3, p, p] and
`grid_thws` int64 [images, 3] = (1, rows, columns) in patches. The model turns each image into
rows/2 * columns/2 tokens (`num_image_tokens`). Images only: the release's processor rejects other media.
"""

import math

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


DEFAULT_MEDIA_PROC_CFG = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 65536,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def resize_plan(width: int, height: int, cfg: dict) -> dict:
    """Target size, right/bottom padding and token count of one image (the release's rule, integer-exact)."""
    patch, merge = cfg["patch_size"], _merge(cfg)
    side_limit = cfg["patch_limit_on_one_side"]
    by_total = math.sqrt(cfg["in_patch_limit"] / (max(1.0, width // patch) * max(1.0, height // patch)))
    scale = min(1.0, by_total, side_limit * patch / width, side_limit * patch / height)
    new_width = min(max(1, int(width * scale)), side_limit * patch)
    new_height = min(max(1, int(height * scale)), side_limit * patch)
    unit = merge * patch
    pad_width, pad_height = (unit - new_width % unit) % unit, (unit - new_height % unit) % unit
    tokens = ((new_height + pad_height) // unit) * ((new_width + pad_width) // unit)
    if cfg.get("fixed_output_tokens") is not None:
        tokens = cfg["fixed_output_tokens"]
    return {"new_width": new_width, "new_height": new_height, "pad_width": pad_width, "pad_height": pad_height,
            "num_tokens": tokens}


def _merge(cfg: dict) -> int:
    merge = cfg["merge_kernel_size"]
    return int(merge[0]) if isinstance(merge, (list, tuple)) else int(merge)


def _as_pil(image):
    from PIL import Image

    if isinstance(image, dict):  # the release's media dicts: {"type": "image", "image": ...}
        if image.get("type", "image") != "image":
            raise ValueError(f"Kimi K3 image processor: media type {image.get('type')!r} is not supported (images only)")
        image = image.get("image")
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, torch.Tensor):
        image = image.numpy()
    if isinstance(image, np.ndarray):
        if image.ndim == 3 and image.shape[0] in (1, 3) and image.shape[-1] not in (1, 3):
            image = image.transpose(1, 2, 0)  # channels first -> last
        if image.dtype != np.uint8:
            if not np.isfinite(image).all():
                raise ValueError("Kimi K3 image processor: the image array holds non-finite values")
            # float arrays in [0, 1] as transformers' image utilities produce them
            image = np.clip(np.rint(image * 255.0 if image.max() <= 1.0 else image), 0, 255).astype(np.uint8)
        return Image.fromarray(image.squeeze(-1) if image.ndim == 3 and image.shape[-1] == 1 else image).convert("RGB")
    raise ValueError(f"Kimi K3 image processor: expected a PIL image, an array or a media dict, got "
                     f"{type(image).__name__}")


class KimiK3ImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        cfg = dict(DEFAULT_MEDIA_PROC_CFG)
        cfg.update(media_proc_cfg or {})
        if cfg.get("transparent_bg_config") is not None:
            raise ValueError("Kimi K3 image processor: media_proc_cfg.transparent_bg_config is not supported; "
                             "composite transparent images onto a background before processing")
        self.media_proc_cfg = cfg

    def num_image_tokens(self, width: int, height: int) -> int:
        """Rows an image of this size (before resizing) becomes in the language model."""
        return resize_plan(width, height, self.media_proc_cfg)["num_tokens"]

    @staticmethod
    def image_prompt(width: int, height: int) -> str:
        """The release's text for one image (its size before resizing); the model expands the `<|media_pad|>`."""
        return f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>"

    def _pixels(self, image) -> np.ndarray:
        from PIL import Image

        cfg = self.media_proc_cfg
        plan = resize_plan(image.width, image.height, cfg)
        size = (plan["new_width"], plan["new_height"])
        if size != image.size:
            image = image.resize(size, resample=Image.Resampling.BICUBIC)
        pixels = np.pad(np.asarray(image), ((0, plan["pad_height"]), (0, plan["pad_width"]), (0, 0)))
        # f32 as the release: x / 255 (f64) rounded to f32, then minus mean, times 1/std, in f32
        pixels = (pixels / 255.0).astype(np.float32)
        pixels -= np.asarray(cfg["image_mean"])
        pixels *= 1.0 / np.asarray(cfg["image_std"])
        return pixels.astype(np.float32, copy=False)

    def preprocess(self, images, return_tensors="pt", **kwargs) -> BatchFeature:
        if not isinstance(images, (list, tuple)):
            images = [images]
        images = [_as_pil(image) for image in images]
        if not images:
            return BatchFeature(data={}, tensor_type=return_tensors)
        patch = self.media_proc_cfg["patch_size"]
        patches, grids = [], []
        for image in images:
            pixels = self._pixels(image)
            rows, cols = pixels.shape[0] // patch, pixels.shape[1] // patch
            # [rows, p, cols, p, c] -> [rows, cols, c, p, p]: patches row-major, each channel-first
            cut = pixels.reshape(rows, patch, cols, patch, 3).transpose(0, 2, 4, 1, 3)
            patches.append(cut.reshape(rows * cols, 3, patch, patch))
            grids.append([1, rows, cols])
        data = {"pixel_values": np.concatenate(patches), "grid_thws": np.asarray(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def to_dict(self):
        output = super().to_dict()
        output["media_proc_cfg"] = dict(self.media_proc_cfg)
        return output


__all__ = ["KimiK3ImageProcessor", "resize_plan"]
