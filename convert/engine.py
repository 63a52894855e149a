"""The streaming, resumable writer shared by convert and export.

Order of work, chosen so that nothing half-written ever looks finished:
  1. each shard is written to `.NAME.partial`, fsynced, then `os.replace`d to NAME, then recorded in the progress
     manifest `.kimik3-progress.json` (itself replaced atomically);
  2. the side files (tokenizer, remote code, card, ...);
  3. `model.safetensors.index.json`;
  4. `config.json` last; then the manifest is removed.
A loader needs config.json, so a folder without it is visibly unfinished, and the index never points at a shard that
is not complete. A re-run with the same inputs and options (same fingerprint) skips the shards the manifest lists
(and whose size matches) and writes the rest; the shard plan is a pure function of the inputs, and every byte
written is a pure function of the plan, so a resumed result is byte-identical to an uninterrupted one.
"""

import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError
from .plan import OutTensor, RunContext, total_bytes
from .safetensors_io import ShardWriter, layout_order

MANIFEST_NAME = ".kimik3-progress.json"
PARTIAL_SUFFIX = ".partial"
INDEX_NAME = "model.safetensors.index.json"
FORMAT_VERSION = 1
# Test hook: "N" raises after N tensors have been written in this run, "N:kill" ends the process on the spot (no
# cleanup runs, like a SIGKILL). Used to test resumption.
INTERRUPT_ENV = "KIMIK3_CONVERT_INTERRUPT_AFTER_TENSORS"


class SimulatedInterruption(RuntimeError):
    pass


@dataclass
class ShardPlan:
    name: str
    tensors: list[OutTensor]

    @property
    def nbytes(self) -> int:
        return total_bytes(self.tensors)


def plan_shards_by_size(tensors: list[OutTensor], max_bytes: int, width: int = 5) -> list[ShardPlan]:
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
    return [ShardPlan(f"model-{i + 1:0{width}d}-of-{total:0{width}d}.safetensors", g) for i, g in enumerate(groups)]


