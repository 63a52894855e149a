"""Resumability: an interrupted conversion (an exception, or a hard kill with no cleanup) is finished by re-running
it, without rewriting finished shards, and the result is byte-identical to an uninterrupted run; an unfinished
folder never looks finished."""

import json
import os
import subprocess
import sys

import pytest

import kimik3.convert as kc
from kimik3.convert import engine, fixture  # noqa: E402
from kimik3.convert.errors import ConversionError  # noqa: E402

SHARD = "120KB"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return fixture.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=2, num_layers=6)


@pytest.fixture(scope="module")
def uninterrupted(release, tmp_path_factory):
    dst = tmp_path_factory.mktemp("full") / "out"
    kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    return dst


def contents(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def looks_unfinished(folder):
    return not (folder / "config.json").exists() and not (folder / engine.INDEX_NAME).exists()


def stamps(folder, names):
    return {n: ((folder / n).stat().st_ino, (folder / n).stat().st_mtime_ns) for n in names}


def test_a_raised_interruption_resumes_to_identical_bytes(release, uninterrupted, tmp_path, monkeypatch):
    num_shards = len(list(uninterrupted.glob("model-*.safetensors")))
    assert num_shards >= 4
    dst = tmp_path / "out"
    monkeypatch.setenv(engine.INTERRUPT_ENV, "70")
    with pytest.raises(engine.SimulatedInterruption):
        kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    monkeypatch.delenv(engine.INTERRUPT_ENV)
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
    code = (
        "import kimik3.convert as kc, sys; "
        f"kc.convert(sys.argv[1], sys.argv[2], max_shard_size='{SHARD}', progress=False)"
    )
    env = dict(os.environ)
    env[engine.INTERRUPT_ENV] = "45:kill"
    result = subprocess.run([sys.executable, "-c", code, str(release.path), str(dst)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 137, result.stderr
    assert looks_unfinished(dst)
    assert list(dst.glob(".model-*.partial"))  # the shard being written when killed: not under its final name
    kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    assert contents(dst) == contents(uninterrupted)


def test_an_unfinished_run_with_other_options_is_not_mixed_in(release, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    monkeypatch.setenv(engine.INTERRUPT_ENV, "30")
    with pytest.raises(engine.SimulatedInterruption):
        kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    monkeypatch.delenv(engine.INTERRUPT_ENV)
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
