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
"""Which files a model folder may name, and a strict read of what it names (docs/bad_inputs.md, "Loading a folder").

One rule for `from_pretrained`, which runs `check_pretrained_folder` before transformers reads any file, and for
`kimik3 convert` / `export` / `verify` (convert/checkpoint.py and convert/safetensors_io.py import these): file names
that stay in the folder, symlinks that stay inside it (a Hub snapshot's into its blobs/, an adopted folder's to the
release folder its record names), strict JSON (no key given twice), the safetensors header read as strictly as the
format, every tensor from one shard, the layer count against the tensors, auto_map naming only
the folder's own code. Pure Python and the standard library: remote code cannot import the kimik3 package.
"""

import contextlib
import contextvars
import gc
import hashlib
import json
import math
import os
import re
import stat
import struct
import warnings


class KimiK3LoadError(ValueError):
    """A file of a model folder, or a release tensor, that cannot be loaded, named in the message."""


# Names the Hub gives repo ids: `name` or `org/name`, no `--` or `..`, not starting or ending with `-` or `.`
_REPO_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9_][\w.-]*(?<![.-])(/[A-Za-z0-9_][\w.-]*(?<![.-]))?")
# A code reference in auto_map: `module.Class` where module.py sits in the folder
_CODE_REFERENCE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")
# The layers of a checkpoint's text model, in the release's and our names (composite or text-only)
_LAYER_NAMES = re.compile(r"(?m)^(?:[^\n]*\.)?layers\.(\d+)\.")
_VISION_NAMES = ("vision_tower.", "mm_projector.")
# safetensors' dtypes and their element sizes (the converter passes the subset it can read)
SAFETENSORS_ITEMSIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                         "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# safetensors caps the header at 100 MB; anything larger is corruption, not a real header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_HUB_CACHE_KINDS = ("models--", "datasets--", "spaces--")
# The record of a folder written by `kimik3 adopt` (our config, code and tokenizer files, links to a release folder's
# shards): it names the one release folder the folder's links may reach.
ADOPTION_RECORD_NAME = "kimik3_adoption.json"


def load_error(path, message: str, tensor: str | None = None) -> KimiK3LoadError:
    """The loading side's error: `<path>[, tensor `T`]: <message>` (the converter's ConversionError reads the same)."""
    where = f"{path}" if tensor is None else f"{path}, tensor `{tensor}`"
    return KimiK3LoadError(f"{where}: {message}")


def looks_like_local_path(text: str) -> bool:
    """True when `text` can only be a local path, so a missing folder is reported as missing rather than looked up on
    the Hub: it starts with `/`, `.` or `~`, holds a backslash or the platform's separator, more than one `/` or a
    trailing one, is not a valid repo id at all, or is `org/name` whose `org` is a folder here (`models/k3` next to
    a `models/` folder). A valid `org/name` with no such folder is a Hub repo id."""
    if not text or text.startswith(("/", ".", "~")) or "\\" in text or (os.sep != "/" and os.sep in text):
        return True
    if text.count("/") > 1 or text.endswith("/") or not _REPO_ID.fullmatch(text):
        return True
    return "/" in text and os.path.isdir(text.split("/", 1)[0])


def _hub_blobs(real_folder: str) -> str | None:
    """The blobs/ folder of a Hub cache snapshot `.../models--o--n/snapshots/<rev>` (its files link there)."""
    snapshots, repo = os.path.dirname(real_folder), os.path.dirname(os.path.dirname(real_folder))
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(_HUB_CACHE_KINDS):
        return os.path.join(repo, "blobs")
    return None


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_file_name(name, named_by, *, what: str = "file", suffix: str = "", tensor: str | None = None,
                    error=load_error) -> None:
    """A name a folder's file gives another file must be a plain file name of that folder: no path separator (`/`,
    `\\`), no `..`, no drive or stream (`:`), no NUL, not empty."""
    if (not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\:\x00")
            or ".." in name or not name.endswith(suffix)):
        kind = f"plain `*{suffix}` file names" if suffix else "plain file names"
        raise error(named_by, f"refusing {what} name {name!r}: {what}s must be {kind} in the checkpoint folder (no "
                    "path separators, no `..`, no drive or absolute path)", tensor)


