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

Transparency, as the release's media_utils.py: with `transparent_bg_config` null (the default) every image is
converted to RGB, so alpha is dropped. With it set, an image whose mode has an alpha band ("A": RGBA, LA, PA) or that
carries a `transparency` entry (palette or grey images with a transparent colour) is composited onto the configured
background (a solid white/black/gray, or a chessboard of `chessboard_square_size` squares anchored at the top-left
pixel); other images (RGB ones always) are converted to RGB. `transparent_bg_fill_stage` says when: "before_resize" (the default)
composites at full size, "after_resize" (what the release ships) resizes the image in its own mode first and
composites the resized image, before padding, so the padding stays zero.
"""

import base64
import binascii
import io
import math
import os
import re
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

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
    "transparent_bg_config": None,
    "transparent_bg_fill_stage": "before_resize",
}

TRANSPARENT_BG_FILL_STAGES = ("before_resize", "after_resize")
# The release's TransparentBgConfig fields with their defaults, which fill the keys a config leaves out
TRANSPARENT_BG_DEFAULTS = {
    "pattern": "black",
    "chessboard_square_size": 16,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 200,
}
SOLID_BACKGROUNDS = {"white": 255, "black": 0, "gray": 128}


def _byte(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255


_TRANSPARENT_BG_CHECKS = {
    "pattern": (lambda v: v == "chessboard" or (isinstance(v, str) and v in SOLID_BACKGROUNDS),
                "one of \"white\", \"black\", \"gray\", \"chessboard\""),
    "chessboard_square_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                               "a positive whole number of pixels"),
    "chessboard_square_on_top_left": (lambda v: isinstance(v, bool), "true or false"),
    "chessboard_white_value": (_byte, "a whole number from 0 to 255"),
    "chessboard_gray_value": (_byte, "a whole number from 0 to 255"),
}


def transparent_bg_problem(value) -> str | None:
    """What is wrong with a `transparent_bg_config` value, naming the key (None when the release would accept it)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"transparent_bg_config = {value!r}: expected null or an object of {', '.join(TRANSPARENT_BG_DEFAULTS)}"
    for key in value:
        if key not in TRANSPARENT_BG_DEFAULTS:
            return (f"transparent_bg_config.{key} is not a setting of the transparent-background fill (it has "
                    f"{', '.join(TRANSPARENT_BG_DEFAULTS)})")
    for key, (supported, what) in _TRANSPARENT_BG_CHECKS.items():
        if key in value and not supported(value[key]):
            return f"transparent_bg_config.{key} = {value[key]!r}: expected {what}"
    return None


def background_pixels(height: int, width: int, background: dict) -> np.ndarray:
    """The fill behind transparent pixels, uint8 [height, width, 3]."""
    pattern = background["pattern"]
    if pattern != "chessboard":
        return np.full((height, width, 3), SOLID_BACKGROUNDS[pattern], dtype=np.uint8)
    side = background["chessboard_square_size"]
    square_sum = np.arange(height)[:, None] // side + np.arange(width)[None, :] // side
    # the release's parity: with square_on_top_left the top-left square is white and its neighbours gray
    gray = square_sum % 2 == (1 if background["chessboard_square_on_top_left"] else 0)
    board = np.where(gray, background["chessboard_gray_value"], background["chessboard_white_value"])
    return np.repeat(board.astype(np.uint8)[:, :, None], 3, axis=2)


def flatten_transparency(image, background: dict | None):
    """An RGB PIL image: alpha dropped when `background` is None, else transparent pixels composited onto it."""
    from PIL import Image

    has_transparency = "A" in image.getbands() or "transparency" in image.info
    if background is None or image.mode == "RGB" or not has_transparency:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    # f32 arithmetic and truncation to uint8, as the release
    alpha = rgba[:, :, 3:].astype(np.float32) / np.float32(255.0)
    mixed = alpha * rgba[:, :, :3] + (1 - alpha) * background_pixels(rgba.shape[0], rgba.shape[1], background)
    return Image.fromarray(mixed.astype(np.uint8))


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_whole(value) -> bool:
    return _whole(value) and value > 0


def _merge_kernel_ok(value) -> bool:
    sides = [value] if _whole(value) else value
    return isinstance(sides, (list, tuple)) and len(sides) in (1, 2) and all(_positive_whole(v) for v in sides) \
        and len(set(sides)) == 1  # the release's merge is square (2x2); resize_plan reads one side


