"""The non-tensor files of a converted / exported folder: tokenizer and chat files, remote code, provenance."""

import fnmatch
import json
from pathlib import Path

from kimik3.remote_code import remote_code_files  # noqa: F401  (the converter copies these into every folder)

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
OUR_AUTO_TOKENIZER = ["tokenization_kimi_k3.KimiK3Tokenizer", "tokenization_kimi_k3.KimiK3TokenizerFast"]
CHAT_TEMPLATE_NAME = "chat_template.jinja"


def read_provenance(root: Path) -> dict:
    """The conversion record of one of our folders ({} when there is none, e.g. a folder saved by a trainer)."""
    path = Path(root) / PROVENANCE_NAME
    if not path.is_file():
        return {}
    try:
        provenance = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(provenance, dict):
        raise ConversionError(f"{path}: not a JSON object")
    return provenance


def tokenizer_files(src: Path) -> list[Path]:
    found = []
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in RELEASE_MODEL_CODE:
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in TOKENIZER_PATTERNS):
                found.append(path)
    return found


def converted_tokenizer_files(src: Path) -> tuple[list[tuple[str, bytes]], dict]:
    """The release's tokenizer files as a converted folder holds them (verbatim, except tokenizer_config.json's
    `auto_map.AutoTokenizer`, naming our classes, and our chat template where the release has none), and the record
    of those changes for the conversion record: {"replaced": {name: original text}, "added": [names]}."""
    out, changes = [], {"replaced": {}, "added": []}
    for path in tokenizer_files(src):
        data = path.read_bytes()
        if path.name == "tokenizer_config.json":
            try:
                text = data.decode("utf-8")
                config = json.loads(text)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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
    return out, changes


def release_tokenizer_files(converted: Path) -> list[tuple[str, bytes]]:
    """The tokenizer files of a converted folder as the release had them: what the conversion record says was
    replaced goes back to its original bytes, what was added stays out."""
    changes = read_provenance(converted).get("tokenizer_changes", {"replaced": {}, "added": []})
    out = []
    for path in tokenizer_files(converted):
        if path.name in changes["added"]:
            continue
        original = changes["replaced"].get(path.name)
        out.append((path.name, original.encode("utf-8") if original is not None else path.read_bytes()))
    return out


def generation_config_bytes(src: Path, config) -> tuple[bytes, str | None]:
    """The converted folder's generation_config.json and, when it differs from the release's, the release's text
    (kept in the conversion record so `kimik3 export` writes it back byte for byte). The release's `max_length` equals
    the context length, so it limits nothing; kept, it makes every `generate(max_new_tokens=...)` warn that both are
    set, so it is left out."""
    text = getattr(config, "text_config", config)
    path = src / "generation_config.json"
    if path.exists():
        original = path.read_bytes()
        try:
            values = json.loads(original)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{path}: not valid JSON ({exc})") from None
        max_length = values.get("max_length") if isinstance(values, dict) else None
        if isinstance(max_length, int) and max_length >= text.max_position_embeddings:
            del values["max_length"]
            return json_bytes(values), original.decode("utf-8")
        return original, None
    values = {"bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id, "pad_token_id": text.pad_token_id}
    return (json.dumps(values, indent=2, sort_keys=True) + "\n").encode(), None


def json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