def _resolves_inside(folder, path) -> bool:
    """`path` resolves inside `folder`, or into the blobs/ of the Hub cache snapshot `folder` is."""
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(path)
    if _within(real, real_folder):
        return True
    blobs = _hub_blobs(real_folder)
    return blobs is not None and _within(real, blobs)


def _adoption_record(folder, error) -> tuple[str, frozenset, dict | None] | None:
    """(the release folder, the names linking into it) of an adopted folder's record (`ADOPTION_RECORD_NAME`, written
    by `kimik3 adopt`); None when `folder` holds no record. The record grants its folder's links their one way out,
    so it is checked before it is believed: a regular file of the folder (a symlink is refused, even one inside),
    strict JSON, its `release` an absolute path without `..` or `.` parts (kimik3 adopt writes it resolved) naming an
    existing directory, its `links` a list of plain file names."""
    record = os.path.join(folder, ADOPTION_RECORD_NAME)
    if not os.path.lexists(record):
        return None
    if os.path.islink(record):
        raise error(record, "is a symlink: the record that lets an adopted folder's links reach its release folder "
                    "must be a regular file of the folder itself")
    value = read_json(record, error=error, object_pairs_hook=dict_without_duplicate_keys)
    release = value.get("release") if isinstance(value, dict) else None
    links = value.get("links") if isinstance(value, dict) else None
    if (not isinstance(release, str) or not os.path.isabs(release) or "\x00" in release
            or os.path.normpath(release) != release or any(p in (".", "..") for p in release.split(os.sep))):
        raise error(record, f"key `release` = {release!r}: the release folder must be named by an absolute path "
                    "without `..` or `.` parts (kimik3 adopt writes it resolved)")
    if not isinstance(links, list):
        raise error(record, "key `links` must list the file names that link into the release folder")
    for name in links:
        check_file_name(name, record, what="linked file", error=error)
    if not os.path.isdir(release):
        raise error(record, f"names the release folder {release}, which is " + (
            "not a directory" if os.path.exists(release) else "missing") + ": the folder's links lead nowhere")
    fingerprints = value.get("fingerprints")  # adopted before fingerprints were taken: None
    if fingerprints is not None and not isinstance(fingerprints, dict):
        raise error(record, "key `fingerprints` must map linked file names to {size, mtime_ns, sha256}")
    return release, frozenset(links), fingerprints


def _adopted_link(folder, path, error) -> bool:
    """True for the one exception of an adopted folder (docs/bad_inputs.md, "Loading a folder"): `path` is a symlink
    directly in `folder`, the record lists its name, and it links to the file of that same name in the release
    folder the record names, a file that resolves inside that folder (or its Hub snapshot's blobs/). A listed link
    whose release file is missing is an error naming both."""
    if not os.path.islink(path) or os.path.dirname(os.path.abspath(path)) != os.path.abspath(folder):
        return False
    record = _adoption_record(folder, error)
    if record is None:
        return False
    release, links, _ = record
    name = os.path.basename(path)
    target = os.path.join(release, name)
    if name not in links or os.readlink(path) != target:
        return False
    if not os.path.lexists(target):
        raise error(path, f"links to {target}, which is missing: the release folder {release} named by "
                    f"{ADOPTION_RECORD_NAME} lacks it (restore it there, or adopt the release again)")
    return _resolves_inside(release, target)


# Files of a release an adopted folder links to are fingerprinted whole up to this size (the index, tokenizer and
# code files); a shard by its size and its safetensors header (names, dtypes, shapes, offsets: about 80 MB of the
# release's 1.5 TB, hashed in about 45 ms for all shards on the development machine: docs/bad_inputs.md).
WHOLE_FILE_FINGERPRINT_BYTES = 64 << 20


def file_fingerprint(path, error=load_error) -> dict:
    """{size, mtime_ns, sha256} of a file an adopted folder links to; sha256 of a `.safetensors` file's 8-byte length
    and header, of anything else whole (when at most WHOLE_FILE_FINGERPRINT_BYTES, else of its start)."""
    digest = hashlib.sha256()
    with open_regular_file(path, error, kind="linked") as handle:
        status = os.fstat(handle.fileno())
        if os.fspath(path).endswith(".safetensors"):
            prefix = handle.read(8)
            digest.update(prefix)
            if len(prefix) == 8:
                (header_len,) = struct.unpack("<Q", prefix)
                digest.update(handle.read(min(header_len, MAX_HEADER_BYTES)))
        else:
            digest.update(handle.read(WHOLE_FILE_FINGERPRINT_BYTES))
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns, "sha256": digest.hexdigest()}


