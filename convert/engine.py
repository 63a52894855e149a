"""The streaming, resumable writer shared by convert and export.

Order of work, chosen so that nothing half-written ever looks finished:
  0. an exclusive `flock` on `DST/.kimik3.lock` for the whole run (a second run into the same folder is refused; the
     kernel drops the lock when a process dies, so a killed run leaves no stale lock);
  1. each shard is written to `.NAME.partial`, fsynced, then `os.replace`d to NAME, then recorded in the progress
     manifest `.kimik3-progress.json` (itself replaced atomically);
  2. the side files (tokenizer, remote code, card, ...);
  3. `model.safetensors.index.json`;
  4. `config.json` last; then the manifest becomes the output record `.kimik3-output.json`.
A loader needs config.json, so a folder without it is visibly unfinished, and the index never points at a shard that
is not complete. A re-run with the same inputs and options (same fingerprint, source files included) skips the shards
the manifest lists (and whose size matches) and writes the rest; the shard plan is a pure function of the inputs, and
every byte written is a pure function of the plan, so a resumed result is byte-identical to an uninterrupted one. A
re-run of a finished conversion does nothing and says so. Manifest and record list every file kimik3 wrote into the
folder: `--overwrite` deletes exactly those, and never a file kimik3 did not write.
"""

import errno
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import struct
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .checkpoint import INDEX_NAME, shard_file_name
from .errors import ConversionError
from .plan import OutTensor, RunContext, total_bytes
from .safetensors_io import ShardWriter, layout_order

MANIFEST_NAME = ".kimik3-progress.json"
RECORD_NAME = ".kimik3-output.json"
LOCK_NAME = ".kimik3.lock"
PARTIAL_SUFFIX = ".partial"
FORMAT_VERSION = 1


@dataclass
class ShardPlan:
    name: str
    tensors: list[OutTensor]

    @property
    def nbytes(self) -> int:
        return total_bytes(self.tensors)