def _three_numbers(value, positive: bool = False) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 3 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 or not positive)
        for v in value)


# What each size setting must be: resize_plan divides by patch_size and merge_kernel_size and scales by the limits
_MEDIA_PROC_CHECKS = {
    "patch_size": (_positive_whole, "a positive whole number of pixels"),
    "merge_kernel_size": (_merge_kernel_ok, "a positive whole number or a list of two equal ones (the release: 2)"),
    "in_patch_limit": (_positive_whole, "a positive whole number of patches"),
    "patch_limit_on_one_side": (_positive_whole, "a positive whole number of patches"),
    "fixed_output_tokens": (lambda v: v is None or _positive_whole(v), "null or a positive whole number"),
    "image_mean": (_three_numbers, "a list of three finite numbers (R, G, B)"),
    "image_std": (lambda v: _three_numbers(v, positive=True), "a list of three finite positive numbers (R, G, B)"),
}


def media_proc_problem(cfg: dict) -> str | None:
    """What is wrong with the size and normalisation settings of a `media_proc_cfg`, naming the key."""
    for key, (supported, what) in _MEDIA_PROC_CHECKS.items():
        if key in cfg and not supported(cfg[key]):
            return f"{key} = {cfg[key]!r}: expected {what}"
    return None


def check_image_size(width, height, what: str) -> None:
    """An image has at least one pixel on each side (a 0 x N image would divide by zero in resize_plan)."""
    if not (_positive_whole(width) and _positive_whole(height)):
        raise ValueError(f"Kimi K3 image processor: {what} is {width!r}x{height!r} pixels: an image needs at least "
                         "one pixel on each side")


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


_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/\s]+={0,2}")


