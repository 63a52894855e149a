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
"""Kimi K3 processor: the K3 tokenizer + `KimiK3ImageProcessor`.

Each `<|kimi_image_placeholder|>` in the text (what the chat template writes for an image part) becomes the
release's image prompt `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>` (W x H the size
before resizing) with one `<|media_pad|>` per image row the model will splice in (rows/2 * columns/2 patches of its
`grid_thws`), so lengths, padding and masks are final before the model runs. With `expand_media_pad=False` the
prompt keeps the release's single `<|media_pad|>` and the model expands it; the model accepts both forms. Texts
written with the release's image prompts already in them pass as they are. Images are matched to placeholders in
reading order (texts in order, then positions). Images only: video and audio inputs are refused.
"""

import json
import shutil
from contextvars import ContextVar
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

from .image_processing_kimi_k3 import KimiK3ImageProcessor, _as_pil
from .tokenization_kimi_k3 import check_tokenizer_files, normalize_conversations


IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_PAD = "<|media_pad|>"
PROCESSOR_CONFIG_NAME = "processor_config.json"
# The code files a processor folder needs: this file and the ones it imports (relative imports only between them),
# read from its import statements as transformers reads them when it loads the class, so no list is kept by hand.
# And the auto_map naming its classes: at the top of processor_config.json for AutoProcessor, inside its nested
# `image_processor` for AutoImageProcessor (which reads only that part of the file).
PROCESSOR_CODE_FILES = (Path(__file__).name,
                        *sorted(Path(name).name for name in get_relative_import_files(str(Path(__file__).resolve()))))
PROCESSOR_AUTO_MAP = {"AutoProcessor": "processing_kimi_k3.KimiK3Processor",
                      "AutoImageProcessor": "image_processing_kimi_k3.KimiK3ImageProcessor"}
# Keyword arguments ProcessorMixin.apply_chat_template passes for media loading that the tokenizer must not see
_MEDIA_LOADING_KWARGS = ("num_frames", "fps", "do_sample_frames", "video_load_backend", "sampling_rate",
                         "load_audio_from_video")
# While apply_chat_template(tokenize=True) renders the tagged template (tokenization_kimi_k3.ChatTagging), the
# tagging and the plain renderings for __call__, which ProcessorMixin calls with the tagged text
_CHAT_RENDERING: ContextVar = ContextVar("kimik3_chat_rendering", default=None)


def _flatten(items) -> list:
    flat = []
    for item in items:
        flat.extend(_flatten(item) if isinstance(item, (list, tuple)) else [item])
    return flat