def release_fingerprints(release, names) -> dict:
    """{name: file_fingerprint} of the release folder's files `names`: what an adoption record keeps."""
    return {name: file_fingerprint(os.path.join(release, name)) for name in sorted(names)}


def check_adopted_release(folder, error=load_error) -> None:
    """An adopted folder's links against the fingerprints its record took at adoption: a release file replaced by
    another of the same name (another size or header) is refused by name; one whose only change is its modification
    time (copied, touched, restored from a backup) gets a warning naming it, since its tensor data may differ. A
    record without fingerprints (adopted before they were taken) is not checked."""
    record_path = os.path.join(folder, ADOPTION_RECORD_NAME)
    record = _adoption_record(folder, error)
    if record is None or record[2] is None:
        return
    release, _, fingerprints = record
    touched = []
    for name, taken in sorted(fingerprints.items()):
        check_file_name(name, record_path, what="fingerprinted file", error=error)
        target = os.path.join(release, name)
        if not os.path.exists(target):
            continue  # the link's own check names it (_adopted_link)
        now = file_fingerprint(target, error)
        if not isinstance(taken, dict) or now["size"] != taken.get("size") or now["sha256"] != taken.get("sha256"):
            what = (f"its size was {taken.get('size'):,} bytes at adoption and is {now['size']:,} now"
                    if isinstance(taken, dict) and now["size"] != taken.get("size") else
                    "its safetensors header differs from the one at adoption" if name.endswith(".safetensors")
                    else "its contents differ from those at adoption")
            raise error(target, f"changed since `kimik3 adopt` wrote {folder}: {what}; the adopted config and "
                        f"{ADOPTION_RECORD_NAME} describe the old file. Adopt the release again (kimik3 adopt "
                        f"{release} DIR)")
        if now["mtime_ns"] != taken.get("mtime_ns"):
            touched.append(name)
    if touched:
        warnings.warn(f"{folder}: the release files {touched} were modified after adoption (same size and "
                      "safetensors header, so the same tensors by name, dtype and shape); if their values changed, "
                      f"adopt the release again (kimik3 adopt {release} DIR)", stacklevel=3)


def check_inside(folder, path, *, error=load_error) -> None:
    """`path` (in `folder`) must not resolve outside it: a symlink out of the folder is refused; symlinks that stay
    inside are fine, and so are a Hub cache snapshot's links into its own `blobs/`, and an adopted folder's links to
    the files of its release folder (`_adopted_link`)."""
    if _resolves_inside(folder, path) or _adopted_link(folder, path, error):
        return
    raise error(path, f"is a symlink to {os.path.realpath(path)}, outside the folder {folder}: a folder's files must "
                "be in it (a Hub cache snapshot's links into its own blobs/, and an adopted folder's links to its "
                "release folder's files of the same names, are the exceptions)")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_json(path, data: bytes | None = None, *, error=load_error, what: str | None = None, strict: bool = False,
              object_pairs_hook=None):
    """A JSON file's value; not UTF-8, not JSON and nesting too deep for the parser (a RecursionError, e.g.
    `[[[[...]]]]`) are errors naming the file. `strict`: NaN / Infinity are not JSON either (the safetensors
    header)."""
    prefix = f"{what}: " if what else ""
    if data is None:  # its own errors (a FIFO, a folder, no file) name the path already
        with open_regular_file(path, error, kind="JSON") as handle:
            data = handle.read()
    try:
        text = data.decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant if strict else None,
                          object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as exc:
        raise error(path, f"{prefix}not UTF-8 ({exc})") from None
    except RecursionError:
        raise error(path, f"{prefix}nested too deeply to parse (JSON arrays or objects inside each other beyond "
                    "Python's recursion limit; a real file nests a few levels)") from None
    except DuplicateKeyError as exc:
        raise error(path, f"{prefix}the key `{exc.key}` appears twice (which value is meant is ambiguous)") from None
    except ValueError as exc:  # JSONDecodeError and rejected constants
        raise error(path, f"{prefix}not JSON ({exc})") from None


class DuplicateKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def dict_without_duplicate_keys(pairs) -> dict:
    """json's object_pairs_hook for config.json and the index: json.loads keeps the last of two equal keys, so a key
    given twice (`num_hidden_layers`, a tensor of weight_map) would be read as whichever came last."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


# --- the safetensors header, as strict as the format --------------------------------------------------------------


def _unique_keys(path, pairs: tuple, tensor, error) -> dict:
    """A JSON object read as a tuple of (key, value) pairs (see `read_safetensors_header`) as a dict, refusing a key
    given twice: json.loads would keep the last, which in a header silently replaces one tensor by another."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                if tensor is None:
                    raise error(path, "corrupted safetensors header: the key appears twice in the header (which one "
                                "is meant is ambiguous)", key)
                raise error(path, f"corrupted safetensors header: its entry has the key {key!r} twice", tensor)
            seen.add(key)
    return obj


def _counts(values) -> bool:
    """A JSON list of non-negative whole numbers (`type() is int`: not a bool, not a float). Written as a loop: a
    release header has half a million entries and this runs for each."""
    if type(values) is not list:
        return False
    for value in values:
        if type(value) is not int or value < 0:
            return False
    return True


_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _parse_entry(path, name, raw, data_start: int, data_size: int, itemsizes, error):
    bad = lambda message: error(path, f"corrupted safetensors header: {message}", name)  # noqa: E731
    if type(raw) is tuple:
        raw = _unique_keys(path, raw, name, error)
    if type(raw) is not dict or raw.keys() != _ENTRY_KEYS:
        raise bad(f"an entry needs exactly dtype, shape and data_offsets, found {raw!r}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in itemsizes:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(itemsizes)})")
    if not _counts(shape):
        raise bad(f"bad shape {shape!r} (a list of non-negative integers)")
    if not _counts(offsets) or len(offsets) != 2:
        raise bad(f"bad data_offsets {offsets!r} (two non-negative integers)")
    if offsets[0] > offsets[1]:
        raise bad(f"data_offsets {offsets} end before they begin")
    expected = math.prod(shape) * itemsizes[dtype]
    if offsets[1] - offsets[0] != expected:
        raise bad(f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype} {shape} needs {expected}")
    if offsets[1] > data_size:
        raise error(path, f"file is truncated: the tensor's data ends at byte {data_start + offsets[1]} but the file "
                    f"has only {data_start + data_size} bytes", name)
    return dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1]


