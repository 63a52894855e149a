"""The model card (README.md) of Kimi K3 folders: converted (`kimik3 convert`), sliced, and saved from a loaded or
fine-tuned model (`save_pretrained` / `push_to_hub`). One template, filled here from the folder's own config."""

import json
from pathlib import Path
from string import Template

TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card_template.md"
RELEASE_REPO = "moonshotai/Kimi-K3"
RELEASE_SHAPE = (93, 896)  # (layers, routed experts) of the release
# The first line after the metadata of every card written here. A README without it was written by someone else and
# is never replaced; deleting the line is how a user keeps an edited card.
CARD_MARKER = ("<!-- kimik3-model-card: written by kimik3.hub_card; delete this line to keep your edits when the "
               "model is saved again -->")
PROVENANCE_NAME = "kimik3_conversion.json"
RELEASE_TAGS = ["kimi_k3", "moe", "hybrid-attention", "linear-attention", "kda", "mla", "custom_code"]
CACHE_CONTEXTS = (4096, 32768, 131072, 1048576)
NO_VISION_NOTE = "the source has no vision tensors; none are written"


def is_kimik3_card(text: str) -> bool:
    return CARD_MARKER in text


def render_model_card(**fields) -> str:
    """Fill the template; every `$name` in it must be given (a missing one raises KeyError naming it)."""
    return Template(TEMPLATE_PATH.read_text()).substitute(**fields)


