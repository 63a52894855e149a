"""Bad input on the run side (issue 10): configs, source index/config files, destination folders, resume, locking,
disk space, CLI arguments. Each case id here has a row in docs/bad_inputs.md ("Runs, folders and configs")."""

import errno
import io
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import threading

import pytest
from safetensors.torch import load_file, save_file

import kimik3.convert as kc
from kimik3.cli import main as kimik3_main
from kimik3.configuration import (
    kimi_linear_style_text_config_dict,
    released_config_dict,
    tiny_text_config_dict,
)
from kimik3.convert import converter, engine, testing
from kimik3.convert import safetensors_io as sio
from kimik3.convert.errors import ConversionError
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

SHARD = "60KB"  # about ten output shards from the tiny release: enough to interrupt in the middle
INDEX = engine.INDEX_NAME


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return testing.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=4, num_layers=4,
                                            num_experts=4, return_dense=False)


@pytest.fixture(scope="module")
def reference(release, tmp_path_factory):
    """An uninterrupted conversion, for byte comparisons."""
    dst = tmp_path_factory.mktemp("reference") / "out"
    kc.convert(release.path, dst, max_shard_size=SHARD, progress=False)
    return dst


def convert(src, dst, **options):
    return kc.convert(src, dst, max_shard_size=SHARD, progress=False, **options)


def contents(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != engine.RECORD_NAME}


def looks_unfinished(folder):
    return not (folder / "config.json").exists() and not (folder / INDEX).exists()


