"""Resumability: an interrupted conversion (an exception, or a hard kill with no cleanup) is finished by re-running
it, without rewriting finished shards, and the result is byte-identical to an uninterrupted run; an unfinished
folder never looks finished."""

import json
import os
import signal

import pytest

import kimik3.convert as kc
from k3_test_utils import run_forked
from kimik3.convert import engine, testing
from kimik3.convert.errors import ConversionError

SHARD = "120KB"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return testing.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=2, num_layers=6)


@pytest.fixture(scope="module")
def uninterrupted(release, tmp_path_factory):
    dst = tmp_path_factory.mktemp("full") / "out"
    kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    return dst


def contents(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def looks_unfinished(folder):
    return not (folder / "config.json").exists() and not (folder / engine.INDEX_NAME).exists()


class Interrupted(Exception):
    pass


def interrupt_after_tensors(monkeypatch, count):
    """The run stops with `Interrupted` once `count` tensors have been written (mid-shard unless a shard ends there)."""
    original = engine.ShardWriter.write_tensor
    written = [0]

    def write_tensor(self, *args, **kwargs):
        if written[0] == count:
            raise Interrupted(f"after {count} tensors")
        original(self, *args, **kwargs)
        written[0] += 1

    monkeypatch.setattr(engine.ShardWriter, "write_tensor", write_tensor)


def kill_after_tensors(src, dst, count):
    """Run in a forked child: the conversion SIGKILLs its own process after `count` tensors, so no `finally`, no
    atexit, nothing cleans up."""
    original, written = engine.ShardWriter.write_tensor, [0]

    def write_tensor(self, *args, **kwargs):
        if written[0] == count:
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, *args, **kwargs)
        written[0] += 1

    engine.ShardWriter.write_tensor = write_tensor
    kc.convert(src, dst, max_shard_size=SHARD, progress=False)


def stamps(folder, names):
    return {n: ((folder / n).stat().st_ino, (folder / n).stat().st_mtime_ns) for n in names}


def test_a_raised_interruption_resumes_to_identical_bytes(release, uninterrupted, tmp_path, monkeypatch):
    num_shards = len(list(uninterrupted.glob("model-*.safetensors")))
    assert num_shards >= 4
    dst = tmp_path / "out"
    interrupt_after_tensors(monkeypatch, 70)
    with pytest.raises(Interrupted):
        kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    monkeypatch.undo()
    assert looks_unfinished(dst)
    assert not list(dst.glob("*.partial")) and not list(dst.glob(".*.partial"))
    done = sorted(json.loads((dst / engine.MANIFEST_NAME).read_text())["done"])
    assert 1 <= len(done) < num_shards
    before = stamps(dst, done)
    summary = kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    assert sorted(summary["skipped"]) == done and len(summary["written"]) == num_shards - len(done)
    assert stamps(dst, done) == before  # finished shards were not rewritten
    assert contents(dst) == contents(uninterrupted)


def test_a_hard_kill_mid_shard_resumes_to_identical_bytes(release, uninterrupted, tmp_path):
    dst = tmp_path / "out"
    returncode, _, error = run_forked(kill_after_tensors, str(release.path), str(dst), 45, timeout=120)
    assert returncode == -signal.SIGKILL, error
    assert looks_unfinished(dst)
    assert list(dst.glob(".model-*.partial"))  # the shard being written when killed: not under its final name
    kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    assert contents(dst) == contents(uninterrupted)


def test_an_unfinished_run_with_other_options_is_not_mixed_in(release, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    interrupt_after_tensors(monkeypatch, 30)
    with pytest.raises(Interrupted):
        kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    monkeypatch.undo()
    with pytest.raises(ConversionError, match="different inputs or options"):
        kc.convert(release.path, dst, max_shard_size=SHARD, num_experts=4, progress=False)
    assert looks_unfinished(dst)
    kc.convert(release.path, dst, max_shard_size=SHARD, num_experts=4, overwrite=True, progress=False)
    assert json.loads((dst / "config.json").read_text())["text_config"]["num_experts"] == 4
    weight_map = json.loads((dst / engine.INDEX_NAME).read_text())["weight_map"]
    assert {p.name for p in dst.glob("model-*.safetensors")} == set(weight_map.values())


def test_a_finished_or_foreign_folder_is_not_overwritten_silently(release, uninterrupted, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        kc.convert(release.path, foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine" and looks_unfinished(foreign)