def _text_config(config):
    """A text config object from a config object or a config.json dict (top-level release schema or text config)."""
    if isinstance(config, dict):
        from kimik3.memory import _text_config_of

        return _text_config_of(config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _metadata(base_model, relation, pipeline_tag: str, experts_format: str) -> str:
    from huggingface_hub import ModelCardData

    derived = base_model is not None
    data = ModelCardData(
        # a folder with no base is our own (random or trained from scratch) weights: the package's license
        license="other" if derived else "apache-2.0",
        license_name="kimi-k3" if derived else None,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        base_model=base_model,
        base_model_relation=relation,
        tags=RELEASE_TAGS + (["mxfp4"] if experts_format == "mxfp4" else []),
    )
    return data.to_yaml()


def _gib(n: int) -> str:
    return f"{n / 2**30:,.3f} GiB" if n >= 2**30 else f"{n / 2**20:,.3f} MiB"


def _decimal_bytes(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


def _architecture_rows(text) -> str:
    from kimik3.memory import weight_bytes

    num_layers = len(text.layer_types)
    num_mla = sum(t == "full_attention" for t in text.layer_types)
    dense = [i for i, t in enumerate(text.mlp_layer_types) if t == "dense"]
    experts = ("MXFP4 (packed, dequantised on the fly)" if text.experts_format == "mxfp4"
               else "unpacked (the model's dtype)")
    mla = (f"{text.num_attention_heads} heads, q LoRA {text.q_lora_rank}, kv LoRA {text.kv_lora_rank}, "
           f"qk {text.qk_nope_head_dim} + {text.qk_rope_head_dim} (NoPE), v {text.v_head_dim}")
    rows = [
        ("layers", f"{num_layers} ({num_layers - num_mla} KDA, {num_mla} gated MLA)"),
        ("hidden size / vocabulary", f"{text.hidden_size} / {text.vocab_size:,}"),
        ("KDA", f"{text.linear_num_heads} heads x {text.linear_head_dim}, short conv {text.linear_conv_kernel_size}"),
        ("MLA", mla),
        ("MoE", f"{text.num_experts} routed experts, top-{text.num_experts_per_token}, {text.num_shared_experts} "
                f"shared; latent width {text.latent_size}, expert width {text.moe_intermediate_size}"),
        ("dense MLP layers", f"{', '.join(map(str, dense)) or 'none'} (width {text.intermediate_size})"),
        ("routed experts stored as", experts),
        ("Block Attention Residuals", f"block size {text.attn_res_block_size}" if text.attn_res_block_size else "off"),
        ("max positions", f"{text.max_position_embeddings:,}"),
        ("weights", f"{_decimal_bytes(weight_bytes(text, text.experts_format))} loaded in bf16 (F32 tensors F32)"),
    ]
    return "\n".join(f"| {name} | {value} |" for name, value in rows)


def _cache_rows(text) -> str:
    from kimik3.memory import memory_table

    contexts = [n for n in CACHE_CONTEXTS if n < text.max_position_embeddings] + [text.max_position_embeddings]
    return "\n".join(
        f"| {r['tokens']:,} | {_gib(r['k3_mla_kv'])} | {_gib(r['k3_kda_state'] + r['k3_kda_conv'])} | "
        f"{_gib(r['k3_total'])} | {_gib(r['official_expanded_kv'])} |"
        for r in memory_table(text, contexts[-4:])
    )


# The card's image section, for folders whose model holds the vision tower. AutoProcessor goes by processor_config.json
# (written by `kimik3 convert` and `kimik3 tiny`), which names our processor; the release's preprocessor_config.json,
# kept as it is in a converted folder, is not read.
IMAGES_SECTION = """
## Images

`KimiK3ForConditionalGeneration` (what `AutoModelForCausalLM` loads here) reads images: the MoonViT-3d tower and the
patch-merger projector turn an image into one row per 2x2 block of 14-pixel patches, spliced in at its
`<|media_pad|>` tokens. `KimiK3Processor` (`processing_kimi_k3.py`, named by `processor_config.json`, which holds the
release's image settings) resizes, normalises and cuts the images with the release's rules and writes one
`<|media_pad|>` per row; its outputs go straight to `generate`:

```python
from PIL import Image
from transformers import AutoProcessor

processor = AutoProcessor.from_pretrained(repo, trust_remote_code=True)
messages = [{"role": "user", "content": [{"type": "image", "image": Image.open("photo.jpg")},
                                          {"type": "text", "text": "What is in this picture?"}]}]
inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True).to(model.device)
out = model.generate(**inputs, max_new_tokens=2048)
print(processor.decode(out[0, inputs["input_ids"].shape[1]:]))
```

Batches of conversations with images pad on the left (`padding=True, padding_side="left"`), and the static cache
(`cache_implementation="static"`) works with images. Images only: video is not supported, and images with
transparency are flattened by dropping the alpha channel (composite them onto a background first).
"""


def _limitations(sliced: bool, random_weights: bool, vision: bool) -> str:
    items = [
        "Images only: video input is not supported (the processor refuses it). The image path (MoonViT-3d tower, "
        "patch-merger projector, splice at `<|media_pad|>`) matches an independent per-patch reference in float32; "
        "it has not yet been compared with Moonshot AI's implementation."
        if vision else
        "This folder holds no vision weights: inputs are text only (the code reads images when a checkpoint carries "
        "the MoonViT tower, `vision_tower.*` and `mm_projector.*`).",
        "Assisted generation / speculative decoding (the KDA state rolls back by replaying recorded inputs) runs "
        "on the default growing cache only: `cache_implementation=\"static\"` cannot be cropped.",
        "No multi-token-prediction head (the release has none).",
        "The full model needs about 1.56 TB for the weights with MXFP4 experts (5.56 TB with bf16 experts): plan "
        "devices with `kimik3 memory --plan`.",
    ]
    if sliced:
        items.insert(0, "This is a sliced model (fewer layers and/or experts) for tests and development; its outputs "
                        "are not those of the full model.")
    if random_weights:
        items.insert(0, "The weights are not the release's (random or trained from scratch); outputs are "
                        "meaningless unless you trained it.")
    return "\n".join(f"- {item}" for item in items)


def _provenance_section(provenance: dict | None) -> str:
    if not provenance:
        return ""
    opts = provenance.get("options", {})
    revision = f" at revision `{provenance['revision']}`" if provenance.get("revision") else ""
    experts = ("MXFP4 (kept packed)" if provenance.get("experts_format") == "mxfp4"
               else "bf16 (exactly dequantised from the release's MXFP4)")
    lines = [
        "",
        f"## Conversion provenance (`{PROVENANCE_NAME}`)",
        "",
        "| | |",
        "|---|---|",
        f"| source | `{provenance['source']}`{revision} |",
        f"| source index sha256 | `{provenance.get('source_index_sha256', '?')[:16]}` |",
        f"| converter format | {provenance.get('converter_version', '?')} |",
        f"| layers | {provenance.get('num_layers')} of {provenance.get('source_num_layers')} |",
        f"| routed experts | {provenance.get('num_experts')} of {provenance.get('source_num_experts')}, stored as "
        f"{experts} |",
        f"| options | `{_command_line_options(opts)}` |",
    ]
    if provenance.get("notes"):
        lines += ["", "Conversion notes:", ""] + [f"- {note}" for note in provenance["notes"]]
    return "\n".join(lines) + "\n"


def _command_line_options(options: dict) -> str:
    chosen = [f"--{key.replace('_', '-')}" if isinstance(value, bool) else f"--{key.replace('_', '-')} {value}"
              for key, value in sorted(options.items()) if value not in (None, False)]
    return ", ".join(chosen) or "defaults"


def build_model_card(config, *, title: str, summary: str, base_model: str | None = None,
                     relation: str | None = None, provenance: dict | None = None, vision: bool = False,
                     sliced: bool = False, repo_id: str = "path/to/this/folder") -> str:
    """The card of one folder, from its config (object or config.json dict)."""
    text = _text_config(config)
    return render_model_card(
        metadata=_metadata(base_model, relation, "image-text-to-text" if vision else "text-generation",
                           text.experts_format).strip(),
        marker=CARD_MARKER,
        title=title,
        summary=summary,
        architecture=_architecture_rows(text),
        mla_cache_dim=text.mla_cache_dim,
        cache_rows=_cache_rows(text),
        num_mla=sum(t == "full_attention" for t in text.layer_types),
        repo_id=repo_id,
        eos_token_id=163586,
        provenance=_provenance_section(provenance),
        images=IMAGES_SECTION if vision else "",
        limitations=_limitations(sliced, base_model is None, vision),
    )


def converted_model_card(provenance: dict, config: dict) -> str:
    """The card of a folder written by `kimik3 convert`, from its provenance record (kimik3_conversion.json) and the
    config.json it writes. Nothing here depends on the destination path, so a resumed run writes the same bytes as
    an uninterrupted one."""
    opts = provenance["options"]
    source = str(provenance["source"])
    is_repo = "/" in source and not Path(source).exists()
    # a Hub id names itself; a local folder is only called the release when it has the release's shape
    is_release_shape = (provenance["source_num_layers"], provenance["source_num_experts"]) == RELEASE_SHAPE
    sliced = opts["num_layers"] is not None or opts["num_experts"] is not None
    vision = "vision_config" in config and not opts["text_only"] and NO_VISION_NOTE not in provenance["notes"]
    # MXFP4 kept packed is the release's quantised weights repacked; bf16 holds the same values exactly. A slice has
    # no relation in the Hub's vocabulary (adapter / merge / quantized / finetune), so it names its base only.
    relation = None if sliced else "quantized"
    revision = f" at revision `{provenance['revision']}`" if provenance.get("revision") else ""
    scope = "text only, " if opts["text_only"] else ""
    title = (f"Kimi K3, sliced to {provenance['num_layers']} layers x {provenance['num_experts']} experts "
             f"({scope}for tests and development)" if sliced else f"Kimi K3 ({scope}converted for transformers)")
    summary = (f"Converted by `kimik3 convert` (converter format {provenance['converter_version']}) from the "
               f"release-layout checkpoint `{source}`{revision}. Weights are unchanged apart from the layout"
               f"{' and the slicing' if sliced else ''}; the license of the source applies.")
    return build_model_card(config, title=title, summary=summary,
                            base_model=source if is_repo or not is_release_shape else RELEASE_REPO,
                            relation=relation, provenance=provenance, vision=vision, sliced=sliced)


def _read_front_matter(readme: Path) -> dict:
    try:
        from huggingface_hub import ModelCard

        return ModelCard.load(readme).data.to_dict()
    except Exception:  # a README that is not a card is simply not a source of metadata
        return {}


def saved_model_card(config, name_or_path: str | None = None, vision: bool = False) -> str:
    """The card of a folder saved from a loaded model. Its base is what it was loaded from: a Hub id, or, for a local
    folder, that folder's own base (its card's `base_model`, or the release for a converted folder). `vision`: the
    saved model holds the vision tower."""
    source = Path(name_or_path) if name_or_path else None
    base_model, provenance = None, None
    if source is not None and source.is_dir():
        if (source / PROVENANCE_NAME).is_file():
            provenance = json.loads((source / PROVENANCE_NAME).read_text())
        base_model = _read_front_matter(source / "README.md").get("base_model") if (source / "README.md").is_file() \
            else None
        if base_model is None and provenance is not None:
            base_model = RELEASE_REPO
    elif name_or_path and "/" in str(name_or_path):
        base_model = str(name_or_path)
    text = _text_config(config)
    if base_model is not None:
        title = "Kimi K3, fine-tuned"
        summary = (f"Saved from a Kimi K3 model loaded from `{name_or_path}` (base: `{base_model}`), e.g. after "
                   "fine-tuning with `Trainer`. The license of the base model applies.")
    else:
        title = "Kimi K3 architecture (own weights)"
        summary = ("A model with the Kimi K3 architecture whose weights do not come from a known base (a random "
                   "initialisation such as `kimik3 tiny`, or a model trained from scratch).")
    sliced = (len(text.layer_types), text.num_experts) != RELEASE_SHAPE
    return build_model_card(config, title=title, summary=summary, base_model=base_model,
                            relation="finetune" if base_model else None, provenance=provenance, vision=vision,
                            sliced=sliced)


def write_model_card(directory, card: str) -> bool:
    """Writes README.md unless the folder has one that is not ours (a user's card is never replaced)."""
    readme = Path(directory) / "README.md"
    if readme.exists() and not is_kimik3_card(readme.read_text(encoding="utf-8", errors="replace")):
        return False
    readme.write_text(card, encoding="utf-8")
    return True


# The card transformers writes to a repo that has none (pushing a tokenizer first does that); it is a placeholder, not
# a user's card, so a model push replaces it.
LIBRARY_PLACEHOLDER = "This model card has been automatically generated."


def _hub_readme(api, repo_id: str, revision: str | None, token) -> str | None:
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    try:
        path = api.hf_hub_download(repo_id, "README.md", revision=revision, token=token)
    except (EntryNotFoundError, RevisionNotFoundError):
        return None
    return Path(path).read_text(encoding="utf-8", errors="replace")


def push_with_card(model, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                   private: bool | None = None, token=None, revision: str | None = None, create_pr: bool = False,
                   max_shard_size="50GB", tags: list[str] | None = None):
    """`model.push_to_hub` for our models: the files `save_pretrained` writes (weights, config with auto_map, code,
    our card) in one commit. A README already on the Hub that is not ours (nor the library's placeholder) is kept;
    `tags` are added to whichever card goes up."""
    import tempfile

    from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        model.save_pretrained(work, max_shard_size=max_shard_size)
        readme = work / "README.md"
        on_hub = _hub_readme(api, repo_id, revision, token)
        if on_hub is not None and not is_kimik3_card(on_hub) and LIBRARY_PLACEHOLDER not in on_hub:
            readme.write_text(on_hub, encoding="utf-8")
        if tags and readme.exists():
            card = ModelCard.load(readme)
            card.data.tags = list(card.data.tags or []) + [t for t in tags if t not in (card.data.tags or [])]
            card.save(readme)
        operations = [CommitOperationAdd(path_in_repo=p.relative_to(work).as_posix(), path_or_fileobj=str(p))
                      for p in sorted(work.rglob("*")) if p.is_file()]
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
        return api.create_commit(repo_id, operations=operations, commit_message=commit_message or "Upload model",
                                 commit_description=commit_description, token=token, create_pr=create_pr,
                                 revision=revision)
