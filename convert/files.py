"""The non-tensor files of a converted / exported folder: tokenizer and chat files, remote code, card, provenance."""

import fnmatch
import json
from pathlib import Path

from . import _modeling

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


def tokenizer_files(src: Path) -> list[Path]:
    found = []
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in RELEASE_MODEL_CODE:
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in TOKENIZER_PATTERNS):
                found.append(path)
    return found


def remote_code_files() -> list[Path]:
    folder = _modeling.modeling_dir()
    return sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")


def modeling_class_names() -> set[str]:
    path = _modeling.modeling_dir() / "modeling_kimi_k3.py"
    if not path.exists():
        return set()
    return {line.split("class ", 1)[1].split("(")[0].split(":")[0].strip()
            for line in path.read_text().splitlines() if line.startswith("class ")}


def generation_config_bytes(src: Path, config) -> bytes:
    path = src / "generation_config.json"
    if path.exists():
        return path.read_bytes()
    text = getattr(config, "text_config", config)
    values = {"bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id, "pad_token_id": text.pad_token_id}
    return (json.dumps(values, indent=2, sort_keys=True) + "\n").encode()


def json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return str(n)


def model_card(provenance: dict) -> bytes:
    """A plain card until `kimik3.hub_card` provides the template: what this is, from what, with which options."""
    opts = provenance["options"]
    text_only = opts["text_only"]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation" if text_only else "pipeline_tag: image-text-to-text",
        "tags:",
        "- kimi-k3",
        "- custom_code",
        "- converted",
        "---",
        "",
        f"# {Path(str(provenance['source'])).name or provenance['source']} (converted for transformers)",
        "",
        f"This folder was **converted** by `kimik3 convert` (converter format {provenance['converter_version']}) "
        f"from the Kimi K3 release-layout checkpoint `{provenance['source']}`"
        + (f" at revision `{provenance['revision']}`" if provenance.get("revision") else "")
        + f" (index sha256 `{provenance['source_index_sha256'][:16]}…`). It loads with",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)",
        "```",
        "",
        "## Conversion options",
        "",
        f"- model: {'text only (`KimiK3ForCausalLM`, no vision tensors)' if text_only else 'composite (`KimiK3ForConditionalGeneration`, text model under `language_model.`)'}",
        f"- routed experts: {'kept MXFP4 (`experts.*_packed` / `*_scale`, dequantised on the fly; `experts_format: mxfp4`)' if opts['experts_dtype'] == 'mxfp4' else 'dequantised exactly from MXFP4 to bf16 (`experts_format: dense`)'}",
        f"- layers: {provenance['num_layers']} of {provenance['source_num_layers']}"
        + ("" if provenance['num_layers'] == provenance['source_num_layers'] else f" (source layers {provenance['layer_map']})"),
        f"- experts: {provenance['num_experts']} of {provenance['source_num_experts']}"
        + ("" if provenance['num_experts'] == provenance['source_num_experts'] else " (the first ones, with their router rows and correction biases)"),
        f"- tensors: {provenance['tensors']} in {provenance['shards']} shard(s), {_format_bytes(provenance['bytes'])}",
        "",
    ]
    if provenance["notes"]:
        lines += ["## Notes", ""] + [f"- {note}" for note in provenance["notes"]] + [""]
    if opts["num_layers"] is not None or opts["num_experts"] is not None:
        lines += ["A sliced model is meant for tests and development; its outputs are not those of the full model.", ""]
    lines += [
        "## License",
        "",
        "The weights are those of the source checkpoint and stay under its license (see `LICENSE` when present).",
        "",
    ]
    return "\n".join(lines).encode()