def fingerprint(shards: list[ShardPlan], identity: dict) -> str:
    """Everything that determines the output bytes: the inputs' identity, the options, and the full layout."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"version": FORMAT_VERSION, "identity": identity}, sort_keys=True).encode())
    for shard in shards:
        digest.update(shard.name.encode())
        for t in shard.tensors:
            digest.update(json.dumps([t.spec.name, t.spec.dtype, list(t.spec.shape), t.origin]).encode())
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name("." + path.name + PARTIAL_SUFFIX)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class Progress:
    """One stderr line, rewritten at most a few times a second: bytes done / total, rate and ETA."""

    def __init__(self, label: str, total: int, enabled: bool = True, stream=None):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.stream = stream or sys.stderr
        self.done = self.skipped = 0
        self.started = self.last = time.monotonic()

    def skip(self, nbytes: int) -> None:
        self.done += nbytes
        self.skipped += nbytes

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self.last >= 0.25:
            self.last = now
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = (self.done - self.skipped) / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "--:--" if left == float("inf") else time.strftime("%H:%M:%S", time.gmtime(left))
        self.stream.write(
            f"\r{self.label}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
            f"({100 * self.done / self.total:5.1f}%) {rate / 1e6:.0f} MB/s ETA {eta}   {end}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic(), "\n")


@contextmanager
def torch_threads(threads: int | None):
    """Intra-op threads for the (de)quantisation, restored afterwards. Conversion is disk-bound; on a shared or
    small machine one thread avoids OpenMP oversubscription (measured here under load: 1 thread 8x faster than 2)."""
    import torch

    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _interrupt_budget():
    raw = os.environ.get(INTERRUPT_ENV)
    if not raw:
        return None, False
    count, _, mode = raw.partition(":")
    return int(count), mode == "kill"


def _our_outputs(dst: Path) -> list[Path]:
    return [p for p in dst.iterdir() if p.suffix == ".safetensors" or p.name.endswith(PARTIAL_SUFFIX)]


def prepare_destination(dst: Path, fp: str, overwrite: bool) -> dict:
    """Returns the manifest to resume from (empty when starting fresh)."""
    manifest_path = dst / MANIFEST_NAME
    if not dst.exists():
        return {}
    if not dst.is_dir():
        raise ConversionError(f"{dst}: exists and is not a folder")
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError:
            manifest = {}
        if manifest.get("fingerprint") == fp:
            return manifest
        if not overwrite:
            raise ConversionError(
                f"{dst}: holds an unfinished run with different inputs or options ({MANIFEST_NAME}); pass "
                "--overwrite to start over"
            )
    elif any(dst.iterdir()) and not overwrite:
        raise ConversionError(f"{dst}: the folder is not empty; pass --overwrite to replace its checkpoint files")
    if overwrite:
        for path in _our_outputs(dst) + [dst / INDEX_NAME, dst / "config.json", manifest_path]:
            if path.exists():
                path.unlink()
    return {}


def _shard_is_done(dst: Path, shard: ShardPlan, manifest: dict) -> bool:
    record = manifest.get("done", {}).get(shard.name)
    path = dst / shard.name
    return bool(record) and path.exists() and path.stat().st_size == record["bytes"]


def _write_shard(dst: Path, shard: ShardPlan, progress: Progress, budget: list) -> int:
    tmp = dst / ("." + shard.name + PARTIAL_SUFFIX)
    ordered = layout_order([t.spec for t in shard.tensors])
    by_name = {t.spec.name: t for t in shard.tensors}
    writer = ShardWriter(tmp, ordered, metadata={"format": "pt"})
    try:
        for spec in ordered:
            writer.write_tensor(spec, by_name[spec.name].produce(), progress.update)
            if budget[0] is not None:
                budget[0] -= 1
                if budget[0] <= 0:
                    if budget[1]:
                        os._exit(137)
                    raise SimulatedInterruption(f"simulated interruption in {shard.name} after `{spec.name}`")
        writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dst / shard.name)
    return (dst / shard.name).stat().st_size


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
) -> dict:
    """side_files / final_files: callables returning [(file name, bytes)], called only once every shard is done
    (final_files go after the index; config.json belongs there). Returns a summary."""
    fp = fingerprint(shards, identity)
    manifest = prepare_destination(dst, fp, overwrite)
    dst.mkdir(parents=True, exist_ok=True)
    manifest = {"fingerprint": fp, "done": dict(manifest.get("done", {})), "stats": dict(manifest.get("stats", {}))}
    context.stats.update(manifest["stats"])
    # recorded before the first byte of output, so even a run killed inside its first shard is recognised (and
    # resumed) by the next run with the same fingerprint
    _write_atomic(dst / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode())
    bar = Progress(label, sum(s.nbytes for s in shards), progress)
    budget = list(_interrupt_budget())
    written, skipped = [], []
    started = time.monotonic()
    try:
        for shard in shards:
            if _shard_is_done(dst, shard, manifest):
                bar.skip(shard.nbytes)
                skipped.append(shard.name)
                continue
            context.shard = shard.name
            with torch_threads(threads):
                size = _write_shard(dst, shard, bar, budget)
            manifest["done"][shard.name] = {"bytes": size}
            if shard.name in context.stats:
                manifest["stats"][shard.name] = context.stats[shard.name]
            _write_atomic(dst / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode())
            written.append(shard.name)
    finally:
        bar.close()
    for name, data in side_files():
        _write_atomic(dst / name, data)
    index = {
        "metadata": dict(metadata or {}, total_size=sum(s.nbytes for s in shards)),
        "weight_map": {t.spec.name: s.name for s in shards for t in s.tensors},
    }
    _write_atomic(dst / INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    for name, data in final_files():
        _write_atomic(dst / name, data)
    (dst / MANIFEST_NAME).unlink(missing_ok=True)
    planned = {s.name for s in shards}
    for stale in _our_outputs(dst):
        if stale.name not in planned:
            stale.unlink()
    return {
        "shards": len(shards),
        "written": written,
        "skipped": skipped,
        "bytes": sum(s.nbytes for s in shards),
        "seconds": time.monotonic() - started,
        "stats": context.stats,
    }
