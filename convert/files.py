"""The non-tensor files of a converted / exported folder: tokenizer and chat files, remote code, provenance."""

import fnmatch
import json
import math
from pathlib import Path

from kimik3.modeling.processing_kimi_k3 import PROCESSOR_CONFIG_NAME
from kimik3.modeling.tokenization_kimi_k3 import AUTO_TOKENIZER

from .checkpoint import check_inside, read_source_file
from .errors import ConversionError

# Tokenizer, chat and processor files of the release, copied verbatim when present.
TOKENIZER_PATTERNS = (
    "tiktoken.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenization_kimi.py",
    "encoding_k3.py",
    "chat_template*",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
    "kimi_k3_processor.py",
    "kimi_k3_vision_processing.py",
    "media_utils.py",
    "LICENSE*",
)
# The release's own model code: replaced by ours, never copied (the names would shadow our files).
RELEASE_MODEL_CODE = ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py")
PROVENANCE_NAME = "kimik3_conversion.json"
# A converted folder tokenizes with our remote code (kimik3.modeling.tokenization_kimi_k3, copied with the model code)
# reading the release's tiktoken.model and tokenizer_config.json; only the config's auto_map changes, and our chat
# template is added where the release ships none. The release's tokenizer code stays (inert: auto_map no longer names
# it), and the conversion record keeps what changed, so `kimik3 export` writes the release's files back byte for byte.
OUR_AUTO_TOKENIZER = AUTO_TOKENIZER  # the entry the tokenizer's own save_pretrained writes
CHAT_TEMPLATE_NAME = "chat_template.jinja"
# A converted folder with the vision tower also gets our processor_config.json (AutoProcessor -> our KimiK3Processor,
# its image settings from the release's preprocessor_config.json, which stays as it is); export leaves it out.
PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"


