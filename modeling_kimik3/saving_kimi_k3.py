# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Packaging a Kimi K3 model folder: the `auto_map` naming our classes, the code files a folder carries (so that it
loads with trust_remote_code in a fresh process, whether the saved class came from the installed package or from a
model folder's flat files), the weights' file mode, and our classes' place in transformers' Auto mappings.

This module imports no model file: it is handed the model object and finds its class's module file from it.
"""

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path


# `auto_map` of a folder whose config.json is our text config, and of one holding the release's composite schema.
# AutoModel is the base model, as transformers' own models: for the composite one KimiK3MultimodalModel (the
# release's file maps AutoModel to the top-level class, which has the head). AutoModelForImageTextToText is what
# pipeline("image-text-to-text") loads.
TEXT_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3TextConfig",
    "AutoModel": "modeling_kimi_k3.KimiK3Model",
    "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
}
COMPOSITE_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k3.KimiK3Config",
    "AutoModel": "multimodal_kimi_k3.KimiK3MultimodalModel",
    "AutoModelForCausalLM": "multimodal_kimi_k3.KimiK3ForConditionalGeneration",
    "AutoModelForImageTextToText": "multimodal_kimi_k3.KimiK3ForConditionalGeneration",
}


def auto_map_for(config) -> dict:
    """The `auto_map` of one of our configs (a config object or its config.json dict): composite when it nests a
    text config."""
    composite = "text_config" in config if isinstance(config, dict) else hasattr(config, "text_config")
    return dict(COMPOSITE_AUTO_MAP if composite else TEXT_AUTO_MAP)


# The code a model folder carries: these modules and every module they import, read from their import statements as
# transformers reads a class's module when it loads it. The two model files are what the `auto_map`s name; no model
# class imports the serving helpers (prompt caches, the prefix store, draft slicing) or the processor (AutoProcessor
# from the folder), so they are named here. The tokenizer's code file is left out of a model's save: the tokenizer's
# own save_pretrained writes it (a model folder without a tokenizer holds no tokenizer code).
CARRIED_MODULES = ("modeling_kimi_k3.py", "multimodal_kimi_k3.py", "serving_kimi_k3.py", "processing_kimi_k3.py")
TOKENIZER_CODE_FILE = "tokenization_kimi_k3.py"
# The decode loop goes into a folder as transformers' custom_generate/generate.py, which from_pretrained(...,
# trust_remote_code=True) installs as the model's generate (docs/design.md, Decode loop); it imports nothing of ours.
DECODE_LOOP_FILE, CUSTOM_GENERATE_FILE = "generate_kimi_k3.py", "custom_generate/generate.py"


def carried_code_files(sources: list[Path], with_tokenizer: bool = False) -> list[Path]:
    """The code files of a model folder, each carried module (with its imports) from the first of `sources` that
    holds it; with `with_tokenizer`, the tokenizer's code file too."""
    from transformers.dynamic_module_utils import get_relative_import_files

    files: dict[str, Path] = {}
    for name in CARRIED_MODULES:
        for folder in sources:
            path = Path(folder) / name
            if not path.is_file():
                continue
            try:
                imported = [Path(p) for p in get_relative_import_files(str(path))]
            except OSError:  # a folder lacking a file the module imports: copy the ones it has
                imported = []
            for found in (path, *imported):
                if found.is_file():
                    files.setdefault(found.name, found)
            break
    return [files[name] for name in sorted(files) if with_tokenizer or name != TOKENIZER_CODE_FILE]


def model_code_folder(model) -> Path:
    """The folder of the model class's module file: the installed package, or the module cache of a model folder's
    copy (a user's subclass defined elsewhere is followed to our class it derives from)."""
    for cls in type(model).__mro__:
        path = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if path is not None and Path(path).name in CARRIED_MODULES:
            return Path(path).resolve().parent
    raise TypeError(f"{type(model).__name__} is not a Kimi K3 model class")


def normal_file_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file: 0o666 less the process's umask (read from /proc where it
    can be, since os.umask can only be read by setting it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def give_weights_the_normal_mode(directory: Path) -> None:
    """safetensors writes its files with mode 0600 (a private temporary file renamed); the weights a save writes get
    the mode of every other file of the folder."""
    index = directory / "model.safetensors.index.json"
    names = {"model.safetensors"}
    if index.is_file():
        names |= set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
    mode = normal_file_mode()
    for name in sorted(names):
        path = directory / name
        if path.is_file() and not path.is_symlink() and (path.stat().st_mode & 0o777) != mode:
            os.chmod(path, mode)