def _check_layout(path, entries: dict, data_start: int, data_size: int, error) -> None:
    """The format indexes the byte buffer fully: sorted by offset, each tensor starts where the previous one ended,
    and the last one ends at the end of the file. Overlaps would let two names share bytes (`k_proj` reading
    `q_proj`'s values); holes or a tail would be bytes that belong to no tensor."""
    ordered = sorted(entries.items(), key=lambda item: (item[1][2], item[1][3]))
    for (before, (_, _, _, before_end)), (after, (_, _, begin, end)) in zip(ordered, ordered[1:]):
        if begin < before_end:
            raise error(path, f"corrupted safetensors header: its data overlaps `{before}` (bytes {begin - data_start}"
                        f"..{min(end, before_end) - data_start} of the data section belong to both)", after)
    position = data_start
    for name, (_, _, begin, end) in ordered:
        if begin > position:
            raise error(path, f"corrupted safetensors header: bytes {position - data_start}..{begin - data_start} of "
                        "the data section before this tensor belong to no tensor (the format allows no holes)", name)
        position = end
    if position != data_start + data_size:
        raise error(path, f"corrupted safetensors header: the last {data_start + data_size - position} bytes of the "
                    "file belong to no tensor (the format allows no trailing data)")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def open_regular_file(path, error=load_error, kind: str = "shard"):
    """Opens `path` for reading only if it is a regular file (a symlink to one is fine: Hub caches use them).
    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer (reading one would wait forever);
    on a regular file it does nothing. `kind` names the file in the messages."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(path, f"{kind} file is missing") from None
    except IsADirectoryError:
        raise error(path, f"is a directory, not a {kind} file") from None
    except OSError as exc:
        raise error(path, f"cannot be opened for reading ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        regular = "a regular `.safetensors` file" if kind == "shard" else "a regular file"
        raise error(path, f"is {_file_kind(mode)}, not a {kind} file ({regular})")
    return os.fdopen(fd, "rb")


def read_safetensors_header(path, *, error=load_error, itemsizes=SAFETENSORS_ITEMSIZES):
    """Parses and validates a shard's header as strictly as the format, reading only the header: returns
    ({name: (dtype, shape, first byte, end byte)}, metadata); offsets are absolute file positions."""
    with open_regular_file(path, error) as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise error(path, f"file is truncated: {size} bytes, not even the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            limit = "more than the format's 100 MB limit" if header_len > MAX_HEADER_BYTES else "beyond the end"
            raise error(path, f"truncated or corrupted safetensors header: it claims {header_len} header bytes "
                        f"({limit}), the file has {size} bytes in total")
        raw = handle.read(header_len)
    # objects as tuples of pairs (a C call per object, where a Python hook per object took seconds on a release
    # header of thousands of entries), arrays stay lists: duplicates are then found per object, as dicts are made
    header = read_json(path, raw, error=error, what="corrupted safetensors header", strict=True,
                       object_pairs_hook=tuple)
    if type(header) is not tuple:
        raise error(path, f"corrupted safetensors header: not a JSON object (found {type(header).__name__})")
    header = _unique_keys(path, header, None, error)
    metadata = header.pop("__metadata__", None)
    if type(metadata) is tuple:
        metadata = _unique_keys(path, metadata, "__metadata__", error)
    if metadata is not None and (not isinstance(metadata, dict) or not all(isinstance(v, str) for v in
                                                                           metadata.values())):
        raise error(path, f"corrupted safetensors header: __metadata__ must map strings to strings, found "
                    f"{metadata!r}"[:300])
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries = {name: _parse_entry(path, name, raw_entry, data_start, data_size, itemsizes, error)
               for name, raw_entry in header.items()}
    _check_layout(path, entries, data_start, data_size, error)
    return entries, metadata or {}


# --- what a folder names ------------------------------------------------------------------------------------------


def check_shards_against_index(headers: dict, weight_map: dict, index_path, error=load_error,
                               listed: bool = True, names_of=None) -> None:
    """Every tensor comes from one place: a tensor in a shard's header that the index does not list, or lists in
    another shard that holds it too (the same name in two shards), is refused naming both files; the index may not
    name a tensor its shard lacks (`listed=False` leaves that to the reader, which refuses such a tensor when it is
    read). `headers`: {shard name: (path, {tensor: entry})} of the shards read; `names_of(shard)`: the tensor names in
    another shard's header (default: from `headers`)."""
    if names_of is None:
        names_of = lambda shard: headers[shard][1] if shard in headers else None  # noqa: E731
    for shard, (path, entries) in headers.items():
        for tensor in entries:
            owner = weight_map.get(tensor)
            if owner == shard:
                continue
            if owner is None:
                raise error(path, f"the shard's header holds this tensor, but it is missing from the index "
                            f"{index_path} (a tensor must come from one place: list it, or remove it from the shard)",
                            tensor)
            owner_path = os.path.join(os.path.dirname(path), owner)
            owner_names = names_of(owner)
            if owner_names is not None and tensor not in owner_names:
                raise error(owner_path, f"the index names this tensor but the shard's header lacks it (it is in "
                            f"{path})", tensor)
            raise error(path, f"the tensor is also in {owner_path}, which the index {index_path} names for it (a "
                        "tensor must come from one shard)", tensor)
    for tensor, shard in weight_map.items() if listed else ():
        if shard in headers and tensor not in headers[shard][1]:
            raise error(headers[shard][0], "the index names this tensor but the shard's header lacks it", tensor)


