"""A checkpoint folder on disk: its config, its index, and lazy access to the shards it names.

Used for both layouts (the release and ours). Shard headers are parsed only when a tensor of that shard is first
needed, so a partial conversion (`--text-only`, `--num-layers`) opens only the shards it reads.
"""

import hashlib
import json
from pathlib import Path

from kimik3.modeling.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

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
    """An index may only name plain files next to it: anything else could read (or, on export, write) elsewhere."""
    if (
        not isinstance(shard, str)
        or not shard
        or shard in (".", "..")
        or "/" in shard
        or "\\" in shard
        or "\x00" in shard
        or ".." in shard
        or ":" in shard
        or not shard.endswith(".safetensors")
    ):
        raise shard_error(index_path, f"refusing shard name {shard!r}: shards must be plain `*.safetensors` file "
                          "names in the checkpoint folder (no path separators, no `..`)", tensor)


def load_config_dict(root: Path) -> dict:
    path = root / "config.json"
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConversionError(f"{path}: config.json is missing") from None
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{path}: not UTF-8 text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from None
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
            raise ConversionError(f"{self.root}: not a checkpoint folder")
        self.chunk_bytes = chunk_bytes
        self.config_dict = load_config_dict(self.root)
        self.config = config_from_dict(self.config_dict, self.root)
        self.composite = hasattr(self.config, "text_config")
        self.text_config = self.config.text_config if self.composite else self.config
        self.vision_config = getattr(self.config, "vision_config", None) if self.composite else None
        self.index_path, self.index_bytes, self.weight_map = self._load_index()
        self._readers: dict[str, ShardReader] = {}

    # --------------------------------------------------------------------------------------------------------------
    def _load_index(self):
        index_path = self.root / INDEX_NAME
        if index_path.exists():
            raw = index_path.read_bytes()
            try:
                index = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ConversionError(f"{index_path}: not a safetensors index (not UTF-8 text: {exc})") from None
            except json.JSONDecodeError as exc:
                raise ConversionError(f"{index_path}: not a safetensors index (not valid JSON: {exc})") from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index_path}: not a safetensors index (needs a `weight_map` object mapping "
                                      "tensor names to shard file names)")
            for tensor, shard in weight_map.items():
                if not isinstance(shard, str):
                    raise ConversionError(f"{index_path}, tensor `{tensor}`: weight_map values must be shard file "
                                          f"names (strings), got {shard!r}")
                check_shard_name(shard, index_path, tensor)
            return index_path, raw, dict(weight_map)
        single = self.root / SINGLE_FILE_NAME
        if single.exists():
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
            if not path.exists():
                raise shard_error(path, f"shard file is missing (the index names it for `{name}`)")
            self._readers[shard] = ShardReader(path, self.chunk_bytes)
        return self._readers[shard]

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
