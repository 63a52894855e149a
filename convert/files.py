"""The non-tensor files of a converted / exported folder: tokenizer and chat files, remote code, card, provenance."""

import fnmatch
import json
from pathlib import Path

import kimik3.modeling

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


def remote_code_files() -> list[Path]:
    folder = Path(kimik3.modeling.__file__).parent
    return sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")


def modeling_class_names() -> set[str]:
    path = Path(kimik3.modeling.__file__).parent / "modeling_kimi_k3.py"
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


def _card_fields(provenance: dict) -> dict:
    """Fields of `kimik3.hub_card.render_model_card`. Nothing here depends on the destination path, so a resumed
    run writes the same bytes as an uninterrupted one."""
    opts = provenance["options"]
    source = str(provenance["source"])
    is_repo = "/" in source and not Path(source).exists()
    chosen = ", ".join(f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
                       for k, v in sorted(opts.items()) if v not in (None, False)) or "defaults"
    experts = ("MXFP4 (kept packed, dequantised on the fly)" if provenance["experts_format"] == "mxfp4"
               else "bf16 (exactly dequantised from the release's MXFP4)")
    notes = ["## Conversion notes", ""] + [f"- {n}" for n in provenance["notes"]] if provenance["notes"] else []
    if opts["num_layers"] is not None or opts["num_experts"] is not None:
        notes += ["", "This is a sliced model for tests and development; its outputs are not those of the full model."]
    return {
        # a Hub id names itself; a local folder is only called the release when it has the release's shape
        "base_model": source if is_repo else (
            "moonshotai/Kimi-K3" if (provenance["source_num_layers"], provenance["source_num_experts"]) == (93, 896)
            else source),
        "title": f"Kimi K3 ({'text only, ' if opts['text_only'] else ''}converted for transformers)",
        "summary": (
            f"Converted by `kimik3 convert` (converter format {provenance['converter_version']}) from the "
            f"release-layout checkpoint `{source}`"
            + (f" at revision `{provenance['revision']}`" if provenance.get("revision") else "")
            + f" (index sha256 `{provenance['source_index_sha256'][:16]}`). Weights are unchanged apart from the "
            "layout; the license of the source applies."
        ),
        "repo_id": "path/to/this/folder",
        "source": f"`{source}`",
        "num_layers": f"{provenance['num_layers']} of {provenance['source_num_layers']}",
        "num_kda": provenance["num_kda"],
        "num_mla": provenance["num_mla"],
        "num_experts": f"{provenance['num_experts']} of {provenance['source_num_experts']}",
        "top_k": provenance["top_k"],
        "experts_format": experts,
        "options": f"`{chosen}`",
        "notes": "\n".join(notes),
    }


def model_card(provenance: dict) -> bytes:
    """The card from `kimik3.hub_card` when installed, else a plain one: what this is, from what, which options."""
    try:
        from kimik3.hub_card import render_model_card
    except ImportError:
        render_model_card = None
    if render_model_card is not None:
        return render_model_card(**_card_fields(provenance)).encode()
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
        f"- routed experts: {'kept MXFP4 (`experts.*_packed` / `*_scale`, dequantised on the fly; `experts_format: mxfp4`)' if provenance['experts_format'] == 'mxfp4' else 'dequantised exactly from MXFP4 to bf16 (`experts_format: dense`)'}",
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
