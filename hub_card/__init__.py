"""The model card (README.md) of converted or fine-tuned Kimi K3 folders: one template, filled here."""

from pathlib import Path

TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card_template.md"
RELEASE_REPO = "moonshotai/Kimi-K3"
RELEASE_SHAPE = (93, 896)  # (layers, routed experts) of the release


def render_model_card(**fields) -> str:
    """Fill the template; every `{name}` in it must be given (a missing one raises KeyError naming it)."""
    return TEMPLATE_PATH.read_text().format(**fields)


def _command_line_options(options: dict) -> str:
    chosen = [f"--{key.replace('_', '-')}" if isinstance(value, bool) else f"--{key.replace('_', '-')} {value}"
              for key, value in sorted(options.items()) if value not in (None, False)]
    return ", ".join(chosen) or "defaults"


def converted_model_card(provenance: dict) -> str:
    """The card of a folder written by `kimik3 convert`, from its provenance record (kimik3_conversion.json).
    Nothing here depends on the destination path, so a resumed run writes the same bytes as an uninterrupted one."""
    opts = provenance["options"]
    source = str(provenance["source"])
    is_repo = "/" in source and not Path(source).exists()
    # a Hub id names itself; a local folder is only called the release when it has the release's shape
    is_release_shape = (provenance["source_num_layers"], provenance["source_num_experts"]) == RELEASE_SHAPE
    experts = ("MXFP4 (kept packed, dequantised on the fly)" if provenance["experts_format"] == "mxfp4"
               else "bf16 (exactly dequantised from the release's MXFP4)")
    notes = ["## Conversion notes", ""] + [f"- {n}" for n in provenance["notes"]] if provenance["notes"] else []
    if opts["num_layers"] is not None or opts["num_experts"] is not None:
        notes += ["", "This is a sliced model for tests and development; its outputs are not those of the full model."]
    revision = f" at revision `{provenance['revision']}`" if provenance.get("revision") else ""
    return render_model_card(
        base_model=source if is_repo or not is_release_shape else RELEASE_REPO,
        title=f"Kimi K3 ({'text only, ' if opts['text_only'] else ''}converted for transformers)",
        summary=(f"Converted by `kimik3 convert` (converter format {provenance['converter_version']}) from the "
                 f"release-layout checkpoint `{source}`{revision} (index sha256 "
                 f"`{provenance['source_index_sha256'][:16]}`). Weights are unchanged apart from the layout; the "
                 "license of the source applies."),
        repo_id="path/to/this/folder",
        source=f"`{source}`",
        num_layers=f"{provenance['num_layers']} of {provenance['source_num_layers']}",
        num_kda=provenance["num_kda"],
        num_mla=provenance["num_mla"],
        num_experts=f"{provenance['num_experts']} of {provenance['source_num_experts']}",
        top_k=provenance["top_k"],
        experts_format=experts,
        options=f"`{_command_line_options(opts)}`",
        notes="\n".join(notes),
    )