def write_remote_code(model, directory: Path) -> None:
    """After save_pretrained wrote the weights and config: gives the weights the normal file mode, copies the code
    files the folder carries and sets the full `auto_map`."""
    give_weights_the_normal_mode(directory)
    # From next to the model's module, else (remote code, whose module cache holds only the loaded class's imports)
    # from the folder the model was loaded from.
    sources = [model_code_folder(model), Path(str(getattr(model.config, "name_or_path", "") or "."))]
    for path in carried_code_files(sources):
        if path.resolve() != (directory / path.name).resolve():
            shutil.copyfile(path, directory / path.name)
    loop = next((Path(folder) / name for folder in sources for name in (DECODE_LOOP_FILE, CUSTOM_GENERATE_FILE)
                 if (Path(folder) / name).is_file()), None)
    if loop is not None and loop.resolve() != (directory / CUSTOM_GENERATE_FILE).resolve():
        (directory / CUSTOM_GENERATE_FILE).parent.mkdir(exist_ok=True)
        shutil.copyfile(loop, directory / CUSTOM_GENERATE_FILE)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = auto_map_for(config)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# The temporary name a sharded model's save writes under, beside the folder asked for (a dot file: no folder listing
# or glob of model folders takes it for one); renamed to that folder once complete.
PARTIAL_PREFIX, PARTIAL_SUFFIX = ".", ".partial"
# What transformers' save_pretrained writes or removes of the weights (model.safetensors, model-XXXXX-of-YYYYY...,
# their index): a folder it replaces loses those of its files the new save does not have.
WEIGHT_FILE_PREFIX = "model"


def _is_sharded(model) -> bool:
    """Whether the model holds tensor- or expert-parallel shards (DTensor parameters) in an initialised process
    group: its save_pretrained then gathers them, collectively, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def _move_into_place(partial: Path, target: Path) -> None:
    """The complete folder `partial` becomes `target`: renamed when `target` does not exist; else its files replace
    theirs, config.json taken away first and put back last (a folder without config.json is no model folder), and
    the target's weight files the new save lacks removed, as transformers' own save removes them."""
    if not target.exists():
        os.rename(partial, target)
        return
    (target / "config.json").unlink(missing_ok=True)
    names = {path.name for path in partial.iterdir()}
    for old in target.glob(f"{WEIGHT_FILE_PREFIX}*.safetensors*"):
        if old.name not in names and old.is_file():
            old.unlink()
    for name in sorted(names - {"config.json"}) + ["config.json"]:
        if (partial / name).is_dir() and (target / name).is_dir():  # custom_generate/: a folder replaces a folder
            shutil.rmtree(target / name)
        os.replace(partial / name, target / name)
    partial.rmdir()


# save_pretrained's Hub arguments: with push_to_hub=True transformers uploads the folder inside its own save, before
# the code files and the full auto_map are written; the folder is uploaded here once complete instead
HUB_ARGUMENTS = ("repo_id", "commit_message", "create_pr", "token", "private")


def save_folder(model, save, save_directory, *args, **kwargs) -> None:
    """`save` (transformers' save_pretrained of `model`) in our layout, the weights' file mode, the code files and the
    full `auto_map`. A model loaded from our layout keeps it (`layout_kept`).

    The folder is written under a temporary name beside the folder asked for and renamed to it once complete (or its
    files moved over an existing folder's, config.json last), so a save that fails midway (a full disk, an error on
    any rank) leaves nothing that looks finished. With `push_to_hub=True` the complete folder is uploaded after.

    A sharded model (docs/design.md, Parallelism): every rank calls this, as transformers' save gathers each shard
    with the other ranks' (one collective per tensor); rank 0 alone writes and uploads."""
    directory = Path(os.path.abspath(save_directory))
    push = kwargs.pop("push_to_hub", False)
    hub = {key: kwargs.pop(key) for key in HUB_ARGUMENTS if key in kwargs}
    sharded = _is_sharded(model)
    writer = kwargs.get("is_main_process", True)
    if sharded:
        import torch.distributed as dist

        writer = writer and dist.get_rank() == 0
    if directory.is_file():
        raise ValueError(f"save_pretrained: {directory} is a file, not a folder")
    if not (sharded or writer):
        # a process that writes nothing (is_main_process=False, no collectives): transformers only makes the folder,
        # and a temporary one made after the writer renamed its own would be left behind
        with layout_kept(model):
            save(directory, *args, **kwargs)
        return
    partial = directory.parent / f"{PARTIAL_PREFIX}{directory.name}{PARTIAL_SUFFIX}"
    before = _file_times(directory) if push and writer else {}
    if writer and partial.exists():  # a save that failed before
        shutil.rmtree(partial)
    if sharded:
        dist.barrier()  # no rank writes into `partial` before rank 0 has cleared it
    with layout_kept(model):
        save(partial, *args, **{**kwargs, "is_main_process": writer})
    if writer:
        write_remote_code(model, partial)
        _move_into_place(partial, directory)
        if push:
            _push_folder(model, directory, hub, before)
    if sharded:
        dist.barrier()  # every rank returns once the folder is in place


def _file_times(directory: Path) -> dict:
    """Modification time of each file under `directory` (none when it does not exist)."""
    if not directory.is_dir():
        return {}
    return {path: path.stat().st_mtime for path in directory.rglob("*") if path.is_file()}


def _push_folder(model, directory: Path, hub: dict, before: dict) -> None:
    """The complete folder to the Hub as transformers' save_pretrained(push_to_hub=True) pushes one: to the repo named
    by `repo_id` or the folder's name, created if need be, a model card written where the folder has none, in one
    commit of the files the save wrote or changed (`before`: the folder's file times before it)."""
    from huggingface_hub import HfApi

    api = HfApi(token=hub.get("token"))
    repo_id = api.create_repo(hub.get("repo_id", directory.name), exist_ok=True, private=hub.get("private")).repo_id
    if not (directory / "README.md").exists():
        from transformers.utils.hub import create_and_tag_model_card

        create_and_tag_model_card(repo_id, getattr(model, "model_tags", None), token=hub.get("token")).save(
            str(directory / "README.md"))
    changed = [path for path, when in _file_times(directory).items() if before.get(path) != when]
    commit_files(api, repo_id, directory, changed, commit_message=hub.get("commit_message"),
                 create_pr=hub.get("create_pr", False))


def commit_files(api, repo_id: str, folder: Path, files, commit_message: str | None = None, **commit_kwargs):
    """One Hub commit of `files` (paths under `folder`, in sorted order, at their paths relative to it)."""
    from huggingface_hub import CommitOperationAdd

    operations = [CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
                  for path in sorted(files)]
    return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message or "Upload model",
                             **commit_kwargs)