def check_layer_count(config: dict, weight_map: dict, config_path, index_path, error=load_error) -> None:
    """config.json's layer count must match the layers whose tensors the checkpoint holds (every layer 0..L-1 has
    some `...layers.N.` tensor): checked on the raw JSON, before a config is built, since building one for a count
    like 10^9 would take hours. A count that is not a positive whole number is left to the config's own check (which
    names the key), and a checkpoint without any `layers.N.` name is not counted."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    key = "text_config.num_hidden_layers" if text is not config else "num_hidden_layers"
    count = text.get("num_hidden_layers")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return
    names = "\n".join(tensor for tensor in weight_map if not tensor.startswith(_VISION_NAMES))
    held = {int(layer) for layer in set(_LAYER_NAMES.findall(names))}
    if not held:
        return  # names of another kind (no `layers.N.`): nothing to count
    missing = next((layer for layer in range(count) if layer not in held), None)
    if missing is not None:
        found = f"layers 0..{max(held)} ({len(held)} layer(s))" if held else "no layer"
        raise error(config_path, f"key `{key}` = {count:,}, but {index_path} holds tensors of {found}, none of layer "
                    f"{missing}: the layer count must match the checkpoint's tensors")


def check_auto_map(folder, config: dict, config_path, error=load_error) -> None:
    """A local folder's auto_map (top level and text_config) may name code only as `module.Class` with module.py in
    the folder: no path, no `..`, and no `repo--module.Class` reference to another Hub repo's code."""
    maps = [config.get("auto_map")] + [sub.get("auto_map") for sub in (config.get("text_config"),
                                                                        config.get("vision_config"))
                                       if isinstance(sub, dict)]
    for position, auto_map in enumerate(maps):
        if auto_map is None:
            continue
        if not isinstance(auto_map, dict):
            raise error(config_path, f"auto_map must be a JSON object mapping auto classes to `module.Class`, found "
                        f"{type(auto_map).__name__}")
        for auto_class, references in auto_map.items():
            for reference in references if isinstance(references, list) else [references]:
                if reference is None:
                    continue
                if isinstance(reference, str) and "--" in reference:
                    raise error(config_path, f"auto_map.{auto_class} = {reference!r} names code from another Hub "
                                "repo (`repo--module.Class`); a local folder may only name its own files "
                                "(`module.Class`)")
                match = _CODE_REFERENCE.fullmatch(reference) if isinstance(reference, str) else None
                if match is None:
                    raise error(config_path, f"auto_map.{auto_class} = {reference!r}: code must be named as "
                                "`module.Class`, with module.py a plain file of the folder (no path, no `..`)")
                path = os.path.join(folder, match.group(1) + ".py")
                if os.path.lexists(path):
                    check_inside(folder, path, error=error)
                    if position == 0:  # the map transformers imports from (a sub-config's is the release's record)
                        _check_defines(path, match.group(2), f"auto_map.{auto_class} = {reference!r}", error)