def read_provenance(root: Path) -> dict:
    """The conversion record of one of our folders ({} when there is none, e.g. a folder saved by a trainer)."""
    path = Path(root) / PROVENANCE_NAME
    if not path.is_file():
        return {}
    try:
        provenance = json.loads(read_source_file(Path(root), path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(provenance, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return provenance


def tokenizer_files(src: Path) -> list[Path]:
    """The side files copied verbatim; one that is a symlink to a file outside the folder is refused (its contents
    would be copied from elsewhere), as from_pretrained refuses one, and so is one that is not a regular file (it was
    left out silently)."""
    found = []
    for path in sorted(src.iterdir()):
        if not path.is_dir() and path.name not in RELEASE_MODEL_CODE:
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in TOKENIZER_PATTERNS):
                check_inside(src, path)
                found.append(path)  # a FIFO or a dangling link is refused when it is read (read_source_file)
    return found


def converted_tokenizer_files(src: Path, processor_config: bytes | None = None) -> tuple[list[tuple[str, bytes]], dict]:
    """The release's tokenizer files as a converted folder holds them (verbatim, except tokenizer_config.json's
    `auto_map.AutoTokenizer`, naming our classes, our chat template where the release has none, and
    `processor_config` as our processor_config.json when given), and the record of those changes for the conversion
    record: {"replaced": {name: original text}, "added": [names]}."""
    out, changes = [], {"replaced": {}, "added": []}
    for path in tokenizer_files(src):
        data = read_source_file(src, path)
        if path.name == PROCESSOR_CONFIG_NAME and processor_config is not None:
            changes["replaced"][path.name] = _text(path, data)
            continue
        if path.name == "tokenizer_config.json":
            try:
                text = data.decode("utf-8")
                config = json.loads(text)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                raise ConversionError(f"{path}: not valid JSON ({exc})") from None
            if not isinstance(config, dict):
                raise ConversionError(f"{path}: not a JSON object")
            config["auto_map"] = {**config.get("auto_map", {}), "AutoTokenizer": list(OUR_AUTO_TOKENIZER)}
            changes["replaced"][path.name] = text
            data = json_bytes(config)
        out.append((path.name, data))
    names = {name for name, _ in out}
    if "tiktoken.model" in names and not any(fnmatch.fnmatch(n, "chat_template*") for n in names):
        from kimik3.configuration import CHAT_TEMPLATE_PATH

        out.append((CHAT_TEMPLATE_NAME, CHAT_TEMPLATE_PATH.read_bytes()))
        changes["added"].append(CHAT_TEMPLATE_NAME)
    if processor_config is not None:
        out.append((PROCESSOR_CONFIG_NAME, processor_config))
        if PROCESSOR_CONFIG_NAME not in changes["replaced"]:
            changes["added"].append(PROCESSOR_CONFIG_NAME)
    return out, changes


def _text(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{path}: not UTF-8 text ({exc})") from None


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(read_source_file(path.parent, path))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return value


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _side(value):
    """A square kernel's side: the release writes merge_kernel_size as 2 in preprocessor_config.json, [2, 2] in
    config.json."""
    return value[0] if isinstance(value, (list, tuple)) and value else value


def _three_numbers(value) -> bool:
    return (isinstance(value, list) and len(value) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                and math.isfinite(v) for v in value))


# Our image processor's settings, each with what it supports (the release's `media_proc_cfg` keys of the same name and
# meaning). `fixed_output_tokens` must stay null: the model splices one row per merged patch block, whatever the
# processor counts.
MEDIA_SETTING_CHECKS = {
    "patch_size": (_positive_int, "a positive whole number"),
    "merge_kernel_size": (lambda v: _positive_int(v) or (isinstance(v, list) and len(v) == 2 and v[0] == v[1]
                                                        and _positive_int(v[0])),
                          "a positive whole number (or a square [k, k])"),
    "in_patch_limit": (_positive_int, "a positive whole number"),
    "patch_limit_on_one_side": (_positive_int, "a positive whole number"),
    "fixed_output_tokens": (lambda v: v is None, "null (the model turns every 2x2 patch block into one row)"),
    "image_mean": (_three_numbers, "three finite numbers"),
    "image_std": (lambda v: _three_numbers(v) and all(x > 0 for x in v), "three finite positive numbers"),
    "transparent_bg_config": (lambda v: _transparent_bg_problem(v) is None,
                              "null, or an object with pattern one of white/black/gray/chessboard, "
                              "chessboard_square_size a positive whole number, chessboard_square_on_top_left true or "
                              "false, chessboard_white_value and chessboard_gray_value whole numbers 0-255"),
    "transparent_bg_fill_stage": (lambda v: v in ("before_resize", "after_resize"),
                                  '"before_resize" or "after_resize"'),
}
# Release settings our image processor does not implement, which change the pixels of some images (none today)
UNAPPLIED_MEDIA_SETTINGS = {}


def _transparent_bg_problem(value):
    from kimik3.modeling.image_processing_kimi_k3 import transparent_bg_problem

    return transparent_bg_problem(value)


def media_proc_settings(src: Path, vision_config) -> tuple[dict, list[str]]:
    """Our image processor's settings from the release's preprocessor_config.json (`media_proc_cfg`): each setting
    our processor has is taken when its value is one we support (a ConversionError names the file and key
    otherwise), the release defaults fill the rest; and notes on release settings that are not applied. patch_size
    and merge_kernel_size must also agree with config.json's vision_config (the tower's own)."""
    from kimik3.modeling.image_processing_kimi_k3 import DEFAULT_MEDIA_PROC_CFG

    path = src / PREPROCESSOR_CONFIG_NAME
    release = _json_object(path).get("media_proc_cfg")
    if not isinstance(release, dict):
        raise ConversionError(f"{path}: no `media_proc_cfg` object (the release keeps its image settings there); "
                              "add it, or convert with --text-only")
    settings = dict(DEFAULT_MEDIA_PROC_CFG)
    for key, (supported, what) in MEDIA_SETTING_CHECKS.items():
        if key not in release:
            continue
        if not supported(release[key]):
            raise ConversionError(f"{path}: media_proc_cfg.{key} = {json.dumps(release[key])} is not supported by "
                                  f"our image processor (expected {what})")
        settings[key] = release[key]
    for key in ("patch_size", "merge_kernel_size"):
        ours, tower = settings[key], getattr(vision_config, key, None)
        if tower is not None and _side(ours) != _side(tower):
            raise ConversionError(f"{path}: media_proc_cfg.{key} = {json.dumps(ours)} but config.json's "
                                  f"vision_config.{key} = {json.dumps(tower)}: the images would not fit the tower")
    notes = [f"{PREPROCESSOR_CONFIG_NAME}: media_proc_cfg.{key} is not applied by our image processor: {why}"
             for key, why in UNAPPLIED_MEDIA_SETTINGS.items() if release.get(key) is not None]
    return settings, notes


def processor_config_bytes(settings: dict) -> bytes:
    """Our processor_config.json for these image settings: what `KimiK3Processor.write_processor_files` writes (the
    image processor's settings nested, both auto_maps), built without a tokenizer."""
    from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor
    from kimik3.modeling.processing_kimi_k3 import PROCESSOR_AUTO_MAP

    image_processor = {**KimiK3ImageProcessor(media_proc_cfg=settings).to_dict(), "auto_map": dict(PROCESSOR_AUTO_MAP)}
    return json_bytes({"auto_map": dict(PROCESSOR_AUTO_MAP), "image_processor": image_processor,
                       "processor_class": "KimiK3Processor"})


def release_tokenizer_files(converted: Path) -> list[tuple[str, bytes]]:
    """The tokenizer files of a converted folder as the release had them: what the conversion record says was
    replaced goes back to its original bytes, what was added stays out."""
    changes = read_provenance(converted).get("tokenizer_changes", {"replaced": {}, "added": []})
    out = []
    for path in tokenizer_files(converted):
        if path.name in changes["added"]:
            continue
        original = changes["replaced"].get(path.name)
        out.append((path.name, original.encode("utf-8") if original is not None else read_source_file(converted, path)))
    return out


def generation_config_bytes(src: Path, config) -> tuple[bytes, str | None]:
    """The converted folder's generation_config.json and, when it differs from the release's, the release's text
    (kept in the conversion record so `kimik3 export` writes it back byte for byte). The release's `max_length` equals
    the context length, so it limits nothing; kept, it makes every `generate(max_new_tokens=...)` warn that both are
    set, so it is left out."""
    text = getattr(config, "text_config", config)
    path = src / "generation_config.json"
    if path.exists():
        original = read_source_file(src, path)
        try:
            values = json.loads(original)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ConversionError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(values, dict):
            # its token ids end and pad what generate() writes: ids outside the vocabulary are refused as in config.json
            from kimik3.modeling.configuration_kimi_k3 import check_token_ids

            try:
                check_token_ids(values, text.vocab_size)
            except ValueError as exc:
                raise ConversionError(f"{path}: {exc}") from None
        max_length = values.get("max_length") if isinstance(values, dict) else None
        if isinstance(max_length, int) and max_length >= text.max_position_embeddings:
            del values["max_length"]
            return json_bytes(values), original.decode("utf-8")
        return original, None
    values = {"bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id, "pad_token_id": text.pad_token_id}
    return (json.dumps(values, indent=2, sort_keys=True) + "\n").encode(), None


def json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