def _is_a_log_unpadding(conversion) -> bool:
    """The A_log un-padding converter of release_layout_kimi_k3.release_conversions (same source and target name)."""
    return type(conversion).__name__ == "WeightConverter" and any(
        type(op).__name__ == "UnpadHeads" for op in getattr(conversion, "operations", ()))


def loaded_release_layout(model) -> bool:
    """Whether `model` was loaded from the release layout: its load applied a conversion beyond the A_log
    un-padding, which transformers' loader records as applied on every load of ours too (the key is the same in
    both layouts). A model built from a config applied none."""
    conversions = getattr(model, "_weight_conversions", None)
    return bool(conversions) and not all(_is_a_log_unpadding(c) for c in conversions)


@contextlib.contextmanager
def layout_kept(model):
    """One A_log rule per layout (docs/design.md, "Parameter names"): ours stores the live [H] heads, the release
    [128] zero-padded. save_pretrained reverses the conversions a load applied, and the loader records the A_log
    un-padding as used on every load, ours too (the name is the same), so a model loaded from our layout would be
    saved padded; inside this block its save keeps our layout instead."""
    conversions = getattr(model, "_weight_conversions", None)
    loaded_ours = bool(conversions) and not loaded_release_layout(model)
    if loaded_ours:
        model._weight_conversions = []
    try:
        yield
    finally:
        if loaded_ours:
            model._weight_conversions = conversions


_REGISTERED: set = set()


def register_auto_classes(model) -> None:
    """The model's class in transformers' Auto mappings under the names our `auto_map` gives it, keyed by its config
    class (so nothing resolves to it without our config): a pipeline given the model object checks its class against
    these mappings, and says that a model it does not find there is "not supported". Done once per class, when its
    first model is built."""
    cls = type(model)
    if cls in _REGISTERED:
        return
    _REGISTERED.add(cls)
    import transformers

    for auto_name, target in auto_map_for(model.config).items():
        auto_class = getattr(transformers, auto_name, None)
        if auto_name != "AutoConfig" and target.rpartition(".")[2] == cls.__name__ and auto_class is not None:
            auto_class.register(cls.config_class, cls, exist_ok=True)