class KimiK3Processor(ProcessorMixin):
    # the sub-processors load through the Auto classes and the folder's auto_map (class-name attributes are
    # deprecated in 5.24 and, on 5.17, resolve to the torchvision-only placeholder of AutoImageProcessor)
    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        if image_processor is None:
            image_processor = KimiK3ImageProcessor()
        if chat_template is None and tokenizer is not None:
            chat_template = getattr(tokenizer, "chat_template", None)
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # the processor's own files resolve inside a local folder, as the tokenizer's do (docs/bad_inputs.md,
        # "Loading a folder"); the tokenizer checks its files when it loads
        check_tokenizer_files(pretrained_model_name_or_path, kwargs.get("subfolder"),
                              {"processor": "processor_config.json", "image": "preprocessor_config.json"})
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def image_prompt(self, width: int, height: int, expand_media_pad: bool = True) -> str:
        prompt = self.image_processor.image_prompt(width, height)
        if expand_media_pad:
            prompt = prompt.replace(MEDIA_PAD, MEDIA_PAD * self.image_processor.num_image_tokens(width, height))
        return prompt

    def __call__(self, images=None, text=None, videos=None, audio=None, expand_media_pad: bool = True,
                 return_tensors="pt", **kwargs):
        if videos is not None or audio is not None:
            raise ValueError("KimiK3Processor reads images only: video and audio inputs are not supported (the "
                             "release's processor refuses them too); pass video frames as separate images")
        if text is None:
            raise ValueError("KimiK3Processor needs text (with one `<|kimi_image_placeholder|>` per image)")
        texts = [text] if isinstance(text, str) else list(text)
        if images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        # apply_chat_template passes one list of images per conversation
        images = [_as_pil(image) for image in _flatten(images or [])]
        for key in _MEDIA_LOADING_KWARGS:
            kwargs.pop(key, None)
        rendering = _CHAT_RENDERING.get()
        if rendering is not None:
            _CHAT_RENDERING.set(None)
            text_inputs = self._encode_chat_rendering(rendering, texts, images, expand_media_pad,
                                                      len(texts) > 1 or not isinstance(text, str), return_tensors,
                                                      kwargs)
        else:
            texts = self._insert_image_prompts(texts, images, expand_media_pad)
            text_inputs = self.tokenizer(texts if len(texts) > 1 or not isinstance(text, str) else texts[0],
                                         return_tensors=return_tensors, **kwargs)
        data = dict(text_inputs)
        if images:
            data.update(self.image_processor.preprocess(images, return_tensors=return_tensors).data)
        return BatchFeature(data=data, tensor_type=return_tensors)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        """As ProcessorMixin's (image parts: `{"type": "image", "image": <PIL image, path or URL>}`), with the
        tokenizer's checks and normalisation first so the text matches `tokenizer.apply_chat_template`. With
        `tokenize=True` the conversation's text is ordinary text wherever it spells a control token or the image
        placeholder, as in the tokenizer's (only the template's own `<|kimi_image_placeholder|>` is an image)."""
        conversation = normalize_conversations(conversation)
        if not kwargs.get("tokenize") or not hasattr(self.tokenizer, "chat_tagging"):
            return super().apply_chat_template(conversation, chat_template, **kwargs)
        kwargs.pop("sanitize_control_tokens", None)
        if kwargs.get("return_assistant_tokens_mask"):
            raise ValueError("return_assistant_tokens_mask: the K3 chat template has no {% generation %} blocks")
        template = self._chat_template_string(chat_template)
        plain = super().apply_chat_template(conversation, template, **{**kwargs, "tokenize": False})
        tagging = self.tokenizer.chat_tagging((IMAGE_PLACEHOLDER,))
        extra = tagging.template_kwargs(template, self.tokenizer.special_tokens_map, kwargs)
        token = _CHAT_RENDERING.set((tagging, plain if isinstance(plain, list) else [plain]))
        try:
            return super().apply_chat_template(conversation, tagging.template(template), **extra, **kwargs)
        finally:
            _CHAT_RENDERING.reset(token)

    def _chat_template_string(self, chat_template):
        templates = self.chat_template
        if chat_template is None:
            if isinstance(templates, dict):
                if "default" not in templates:
                    raise ValueError(f"the processor has chat templates {sorted(templates)} but none named "
                                     "`default`: pass chat_template")
                return templates["default"]
            if templates is None:
                raise ValueError("the processor has no chat template")
            return templates
        return templates[chat_template] if isinstance(templates, dict) and chat_template in templates else chat_template

    def _encode_chat_rendering(self, rendering, texts, images, expand_media_pad, is_batched, return_tensors, kwargs):
        """The tagged chat text: pieces checked against the plain rendering, the template's placeholders replaced
        by image prompts (the same rules as `_insert_image_prompts`, counted over the template's markers only),
        encoded piece by piece."""
        tagging, plains = rendering
        rows = [tagging.split(t, p) for t, p in zip(texts, plains)]
        placeholders = sum(m and t == IMAGE_PLACEHOLDER for row in rows for t, m in row)
        pre_written = sum(m and t == MEDIA_PAD for row in rows for t, m in row)
        self._check_image_counts(placeholders, pre_written, len(images))
        prompts = iter(self.image_prompt(image.width, image.height, expand_media_pad) for image in images)
        expanded = []
        for row in rows:
            out = []
            for t, m in row:
                if m and t == IMAGE_PLACEHOLDER:
                    prompt = next(prompts)
                    out.extend(tagging.split(tagging.tag(prompt), prompt))
                else:
                    out.append((t, m))
            expanded.append(out)
        ids = [self.tokenizer.encode_chat_pieces(row) for row in expanded]
        options = {k: kwargs.pop(k) for k in ("padding", "truncation", "max_length") if k in kwargs}
        return self.tokenizer.chat_batch_encoding(ids, is_batched, return_tensors=return_tensors,
                                                  tokenizer_kwargs=kwargs, **options)

    @staticmethod
    def _check_image_counts(placeholders: int, pre_written: int, images: int):
        if placeholders and pre_written:
            raise ValueError(f"the text mixes {IMAGE_PLACEHOLDER} and {MEDIA_PAD}: use one form")
        if placeholders == 0:
            if pre_written and pre_written != images:
                raise ValueError(f"the text holds {pre_written} {MEDIA_PAD} token(s) but {images} image(s) "
                                 "were given")
            if not pre_written and images:
                raise ValueError(f"{images} image(s) were given but the text has no {IMAGE_PLACEHOLDER}")
        elif placeholders != images:
            raise ValueError(f"the text holds {placeholders} {IMAGE_PLACEHOLDER} but {images} image(s) were "
                             "given: one placeholder per image")

    def _insert_image_prompts(self, texts: list[str], images: list, expand_media_pad: bool) -> list[str]:
        placeholders = sum(t.count(IMAGE_PLACEHOLDER) for t in texts)
        self._check_image_counts(placeholders, sum(t.count(MEDIA_PAD) for t in texts), len(images))
        if placeholders == 0:
            return texts
        prompts = iter(self.image_prompt(image.width, image.height, expand_media_pad) for image in images)
        return ["".join(part if i == 0 else next(prompts) + part for i, part in enumerate(t.split(IMAGE_PLACEHOLDER)))
                for t in texts]

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Also writes the processor code files next to the configs, with their `auto_map`, so the folder loads with
        `AutoProcessor.from_pretrained(..., trust_remote_code=True)` without the package."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        self.write_processor_files(save_directory)
        return result

    def write_processor_files(self, directory) -> Path:
        """processor_config.json (the image processor's settings nested, both auto_maps) and the code files: what a
        folder that already holds the tokenizer (a model folder) needs for AutoProcessor. Returns the config path."""
        directory, here = Path(directory), Path(__file__).resolve().parent
        directory.mkdir(parents=True, exist_ok=True)
        for name in PROCESSOR_CODE_FILES:
            if (here / name).resolve() != (directory / name).resolve():
                shutil.copyfile(here / name, directory / name)
        config = self.to_dict()
        config["auto_map"] = dict(PROCESSOR_AUTO_MAP)
        config["image_processor"]["auto_map"] = dict(PROCESSOR_AUTO_MAP)
        config_path = directory / PROCESSOR_CONFIG_NAME
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return config_path

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "grid_thws"]


__all__ = ["KimiK3Processor"]
