"""A small random K3 with every mechanism on (the preset `kimik3.configuration.tiny_text_config_dict`), and the
folder `kimik3 tiny` writes it to."""

import fnmatch
from pathlib import Path

from kimik3.remote_code import remote_code_entries, save_with_code

from kimik3.tokenizer_files import TOKENIZER_FILE_NAMES, special_token_ids, write_tokenizer_folder

# What `kimik3 tiny` writes (save_pretrained, the remote code, the tokenizer, the processor config); with --overwrite
# these are replaced.
TINY_FILES = ("config.json", "generation_config.json", "model.safetensors", "processor_config.json") + \
    TOKENIZER_FILE_NAMES
# The tiny folder's synthetic tokenizer: 512 BPE ranks + the 256 reserved specials = its vocab_size. The preset
# (`tiny_text_config_dict`, vocab 128, used by the model tests) stays; the folder overrides vocab and token ids.
TINY_NUM_RANKS = 512


def tiny_tokenizer_overrides() -> dict:
    """Config overrides that make the tiny model's vocabulary and BOS/EOS/PAD ids those of the tiny tokenizer."""
    return {"vocab_size": TINY_NUM_RANKS + 256, **special_token_ids(TINY_NUM_RANKS)}


class TinyFolderError(ValueError):
    pass


def check_tiny_layers(num_hidden_layers) -> None:
    """The config's own bound, checked before the layer schedule is laid out: `--layers 1000000000` built lists of
    10^9 layers and never finished."""
    from kimik3.modeling.configuration_kimi_k3 import MAX_HIDDEN_LAYERS

    if isinstance(num_hidden_layers, int) and num_hidden_layers > MAX_HIDDEN_LAYERS:
        raise TinyFolderError(f"--layers {num_hidden_layers}: at most {MAX_HIDDEN_LAYERS} (the layers a Kimi K3 "
                              "config may have; the release has 93)")


def build_tiny_model(seed: int = 0, num_hidden_layers: int = 4, **overrides):
    """A small random K3 model with every mechanism on; pseudo-queries get random values (zeros would hide
    AttnRes bugs: uniform mixing)."""
    import torch

    check_tiny_layers(num_hidden_layers)

    from kimik3.configuration import tiny_text_config_dict
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    token_ids = {k: overrides.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in overrides}
    torch.manual_seed(seed)
    config_dict = tiny_text_config_dict(num_hidden_layers=num_hidden_layers, **overrides)
    config_dict.update(token_ids)
    config = KimiK3TextConfig(**config_dict)
    model = KimiK3ForCausalLM(config)
    with torch.no_grad():
        # every pseudo-query, layer 0's unused one (a buffer) included, in module order
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("res_proj.weight"):
                tensor.normal_(0.0, 0.5)
    return model.eval()


