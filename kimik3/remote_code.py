"""What a model folder needs to run as remote code: the flat `.py` files of `kimik3.modeling` (which files, and the
`auto_map` naming our classes in them, are the remote code's own facts: `kimik3.modeling.saving_kimi_k3`). `kimik3
tiny`, the demo and the converter use them from here."""

import shutil
from pathlib import Path


def modeling_dir() -> Path:
    import kimik3.modeling

    return Path(kimik3.modeling.__file__).resolve().parent


def remote_code_files() -> list[Path]:
    """The files a model folder needs to run as remote code (copied flat; relative imports only between them): what a
    model's save carries, and the tokenizer's code file."""
    from kimik3.modeling.saving_kimi_k3 import carried_code_files

    return carried_code_files([modeling_dir()], with_tokenizer=True)


def remote_code_entries() -> list[tuple[str, Path]]:
    """(name inside the folder, source file) of everything a converted or adopted folder carries as code: the flat
    files of `remote_code_files` and the decode loop as transformers' `custom_generate/generate.py`, which
    `from_pretrained(..., trust_remote_code=True)` installs as the model's `generate` (docs/design.md, Decode
    loop)."""
    from kimik3.modeling.saving_kimi_k3 import CUSTOM_GENERATE_FILE, DECODE_LOOP_FILE

    return [(path.name, path) for path in remote_code_files()] + [
        (CUSTOM_GENERATE_FILE, modeling_dir() / DECODE_LOOP_FILE)]


def save_with_code(model, directory: str | Path) -> Path:
    """`kimik3.hub_card.save_with_card` (weights, config with the full auto_map, the code files the model's save
    carries, the card) plus the tokenizer's code file: a folder loadable with trust_remote_code in a fresh process,
    its code the installed package's."""
    from kimik3.hub_card import save_with_card

    directory = save_with_card(model, directory)
    for path in remote_code_files():
        # a new file of the folder, with the normal mode (copy2 would carry the installed file's mode and times)
        shutil.copyfile(path, directory / path.name)
    return directory
