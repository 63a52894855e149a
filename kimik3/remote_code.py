"""What a model folder needs to run as remote code: the flat `.py` files of `kimik3.modeling` and the `auto_map`
naming our classes in them. `kimik3 tiny`, the demo and the converter import both from here."""

import shutil
from pathlib import Path

# The `auto_map`s are defined next to the code that writes them on save_pretrained (remote code cannot import this
# package); re-exported here.
from kimik3.modeling.modeling_kimi_k3 import COMPOSITE_AUTO_MAP, TEXT_AUTO_MAP, auto_map_for  # noqa: F401


def modeling_dir() -> Path:
    import kimik3.modeling

    return Path(kimik3.modeling.__file__).resolve().parent


def remote_code_files() -> list[Path]:
    """The files a model folder needs to run as remote code (copied flat; relative imports only between them)."""
    return sorted(p for p in modeling_dir().glob("*.py") if p.name != "__init__.py")


def save_with_code(model, directory: str | Path) -> Path:
    """save_pretrained (which writes the code files the model imports, the full auto_map and the card) plus every
    remote-code file of the package, loadable with trust_remote_code in a fresh process."""
    directory = Path(directory)
    model.save_pretrained(directory)
    for path in remote_code_files():
        # a new file of the folder, with the normal mode (copy2 would carry the installed file's mode and times)
        shutil.copyfile(path, directory / path.name)
    return directory
