"""The model card (README.md) of Kimi K3 folders: converted (`kimik3 convert`), sliced, and saved from a loaded or
fine-tuned model (`save_with_card` / `push_with_card`: a model's own save_pretrained and push_to_hub write no card of
ours, since its code may run from a model folder without this package). One template, filled here from the folder's
own config."""

import json
import re
import struct
from pathlib import Path
from string import Template

TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card_template.md"
RELEASE_REPO = "moonshotai/Kimi-K3"
# Weights derived from Kimi K3's are under its license, wherever they were converted or trained
RELEASE_LICENSE_LINK = f"https://huggingface.co/{RELEASE_REPO}/blob/main/LICENSE"
RELEASE_SHAPE = (93, 896)  # (layers, routed experts) of the release
# The first line after the metadata of every card written here. A README without it was written by someone else and
# is never replaced; deleting the line is how a user keeps an edited card.
CARD_MARKER = ("<!-- kimik3-model-card: written by kimik3.hub_card; delete this line to keep your edits when the "
               "model is saved again -->")
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


_HUB_CACHE_FOLDER = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def hub_repo_id(source) -> str | None:
    """The Hub repo a source names, or None: `org/name` as transformers and `kimik3 convert` read it (not a local
    path, files_kimi_k3.looks_like_local_path), or a Hub cache snapshot folder (`.../models--org--name/
    snapshots/<rev>`). A local folder is never a `base_model`: the Hub resolves that field as a repo id."""
    if source is None:
        return None
    text = str(source)
    cached = _HUB_CACHE_FOLDER.search(text.replace("\\", "/"))
    if cached:
        return f"{cached['org']}/{cached['name']}"
    from kimik3.modeling.files_kimi_k3 import looks_like_local_path

    if "/" not in text or looks_like_local_path(text) or Path(text).exists():
        return None
    return text


def _experts_format(name):
    """The experts format object of that name (modeling_kimik3/experts_format_kimi_k3.py); dense for a name it does
    not know (an older card's or provenance's)."""
    from kimik3.modeling.experts_format_kimi_k3 import DENSE, experts_format

    return experts_format(name, default=DENSE)


def _metadata(base_model, relation, derived: bool, pipeline_tag: str, experts_format: str) -> str:
    from huggingface_hub import ModelCardData

    if base_model is None:
        relation = None  # a relation names how this folder relates to its base
    data = ModelCardData(
        # weights derived from the release's are under its license (linked: `other` alone names none); our own
        # weights (random, or trained from scratch) are under the package's
        license="other" if derived else "apache-2.0",
        license_name="kimi-k3" if derived else None,
        license_link=RELEASE_LICENSE_LINK if derived else None,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        base_model=base_model,
        base_model_relation=relation,
        tags=RELEASE_TAGS + [tag for tag in [_experts_format(experts_format).card_tag] if tag],
    )
    return data.to_yaml()


def _gib(n: int) -> str:
    return f"{n / 2**30:,.3f} GiB" if n >= 2**30 else f"{n / 2**20:,.3f} MiB"