def _shown(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def _base64_image(text: str):
    """The image whose file bytes `text` is in base64, or None when it is not one (then it was meant as a path)."""
    from PIL import Image

    if len(text) < 64 or not _BASE64_TEXT.fullmatch(text):
        return None
    try:
        with Image.open(io.BytesIO(base64.b64decode(text))) as opened:
            opened.load()
            return opened.copy()
    except (binascii.Error, ValueError, OSError, SyntaxError):
        return None


def load_image_source(source):
    """A PIL image from where a chat message or a caller names one: a local path, a `file://` URL, a
    `data:image/...;base64,` URL or bare base64 data (the forms transformers' processors take). Remote URLs (http,
    https, any other scheme) are refused without a connection: this file makes no network calls, so the caller
    downloads the image and passes its path. EXIF orientation is applied, as transformers' `load_image` does; the mode
    is kept, so transparency is resolved by the image processor's settings. Errors are ValueErrors naming the path."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    text = os.fsdecode(source) if isinstance(source, (bytes, os.PathLike)) else source
    lowered = text[:16].lower()
    data, path = None, None
    if lowered.startswith("data:"):
        header, _, payload = text.partition(",")
        if ";base64" not in header.lower():
            raise ValueError(f"Kimi K3 image processor: data URL {_shown(header)!r}: only base64 data URLs are read "
                             "(data:image/...;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"Kimi K3 image processor: data URL {_shown(header)!r}: not valid base64 "
                             f"({exc})") from None
        where = f"data URL {_shown(header)!r}"
    elif "://" in text:
        parts = urlsplit(text)
        if parts.scheme.lower() != "file":
            raise ValueError(f"Kimi K3 image processor: {_shown(text)}: remote image URLs are not fetched (no network "
                             "access here); download the image and pass its local path or a file:// URL")
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"Kimi K3 image processor: {_shown(text)}: a file:// URL on host {parts.netloc!r}; only "
                             "local files are read (file:///path/to/image.png)")
        path = url2pathname(unquote(parts.path))
    else:
        path = text
    if path is not None:
        if not os.path.exists(path):
            image = _base64_image(path)  # what transformers' load_image also accepts: base64 text of an image file
            if image is None:
                raise ValueError(f"Kimi K3 image processor: {_shown(path)}: no such image file")
            return image
        elif os.path.isdir(path):
            raise ValueError(f"Kimi K3 image processor: {path}: is a folder, not an image file")
        elif not os.path.isfile(path):
            # a FIFO or a device would block or never end: only regular files are opened
            raise ValueError(f"Kimi K3 image processor: {path}: is not a regular file")
        else:
            where = path
    try:
        with Image.open(io.BytesIO(data) if data is not None else path) as opened:
            opened.load()  # decode now, so a truncated file is an error here, naming it
            image = ImageOps.exif_transpose(opened)  # a loaded copy, independent of the file
    except UnidentifiedImageError:
        raise ValueError(f"Kimi K3 image processor: {where}: not an image file (PIL cannot identify it)") from None
    except Image.DecompressionBombError as exc:
        raise ValueError(f"Kimi K3 image processor: {where}: {exc}") from None
    except (OSError, SyntaxError) as exc:  # truncated or corrupt data, unreadable file (PIL raises SyntaxError too)
        raise ValueError(f"Kimi K3 image processor: {where}: cannot read the image ({exc})") from None
    return image


def _as_pil(image):
    from PIL import Image

    if isinstance(image, dict):  # the release's media dicts: {"type": "image", "image": ...}
        if image.get("type", "image") != "image":
            raise ValueError(f"Kimi K3 image processor: media type {image.get('type')!r} is not supported (images only)")
        # the image itself under "image", or where to read it: "url" / "path" (transformers' content-part keys)
        image = next((image[key] for key in ("image", "url", "path", "base64") if image.get(key) is not None),
                     None)
    if isinstance(image, (str, os.PathLike)):
        image = load_image_source(image)
    if isinstance(image, Image.Image):
        return image  # in its own mode: transparency is resolved by the image processor's settings
    if isinstance(image, torch.Tensor):
        image = image.numpy()
    if isinstance(image, np.ndarray):
        if image.ndim == 3 and image.shape[0] in (1, 3, 4) and image.shape[-1] not in (1, 3, 4):
            image = image.transpose(1, 2, 0)  # channels first -> last
        if image.dtype != np.uint8:
            if not np.isfinite(image).all():
                raise ValueError("Kimi K3 image processor: the image array holds non-finite values")
            # float arrays in [0, 1] as transformers' image utilities produce them
            image = np.clip(np.rint(image * 255.0 if image.max() <= 1.0 else image), 0, 255).astype(np.uint8)
        return Image.fromarray(image.squeeze(-1) if image.ndim == 3 and image.shape[-1] == 1 else image)
    raise ValueError(f"Kimi K3 image processor: expected a PIL image, an array, a path or URL, or a media dict, "
                     f"got {type(image).__name__}")


class KimiK3ImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        cfg = dict(DEFAULT_MEDIA_PROC_CFG)
        cfg.update(media_proc_cfg or {})
        problem = media_proc_problem(cfg) or transparent_bg_problem(cfg["transparent_bg_config"])
        if problem is not None:
            raise ValueError(f"Kimi K3 image processor: media_proc_cfg.{problem}")
        if cfg["transparent_bg_fill_stage"] not in TRANSPARENT_BG_FILL_STAGES:
            raise ValueError(f"Kimi K3 image processor: media_proc_cfg.transparent_bg_fill_stage = "
                             f"{cfg['transparent_bg_fill_stage']!r}: expected \"before_resize\" or \"after_resize\"")
        self.media_proc_cfg = cfg
        given = cfg["transparent_bg_config"]
        self._background = None if given is None else {**TRANSPARENT_BG_DEFAULTS, **given}

    def num_image_tokens(self, width: int, height: int) -> int:
        """Rows an image of this size (before resizing) becomes in the language model."""
        check_image_size(width, height, "the image size")
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
        fill_after_resize = cfg["transparent_bg_fill_stage"] == "after_resize"
        if not fill_after_resize:
            image = flatten_transparency(image, self._background)
        if size != image.size:
            # after_resize this is in the image's own mode: PIL premultiplies alpha, so fully transparent pixels do not
            # bleed their colour into the edges (and it resizes palette images nearest-neighbour)
            image = image.resize(size, resample=Image.Resampling.BICUBIC)
        if fill_after_resize:
            image = flatten_transparency(image, self._background)  # drawn on the resized image, not on the padding
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
        for index, image in enumerate(images):
            check_image_size(image.width, image.height, f"image {index}")
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


__all__ = ["KimiK3ImageProcessor", "background_pixels", "flatten_transparency", "load_image_source",
           "resize_plan", "transparent_bg_problem"]
