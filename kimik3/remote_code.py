"""What a model folder needs to run as remote code: the flat `.py` files of `kimik3.modeling` and the `auto_map`
naming our classes in them. The one home of both facts: `kimik3 tiny`, the demo and the converter import them."""

import json
import shutil
from pathlib import Path

# `auto_map` of a folder whose config.json is our text config (`KimiK3TextConfig`, `KimiK3ForCausalLM`).
TEXT_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3TextConfig",
    "AutoModel": "modeling_kimi_k3.KimiK3Model",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
}
# `auto_map` of a folder whose config.json is the release's composite schema (`KimiK3Config`); the release maps
# AutoModel to the top-level class too.
COMPOSITE_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
}


def auto_map_for(config) -> dict:
    """The `auto_map` for one of our configs: composite when it nests a text config."""
    return dict(COMPOSITE_AUTO_MAP if hasattr(config, "text_config") else TEXT_AUTO_MAP)


def modeling_dir() -> Path:
    import kimik3.modeling

    return Path(kimik3.modeling.__file__).resolve().parent


def remote_code_files() -> list[Path]:
    """The files a model folder needs to run as remote code (copied flat; relative imports only between them)."""
    return sorted(p for p in modeling_dir().glob("*.py") if p.name != "__init__.py")


def save_with_code(model, directory: str | Path) -> Path:
    """save_pretrained + the remote-code files + auto_map, loadable with trust_remote_code in a fresh process."""
    directory = Path(directory)
    model.save_pretrained(directory)
    # save_pretrained copies remote code only for classes registered for an auto class, and only the files they
    # import; every file goes in, whatever this model's class.
    for path in remote_code_files():
        shutil.copy2(path, directory / path.name)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map_for(model.config)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
