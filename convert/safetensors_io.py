"""Streaming safetensors reader and writer (format only; no pickle anywhere).

Why not `safetensors.safe_open` for the bulk reads: it memory-maps the whole shard, and every page touched stays in
the process's RSS until the file is closed (measured here: reading a 1 GiB shard tensor by tensor through
`safe_open` raised RSS by 1 GiB). A release shard is 17 GB, so the bound "peak RSS independent of model size" needs
plain positioned reads into buffers we own. The format is simple and fixed: an 8-byte little-endian header length,
a JSON header `{name: {dtype, shape, data_offsets}}` (+ optional `__metadata__`), then the raw little-endian data.
The header parser (files_kimi_k3.read_safetensors_header, which from_pretrained also runs on every shard of a
folder) is as strict as the format (known dtypes, shape x itemsize = offset span, no duplicate keys,
the data section indexed fully with no overlaps, holes or trailing bytes, `__metadata__` strings only), so a
truncated, corrupted or ambiguous shard fails with the file and tensor named instead of yielding wrong weights; tests
cross-check both directions against the `safetensors` library. Every chunk read is also checked for NaN / infinity
(and E8M0 scale bytes for 0xFF) on the way through, so non-finite values never reach an output.
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

from kimik3.modeling.files_kimi_k3 import open_regular_file as _open_regular_file, read_safetensors_header

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
ITEMSIZES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


def itemsize(dtype_name: str) -> int:
    return ITEMSIZES[dtype_name]


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


def open_regular_file(path: Path):
    """Opens `path` for reading only if it is a regular file (a symlink to one is fine: Hub caches use them); never
    blocks on a FIFO (files_kimi_k3.open_regular_file)."""
    return _open_regular_file(path, shard_error)


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parses and validates a shard's header as strictly as the format: returns ({name: entry}, metadata). The parser
    is the one from_pretrained runs on every shard of a folder (files_kimi_k3.read_safetensors_header)."""
    path = Path(path)
    entries, metadata = read_safetensors_header(path, error=shard_error, itemsizes=ITEMSIZES)
    return {name: TensorEntry(name, *entry) for name, entry in entries.items()}, metadata


# ------------------------------------------------------------------------------------------------------------------
# Values: nothing non-finite passes into a model. Checked on every chunk as it is read (no second read): a NaN-
# propagating min/max runs at memory speed, and only a chunk that fails it is searched for the first bad element.

# Bytes that hold E8M0 scales (MXFP4 `weight_scale`): the dtype says U8, the format says 0xFF is NaN.
E8M0 = "e8m0"
_CHECK_BLOCK = 1 << 24  # elements per min/max call (f8 blocks are widened to f32 first)
_NO_MINMAX = (torch.float8_e4m3fn, torch.float8_e5m2)


def _first_non_finite(values: torch.Tensor) -> int | None:
    for start in range(0, values.numel(), _CHECK_BLOCK):
        block = values[start:start + _CHECK_BLOCK]
        if block.dtype in _NO_MINMAX:
            block = block.float()
        low, high = torch.aminmax(block)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            return start + int(torch.nonzero(~torch.isfinite(block))[0, 0])
    return None


def _position(entry: TensorEntry, flat: int) -> list[int]:
    index = []
    for dim in reversed(entry.shape or (1,)):
        index.append(flat % dim)
        flat //= dim
    return index[::-1]


def check_values(path, entry: TensorEntry, data: torch.Tensor, offset: int, encoding: str | None = None) -> None:
    """Raises if the whole elements among `data` (bytes [offset, offset + len) of the tensor's data) include a NaN or
    infinity, or, with encoding E8M0, a scale byte 0xFF."""
    if encoding == E8M0:
        if data.numel() and int(data.max()) == 0xFF:
            flat = offset + int(torch.nonzero(data == 0xFF)[0, 0])
            raise shard_error(path, f"E8M0 scale byte 0xFF (NaN in the MX format) at {_position(entry, flat)}; "
                              "valid scales are 0x00..0xFE", entry.name)
        return
    dtype = entry.torch_dtype
    if not dtype.is_floating_point:
        return
    size = itemsize(entry.dtype)
    skip = -offset % size  # a chunk may start or end inside an element; check the whole ones
    count = (data.numel() - skip) // size
    if count <= 0:
        return
    values = data[skip:skip + count * size].view(dtype)
    bad = _first_non_finite(values)
    if bad is not None:
        flat = (offset + skip) // size + bad
        raise shard_error(path, f"non-finite value {float(values[bad])} at {_position(entry, flat)} "
                          f"({entry.dtype} {list(entry.shape)}); a checkpoint with NaN or infinity is refused",
                          entry.name)


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
            self._handle = open_regular_file(self.path)
        self._handle.seek(offset)
        view = memoryview(buffer.numpy()).cast("B")
        got = self._handle.readinto(view)
        if got != len(view):
            raise shard_error(self.path, f"file is truncated: short read ({got} of {len(view)} bytes)", name)

    def read_bytes(self, name: str, start: int = 0, stop: int | None = None, encoding: str | None = None) -> torch.Tensor:
        """Raw bytes [start, stop) of a tensor's data as a uint8 tensor, its values checked (`check_values`)."""
        entry = self.entry(name)
        stop = entry.nbytes if stop is None else stop
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        if stop > start:
            self._read_into(buffer, entry.begin + start, name)
            check_values(self.path, entry, buffer, start, encoding)
        return buffer

    def read(self, name: str, encoding: str | None = None) -> torch.Tensor:
        entry = self.entry(name)
        return self.read_bytes(name, encoding=encoding).view(entry.torch_dtype).reshape(entry.shape)

    def iter_byte_chunks(self, name: str, nbytes: int | None = None) -> Iterator[torch.Tensor]:
        """The first `nbytes` (default: all) of a tensor's data in chunks of at most `chunk_bytes` (whole elements,
        so every element is value-checked)."""
        entry = self.entry(name)
        total = entry.nbytes if nbytes is None else nbytes
        step = max(itemsize(entry.dtype), self.chunk_bytes - self.chunk_bytes % itemsize(entry.dtype))
        for start in range(0, total, step):
            yield self.read_bytes(name, start, min(total, start + step))


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
        try:
            self._handle.write(encode_header(specs, metadata))
        except BaseException:
            _close_quietly(self._handle)
            raise
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
        """Stops without raising: the write in flight may have failed (a full disk), and closing flushes the buffer,
        which fails the same way; the caller removes the file."""
        try:
            self._wait()
        except Exception:
            pass
        finally:
            self._pool.shutdown()
            _close_quietly(self._handle)


def _close_quietly(handle) -> None:
    # a buffered file closes its descriptor even when the flush before it fails
    try:
        handle.close()
    except OSError:
        pass
