"""A checkpoint folder on disk: its config, its index, and lazy access to the shards it names.

Used for both layouts (the release and ours). Shard headers are parsed only when a tensor of that shard is first
needed, so a partial conversion (`--text-only`, `--num-layers`) opens only the shards it reads.
"""

import hashlib
import json
import os
from pathlib import Path

from kimik3.modeling.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig
from kimik3.modeling.files_kimi_k3 import (
    DuplicateKeyError,
    check_file_name,
    check_inside as _check_inside,
    check_layer_count,
    check_shards_against_index,
    dict_without_duplicate_keys,
    open_regular_file as _open_regular_file,
)

from .errors import ConversionError, shard_error
from .safetensors_io import DEFAULT_CHUNK_BYTES, ShardReader, TensorEntry, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
# The release numbers its shards like save_pretrained but writes the total with 6 digits (model-00001-of-000096)
RELEASE_TOTAL_DIGITS = 6


def shard_file_name(number: int, total: int, total_digits: int = 5) -> str:
    """`model-00001-of-00004.safetensors`: save_pretrained's shard names (1-based)."""
    return f"model-{number:05d}-of-{total:0{total_digits}d}.safetensors"


def check_shard_name(shard: str, index_path: Path, tensor: str) -> None:
    """An index may only name plain files next to it: anything else could read (or, on export, write) elsewhere. The
    rule is the one from_pretrained applies (files_kimi_k3.check_file_name)."""
    check_file_name(shard, index_path, what="shard", suffix=".safetensors", tensor=tensor, error=shard_error)


def check_inside(root: Path, path: Path) -> None:
    """A file of the source folder must not be a symlink to somewhere outside it (a Hub cache's links into its own
    blobs/ excepted): files_kimi_k3.check_inside, the rule from_pretrained applies."""
    _check_inside(root, path, error=shard_error)


def _json_error(path: Path, exc: RecursionError) -> ConversionError:
    return ConversionError(f"{path}: JSON nested too deeply to parse (arrays or objects inside each other beyond "
                           "Python's recursion limit; a real file nests a few levels)")


def read_source_file(root: Path, path: Path) -> bytes:
    """The bytes of a file of the source folder: inside it (`check_inside`) and a regular file (a FIFO would block the
    read forever)."""
    check_inside(root, path)
    with _open_regular_file(path, shard_error, kind=path.name) as handle:
        return handle.read()


def _duplicate_key_error(path: Path, exc) -> ConversionError:
    return ConversionError(f"{path}: the key `{exc.key}` appears twice (which value is meant is ambiguous)")


def load_config_dict(root: Path) -> dict:
    path = root / "config.json"
    if not os.path.lexists(path):
        raise ConversionError(f"{path}: config.json is missing")
    try:
        raw = json.loads(read_source_file(root, path).decode("utf-8"), object_pairs_hook=dict_without_duplicate_keys)
    except DuplicateKeyError as exc:
        raise _duplicate_key_error(path, exc) from None
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{path}: not UTF-8 text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError as exc:
        raise _json_error(path, exc) from None
    if not isinstance(raw, dict):
        raise ConversionError(f"{path}: must hold a JSON object, not a {type(raw).__name__}")
    return raw


def config_from_dict(raw: dict, path: Path):
    """Our config classes read both the release's config.json and ours (composite or text-only). Their validation
    errors name the key; this adds the file."""
    try:
        if "text_config" in raw:
            return KimiK3Config(**raw)
        return KimiK3TextConfig(**raw)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{path / 'config.json'}: cannot be read as a Kimi K3 config: {exc}") from None