def fail_after_tensors(monkeypatch, count, exc):
    """Makes the shard writer raise `exc` when it is asked for tensor number `count` + 1 of this run."""
    original = engine.ShardWriter.write_tensor
    calls = [0]

    def write_tensor(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > count:
            raise exc
        return original(self, *args, **kwargs)

    monkeypatch.setattr(engine.ShardWriter, "write_tensor", write_tensor)


def interrupted_run(release_path, dst, monkeypatch, count=25):
    fail_after_tensors(monkeypatch, count, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        convert(release_path, dst)
    monkeypatch.undo()
    done = json.loads((dst / engine.MANIFEST_NAME).read_text())["done"]
    assert looks_unfinished(dst) and 1 <= len(done)
    return sorted(done)


# ---------------------------------------------------------------------------------------------------------------
# Config values: a ValueError naming the key, never an AttributeError / ZeroDivisionError, never a silent NaN


def text_config(**changes):
    cfg = tiny_text_config_dict()
    for key, value in changes.items():
        if key.startswith("lac_"):
            cfg["linear_attn_config"][key[4:]] = value
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("cfg, key", [
    pytest.param(text_config(linear_attn_config="kda"), "linear_attn_config", id="cfg-linear-attn-config-str"),
    pytest.param(text_config(num_key_value_heads=0), "num_key_value_heads", id="cfg-num-key-value-heads-zero"),
    pytest.param(text_config(moe_layer_freq=0), "moe_layer_freq", id="cfg-moe-layer-freq-zero"),
    pytest.param(text_config(rms_norm_eps=math.nan), "rms_norm_eps", id="cfg-rms-norm-eps-nan"),
    pytest.param(text_config(rms_norm_eps=-1e-5), "rms_norm_eps", id="cfg-rms-norm-eps-negative"),
    pytest.param(text_config(mla_rms_norm_eps=0.0), "mla_rms_norm_eps", id="cfg-mla-rms-norm-eps-zero"),
    pytest.param(text_config(routed_scaling_factor=math.inf), "routed_scaling_factor",
                 id="cfg-routed-scaling-factor-inf"),
    pytest.param(text_config(activation_situ_beta=math.nan), "activation_situ_beta", id="cfg-situ-beta-nan"),
    pytest.param(text_config(max_position_embeddings=0), "max_position_embeddings",
                 id="cfg-max-position-embeddings-zero"),
    pytest.param(text_config(hidden_size=64.0), "hidden_size", id="cfg-hidden-size-float"),
    pytest.param(text_config(num_hidden_layers=0), "num_hidden_layers", id="cfg-num-hidden-layers-zero"),
    pytest.param(text_config(lac_gate_lower_bound=math.nan), "linear_attn_config.gate_lower_bound",
                 id="cfg-gate-lower-bound-nan"),
    pytest.param(text_config(lac_kda_layers="123"), "linear_attn_config.kda_layers", id="cfg-kda-layers-str"),
    pytest.param(text_config(lac_num_heads=0), "linear_attn_config.num_heads", id="cfg-linear-num-heads-zero"),
])
def test_bad_text_config_values_name_the_key(cfg, key):
    with pytest.raises(ValueError, match=rf"key `{key}`: must be "):
        KimiK3TextConfig(**cfg)


@pytest.mark.parametrize("change, key", [
    pytest.param(lambda c: c.__setitem__("text_config", [1, 2]), "text_config", id="cfg-text-config-list"),
    pytest.param(lambda c: c.__setitem__("vision_config", "moonvit"), "vision_config", id="cfg-vision-config-str"),
    pytest.param(lambda c: c["text_config"].__setitem__("num_key_value_heads", 0), "text_config.num_key_value_heads",
                 id="cfg-nested-key-named"),
])
def test_bad_composite_config_values_name_the_key(change, key):
    cfg = released_config_dict()
    change(cfg)
    with pytest.raises(ValueError, match=rf"key `{key}`"):
        KimiK3Config(**cfg)


def test_the_release_and_the_presets_still_pass():
    KimiK3Config(**released_config_dict())
    KimiK3TextConfig(**kimi_linear_style_text_config_dict())
    for layers in (1, 2, 5, 8):
        assert len(KimiK3TextConfig(**tiny_text_config_dict(num_hidden_layers=layers)).layer_types) == layers


# ---------------------------------------------------------------------------------------------------------------
# Source config.json / index: a ConversionError naming the file (and key), before anything is written


def set_in_config(path, key, value):
    cfg = json.loads(path.read_text())
    cfg["text_config"][key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("name, damage, fragments", [
    pytest.param("config.json", lambda p: p.write_bytes(b'{"text_config": "\xff\xfe"}'), ["not UTF-8"],
                 id="config-not-utf8"),
    pytest.param("config.json", lambda p: p.write_text("[1, 2]"), ["JSON object", "list"], id="config-not-object"),
    pytest.param("config.json", lambda p: set_in_config(p, "moe_layer_freq", 0),
                 ["text_config.moe_layer_freq", "positive integer"], id="config-moe-layer-freq-zero"),
    pytest.param("config.json", lambda p: set_in_config(p, "rms_norm_eps", "1e-5"),
                 ["text_config.rms_norm_eps", "finite positive number"], id="config-rms-norm-eps-str"),
    pytest.param(INDEX, lambda p: p.write_bytes(b'{"weight_map": {"a": "\xc3\x28"}}'), ["not UTF-8"],
                 id="index-not-utf8"),
    pytest.param(INDEX, lambda p: p.write_text('{"weight_map": '), ["not valid JSON"], id="index-not-json"),
    pytest.param(INDEX, lambda p: p.write_text("[]"), ["weight_map"], id="index-not-object"),
    pytest.param(INDEX, lambda p: p.write_text('{"weight_map": ["model.safetensors"]}'), ["weight_map"],
                 id="index-weight-map-list"),
    pytest.param(INDEX, lambda p: p.write_text('{"weight_map": {"lm_head.weight": 3}}'),
                 ["lm_head.weight", "strings", "3"], id="index-weight-map-value-int"),
    pytest.param("config.json", lambda p: p.write_text("[" * 100_000 + "]" * 100_000), ["nested too deeply"],
                 id="config-deeply-nested"),
    pytest.param("config.json", lambda p: p.write_text(p.read_text()[:-1].rstrip() + ', "text_config": {}}'),
                 ["the key `text_config` appears twice"], id="config-duplicate-key"),
    pytest.param(INDEX, lambda p: p.write_text('{"weight_map": {"lm_head.weight": "a.safetensors", '
                                               '"lm_head.weight": "b.safetensors"}}'),
                 ["the key `lm_head.weight` appears twice"], id="index-duplicate-tensor"),
    pytest.param(INDEX, lambda p: p.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                 ["nested too deeply"], id="index-deeply-nested"),
])
def test_bad_source_files_are_named(release, tmp_path, name, damage, fragments):
    src = tmp_path / "src"
    src.mkdir()
    for keep in ("config.json", INDEX):  # both are read before any shard
        shutil.copy(release.path / keep, src / keep)
    damage(src / name)
    with pytest.raises(ConversionError) as info:
        convert(src, tmp_path / "out")
    message = str(info.value)
    assert str(src / name) in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert not (tmp_path / "out").exists()


def convert_error_or_hang(src, dst, seconds: float = 60) -> str | None:
    """The ConversionError message of convert(src, dst), run in a thread so that a hang fails the test after
    `seconds` instead of stopping the suite (a FIFO blocks a reader; a config of 10^9 layers never finished)."""
    outcome = {}

    def run():
        try:
            convert(src, dst)
        except ConversionError as exc:
            outcome["error"] = str(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "convert hangs"
    return outcome.get("error")


@pytest.mark.parametrize("count, fragments", [
    pytest.param(10**9, ["`text_config.num_hidden_layers` = 1,000,000,000",
                         "layers 0..3 (4 layer(s)), none of layer 4"],
                 id="num-hidden-layers-huge"),
    pytest.param(5, ["`text_config.num_hidden_layers` = 5", "none of layer 4"], id="num-hidden-layers-one-more"),
])
def test_a_layer_count_the_tensors_do_not_have_is_refused_at_once(release, tmp_path, count, fragments):
    """Checked on the raw config.json against the index: building a config of 10^9 layers never finished."""
    src = tmp_path / "src"
    shutil.copytree(release.path, src)
    set_in_config(src / "config.json", "num_hidden_layers", count)
    error = convert_error_or_hang(src, tmp_path / "out")
    assert error is not None and error.startswith(f"{src / 'config.json'}: key "), error
    for fragment in fragments + [str(src / INDEX)]:
        assert fragment in error, error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", [
    pytest.param("LICENSE", id="side-file-symlink-out"),
    pytest.param("config.json", id="config-symlink-out"),
    pytest.param(INDEX, id="index-symlink-out"),
])
def test_a_source_file_linked_out_of_the_folder_is_refused(release, tmp_path, name):
    """Its contents would come from elsewhere (a side file was copied into the output as it was)."""
    src = tmp_path / "k3"
    shutil.copytree(release.path, src)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(src / name, outside / name)
    (src / name).symlink_to(outside / name)
    with pytest.raises(ConversionError, match=re.escape(f"{src / name}: is a symlink to {outside / name}, outside "
                                                        f"the folder {src}")):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, kind", [
    pytest.param("config.json", "config.json", id="config-is-fifo"),
    pytest.param(INDEX, INDEX, id="index-is-fifo"),
    pytest.param("generation_config.json", "generation_config.json", id="generation-config-is-fifo"),
    pytest.param("tokenizer_config.json", "tokenizer_config.json", id="side-file-is-fifo"),
])
def test_a_source_file_that_is_a_fifo_is_refused_without_waiting(release, tmp_path, name, kind):
    """Reading a FIFO waits for a writer forever: the file is opened non-blocking and refused (the test gives up
    after 60 s)."""
    src = tmp_path / "k3"
    shutil.copytree(release.path, src)
    (src / name).unlink()
    os.mkfifo(src / name)
    error = convert_error_or_hang(src, tmp_path / "out")
    assert error == f"{src / name}: is a FIFO, not a {kind} file (a regular file)"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command, src", [
    pytest.param("convert", "./k3-missing", id="convert-src-missing-dot-path"),
    pytest.param("convert", "data/k3/v1", id="convert-src-missing-nested-path"),
    pytest.param("convert", "models/k3", id="convert-src-missing-under-local-folder"),
    pytest.param("convert", "C:\\models\\k3", id="convert-src-missing-windows-path"),
    pytest.param("verify", "models/k3", id="verify-src-missing-path"),
    pytest.param("export", "./k3-missing", id="export-src-missing-path"),
])
def test_a_missing_local_source_is_not_looked_up_on_the_hub(reference, tmp_path, monkeypatch, capsys, command, src):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()

    def no_hub(*args, **kwargs):
        raise AssertionError("a Hub lookup was tried")

    monkeypatch.setattr(converter, "_hub_checkpoint", no_hub)
    second = str(reference) if command == "verify" else str(tmp_path / "out")
    assert getattr(kc, f"run_{command}")([src, second]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kimik3 {command}: error: {src}: no such folder"), err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# Command-line arguments: `kimik3 <cmd>: error: ...`, exit code 2, no traceback, nothing written


@pytest.mark.parametrize("args, fragment", [
    pytest.param(["--threads", "-1"], "argument --threads: -1 must be at least 1", id="threads-negative"),
    pytest.param(["--threads", "two"], "argument --threads: 'two' is not a whole number", id="threads-not-a-number"),
    pytest.param(["--num-layers", "0"], "argument --num-layers: 0 must be at least 1", id="num-layers-zero"),
    pytest.param(["--num-experts", "-2"], "argument --num-experts: -2 must be at least 1", id="num-experts-negative"),
    pytest.param(["--max-shard-size", "0"], "cannot read size '0' as a positive size", id="max-shard-size-zero"),
    pytest.param(["--threads", "1000000000"], "--threads 1000000000: at most 1024", id="threads-huge"),
])
def test_bad_cli_arguments_exit_two(release, tmp_path, capsys, args, fragment):
    dst = tmp_path / "out"
    assert kc.run_convert([str(release.path), str(dst), "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert "kimik3 convert: error: " in err and fragment in err and "Traceback" not in err, err
    assert not dst.exists()


@pytest.mark.parametrize("args, fragment", [
    pytest.param(["--layers", "0"], "argument --layers: 0 must be at least 1", id="tiny-layers-zero"),
])
def test_tiny_bad_arguments_exit_two_in_a_real_process(tmp_path, args, fragment):
    """The one subprocess: the console entry's exit code and stderr, as a shell sees them."""
    result = subprocess.run([sys.executable, "-m", "kimik3.cli", "tiny", str(tmp_path / "t"), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"kimik3 tiny: error: {fragment}" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "t").exists()


def test_a_usage_error_answers_before_torch_or_transformers_is_imported(tmp_path):
    """Building the command's parser (every subcommand's flags, `serve`'s and `chat`'s choices included) imports
    neither, so a bad argument or --help answers at once."""
    code = ("import runpy, sys\n"
            "sys.argv = ['kimik3', 'tiny', sys.argv[1], '--layers', '0']\n"
            "try:\n"
            "    runpy.run_module('kimik3.cli', run_name='__main__')\n"
            "except SystemExit as exit:\n"
            "    print(exit.code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t")], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["2", "[]"], result.stdout + result.stderr


@pytest.mark.parametrize("setup, overwrite, fragment", [
    pytest.param(lambda d: (d / "notes.txt").write_text("mine"), False, "not empty; pass --overwrite",
                 id="tiny-not-empty"),
    pytest.param(lambda d: (d / "model-00001-of-00002.safetensors").write_bytes(b"x"), True,
                 "model-00001-of-00002.safetensors", id="tiny-overwrite-foreign-model-files"),
])
def test_tiny_refuses_folders_it_would_mix_into(tmp_path, capsys, setup, overwrite, fragment):
    folder = tmp_path / "t"
    folder.mkdir()
    setup(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert kimik3_main(["tiny", str(folder)] + (["--overwrite"] if overwrite else [])) == 2
    err = capsys.readouterr().err
    assert f"kimik3 tiny: error: {folder}" in err and fragment in err, err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_tiny_overwrites_a_folder_it_wrote(tmp_path, capsys):
    """Its own files (the card, custom_generate/ and the code included) are no foreign model files: a second
    `kimik3 tiny --overwrite` replaces them, a user's notes stay."""
    folder = tmp_path / "t"
    assert kimik3_main(["tiny", str(folder)]) == 0
    (folder / "notes.txt").write_text("mine")
    assert kimik3_main(["tiny", str(folder), "--overwrite"]) == 0, capsys.readouterr().err
    assert (folder / "custom_generate" / "generate.py").is_file() and (folder / "notes.txt").read_text() == "mine"


def write_config_file(folder, name, text):
    (folder / name).write_text(text)
    return str(folder / name)


MEMORY = "kimik3 memory: error: argument"
DEMO = "kimik3 demo: error: argument"


@pytest.mark.parametrize("args, fragment", [
    pytest.param(["memory", "--tokens", "abc"], f"{MEMORY} --tokens: 'abc' is not a whole number",
                 id="memory-tokens-not-a-number"),
    pytest.param(["memory", "--tokens", "131072,0"], f"{MEMORY} --tokens: 0 must be at least 1",
                 id="memory-tokens-zero"),
    pytest.param(["memory", "--batch", "0"], f"{MEMORY} --batch: 0 must be at least 1", id="memory-batch-zero"),
    pytest.param(["memory", "--config", "{tmp}/absent.json"], MEMORY + " --config: {tmp}/absent.json: no such file",
                 id="memory-config-missing"),
    pytest.param(["memory", "--config", "{tmp}"], MEMORY + " --config: {tmp}: is a folder", id="memory-config-folder"),
    pytest.param(["memory", "--config", "{not_json}"], MEMORY + " --config: {not_json}: cannot be read as JSON",
                 id="memory-config-not-json"),
    pytest.param(["memory", "--config", "{list}"], MEMORY + " --config: {list}: must hold a JSON object, not a list",
                 id="memory-config-not-object"),
    pytest.param(["memory", "--config", "{bad_value}"],
                 MEMORY + " --config: {bad_value}: Kimi K3 config, key `num_key_value_heads`: must be",
                 id="memory-config-bad-value"),
    pytest.param(["demo", "--new-tokens", "0"], f"{DEMO} --new-tokens: 0 must be at least 1",
                 id="demo-new-tokens-zero"),
    pytest.param(["demo", "--new-tokens", "abc"], f"{DEMO} --new-tokens: 'abc' is not a whole number",
                 id="demo-new-tokens-not-a-number"),
])
def test_memory_and_demo_bad_arguments_exit_two(tmp_path, capsys, args, fragment):
    names = {
        "tmp": str(tmp_path),
        "not_json": write_config_file(tmp_path, "not_json.json", '{"hidden_size": '),
        "list": write_config_file(tmp_path, "list.json", "[1, 2]"),
        "bad_value": write_config_file(tmp_path, "bad_value.json", json.dumps(text_config(num_key_value_heads=0))),
    }
    assert kimik3_main([arg.format(**names) for arg in args]) == 2
    captured = capsys.readouterr()
    assert fragment.format(**names) in captured.err and "Traceback" not in captured.err, captured.err
    assert captured.out == ""  # refused before any work


# ---------------------------------------------------------------------------------------------------------------
# Runs and destination folders


def lock_held(release, reference, tmp_path, monkeypatch, capsys):
    """A second conversion into a folder another one is writing is refused, naming the folder; the first is intact."""
    dst = tmp_path / "out"
    with engine.destination_lock(dst):
        with pytest.raises(ConversionError, match="another kimik3 conversion is writing into this folder") as info:
            convert(release.path, dst)
        assert str(dst) in str(info.value)
        assert [p.name for p in dst.iterdir()] == [engine.LOCK_NAME]
    assert not dst.exists()  # the holder created it and left it empty: removed
    convert(release.path, dst)
    assert contents(dst) == contents(reference)


def lock_file_left_by_kill(release, reference, tmp_path, monkeypatch, capsys):
    """A lock file nobody holds (what a kill -9 leaves) does not block, and is gone after the run."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / engine.LOCK_NAME).write_text("")
    convert(release.path, dst)
    assert not (dst / engine.LOCK_NAME).exists() and contents(dst) == contents(reference)


def src_changed_same_size(release, reference, tmp_path, monkeypatch, capsys):
    """A source shard rewritten with other values but the same size, header and mtime: the resume refuses to mix."""
    src = tmp_path / "k3"
    shutil.copytree(release.path, src)
    dst = tmp_path / "out"
    interrupted_run(src, dst, monkeypatch)
    shard = src / "model-00001-of-000007.safetensors"
    stat = shard.stat()
    tensors = load_file(str(shard))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = -tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shard.stat().st_size == stat.st_size and shard.stat().st_mtime_ns == stat.st_mtime_ns
    with pytest.raises(ConversionError, match="made from a different version of ") as info:
        convert(src, dst)
    assert str(shard) in str(info.value)
    assert str(dst) in str(info.value) and "--overwrite" in str(info.value)
    assert looks_unfinished(dst)
    convert(src, dst, overwrite=True)
    assert read_tensor(dst, name).equal(-read_tensor(reference, name))  # rebuilt from the new source


def read_tensor(folder, name):
    shard = json.loads((folder / INDEX).read_text())["weight_map"][name]
    return load_file(str(folder / shard))[name]


def src_spelled_differently(release, reference, tmp_path, monkeypatch, capsys):
    """`k3/` (trailing slash), `k3` relative to the working folder and the absolute path are one run."""
    dst = tmp_path / "out"
    done = interrupted_run(str(release.path) + "/", dst, monkeypatch)
    monkeypatch.chdir(release.path.parent)
    summary = convert(release.path.name, dst)
    assert sorted(summary["skipped"]) == done and summary["written"]
    # the same bytes, apart from the provenance and card, which quote SRC as it was typed
    quoted = ("README.md", "kimik3_conversion.json")
    assert {n: b for n, b in contents(dst).items() if n not in quoted} == {
        n: b for n, b in contents(reference).items() if n not in quoted}
    assert convert(str(release.path.resolve()), dst)["already_done"]


def rerun_finished_noop(release, reference, tmp_path, monkeypatch, capsys):
    """Re-running a finished conversion writes nothing and says so (exit code 0)."""
    dst = tmp_path / "out"
    shutil.copytree(reference, dst)
    stamps = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    summary = convert(release.path, dst)
    assert summary["already_done"] and summary["written"] == [] and len(summary["skipped"]) == summary["shards"]
    assert kc.run_convert([str(release.path), str(dst), "--max-shard-size", SHARD, "--quiet"]) == 0
    assert "already holds this result" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == stamps


def finished_with_other_options(release, reference, tmp_path, monkeypatch, capsys):
    """A finished conversion with other options is not replaced without --overwrite."""
    dst = tmp_path / "out"
    shutil.copytree(reference, dst)
    with pytest.raises(ConversionError, match="holds a finished conversion with different inputs or options"):
        convert(release.path, dst, num_experts=2)
    assert contents(dst) == contents(reference)


def overwrite_replaces_previous_model(release, reference, tmp_path, monkeypatch, capsys):
    """--overwrite removes every file of the previous model (here ten shards become one), keeps the user's file,
    and says it kept it."""
    dst = tmp_path / "out"
    shutil.copytree(reference, dst)
    (dst / "notes.txt").write_text("mine")
    summary = kc.convert(release.path, dst, max_shard_size="10MB", num_experts=2, overwrite=True, progress=False)
    assert summary["kept"] == ["notes.txt"] and (dst / "notes.txt").read_text() == "mine"
    weight_map = json.loads((dst / INDEX).read_text())["weight_map"]
    assert {p.name for p in dst.glob("*.safetensors")} == set(weight_map.values()) == {
        "model-00001-of-00001.safetensors"}
    record = json.loads((dst / engine.RECORD_NAME).read_text())
    assert {str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()} == set(record["files"]) | {
        "notes.txt", engine.RECORD_NAME}


def overwrite_foreign_model_files(release, reference, tmp_path, monkeypatch, capsys):
    """--overwrite never deletes model files kimik3 did not write: it names them and touches nothing."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    (dst / "pytorch_model.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ConversionError, match="config.json, pytorch_model.bin; delete or move them yourself"):
        convert(release.path, dst, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "pytorch_model.bin"]


def dst_not_empty(release, reference, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="the folder is not empty; pass --overwrite"):
        convert(release.path, dst)
    assert [p.name for p in dst.iterdir()] == ["notes.txt"]


def dst_is_a_file(release, reference, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "out"
    dst.write_text("x")
    with pytest.raises(ConversionError, match="exists and is not a folder"):
        convert(release.path, dst)


def dst_inside_src(release, reference, tmp_path, monkeypatch, capsys):
    """DST inside SRC (also reached through a symlink to it): the source folder is only read, so the run is refused
    before anything is created; convert and export alike."""
    src = tmp_path / "k3"
    shutil.copytree(release.path, src)
    (tmp_path / "link").symlink_to(src)
    for dst in (src / "out", tmp_path / "link" / "nested" / "out"):
        with pytest.raises(ConversionError, match=re.escape(f"{dst}: the destination is inside the source folder ")):
            convert(src, dst)
    with pytest.raises(ConversionError, match=re.escape(f"{reference / 'sub'}: the destination is inside the "
                                                        "source folder")):
        kc.export(reference, reference / "sub", progress=False)
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in release.path.iterdir())
    assert not (reference / "sub").exists()


def dst_symlink_to_elsewhere(release, reference, tmp_path, monkeypatch, capsys):
    """DST a symlink to an empty folder elsewhere: the user named it, so the conversion is written there."""
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    convert(release.path, tmp_path / "out")
    assert contents(tmp_path / "real").keys() == contents(reference).keys()
    assert contents(tmp_path / "real")[INDEX] == contents(reference)[INDEX]


def single_file_beside_index(release, reference, tmp_path, monkeypatch, capsys):
    """model.safetensors next to the index (from_pretrained would read it and ignore the index): refused naming
    SRC before any shard is read."""
    src = tmp_path / "k3"
    src.mkdir()
    for keep in ("config.json", INDEX):
        shutil.copy(release.path / keep, src / keep)
    (src / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(ConversionError, match=re.escape(f"{src}: holds both model.safetensors and {INDEX}: two "
                                                        "sources for the weights")):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def disk_full_upfront(release, reference, tmp_path, monkeypatch, capsys):
    """Too little free space is found before the first byte, naming the folder and the bytes needed."""
    dst = tmp_path / "out"
    monkeypatch.setattr(engine.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ConversionError, match=r"not enough free disk space: the shards still to write need [\d,]+ "
                                              r"bytes, 1,000 are free") as info:
        convert(release.path, dst)
    assert str(dst) in str(info.value) and not dst.exists()


def disk_full_mid_run(release, reference, tmp_path, monkeypatch, capsys):
    """ENOSPC while writing names the file and the bytes still needed; the same command then resumes."""
    dst = tmp_path / "out"
    fail_after_tensors(monkeypatch, 30, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(ConversionError, match=r"model-000\d\d-of-00010.safetensors: No space left on device while "
                                              r"writing; about [\d,]+ more bytes are needed") as info:
        convert(release.path, dst)
    assert "run the same command again: it resumes" in str(info.value)
    assert looks_unfinished(dst) and not list(dst.glob(".*.partial"))
    monkeypatch.undo()
    summary = convert(release.path, dst)
    assert summary["skipped"] and contents(dst) == contents(reference)


class ShortWritesThenFull(io.FileIO):
    """A file on a disk with `room` bytes left, as the kernel reports it: a write is cut short at the limit, the next
    one fails with ENOSPC; so the buffered tail of a shard fails again when the file is closed."""

    room = 0

    def write(self, data):
        left = self.room - self.tell()
        if left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(memoryview(data).cast("B")[:left])


def disk_full_in_the_last_bytes(release, reference, tmp_path, monkeypatch, capsys):
    """ENOSPC in the buffered last bytes of the first shard (the close that follows fails the same way): no
    `.partial` stays (one did), and the same command resumes to the same bytes."""
    dst = tmp_path / "out"
    first = sorted(reference.glob("model-*.safetensors"))[0]
    monkeypatch.setattr(ShortWritesThenFull, "room", first.stat().st_size - 2000)
    monkeypatch.setattr(sio, "open", lambda path, mode: io.BufferedWriter(ShortWritesThenFull(path, mode)),
                        raising=False)
    with pytest.raises(ConversionError, match=re.escape(f"{dst / first.name}: No space left on device while "
                                                        "writing")):
        convert(release.path, dst)
    assert looks_unfinished(dst) and not list(dst.glob(".*.partial")), sorted(p.name for p in dst.iterdir())
    monkeypatch.undo()
    convert(release.path, dst)
    assert contents(dst) == contents(reference)


def file_size_limit(release, reference, tmp_path, monkeypatch, capsys):
    """A real RLIMIT_FSIZE below the first shard's size (Python ignores SIGXFSZ, so the write fails with EFBIG): the
    error names the file (it named none), no `.partial` stays, and the same command resumes to the same bytes."""
    dst = tmp_path / "out"
    first = sorted(reference.glob("model-*.safetensors"))[0]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (first.stat().st_size - 2000, hard))
    try:
        with pytest.raises(ConversionError, match=re.escape(f"{dst / first.name}: File too large while writing: the "
                                                            "process's file-size limit (`ulimit -f`)")):
            convert(release.path, dst)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert looks_unfinished(dst) and not list(dst.glob(".*.partial"))
    convert(release.path, dst)
    assert contents(dst) == contents(reference)


def ctrl_c_during_convert(release, reference, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of a shard: one line on stderr (it was a KeyboardInterrupt traceback), exit 130, no
    `.partial`, and the same command resumes after the finished shards to the same bytes."""
    dst = tmp_path / "out"
    args = [str(release.path), str(dst), "--max-shard-size", SHARD, "--quiet"]
    fail_after_tensors(monkeypatch, 25, KeyboardInterrupt())
    assert kc.run_convert(args) == 130
    err = capsys.readouterr().err
    assert err == "kimik3 convert: interrupted; run the same command again to resume after the finished shards\n"
    assert looks_unfinished(dst) and not list(dst.glob(".*.partial"))
    done = json.loads((dst / engine.MANIFEST_NAME).read_text())["done"]
    monkeypatch.undo()
    assert kc.run_convert(args) == 0 and done
    assert contents(dst) == contents(reference)


def threads_negative_api(release, reference, tmp_path, monkeypatch, capsys):
    with pytest.raises(ConversionError, match="--threads -1: must be a whole number >= 1"):
        convert(release.path, tmp_path / "out", threads=-1)
    assert not (tmp_path / "out").exists()


RUN_CASES = [
    pytest.param(lock_held, id="lock-held"),
    pytest.param(lock_file_left_by_kill, id="lock-file-left-by-kill"),
    pytest.param(src_changed_same_size, id="src-changed-same-size"),
    pytest.param(src_spelled_differently, id="src-spelled-differently"),
    pytest.param(rerun_finished_noop, id="rerun-finished-noop"),
    pytest.param(finished_with_other_options, id="finished-other-options"),
    pytest.param(overwrite_replaces_previous_model, id="overwrite-replaces-previous-model"),
    pytest.param(overwrite_foreign_model_files, id="overwrite-foreign-model-files"),
    pytest.param(dst_not_empty, id="dst-not-empty"),
    pytest.param(dst_is_a_file, id="dst-is-a-file"),
    pytest.param(disk_full_upfront, id="disk-full-upfront"),
    pytest.param(disk_full_mid_run, id="disk-full-mid-run"),
    pytest.param(threads_negative_api, id="threads-negative-api"),
    pytest.param(disk_full_in_the_last_bytes, id="disk-full-in-the-last-bytes"),
    pytest.param(file_size_limit, id="file-size-limit"),
    pytest.param(ctrl_c_during_convert, id="ctrl-c-exit-130-resumes"),
    pytest.param(dst_inside_src, id="dst-inside-src"),
    pytest.param(dst_symlink_to_elsewhere, id="dst-symlink-to-elsewhere-accepted"),
    pytest.param(single_file_beside_index, id="src-single-file-beside-index"),
]


@pytest.mark.parametrize("scenario", RUN_CASES)
def test_runs_and_destination_folders(scenario, release, reference, tmp_path, monkeypatch, capsys):
    """Each scenario above asserts its own outcome (the error and its wording, what is or is not left in the
    destination); this only runs them with the shared fixtures."""
    scenario(release, reference, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("make, fragment", [
    pytest.param(lambda t: (t / "loop").symlink_to(t / "loop") or t / "loop",
                 "the destination is a symlink loop (it never resolves to a folder)", id="dst-symlink-loop"),
    pytest.param(lambda t: str(t / "o\x00x"), "the destination path holds a NUL byte", id="dst-nul-byte"),
    pytest.param(lambda t: "", "the destination is an empty path: name a folder", id="dst-empty-path"),
])
def test_a_destination_path_the_os_cannot_use_is_named(release, tmp_path, capsys, make, fragment):
    """A symlink loop was a RuntimeError traceback, a NUL byte a ValueError; an empty DST was the working folder."""
    dst = make(tmp_path)
    assert kc.run_convert([str(release.path), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "kimik3 convert: error: " in err and fragment in err and "Traceback" not in err, err


@pytest.mark.parametrize("layers", [pytest.param("1000000000", id="tiny-layers-huge")])
def test_tiny_refuses_more_layers_than_a_config_may_have_at_once(tmp_path, capsys, layers):
    """The layer schedule of 10^9 layers was laid out before the config's bound was checked: it never finished."""
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(rc=kimik3_main(["tiny", str(tmp_path / "t"), "--layers",
                                                                            layers])), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "kimik3 tiny hangs"
    assert outcome["rc"] == 2
    assert f"kimik3 tiny: error: --layers {layers}: at most 4096" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
