"""`kimik3 adopt RELEASE_DIR OUT_DIR`: a folder our code loads the release from, without a second copy of it.

OUT_DIR gets what `kimik3 convert` writes around the tensors (our config.json with our auto_map and the chosen
experts_format, our code files, the tokenizer / processor / generation files as convert makes them) and, instead of
converted shards, symlinks to the release's own files: its index (the weight_map as it is) and every shard it names,
and each side file convert would copy verbatim. The loader reads the release layout as it is on disk
(release_layout_kimi_k3.check_release_load: renames, MXFP4 kept packed or dequantised), so loading OUT_DIR is loading the
release's tensors through our code. The record `files_kimi_k3.ADOPTION_RECORD_NAME` names the one release folder the
links may reach, which the folder checks of every load verify (docs/bad_inputs.md, "Loading a folder"). The release
folder is only read; OUT_DIR is written into a temporary sibling and renamed when complete.
"""

import copy
import os
import secrets
import shutil
from pathlib import Path

from kimik3.modeling.configuration_kimi_k3 import DEFAULT_EXPERTS_FORMAT
from kimik3.modeling.files_kimi_k3 import ADOPTION_RECORD_NAME, release_fingerprints
from kimik3.remote_code import remote_code_entries

from . import files
from .checkpoint import Checkpoint, read_source_file
from .converter import open_source, processor_config
from .engine import check_paths
from .errors import ConversionError
from .plan import streamed_format
from .plan import ConvertOptions, build_convert_plan
from .schedule import output_config_dict

ADOPTER_VERSION = "1"


def _check_destination(release: Path, dst: Path) -> None:
    """DST is new (or an empty folder) and outside the release folder, which is never written."""
    real_release, real_dst = release.resolve(), dst.resolve()
    if real_dst == real_release or real_release in real_dst.parents:
        raise ConversionError(f"{dst}: the destination is " + ("the release folder" if real_dst == real_release else
                              f"inside the release folder {release}") + " (the release folder is never written)")
    if os.path.lexists(dst) and not (dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir())):
        raise ConversionError(f"{dst}: exists and is not an empty folder; adopt into a new folder (nothing of it is "
                              "replaced)")
    if not dst.parent.is_dir():
        raise ConversionError(f"{dst}: its parent folder {dst.parent} does not exist")


def _config(ckpt: Checkpoint, plan) -> dict:
    """convert's config.json for the whole model, with the release's quantization_config kept on the text config: the
    weights on disk are the release's, so the config says so; the loader hides it from transformers while it reads
    the experts itself, reads the release in step with its conversions, and puts it back so that save_pretrained
    writes the release layout again (release_layout_kimi_k3.check_release_load)."""
    config = output_config_dict(ckpt.config, plan.text_config, text_only=False)
    quantization = getattr(ckpt.text_config, "quantization_config", None)
    if quantization is not None:
        (config["text_config"] if ckpt.composite else config)["quantization_config"] = copy.deepcopy(quantization)
    return config


def _side_files(ckpt: Checkpoint, plan, notes: list) -> tuple[list[tuple[str, bytes]], dict]:
    """The non-tensor files of a converted folder (convert's own functions), and the names of the tokenizer files
    convert changes or adds (convert's record keeps the originals' text for export; here they stay in the release)."""
    out, changes = files.converted_tokenizer_files(ckpt.root, processor_config(ckpt, plan, notes))
    out.append(("generation_config.json", files.generation_config_bytes(ckpt.root, ckpt.config)[0]))
    out += [(name, path.read_bytes()) for name, path in remote_code_entries()]
    return out, {"replaced": sorted(changes["replaced"]), "added": changes["added"]}


def _verbatim(ckpt: Checkpoint, name: str, data: bytes) -> bool:
    """The release holds `name` with exactly these bytes: the folder links to it instead of copying it."""
    path = ckpt.root / name
    return path.is_file() and read_source_file(ckpt.root, path) == data


def adopt(src, dst, *, experts_format: str = DEFAULT_EXPERTS_FORMAT) -> dict:
    """Writes the adopted folder `dst` for the release-layout folder `src` (a Hub snapshot folder works: link to its
    names, which link into its blobs/). Returns a summary: the record, the bytes written, the links."""
    streamed_format(experts_format)
    check_paths(src, dst)
    release, dst = Path(src), Path(os.path.abspath(dst))  # `.` or `out/` named as a folder with a parent
    if not release.is_dir():
        raise ConversionError(f"{src}: no such folder (kimik3 adopt links to a local folder's files; for a Hub repo, "
                              "download it first and adopt its snapshot folder)")
    if os.path.lexists(release / ADOPTION_RECORD_NAME):
        raise ConversionError(f"{release / ADOPTION_RECORD_NAME}: {src} is an adopted folder itself; adopt the "
                              "release folder its record names")
    _check_destination(release, dst)
    notes: list = []
    with open_source(release, None, ConvertOptions.chunk_bytes) as ckpt:
        # the plan checks every release tensor's name, dtype and shape (headers only) as convert would: what loads
        # from the adopted folder is known to load before anything is written
        plan = build_convert_plan(ckpt, ConvertOptions(experts_format=experts_format))
        notes += plan.notes
        config = _config(ckpt, plan)
        written, tokenizer_changes = _side_files(ckpt, plan, notes)
        index_name = ckpt.index_path.name
        linked = {index_name, *ckpt.weight_map.values()}  # the index and its shards (or the single model.safetensors)
        for shard in sorted(set(ckpt.weight_map.values())):
            if not (ckpt.root / shard).is_file():
                raise ConversionError(f"{ckpt.root / shard}: shard file is missing (the index names it); a Hub "
                                      "snapshot needs every shard downloaded")
        regular = []
        for name, data in written:
            if _verbatim(ckpt, name, data):
                linked.add(name)
            else:
                regular.append((name, data))
        root = str(ckpt.root.resolve())
        record = {
            "adopter_version": ADOPTER_VERSION,
            "release": root,
            "source": os.fspath(src),
            "source_index_sha256": ckpt.index_digest(),
            "experts_format": experts_format,
            "links": sorted(linked),
            "written": sorted([name for name, _ in regular] + [ADOPTION_RECORD_NAME, "config.json"]),
            "tokenizer_changes": tokenizer_changes,
            "release_a_log_length": plan.release_a_log_length(),
            # checked at every load (files_kimi_k3.check_adopted_release): a release file replaced after adoption
            "fingerprints": release_fingerprints(ckpt.root, linked),
            "notes": notes,
        }
    regular += [(ADOPTION_RECORD_NAME, files.json_bytes(record)), ("config.json", files.json_bytes(config))]
    temporary = dst.parent / f".{dst.name}.adopting-{secrets.token_hex(4)}"
    temporary.mkdir()  # the mode of any new folder (mkdtemp's would be 0700)
    try:
        for name in record["links"]:
            (temporary / name).parent.mkdir(exist_ok=True)
            os.symlink(os.path.join(root, name), temporary / name)
        for name, data in regular:
            (temporary / name).parent.mkdir(exist_ok=True)  # custom_generate/
            (temporary / name).write_bytes(data)
        os.rename(temporary, dst)  # replaces an empty folder; a half-written one never has DST's name
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return {"record": record, "bytes_written": sum(len(data) for _, data in regular), "links": len(record["links"])}


__all__ = ["ADOPTER_VERSION", "adopt"]