class Checkpoint:
    def __init__(self, root: str | Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES, fetch=None):
        self.root = Path(root)
        self.fetch = fetch  # downloads a shard on first use (Hub sources); None for local folders
        if not self.root.is_dir():
            what = "no such folder" if not self.root.exists() else "not a checkpoint folder (not a folder)"
            raise ConversionError(f"{os.fspath(root)}: {what}")
        self.chunk_bytes = chunk_bytes
        self.config_dict = load_config_dict(self.root)
        self.index_path, self.index_bytes, self.weight_map = self._load_index()
        # before the config is built: building one for 10^9 layers would not finish
        check_layer_count(self.config_dict, self.weight_map, self.root / "config.json", self.index_path,
                          error=shard_error)
        self.config = config_from_dict(self.config_dict, self.root)
        self.composite = hasattr(self.config, "text_config")
        self.text_config = self.config.text_config if self.composite else self.config
        self.vision_config = getattr(self.config, "vision_config", None) if self.composite else None
        self._readers: dict[str, ShardReader] = {}

    # --------------------------------------------------------------------------------------------------------------
    def _load_index(self):
        index_path = self.root / INDEX_NAME
        if os.path.lexists(index_path) and os.path.lexists(self.root / SINGLE_FILE_NAME):
            # from_pretrained would read model.safetensors and ignore the index: which one is meant is ambiguous
            raise ConversionError(f"{self.root}: holds both {SINGLE_FILE_NAME} and {INDEX_NAME}: two sources for the "
                                  "weights; remove the one that does not belong")
        if os.path.lexists(index_path):
            raw = read_source_file(self.root, index_path)
            try:
                index = json.loads(raw.decode("utf-8"), object_pairs_hook=dict_without_duplicate_keys)
            except DuplicateKeyError as exc:
                raise _duplicate_key_error(index_path, exc) from None
            except UnicodeDecodeError as exc:
                raise ConversionError(f"{index_path}: not a safetensors index (not UTF-8 text: {exc})") from None
            except json.JSONDecodeError as exc:
                raise ConversionError(f"{index_path}: not a safetensors index (not valid JSON: {exc})") from None
            except RecursionError as exc:
                raise _json_error(index_path, exc) from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index_path}: not a safetensors index (needs a `weight_map` object mapping "
                                      "tensor names to shard file names)")
            checked = set()
            for tensor, shard in weight_map.items():
                if not isinstance(shard, str):
                    raise ConversionError(f"{index_path}, tensor `{tensor}`: weight_map values must be shard file "
                                          f"names (strings), got {shard!r}")
                if shard not in checked:  # each name once (thousands of tensors a shard)
                    check_shard_name(shard, index_path, tensor)
                    checked.add(shard)
            return index_path, raw, dict(weight_map)
        single = self.root / SINGLE_FILE_NAME
        if os.path.lexists(single):
            check_inside(self.root, single)
            entries, _ = read_header(single)
            raw = json.dumps(sorted(entries)).encode()
            return single, raw, {name: SINGLE_FILE_NAME for name in entries}
        raise ConversionError(f"{self.root}: neither {INDEX_NAME} nor {SINGLE_FILE_NAME} exists")

    def index_digest(self) -> str:
        return hashlib.sha256(self.index_bytes).hexdigest()

    def shard_path(self, shard: str) -> Path:
        return self.root / shard

    def shard_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise ConversionError(f"{self.index_path}: the index lacks tensor `{name}`") from None

    def reader(self, name: str) -> ShardReader:
        shard = self.shard_of(name)
        if shard not in self._readers:
            path = self.shard_path(shard)
            if not path.exists() and self.fetch is not None:
                self.fetch(shard)
            if os.path.lexists(path):
                check_inside(self.root, path)
            if not path.exists():
                raise shard_error(path, f"shard file is missing (the index names it for `{name}`)")
            reader = ShardReader(path, self.chunk_bytes)
            check_shards_against_index({shard: (path, reader.entries)}, self.weight_map, self.index_path,
                                       error=shard_error, listed=False, names_of=self._names_in)
            self._readers[shard] = reader
        return self._readers[shard]

    def _names_in(self, shard: str):
        """The tensor names in another shard's header, for the message when a tensor sits in the wrong one (None when
        that shard cannot be read: the error for it comes when it is opened)."""
        if shard in self._readers:
            return self._readers[shard].entries
        path = self.shard_path(shard)
        try:
            check_file_name(shard, self.index_path, what="shard", suffix=".safetensors", error=shard_error)
            check_inside(self.root, path)
            return read_header(path)[0]
        except ConversionError:
            return None

    def entry(self, name: str) -> TensorEntry:
        return self.reader(name).entry(name)

    def shards_used(self, names) -> list[str]:
        return sorted({self.shard_of(n) for n in names})

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
