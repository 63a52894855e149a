"""A small random K3 with every mechanism on (the preset `kimik3.configuration.tiny_text_config_dict`), and the
folder `kimik3 tiny` writes it to."""

import fnmatch
from pathlib import Path

from kimik3.remote_code import remote_code_files, save_with_code

# What `kimik3 tiny` writes (save_pretrained, then the remote code); with --overwrite these are replaced.
TINY_FILES = ("config.json", "generation_config.json", "model.safetensors")


class TinyFolderError(ValueError):
    pass


def build_tiny_model(seed: int = 0, num_hidden_layers: int = 4, **overrides):
    """A small random K3 model with every mechanism on; pseudo-queries get random values (zeros would hide
    AttnRes bugs: uniform mixing)."""
    import torch

    from kimik3.configuration import tiny_text_config_dict
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    torch.manual_seed(seed)
    config = KimiK3TextConfig(**tiny_text_config_dict(num_hidden_layers=num_hidden_layers, **overrides))
    model = KimiK3ForCausalLM(config)
    with torch.no_grad():
        # every pseudo-query, layer 0's unused one (a buffer) included, in module order
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("res_proj.weight"):
                tensor.normal_(0.0, 0.5)
    return model.eval()


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

    ours = set(TINY_FILES) | {p.name for p in remote_code_files()}
    others = sorted(p.name for p in directory.iterdir() if p.name not in ours)
    mixed = [name for name in others if any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILE_PATTERNS)]
    if mixed:
        raise TinyFolderError(f"{directory}: holds model files that `kimik3 tiny` does not write ({', '.join(mixed)}); "
                              "they would be mixed into the new model: delete or move them, or choose another folder")
    return others


def write_tiny_folder(directory: str | Path, num_hidden_layers: int = 4, seed: int = 0, overwrite: bool = False):
    """Checks the folder (TinyFolderError), then writes the tiny model with its remote code.
    Returns (model, names of the other files kept in the folder)."""
    directory = Path(directory)
    kept = check_tiny_directory(directory, overwrite)
    model = build_tiny_model(seed=seed, num_hidden_layers=num_hidden_layers)
    save_with_code(model, directory)
    return model, kept
