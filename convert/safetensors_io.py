"""Streaming safetensors reader and writer (format only; no pickle anywhere).

Why not `safetensors.safe_open` for the bulk reads: it memory-maps the whole shard, and every page touched stays in
the process's RSS until the file is closed (measured here: reading a 1 GiB shard tensor by tensor through
`safe_open` raised RSS by 1 GiB). A release shard is 17 GB, so the bound "peak RSS independent of model size" needs
plain positioned reads into buffers we own. The format is simple and fixed: an 8-byte little-endian header length,
a JSON header `{name: {dtype, shape, data_offsets}}` (+ optional `__metadata__`), then the raw little-endian data.
The header parser below is strict, so a truncated or corrupted shard fails with the file and tensor named; tests
cross-check both directions against the `safetensors` library.
"""

import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .errors import shard_error

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# safetensors caps the header at 100 MB; anything larger is corruption, not a real header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


def itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype_name]).element_size()


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _parse_entry(path, name, raw, data_start: int, data_size: int) -> TensorEntry:
    if not isinstance(raw, dict) or set(raw) - {"dtype", "shape", "data_offsets"}:
        raise shard_error(path, f"corrupted safetensors header: bad entry {raw!r}", name)
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in DTYPES:
        raise shard_error(path, f"corrupted safetensors header: unknown dtype {dtype!r}", name)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise shard_error(path, f"corrupted safetensors header: bad shape {shape!r}", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise shard_error(path, f"corrupted safetensors header: bad data_offsets {offsets!r}", name)
    expected = math.prod(shape) * itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        raise shard_error(
            path,
            f"corrupted safetensors header: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but "
            f"{dtype} {shape} needs {expected}",
            name,
        )
    if offsets[1] > data_size:
        raise shard_error(
            path,
            f"file is truncated: the tensor's data ends at byte {data_start + offsets[1]} but the file has only "
            f"{data_start + data_size} bytes",
            name,
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parses and validates a shard's header. Returns ({name: entry}, metadata)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise shard_error(path, f"file is truncated: {size} bytes, not even the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise shard_error(
                    path,
                    f"truncated or corrupted safetensors header: it claims {header_len} header bytes, the file has "
                    f"{size} bytes in total",
                )
            raw = handle.read(header_len)
    except FileNotFoundError:
        raise shard_error(path, "shard file is missing") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise shard_error(path, f"corrupted safetensors header (not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise shard_error(path, "corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries = {name: _parse_entry(path, name, raw_entry, data_start, data_size) for name, raw_entry in header.items()}
    return entries, metadata


class ShardReader:
    """Reads tensors of one shard with positioned reads into fresh buffers (no mmap, see the module docstring)."""

    def __init__(self, path: str | os.PathLike, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.path = Path(path)
        self.entries, self.metadata = read_header(self.path)
        self.chunk_bytes = chunk_bytes
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise shard_error(self.path, "the index names this tensor but the shard's header lacks it", name) from None

    def _read_into(self, buffer: torch.Tensor, offset: int, name: str) -> None:
        if self._handle is None:
            self._handle = open(self.path, "rb")
        self._handle.seek(offset)
        view = memoryview(buffer.numpy()).cast("B")
        got = self._handle.readinto(view)
        if got != len(view):
            raise shard_error(self.path, f"file is truncated: short read ({got} of {len(view)} bytes)", name)

    def read_bytes(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Raw bytes [start, stop) of a tensor's data as a uint8 tensor."""
        entry = self.entry(name)
        stop = entry.nbytes if stop is None else stop
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        if stop > start:
            self._read_into(buffer, entry.begin + start, name)
        return buffer

    def read(self, name: str) -> torch.Tensor:
        entry = self.entry(name)
        return self.read_bytes(name).view(entry.torch_dtype).reshape(entry.shape)

    def iter_byte_chunks(self, name: str, nbytes: int | None = None) -> Iterator[torch.Tensor]:
        """The first `nbytes` (default: all) of a tensor's data in chunks of at most `chunk_bytes`."""
        total = self.entry(name).nbytes if nbytes is None else nbytes
        for start in range(0, total, self.chunk_bytes):
            yield self.read_bytes(name, start, min(total, start + self.chunk_bytes))


# ------------------------------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class OutSpec:
    """What the writer needs to lay out one tensor before its bytes exist."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def layout_order(specs: Iterable[OutSpec]) -> list[OutSpec]:
    # Wider dtypes first, so every tensor starts at an offset aligned to its element size (the data section starts
    # 8-aligned); then by name, so the layout is a pure function of the set of tensors.
    return sorted(specs, key=lambda s: (-itemsize(s.dtype), s.name))


def encode_header(specs: list[OutSpec], metadata: dict[str, str] | None) -> bytes:
    header: dict = {}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def tensor_bytes(chunk: torch.Tensor):
    """A buffer of the tensor's raw little-endian bytes (numpy has no bfloat16, so go through uint8)."""
    flat = chunk.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


class ShardWriter:
    """Writes one shard to `path`: the header first (all shapes are known from the plan), then each tensor's bytes as
    its producer yields them. One write is in flight on a helper thread while the producer makes the next chunk
    (file writes release the GIL), so at most two chunks of output are alive at any time."""

    def __init__(self, path: Path, specs: list[OutSpec], metadata: dict[str, str] | None = None):
        self.path = path
        self.specs = specs
        self._handle = open(path, "wb")
        self._handle.write(encode_header(specs, metadata))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimik3-writer")
        self._pending = None
        self._index = 0

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _submit(self, data) -> None:
        self._wait()
        self._pending = self._pool.submit(self._handle.write, data)

    def write_tensor(self, spec: OutSpec, chunks: Iterable[torch.Tensor], on_bytes=None) -> None:
        if self.specs[self._index] != spec:
            raise RuntimeError(f"{self.path}: tensors written out of layout order at `{spec.name}`")
        written = 0
        for chunk in chunks:
            if DTYPE_NAMES.get(chunk.dtype) != spec.dtype and chunk.dtype != torch.uint8:
                raise RuntimeError(f"`{spec.name}`: producer gave {chunk.dtype}, the plan says {spec.dtype}")
            data = tensor_bytes(chunk)
            size = len(data) if isinstance(data, bytes) else data.nbytes
            if written + size > spec.nbytes:
                raise RuntimeError(f"`{spec.name}`: producer gave more than the {spec.nbytes} bytes of the plan")
            self._submit(data)
            written += size
            if on_bytes is not None:
                on_bytes(size)
            # drop our references before the producer makes the next chunk (the writer thread holds its own)
            del chunk, data
        if written != spec.nbytes:
            raise RuntimeError(f"`{spec.name}`: producer gave {written} bytes, the plan says {spec.nbytes}")
        self._index += 1

    def close(self, durable: bool = True) -> None:
        self._wait()
        self._pool.shutdown()
        if self._index != len(self.specs):
            raise RuntimeError(f"{self.path}: closed after {self._index} of {len(self.specs)} tensors")
        self._handle.flush()
        if durable:
            os.fsync(self._handle.fileno())
        self._handle.close()

    def abort(self) -> None:
        try:
            self._wait()
        except OSError:
            pass
        finally:
            self._pool.shutdown()
            self._handle.close()