def build_tiny_vision_model(seed: int = 0, num_hidden_layers: int = 4, **overrides):
    """`build_tiny_model`'s text model (the same weights) as the `language_model` of a KimiK3ForConditionalGeneration
    with a small random vision tower and projector of the release's design (the sizes of
    `kimik3.convert.testing.TINY_VISION`, 14-pixel patches as the processor cuts them). Images are marked by
    `media_placeholder_token_id`: the tiny tokenizer's `<|media_pad|>` when the overrides give its vocabulary."""
    import torch

    from kimik3.configuration import released_config_dict
    from kimik3.convert.testing import TINY_VISION
    from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration

    text = build_tiny_model(seed=seed, num_hidden_layers=num_hidden_layers, **overrides)
    raw = released_config_dict()
    raw.pop("auto_map", None)  # save_pretrained writes ours
    raw["text_config"] = text.config.to_dict()
    raw["vision_config"].update(TINY_VISION, patch_size=14, text_hidden_size=text.config.hidden_size)
    ids = {k: getattr(text.config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # <|media_pad|> is the 22nd reserved special after the ranks (163605 = 163584 + 21 in the release)
    raw.update(ids, media_placeholder_token_id=text.config.vocab_size - 256 + 21)
    torch.manual_seed(seed + 1)
    model = KimiK3ForConditionalGeneration(KimiK3Config(**raw))
    model.language_model.load_state_dict(text.state_dict())
    return model.eval()


def packed_mxfp4_copy(dense_model):
    """The same model with its routed experts packed as MXFP4 (the release format), quantised from the dense ones
    (the GPU tests' and diagnostics' packed model)."""
    import copy

    from kimik3.modeling.experts_format_kimi_k3 import MXFP4
    from kimik3.modeling.modeling_kimi_k3 import KimiK3Experts, KimiK3ForCausalLM

    config = copy.deepcopy(dense_model.config)
    config.experts_format = MXFP4.name
    packed = KimiK3ForCausalLM(config).to(dense_model.device)
    missing, unexpected = packed.load_state_dict(dense_model.state_dict(), strict=False)
    stored = tuple(stack + suffix for stack in KimiK3Experts.STACKS for suffix in MXFP4.suffixes)
    if not all(key.endswith(stored) for key in missing) or not all(
            key.endswith(KimiK3Experts.STACKS) for key in unexpected):
        raise ValueError(f"packed_mxfp4_copy: expected only the expert weights to change form, got missing "
                         f"{missing}, unexpected {unexpected}")
    for name, module in dense_model.named_modules():
        if isinstance(module, KimiK3Experts):
            target = packed.get_submodule(name)
            for stack in target.STACKS:
                values = target.format.from_dense(getattr(module, stack).detach())
                for tensor, value in zip(target.stored(stack), values):
                    tensor.copy_(value)
    return packed.eval()


def check_tiny_directory(directory: Path, overwrite: bool) -> list[str]:
    """Refuses a folder that is not empty unless --overwrite; even then refuses one holding model files that tiny
    does not write (they would be mixed into the new model). Returns the names of the other files, which stay."""
    if directory.exists() and not directory.is_dir():
        raise TinyFolderError(f"{directory}: exists and is not a folder")
    if not directory.exists() or not any(directory.iterdir()):
        return []
    if not overwrite:
        raise TinyFolderError(f"{directory}: the folder is not empty; pass --overwrite to replace the model files "
                              "there (other files are kept)")
    from kimik3.convert.engine import MODEL_FILE_PATTERNS

    # what `kimik3 tiny` writes: its files, the card (a README that is not ours is kept, never replaced) and the code,
    # custom_generate/ included
    ours = set(TINY_FILES) | {"README.md"} | {name.split("/")[0] for name, _ in remote_code_entries()}
    others = sorted(p.name for p in directory.iterdir() if p.name not in ours)
    mixed = [name for name in others if any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILE_PATTERNS)]
    if mixed:
        raise TinyFolderError(f"{directory}: holds model files that `kimik3 tiny` does not write ({', '.join(mixed)}); "
                              "they would be mixed into the new model: delete or move them, or choose another folder")
    return others


def write_tiny_folder(directory: str | Path, num_hidden_layers: int = 4, seed: int = 0, overwrite: bool = False,
                      vision: bool = False):
    """Checks the folder (TinyFolderError), then writes the tiny model with its remote code, tokenizer and processor
    config; `vision=True` writes the composite model with a vision tower (`build_tiny_vision_model`).
    Returns (model, names of the other files kept in the folder)."""
    directory = Path(directory)
    check_tiny_layers(num_hidden_layers)
    kept = check_tiny_directory(directory, overwrite)
    build = build_tiny_vision_model if vision else build_tiny_model
    model = build(seed=seed, num_hidden_layers=num_hidden_layers, **tiny_tokenizer_overrides())
    ids = special_token_ids(TINY_NUM_RANKS)
    model.generation_config.update(**ids)  # generation stops at <|end_of_msg|>, as the release's does
    save_with_code(model, directory)
    write_tokenizer_folder(directory, TINY_NUM_RANKS)
    write_processor_config(directory)
    return model, kept


def write_processor_config(directory: Path) -> Path:
    """processor_config.json (release image settings, auto_map) so `AutoProcessor.from_pretrained(folder,
    trust_remote_code=True)` gives the K3 processor over the folder's tokenizer: prompts for the text model, and
    images too for the model with a vision tower (`kimik3 tiny --vision`)."""
    from kimik3.modeling.processing_kimi_k3 import KimiK3Processor
    from kimik3.modeling.tokenization_kimi_k3 import KimiK3TokenizerFast

    return KimiK3Processor(tokenizer=KimiK3TokenizerFast.from_pretrained(directory)).write_processor_files(directory)