def _decimal_bytes(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


def _layer_list(indices: list[int]) -> str:
    """Layer indices as the table reads them: "layer 0", "layers 0, 1", "no layer"."""
    if not indices:
        return "no layer"
    return f"layer{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def _architecture_rows(text) -> str:
    from kimik3.memory import weight_bytes

    num_layers = len(text.layer_types)
    num_mla = sum(t == "full_attention" for t in text.layer_types)
    dense = [i for i, t in enumerate(text.mlp_layer_types) if t == "dense"]
    experts = _experts_format(text.experts_format).card_text
    mla = (f"{text.num_attention_heads} heads, q LoRA {text.q_lora_rank}, kv LoRA {text.kv_lora_rank}, "
           f"qk {text.qk_nope_head_dim} + {text.qk_rope_head_dim} (NoPE), v {text.v_head_dim}")
    rows = [
        ("layers", f"{num_layers} ({num_layers - num_mla} KDA, {num_mla} gated MLA)"),
        ("hidden size / vocabulary", f"{text.hidden_size} / {text.vocab_size:,}"),
        ("KDA", f"{text.linear_num_heads} heads x {text.linear_head_dim}, short conv {text.linear_conv_kernel_size}"),
        ("MLA", mla),
        ("MoE", f"{text.num_experts} routed experts, top-{text.num_experts_per_token}, {text.num_shared_experts} "
                f"shared; latent width {text.latent_size}, expert width {text.moe_intermediate_size}"),
        ("dense MLP instead of MoE", _layer_list(dense) + (f" (width {text.intermediate_size})" if dense else "")),
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

`KimiK3ForConditionalGeneration` (what `AutoModelForCausalLM` and `AutoModelForImageTextToText` load here, and so
`pipeline("image-text-to-text", model=repo, trust_remote_code=True)`; `AutoModel` gives the base model without the
head, `KimiK3MultimodalModel`) reads images: the MoonViT-3d tower and the patch-merger projector turn an image into
one row per 2x2 block of 14-pixel patches, spliced in at its `<|media_pad|>` tokens. `KimiK3Processor`
(`processing_kimi_k3.py`, named by `processor_config.json`, which holds the release's image settings) resizes,
normalises and cuts the images with the release's rules and writes one `<|media_pad|>` per row; its outputs go
straight to `generate`:

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
    from kimik3.convert.files import PROVENANCE_NAME

    if not provenance:
        return ""
    opts = provenance.get("options", {})
    revision = f" at revision `{provenance['revision']}`" if provenance.get("revision") else ""
    experts = _experts_format(provenance.get("experts_format")).provenance_text
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
                     sliced: bool = False, repo_id: str = "path/to/this/folder", derived: bool | None = None) -> str:
    """The card of one folder, from its config (object or config.json dict). `base_model` is a Hub repo id or None;
    `derived`: the weights come from Kimi K3's (default: when there is a base)."""
    text = _text_config(config)
    derived = base_model is not None if derived is None else derived
    return render_model_card(
        # both tags are tasks whose pipeline loads the folder by name (`auto_map` names the Auto class of each)
        metadata=_metadata(base_model, relation, derived, "image-text-to-text" if vision else "text-generation",
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
        limitations=_limitations(sliced, not derived, vision),
    )


def converted_model_card(provenance: dict, config: dict) -> str:
    """The card of a folder written by `kimik3 convert`, from its provenance record (kimik3_conversion.json) and the
    config.json it writes. Nothing here depends on the destination path, so a resumed run writes the same bytes as
    an uninterrupted one."""
    opts = provenance["options"]
    source = str(provenance["source"])
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
    return build_model_card(config, title=title, summary=summary, base_model=_converted_base(provenance),
                            relation=relation, provenance=provenance, vision=vision, sliced=sliced, derived=True)


def _converted_base(provenance: dict) -> str | None:
    """The Hub repo a conversion comes from: the source's repo id (or Hub cache folder); a local folder of the
    release's shape is taken for a download of the release; any other local folder has no known repo."""
    repo = hub_repo_id(provenance["source"])
    if repo is not None:
        return repo
    shape = (provenance.get("source_num_layers"), provenance.get("source_num_experts"))
    return RELEASE_REPO if shape == RELEASE_SHAPE else None


def _read_front_matter(readme: Path) -> dict:
    try:
        from huggingface_hub import ModelCard

        return ModelCard.load(readme).data.to_dict()
    except Exception:  # a README that is not a card is simply not a source of metadata
        return {}


# Bytes compared per tensor (at its start, middle and end) between a saved folder and the one it was loaded from
SAMPLE_BYTES = 64
WEIGHTS_INDEX = "model.safetensors.index.json"


def _safetensors_entries(path: Path) -> dict:
    """{tensor name: (dtype, shape, absolute begin, end)} of one safetensors file: the one strict header reader's
    (files_kimi_k3.read_safetensors_header; a bad header is a KimiK3LoadError naming the file)."""
    from kimik3.modeling.files_kimi_k3 import read_safetensors_header

    return read_safetensors_header(path)[0]


def _weight_files(folder: Path | str, repo_id: str | None = None) -> list[Path] | None:
    """The safetensors files of a local folder or of a repo in the local Hub cache (never downloaded)."""
    def local(name):
        if repo_id is None:
            path = Path(folder) / name
            return path if path.is_file() else None
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, name)
        return Path(found) if isinstance(found, str) else None

    index = local(WEIGHTS_INDEX)
    if index is not None:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        paths = [local(shard) for shard in shards]
        return paths if paths and all(paths) else None
    single = local("model.safetensors")
    return [single] if single is not None else None


def _sample(handle, begin: int, end: int) -> bytes:
    chunks = []
    for offset in sorted({begin, max(begin, (begin + end) // 2 - SAMPLE_BYTES // 2), max(begin, end - SAMPLE_BYTES)}):
        handle.seek(offset)
        chunks.append(handle.read(min(SAMPLE_BYTES, end - offset)))
    return b"".join(chunks)


def _tensor_samples(files: list[Path]) -> dict:
    samples = {}
    for path in files:
        entries = _safetensors_entries(path)
        with open(path, "rb") as handle:
            for name, (dtype, shape, begin, end) in entries.items():
                samples[name] = (dtype, shape, _sample(handle, begin, end))
    return samples


def compare_saved_weights(saved: Path, source: Path | str | None, repo_id: str | None = None) -> dict | None:
    """How the weights just saved to `saved` relate to those of the folder (or cached Hub repo) they were loaded from:
    each tensor's dtype, shape and three 64-byte samples (a fine-tune or a merged adapter changes nearly every element
    of the tensors it trains). None when they cannot be compared: no source files, the same folder, or no tensor
    name in common (another layout).

    {"outcome": "unchanged" | "changed" | "cast" | "subset", "changed": names, "cast": names, "left_out": names,
    "added": names}; "cast" when only dtypes differ, "subset" when the saved tensors are some of the source's,
    unchanged (e.g. saved without the vision tower)."""
    if source is None:
        return None
    if repo_id is None and Path(source).resolve() == Path(saved).resolve():
        return None
    try:
        source_files = _weight_files(source, repo_id)
        saved_files = _weight_files(saved)
        if not source_files or not saved_files:
            return None
        before, after = _tensor_samples(source_files), _tensor_samples(saved_files)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    common = sorted(before.keys() & after.keys())
    if not common:  # another layout (e.g. the text model saved alone from a composite folder): nothing to compare
        return None
    changed = [n for n in common if before[n][0] == after[n][0] and before[n] != after[n]]
    cast = [n for n in common if before[n][0] != after[n][0]]
    left_out, added = sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())
    if changed or added:
        outcome = "changed"
    elif cast:
        outcome = "cast"
    elif left_out:
        outcome = "subset"
    else:
        outcome = "unchanged"
    return {"outcome": outcome, "changed": changed, "cast": cast, "left_out": left_out, "added": added}


def _source_card(name_or_path: str | None) -> tuple[dict, dict | None, Path | None, str | None]:
    """(the source's card metadata, its provenance record, its local folder, its Hub repo id) for a model loaded
    from `name_or_path`; a Hub repo's card is read only from the local cache."""
    from kimik3.convert.files import PROVENANCE_NAME  # the converter's record (imported here: convert imports us)

    source = Path(name_or_path) if name_or_path else None
    if source is not None and source.is_dir():
        provenance = None
        if (source / PROVENANCE_NAME).is_file():
            provenance = json.loads((source / PROVENANCE_NAME).read_text())
        meta = _read_front_matter(source / "README.md") if (source / "README.md").is_file() else {}
        return meta, provenance, source, hub_repo_id(source.resolve())
    repo = hub_repo_id(name_or_path)
    if repo is None:
        return {}, None, None, None
    from huggingface_hub import try_to_load_from_cache

    readme = try_to_load_from_cache(repo, "README.md")
    return (_read_front_matter(Path(readme)) if isinstance(readme, str) else {}), None, None, repo


def saved_model_card(config, name_or_path: str | None = None, vision: bool = False,
                     saved: Path | str | None = None) -> str:
    """The card of a folder saved from a loaded model (`saved`: where its weights were just written).

    Its base is a Hub repo: the source's own base (its card's `base_model`, a converted folder's source), else the
    source itself when it is a Hub repo. The relation follows what the weights show, compared with the source's
    (`compare_saved_weights`): changed -> `finetune`; unchanged -> the source's own relation (a re-saved conversion
    stays `quantized`); anything else, or no source files to compare with -> no relation, and the card says so."""
    meta, provenance, folder, repo = _source_card(name_or_path)
    source_base = meta.get("base_model")
    source_base = hub_repo_id(source_base) if isinstance(source_base, str) else None
    if source_base is None and provenance is not None:
        source_base = _converted_base(provenance)
    source_relation = meta.get("base_model_relation") if source_base else None
    if provenance is not None and source_relation is None and source_base is not None:
        sliced_source = any(provenance.get("options", {}).get(k) is not None for k in ("num_layers", "num_experts"))
        source_relation = None if sliced_source else "quantized"
    # weights from Kimi K3's: a conversion, a card under the release's license, or a Hub repo of this architecture
    derived = provenance is not None or meta.get("license") == "other" or source_base is not None or \
        (repo is not None and folder is None)
    comparison = None
    if saved is not None and (folder is not None or repo is not None):
        comparison = compare_saved_weights(Path(saved), folder if folder is not None else repo,
                                           repo_id=repo if folder is None else None)
    outcome = comparison["outcome"] if comparison else None
    loaded = f"`{name_or_path}`"
    text = _text_config(config)
    if not derived:
        base_model, relation = None, None
        title = "Kimi K3 architecture (own weights)"
        summary = ("A model with the Kimi K3 architecture whose weights do not come from a known base (a random "
                   "initialisation such as `kimik3 tiny`, or a model trained from scratch).")
        if outcome == "changed":
            summary += f" Saved from {loaded} after its weights changed (e.g. training)."
    elif outcome == "changed":
        base_model, relation = repo if folder is None else (source_base or repo), "finetune"
        count = len(comparison["changed"]) + len(comparison["added"])
        title = "Kimi K3, fine-tuned"
        summary = (f"Saved from a Kimi K3 model loaded from {loaded}; {count} of its tensors differ from that "
                   "checkpoint's (e.g. after fine-tuning). The license of the base model applies.")
    elif outcome == "unchanged":
        base_model, relation = (source_base, source_relation) if source_base else (repo, None)
        title = "Kimi K3 (saved again, weights unchanged)"
        summary = (f"Saved from a Kimi K3 model loaded from {loaded}, with the same weights (every tensor's dtype, "
                   "shape and sampled bytes equal that checkpoint's). The license of the base model applies.")
    else:
        base_model, relation = source_base or repo, None
        what = None if comparison is None else {
            "cast": f"in another dtype ({len(comparison['cast'])} tensors) than",
            "subset": f"without {len(comparison['left_out'])} of the tensors of"}.get(outcome)
        title = "Kimi K3 (saved from a loaded model)"
        summary = (f"Saved from a Kimi K3 model loaded from {loaded}" + (
            f", {what} that checkpoint, otherwise unchanged." if what else
            "; its weights could not be compared with that checkpoint's (its files are not on this machine), so "
            "this card does not say whether they were changed.") + " The license of the base model applies.")
    sliced = (len(text.layer_types), text.num_experts) != RELEASE_SHAPE
    return build_model_card(config, title=title, summary=summary, base_model=base_model, relation=relation,
                            provenance=provenance, vision=vision, sliced=sliced, derived=derived)


def write_model_card(directory, card: str) -> bool:
    """Writes README.md unless the folder has one that is not ours (a user's card is never replaced)."""
    readme = Path(directory) / "README.md"
    if readme.exists() and not is_kimik3_card(readme.read_text(encoding="utf-8", errors="replace")):
        return False
    readme.write_text(card, encoding="utf-8")
    return True


def save_with_card(model, directory, **save_kwargs) -> Path:
    """`model.save_pretrained(directory, **save_kwargs)` (weights, config with `auto_map`, code) and the card of the
    saved folder (`saved_model_card`; a README that is not ours is kept). Returns the folder."""
    directory = Path(directory)
    model.save_pretrained(directory, **save_kwargs)
    if save_kwargs.get("is_main_process", True):
        write_model_card(directory, saved_model_card(model.config, model.config.name_or_path,
                                                     vision=getattr(model, "vision_tower", None) is not None,
                                                     saved=directory))
    return directory


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
    """`model.push_to_hub` with our card: the files `save_with_card` writes (weights, config with auto_map, code, the
    card) in one commit. A README already on the Hub that is not ours (nor the library's placeholder) is kept;
    `tags` are added to whichever card goes up."""
    import tempfile

    from huggingface_hub import HfApi, ModelCard

    from kimik3.modeling.saving_kimi_k3 import commit_files

    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        save_with_card(model, work, max_shard_size=max_shard_size)
        readme = work / "README.md"
        on_hub = _hub_readme(api, repo_id, revision, token)
        if on_hub is not None and not is_kimik3_card(on_hub) and LIBRARY_PLACEHOLDER not in on_hub:
            readme.write_text(on_hub, encoding="utf-8")
        if tags and readme.exists():
            card = ModelCard.load(readme)
            card.data.tags = list(card.data.tags or []) + [t for t in tags if t not in (card.data.tags or [])]
            card.save(readme)
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
        return commit_files(api, repo_id, work, [p for p in work.rglob("*") if p.is_file()], commit_message,
                            commit_description=commit_description, token=token, create_pr=create_pr,
                            revision=revision)