def _check_defines(path, name: str, what: str, error) -> None:
    """The module file names `name` at its top level (a class, or an alias of one): transformers would otherwise
    import it and fail on a bare AttributeError naming neither the key nor the file."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    if not re.search(rf"(?m)^(?:class\s+{name}\b|{name}\s*=|from\s+\S+\s+import\s+.*\b{name}\b)", text):
        raise error(path, f"{what}: {os.path.basename(path)} defines no `{name}`")


def _index_name(variant: str | None) -> tuple[str, str]:
    if variant:
        return f"model.safetensors.index.{variant}.json", f"model.{variant}.safetensors"
    return "model.safetensors.index.json", "model.safetensors"


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off while a folder's headers are parsed: the half million small objects of a
    release's headers would trigger a full collection again and again, which halved the check's time when paused."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _weights_files(folder, config: dict | None, config_path, variant: str | None, use_safetensors, error):
    """The index and single-file names transformers would read the weights from, as it picks them: config.json's
    `transformers_weights` names the file outright (an index or a shard); otherwise `model.safetensors` wins over
    the index, so a folder holding both has two sources for its weights and is refused. A pickled checkpoint
    (`pytorch_model.bin`, chosen with use_safetensors=False or when no safetensors weights exist) is refused: it
    would be unpickled."""
    explicit = config.get("transformers_weights") if isinstance(config, dict) else None
    if explicit is not None:
        check_file_name(explicit, config_path, what="`transformers_weights` file", error=error)
        if explicit.endswith(".safetensors.index.json"):
            return explicit, None
        if not explicit.endswith(".safetensors"):
            raise error(config_path, f"key `transformers_weights` = {explicit!r}: a `*.safetensors` file or a "
                        "`*.safetensors.index.json` index of the folder")
        return None, explicit
    index_name, single_name = _index_name(variant)
    pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")
               if os.path.lexists(os.path.join(folder, name))]
    has_safetensors = any(os.path.lexists(os.path.join(folder, n)) for n in (index_name, single_name))
    if pickled and (use_safetensors is False or not has_safetensors):
        raise error(os.path.join(folder, pickled[0]), "a pickled checkpoint is never loaded (unpickling a file can "
                    "run code): Kimi K3 folders hold safetensors weights; convert it to safetensors"
                    + (" (use_safetensors=False asks for it)" if use_safetensors is False else ""))
    if os.path.lexists(os.path.join(folder, index_name)) and os.path.lexists(os.path.join(folder, single_name)):
        raise error(folder, f"holds both {single_name} and {index_name}: two sources for the weights (transformers "
                    f"would read {single_name} and ignore the index); remove the one that does not belong")
    return index_name, single_name


def check_folder(folder, *, variant: str | None = None, complete: bool = True, error=load_error,
                 use_safetensors=None) -> None:
    """The checks `from_pretrained` runs on a local folder before transformers reads it: config.json, the index and
    every shard it names stay in the folder, parse (the shard headers strictly, read-only, so it is cheap), and every
    tensor comes from one place; config.json's layer count matches the tensors and its auto_map names code in the
    folder. `complete=False` (a Hub cache snapshot) skips the shards not downloaded yet."""
    folder = os.fspath(folder)
    config, config_path = None, os.path.join(folder, "config.json")
    if os.path.lexists(config_path):
        check_inside(folder, config_path, error=error)
        config = read_json(config_path, error=error, object_pairs_hook=dict_without_duplicate_keys)
        if not isinstance(config, dict):
            raise error(config_path, f"must hold a JSON object, not a {type(config).__name__}")
        check_auto_map(folder, config, config_path, error)
    check_adopted_release(folder, error)
    for name in ("generation_config.json",):
        if os.path.lexists(os.path.join(folder, name)):
            check_inside(folder, os.path.join(folder, name), error=error)
    index_name, single_name = _weights_files(folder, config, config_path, variant, use_safetensors, error)
    index_path = os.path.join(folder, index_name) if index_name else None
    single_path = os.path.join(folder, single_name) if single_name else None
    if index_path is not None and os.path.lexists(index_path):
        check_inside(folder, index_path, error=error)
        index = read_json(index_path, error=error, object_pairs_hook=dict_without_duplicate_keys)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise error(index_path, "not a safetensors index (needs a `weight_map` object mapping tensor names to "
                        "shard file names)")
        first_tensor = {}
        for tensor, shard in weight_map.items():
            if type(shard) is not str or shard not in first_tensor:  # each name once (thousands of tensors a shard)
                check_file_name(shard, index_path, what="shard", suffix=".safetensors", tensor=tensor, error=error)
                first_tensor[shard] = tensor
    elif single_path is not None and os.path.lexists(single_path):
        index_path, weight_map, first_tensor = single_path, None, {single_name: None}
    else:
        return
    headers = {}
    with _collector_paused():
        for shard, tensor in first_tensor.items():
            path = os.path.join(folder, shard)
            if not os.path.lexists(path) and not complete:
                continue
            check_inside(folder, path, error=error)
            if not os.path.exists(path):
                raise error(path, "shard file is missing" + (f" (the index names it for `{tensor}`)" if tensor else
                                                             ""))
            headers[shard] = (path, read_safetensors_header(path, error=error)[0])
    if weight_map is None:
        weight_map = {tensor: single_name for tensor in headers[single_name][1]}
    else:
        check_shards_against_index(headers, weight_map, index_path, error)
    if config is not None:
        check_layer_count(config, weight_map, config_path, index_path, error)


def weight_files(folder, variant: str | None = None) -> dict:
    """{tensor: the weights file of a local folder holding it} (the index's weight_map, or the single file's header),
    for error messages; empty when the folder has neither or they do not parse."""
    index_name, single_name = _index_name(variant)
    index_path, single_path = os.path.join(folder, index_name), os.path.join(folder, single_name)
    try:
        if os.path.isfile(index_path):
            weight_map = read_json(index_path).get("weight_map", {})
            return weight_map if isinstance(weight_map, dict) else {}
        if os.path.isfile(single_path):
            return dict.fromkeys(read_safetensors_header(single_path)[0], single_name)
    except (KimiK3LoadError, AttributeError):
        pass
    return {}


def _hub_snapshot(repo_id: str, kwargs) -> str | None:
    """The local snapshot folder of a Hub repo id when the cache already holds its config.json (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub is a transformers dependency
        return None
    name = "/".join(p for p in (kwargs.get("subfolder") or "", "config.json") if p)
    try:
        found = try_to_load_from_cache(repo_id, name, cache_dir=kwargs.get("cache_dir"),
                                       revision=kwargs.get("revision"))
    except Exception:  # an unusual id or cache: transformers reports what it finds
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


_FOLDER_CHECKED: contextvars.ContextVar = contextvars.ContextVar("kimik3_folder_checked", default=None)


def check_pretrained_folder(pretrained, kwargs) -> None:
    """from_pretrained's first step: a local folder (or the cached snapshot of a Hub repo id) is checked as above; a
    string that can only be a local path but names no folder is an error rather than a Hub lookup."""
    if not isinstance(pretrained, (str, os.PathLike)) or _FOLDER_CHECKED.get() == (os.fspath(pretrained),):
        return
    text, complete = os.fspath(pretrained), True
    for key in ("variant", "gguf_file"):  # each becomes part of a file name in the folder
        value = kwargs.get(key)
        if value is not None and (not isinstance(value, str) or not value or any(c in value for c in "/\\:\x00")
                                  or ".." in value):
            raise load_error(text, f"refusing {key}={value!r}: it names a file of the folder, so it must be a plain "
                             "name (no path separators, no `..`)")
    if os.path.isdir(text):
        folder = text
        subfolder = (kwargs.get("subfolder") or "").rstrip("/")
        if subfolder:
            parts = subfolder.replace("\\", "/").split("/")
            if subfolder.startswith("/") or any(p in ("", "..") or ":" in p or "\x00" in p for p in parts):
                raise load_error(text, f"refusing subfolder {subfolder!r}: a path inside the folder (no `..`, no "
                                 "absolute path)")
            folder = os.path.join(text, subfolder)
            check_inside(text, folder)
            if not os.path.isdir(folder):
                raise load_error(text, f"subfolder {subfolder!r} is not a folder in it (its folders: "
                                 f"{sorted(e.name for e in os.scandir(text) if e.is_dir())})")
        gguf = kwargs.get("gguf_file")
        if gguf and os.path.lexists(os.path.join(folder, gguf)):  # transformers reads it from the folder
            check_inside(folder, os.path.join(folder, gguf))
    elif os.path.exists(text):
        return  # a file: transformers says what it makes of it
    elif looks_like_local_path(text):
        raise load_error(text, "no such folder (a local path: not looked up on the Hub, which only takes repo ids "
                         "`name` or `org/name`)")
    else:
        folder, complete = _hub_snapshot(text, kwargs), False
        if folder is None:
            return
    check_folder(folder, variant=kwargs.get("variant"), complete=complete,
                 use_safetensors=kwargs.get("use_safetensors"))


@contextlib.contextmanager
def checked_pretrained_folder(pretrained, kwargs):
    """Runs `check_pretrained_folder` once for a whole from_pretrained (the composite class reads the index before
    the text class's from_pretrained runs the check again)."""
    check_pretrained_folder(pretrained, kwargs)
    token = _FOLDER_CHECKED.set((os.fspath(pretrained),) if isinstance(pretrained, (str, os.PathLike)) else None)
    try:
        yield
    finally:
        _FOLDER_CHECKED.reset(token)


__all__ = [
    "ADOPTION_RECORD_NAME",
    "DuplicateKeyError",
    "KimiK3LoadError",
    "check_adopted_release",
    "file_fingerprint",
    "release_fingerprints",
    "check_auto_map",
    "check_file_name",
    "check_folder",
    "check_inside",
    "check_layer_count",
    "check_pretrained_folder",
    "check_shards_against_index",
    "checked_pretrained_folder",
    "dict_without_duplicate_keys",
    "load_error",
    "looks_like_local_path",
    "open_regular_file",
    "read_json",
    "read_safetensors_header",
    "weight_files",
]