def plan_shards_by_size(tensors: list[OutTensor], max_bytes: int) -> list[ShardPlan]:
    """Greedy packing in plan order; a tensor larger than the limit gets a shard of its own (never split)."""
    groups: list[list[OutTensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or (size + tensor.spec.nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.spec.nbytes
    total = len(groups)
    return [ShardPlan(shard_file_name(i + 1, total), g) for i, g in enumerate(groups)]


SAMPLE_BLOCKS = 8
SAMPLE_BLOCK_BYTES = 64 * 1024


def source_fingerprint(path: Path) -> str:
    """What a source file's content is taken to be, without reading it all: size, mtime_ns, a digest of the
    safetensors header (every tensor's name, dtype, shape and offsets) and a digest of 8 evenly strided 64 KiB blocks.

    Limit: a change of tensor bytes outside the sampled blocks that also keeps the size, the header and the mtime
    (an in-place patch followed by `touch -d` to the old time) goes unnoticed. Anything that rewrites the file (a
    re-download, `save_file`, `cp` without `-p`) changes the mtime, and a changed layout changes the header.
    """
    path = Path(path).resolve()
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        digest.update(prefix)
        if len(prefix) == 8:
            header_len = min(struct.unpack("<Q", prefix)[0], max(stat.st_size - 8, 0))
            digest.update(handle.read(header_len))
        span = max(stat.st_size - SAMPLE_BLOCK_BYTES, 0)
        for i in range(SAMPLE_BLOCKS):
            handle.seek(span * i // (SAMPLE_BLOCKS - 1))
            digest.update(handle.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def _fingerprint_source(path: Path) -> str:
    try:
        return source_fingerprint(path)
    except FileNotFoundError:
        raise ConversionError(f"{path}: the source file is missing (the index names it)") from None


def fingerprint(shards: list[ShardPlan], identity: dict, sources: dict | None = None) -> str:
    """Everything that determines the output bytes: the inputs' identity (source file fingerprints included), the
    options, and the full layout."""
    digest = hashlib.sha256()
    header = {"version": FORMAT_VERSION, "identity": identity}
    if sources:
        header["sources"] = sources
    digest.update(json.dumps(header, sort_keys=True).encode())
    for shard in shards:
        digest.update(shard.name.encode())
        for t in shard.tensors:
            digest.update(json.dumps([t.spec.name, t.spec.dtype, list(t.spec.shape), t.origin]).encode())
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name("." + path.name + PARTIAL_SUFFIX)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


class ByteProgress(tqdm):
    """tqdm in the units the CLI reports: GB done / total and MB/s, whatever the size (tqdm's own scaling would
    switch between kB, MB and GB as the run grows)."""

    BAR_FORMAT = "{desc}: {gb_done:.2f}/{gb_total:.2f} GB ({percentage:5.1f}%) {mb_per_s:.0f} MB/s ETA {remaining}"

    @property
    def format_dict(self):
        values = super().format_dict
        rate = values["rate"]
        if rate is None:
            rate = (values["n"] - values["initial"]) / max(values["elapsed"], 1e-9)
        return dict(values, gb_done=values["n"] / 1e9, gb_total=(values["total"] or 0) / 1e9, mb_per_s=rate / 1e6)


def progress_bar(label: str, total: int, done: int, enabled: bool) -> ByteProgress:
    """Bytes written / total on stderr; `done`, the shards finished by an earlier run, counts from the start without
    entering the rate and ETA."""
    return ByteProgress(total=total, initial=done, desc=label, bar_format=ByteProgress.BAR_FORMAT,
                        disable=not enabled, file=sys.stderr)


# OpenMP allocates a stack per thread up front: --threads 10^9 aborted the process (libgomp: out of memory)
MAX_THREADS = 1024


def check_threads(threads) -> None:
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ConversionError(f"--threads {threads!r}: must be a whole number >= 1 (leave it out for torch's default)")
    if threads is not None and threads > MAX_THREADS:
        raise ConversionError(f"--threads {threads}: at most {MAX_THREADS} (this machine has {os.cpu_count()} CPUs; "
                              "leave it out for torch's default)")


def check_paths(src, dst) -> None:
    """SRC and DST as the user gave them: an empty path would be the working folder, a NUL byte or a symlink loop
    would fail later in the OS with no path named."""
    for what, path in (("source", src), ("destination", dst)):
        text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        if text is None:
            continue
        if not text:
            raise ConversionError(f"the {what} is an empty path: name a folder (`.` for the working folder)")
        if "\x00" in text:
            raise ConversionError(f"{text!r}: the {what} path holds a NUL byte")
        try:
            Path(text).resolve()
        except RuntimeError:  # pathlib's "Symlink loop"
            raise ConversionError(f"{text}: the {what} is a symlink loop (it never resolves to a folder)") from None


@contextmanager
def torch_threads(threads: int | None):
    """Intra-op threads for the (de)quantisation, restored afterwards. Conversion is disk-bound; on a shared or
    small machine one thread avoids OpenMP oversubscription (measured here under load: 1 thread 8x faster than 2)."""
    import torch

    check_threads(threads)
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Names a folder of model files holds: a file like these that kimik3 did not write would end up mixed into the new
# model, so `--overwrite` refuses to run next to one rather than delete it or leave it.
MODEL_FILE_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.json", "*.py", "*.model", "*.jinja",
                       "*.tiktoken", "tokenizer*", "chat_template*", "README*", "LICENSE*")


@contextmanager
def destination_lock(dst: Path):
    """Holds an exclusive flock on DST/.kimik3.lock (creating DST) for the duration; the kernel releases it when the
    process ends, however it ends. A folder this call created and that is still empty afterwards is removed."""
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"{dst}: exists and is not a folder")
    created = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    path = dst / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConversionError(f"{dst}: another kimik3 conversion is writing into this folder (it holds "
                                  f"{LOCK_NAME}); wait for it to finish, or choose another folder") from None
        try:  # the previous holder unlinks the file on its way out: a lock on that unlinked file guards nothing
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)
        if created and not any(dst.iterdir()):
            dst.rmdir()


def _read_record(path: Path) -> dict | None:
    """A manifest or output record; {} when it exists but cannot be read (it is still ours), None when absent."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _files_of(record: dict) -> set[str]:
    names = record.get("files", [])
    return {n for n in (names if isinstance(names, list) else []) if isinstance(n, str)} | set(record.get("done", {}))


def _is_ours(name: str, record: dict) -> bool:
    # a folder is ours when a file the run wrote lies in it (custom_generate/generate.py)
    return (name in (MANIFEST_NAME, RECORD_NAME) or name in _files_of(record)
            or any(f.startswith(name + "/") for f in _files_of(record))
            or (name.startswith(".") and name.endswith(PARTIAL_SUFFIX)))


def _listing(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _refusal(dst: Path, record: dict | None, finished: bool, sources: dict, source_paths: dict) -> ConversionError:
    if record is None:
        return ConversionError(f"{dst}: the folder is not empty; pass --overwrite to replace the files of an earlier "
                               "kimik3 run there (files kimik3 did not write are never deleted)")
    what = "a finished conversion" if finished else "an unfinished run"
    old = record.get("sources", {}) if isinstance(record.get("sources"), dict) else {}
    changed = [str(source_paths.get(n, n)) for n in sorted(sources) if n in old and old[n] != sources[n]]
    if changed:
        return ConversionError(
            f"{dst}: holds {what} made from a different version of {_listing(changed)} (size, modification time or "
            "sampled content changed since); its shards cannot be reused; pass --overwrite to start over")
    name = RECORD_NAME if finished else MANIFEST_NAME
    return ConversionError(f"{dst}: holds {what} with different inputs or options ({name}); pass --overwrite to "
                           "start over")


def prepare_destination(dst: Path, fp: str, overwrite: bool, sources: dict | None = None,
                        source_paths: dict | None = None) -> tuple[dict, list[str]]:
    """Returns (the manifest or record to resume from, empty when starting fresh; names of files kept because kimik3
    did not write them). DST exists (the caller holds its lock)."""
    sources, source_paths = sources or {}, source_paths or {}
    manifest = _read_record(dst / MANIFEST_NAME)
    record = manifest if manifest is not None else _read_record(dst / RECORD_NAME)
    if record and record.get("fingerprint") == fp:
        if manifest is None:
            record = dict(record, complete=True)
        return record, []
    entries = [p for p in dst.iterdir() if p.name != LOCK_NAME]
    if not entries:
        return {}, []
    if not overwrite:
        raise _refusal(dst, record, manifest is None, sources, source_paths)
    record = record or {}
    foreign = [p for p in entries if not _is_ours(p.name, record)]
    mixed_in = [p for p in foreign if any(fnmatch.fnmatch(p.name, pat) for pat in MODEL_FILE_PATTERNS)]
    if mixed_in:
        names = _listing(sorted(p.name for p in mixed_in))
        raise ConversionError(
            f"{dst}: --overwrite only replaces files an earlier kimik3 run wrote here, and these look like model "
            f"files that kimik3 did not write: {names}; delete or move them yourself, or choose another folder")
    for path in entries:
        if _is_ours(path.name, record) and path.is_file():
            path.unlink()
    return {}, sorted(p.name for p in foreign)


def _shard_is_done(dst: Path, shard: ShardPlan, manifest: dict) -> bool:
    record = manifest.get("done", {}).get(shard.name)
    path = dst / shard.name
    return bool(record) and path.exists() and path.stat().st_size == record["bytes"]


def _write_shard(dst: Path, shard: ShardPlan, progress: ByteProgress) -> int:
    tmp = dst / ("." + shard.name + PARTIAL_SUFFIX)
    ordered = layout_order([t.spec for t in shard.tensors])
    by_name = {t.spec.name: t for t in shard.tensors}
    writer = None
    try:  # whatever stops the shard (a full disk, a file-size limit, an error, Ctrl-C), no `.partial` stays
        writer = ShardWriter(tmp, ordered, metadata={"format": "pt"})
        for spec in ordered:
            writer.write_tensor(spec, by_name[spec.name].produce(), progress.update)
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dst / shard.name)
    return (dst / shard.name).stat().st_size


def _check_free_space(dst: Path, needed: int) -> None:
    free = shutil.disk_usage(dst).free
    if free < needed:
        raise ConversionError(f"{dst}: not enough free disk space: the shards still to write need {needed:,} bytes, "
                              f"{free:,} are free; free some space (or choose another folder) and run again")


def _disk_full_error(path: Path, exc: OSError, needed: int, done: int) -> ConversionError:
    return ConversionError(
        f"{path}: {os.strerror(exc.errno)} while writing; about {needed:,} more bytes are needed to finish. Free some "
        f"space and run the same command again: it resumes after the {done} finished shard(s)")


def _file_too_large_error(path: Path, exc: OSError, size: int | None, done: int) -> ConversionError:
    wanted = f" (it needs about {size:,} bytes)" if size else ""
    return ConversionError(
        f"{path}: {os.strerror(exc.errno)} while writing: the process's file-size limit (`ulimit -f`) is below this "
        f"file's size{wanted}. Raise the limit, or pass a smaller --max-shard-size (which starts over), and run the "
        f"same command again: it resumes after the {done} finished shard(s)")


def _save_manifest(dst: Path, manifest: dict, name: str = MANIFEST_NAME) -> None:
    _write_atomic(dst / name, json.dumps(manifest, indent=1, sort_keys=True).encode())


def _all_written(dst: Path, shards: list[ShardPlan], record: dict) -> bool:
    return (bool(record.get("complete")) and all(_shard_is_done(dst, s, record) for s in shards)
            and all((dst / name).exists() for name in _files_of(record)))


def write_checkpoint(
    dst: Path,
    shards: list[ShardPlan],
    identity: dict,
    side_files,
    final_files,
    context: RunContext,
    overwrite: bool = False,
    progress: bool = True,
    label: str = "kimik3",
    metadata: dict | None = None,
    threads: int | None = None,
    sources: dict | None = None,
) -> dict:
    """side_files / final_files: callables returning [(file name, bytes)], called only once every shard is done
    (final_files go after the index; config.json belongs there). sources: {name: path} of the input files the
    shards are made from; their `source_fingerprint`s are part of the run's fingerprint, so a resume never mixes
    shards made from an older version of a source. Returns a summary (`already_done` when nothing was left to do)."""
    check_threads(threads)
    dst = Path(dst)
    source_paths = {name: Path(path) for name, path in (sources or {}).items()}
    source_fps = {name: _fingerprint_source(path) for name, path in source_paths.items()}
    fp = fingerprint(shards, identity, source_fps)
    started = time.monotonic()
    with destination_lock(dst):
        record, kept = prepare_destination(dst, fp, overwrite, source_fps, source_paths)
        context.stats.update(record.get("stats", {}))
        summary = {"shards": len(shards), "bytes": sum(s.nbytes for s in shards), "stats": context.stats,
                   "kept": kept, "already_done": False}
        if _all_written(dst, shards, record):
            return dict(summary, written=[], skipped=[s.name for s in shards], already_done=True,
                        seconds=time.monotonic() - started)
        manifest = {"fingerprint": fp, "sources": source_fps, "done": dict(record.get("done", {})),
                    "stats": dict(record.get("stats", {})), "files": sorted(_files_of(record))}
        todo = [s for s in shards if not _shard_is_done(dst, s, manifest)]
        _check_free_space(dst, sum(s.nbytes for s in todo))
        # recorded before the first byte of output, so even a run killed inside its first shard is recognised (and
        # resumed) by the next run with the same fingerprint
        _save_manifest(dst, manifest)
        written = _write_all(dst, shards, manifest, context, label, progress, threads, side_files, final_files,
                             metadata)
    return dict(summary, written=written, skipped=[s.name for s in shards if s.name not in written],
                seconds=time.monotonic() - started)


def _write_all(dst, shards, manifest, context, label, progress, threads, side_files, final_files, metadata):
    """Shards, side files, index, config.json, output record; returns the names of the shards written. A full disk
    becomes a ConversionError naming the file and the bytes still needed (the manifest stays, so a re-run resumes)."""
    done = sum(s.nbytes for s in shards if _shard_is_done(dst, s, manifest))
    bar = progress_bar(label, sum(s.nbytes for s in shards), done, progress)
    written = []
    current = dst
    try:
        try:
            for shard in shards:
                if _shard_is_done(dst, shard, manifest):
                    continue
                context.shard = shard.name
                current = dst / shard.name
                with torch_threads(threads):
                    size = _write_shard(dst, shard, bar)
                manifest["done"][shard.name] = {"bytes": size}
                manifest["files"] = sorted(set(manifest["files"]) | {shard.name})
                if shard.name in context.stats:
                    manifest["stats"][shard.name] = context.stats[shard.name]
                _save_manifest(dst, manifest)
                written.append(shard.name)
        finally:
            bar.close()
        index = {
            "metadata": dict(metadata or {}, total_size=sum(s.nbytes for s in shards)),
            "weight_map": {t.spec.name: s.name for s in shards for t in s.tensors},
        }
        index_file = [(INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())]
        for batch in (side_files, lambda: index_file, final_files):
            files = batch()
            # named in the manifest before they exist, so `--overwrite` knows them even after a kill mid-batch
            manifest["files"] = sorted(set(manifest["files"]) | {name for name, _ in files})
            _save_manifest(dst, manifest)
            for name, data in files:
                current = dst / name
                current.parent.mkdir(exist_ok=True)  # custom_generate/
                _write_atomic(current, data)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            size = next((s.nbytes for s in shards if dst / s.name == current), None)
            raise _file_too_large_error(current, exc, size, len(manifest["done"])) from None
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        needed = sum(s.nbytes for s in shards if s.name not in manifest["done"])
        raise _disk_full_error(current, exc, needed, len(manifest["done"])) from None
    _save_manifest(dst, manifest, RECORD_NAME)
    (dst / MANIFEST_NAME).unlink(missing_ok=True)
    return written
