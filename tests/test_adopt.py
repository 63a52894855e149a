"""`kimik3 adopt` (convert/adopt.py): a folder of kilobytes whose shards are links into the release folder loads
through the Auto classes (in this process and in a fresh one) with logits equal to the converted folder's, in both
expert formats and from a Hub snapshot; the release folder is never written; the links' one way out
(files_kimi_k3.check_inside, docs/bad_inputs.md "Loading a folder") refuses everything but the release its record
names."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import kimik3.convert as kc
from kimik3.cli import main
from kimik3.convert import adopt as adopt_module
from kimik3.convert import testing
from kimik3.convert.adopt import adopt
from kimik3.modeling.files_kimi_k3 import ADOPTION_RECORD_NAME, KimiK3LoadError
from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration
from kimik3.modeling.saving_kimi_k3 import COMPOSITE_AUTO_MAP
from test_bad_inputs_loading import hub_cache_snapshot

FORMATS = ("dense", "mxfp4")
IDS = [[5, 17, 42, 99, 3, 250, 7, 64]]


def tree_state(folder: Path) -> dict:
    """Every entry under `folder`: its kind, mtime and (files) the sha256 of its bytes, links not followed."""
    state = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        digest = os.readlink(path) if kind == "link" else hashlib.sha256(path.read_bytes()).hexdigest() \
            if kind == "file" else None
        state[str(path.relative_to(folder))] = (kind, info.st_mtime_ns, digest)
    return state


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    fixture = testing.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=5, num_layers=2,
                                               num_experts=4)
    return fixture.path, tree_state(fixture.path)


@pytest.fixture(scope="module")
def adopted(release):
    path = release[0]
    root = path.parent.parent / "adopted"
    root.mkdir()
    # the default format through the command, mxfp4 through the library
    assert main(["adopt", str(path), str(root / "dense")]) == 0
    adopt(path, root / "mxfp4", experts_format="mxfp4")
    return {fmt: root / fmt for fmt in FORMATS}


def logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(IDS)).logits


@pytest.fixture(scope="module")
def converted_logits(release, tmp_path_factory):
    """`kimik3 convert` of the same release, loaded through AutoModelForCausalLM: the reference."""
    root, out = tmp_path_factory.mktemp("converted"), {}
    for fmt in FORMATS:
        kc.convert(release[0], root / fmt, progress=False, experts_format=fmt)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(root / fmt), trust_remote_code=True,
                                                                  dtype=torch.float32)
        out[fmt] = logits(model)
    return out


def regular_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if not p.is_symlink() and p.is_file())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_adopted_folder_is_kilobytes_of_ours_and_links_to_the_release(release, adopted, fmt):
    path, folder = release[0], adopted[fmt]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    record = json.loads((folder / ADOPTION_RECORD_NAME).read_text())
    assert record["release"] == str(path.resolve()) and record["experts_format"] == fmt
    for name in {"model.safetensors.index.json", *index["weight_map"].values()}:
        assert (folder / name).is_symlink() and os.readlink(folder / name) == str(path.resolve() / name), name
        assert name in record["links"]
    assert regular_bytes(folder) < 1_000_000  # ~500 kB, most of it our code files
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == COMPOSITE_AUTO_MAP and config["text_config"]["experts_format"] == fmt
    # the weights on disk are the release's: the config keeps its quantization_config (the loader hides it)
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    # our code, not the release's files of the same names; the release's tokenizer config rewritten, its vocab linked
    for name in ("modeling_kimi_k3.py", "configuration_kimi_k3.py", "tokenizer_config.json", "config.json"):
        assert not (folder / name).is_symlink() and (folder / name).read_bytes() != (path / name).read_bytes(), name
    assert (folder / "tiktoken.model").is_symlink()
    assert not list(folder.parent.glob(".*adopting*"))  # no temporary sibling left


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_adopted_folder_loads_like_the_converted_one(adopted, converted_logits, fmt):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(adopted[fmt]), trust_remote_code=True,
                                                              dtype=torch.float32)
    assert type(model).__module__.startswith("transformers_modules")  # the folder's code
    assert model.generate.func.__module__.endswith("custom_generate.generate")  # and its decode loop
    packed = [n for n, _ in model.named_buffers() if n.endswith("gate_up_proj_packed")] + \
        [n for n, _ in model.named_parameters() if n.endswith("gate_up_proj_packed")]
    assert bool(packed) == (fmt == "mxfp4")
    assert torch.equal(logits(model), converted_logits[fmt])


def test_tokenizer_processor_base_model_and_pipeline(adopted):
    folder = str(adopted["mxfp4"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert type(tokenizer).__name__ == "KimiK3TokenizerFast" and tokenizer.decode(tokenizer("hello world")
                                                                                  ["input_ids"]) == "hello world"
    processor = transformers.AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    assert type(processor).__name__ == "KimiK3Processor"
    base = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(base).__name__ == "KimiK3MultimodalModel"
    generator = transformers.pipeline("text-generation", model=folder, trust_remote_code=True, dtype=torch.float32)
    out = generator("hello", max_new_tokens=2, do_sample=False, return_full_text=False)
    assert isinstance(out[0]["generated_text"], str)


def test_a_hub_snapshot_as_the_release(release, converted_logits, tmp_path):
    snapshot = hub_cache_snapshot(release[0], tmp_path / "cache")
    out = tmp_path / "adopted"
    adopt(snapshot, out, experts_format="mxfp4")
    shard = json.loads((release[0] / "model.safetensors.index.json").read_text())["weight_map"]
    shard = next(iter(shard.values()))
    assert os.readlink(out / shard) == str(snapshot / shard)  # the snapshot's name, not its blob
    model = KimiK3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    assert torch.equal(logits(model), converted_logits["mxfp4"])


FRESH = """
import json, sys, torch
sys.modules["kimik3"] = None  # the installed package is not there: the folder's flat files must be enough
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
with torch.no_grad():
    print(json.dumps(model(input_ids=torch.tensor(json.loads(sys.argv[2]))).logits.tolist()))
"""


def test_a_fresh_process_loads_the_adopted_folder(adopted, converted_logits, fresh_python):
    returncode, stdout, error = fresh_python(FRESH, str(adopted["mxfp4"]), json.dumps(IDS))
    assert returncode == 0, error
    assert torch.equal(torch.tensor(json.loads(stdout.strip().splitlines()[-1])), converted_logits["mxfp4"])


# --- refusals ------------------------------------------------------------------------------------------------------


def _record(folder: Path, **changes) -> None:
    path = folder / ADOPTION_RECORD_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _a_shard(folder: Path) -> str:
    return next(n for n in json.loads((folder / ADOPTION_RECORD_NAME).read_text())["links"]
                if n.endswith(".safetensors"))


def link_elsewhere(release, folder, tmp):
    shard = _a_shard(folder)
    (tmp / "elsewhere").mkdir()
    shutil.copy(release / shard, tmp / "elsewhere" / shard)
    (folder / shard).unlink()
    (folder / shard).symlink_to(tmp / "elsewhere" / shard)
    return rf"{shard}: is a symlink to .*elsewhere.*outside the folder"


def link_not_listed(release, folder, tmp):
    shard = _a_shard(folder)
    links = json.loads((folder / ADOPTION_RECORD_NAME).read_text())["links"]
    _record(folder, links=[n for n in links if n != shard])
    return rf"{shard}: is a symlink to .*, outside the folder"


def record_names_other_folder(release, folder, tmp):
    shutil.copytree(release, tmp / "other")  # a real release folder, but not the one the links reach
    _record(folder, release=str((tmp / "other").resolve()))
    return r"is a symlink to .*k3.*, outside the folder"


def record_is_symlink(release, folder, tmp):
    record = folder / ADOPTION_RECORD_NAME
    record.rename(folder / "record.json")
    record.symlink_to("record.json")  # even one that stays inside
    return rf"{ADOPTION_RECORD_NAME}: is a symlink: the record"


def record_dotdot(release, folder, tmp):
    _record(folder, release=f"{release.parent}/x/../{release.name}")
    return r"key `release` = .*/x/\.\./.*absolute path without `\.\.`"


def record_release_missing(release, folder, tmp):
    _record(folder, release=str(tmp / "gone"))
    return r"names the release folder .*gone, which is missing"


def release_shard_missing(release, folder, tmp):
    shard = _a_shard(folder)
    (release / shard).unlink()
    return rf"{shard}: links to .*{shard}, which is missing: the release folder .* lacks it"


@pytest.mark.parametrize("damage", [
    pytest.param(link_elsewhere, id="adopt-link-elsewhere"),
    pytest.param(link_not_listed, id="adopt-link-not-listed"),
    pytest.param(record_names_other_folder, id="adopt-record-names-other-folder"),
    pytest.param(record_is_symlink, id="adopt-record-symlink"),
    pytest.param(record_dotdot, id="adopt-record-dotdot"),
    pytest.param(record_release_missing, id="adopt-record-release-missing"),
    pytest.param(release_shard_missing, id="adopt-release-shard-missing"),
])
def test_the_links_reach_only_the_release_the_record_names(release, tmp_path, damage):
    copy, folder = tmp_path / "k3", tmp_path / "adopted"
    shutil.copytree(release[0], copy)  # a release of its own, which a case may damage
    adopt(copy, folder)
    match = damage(copy, folder, tmp_path)
    with pytest.raises(KimiK3LoadError, match=match):
        KimiK3ForConditionalGeneration.from_pretrained(folder)


def _interrupt_the_third_link(monkeypatch, dst: Path) -> list:
    """os.symlink in adopt raises at its third call (a Ctrl-C, say); returns what DST was at that moment."""
    seen, symlink = [], os.symlink

    def failing(target, link, *args, **kwargs):
        if len(seen) == 2:
            seen.append((dst.exists(), Path(link).parent.name))
            raise KeyboardInterrupt
        seen.append(None)
        return symlink(target, link, *args, **kwargs)

    monkeypatch.setattr(adopt_module.os, "symlink", failing)
    return seen


@pytest.mark.parametrize("case", [
    pytest.param("dst-not-empty", id="adopt-dst-not-empty"),
    pytest.param("dst-inside-release", id="adopt-dst-inside-release"),
    pytest.param("source-adopted", id="adopt-source-adopted"),
    pytest.param("interrupted", id="adopt-interrupted"),
])
def test_adopt_refuses_before_writing_and_leaves_nothing_half_written(release, adopted, tmp_path, monkeypatch,
                                                                      capsys, case):
    path, dst = release[0], tmp_path / "out"
    if case == "dst-not-empty":
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
        assert main(["adopt", str(path), str(dst)]) == 2
        assert "exists and is not an empty folder" in capsys.readouterr().err
        assert [p.name for p in dst.iterdir()] == ["notes.txt"]
        return
    if case == "interrupted":
        seen = _interrupt_the_third_link(monkeypatch, dst)
        with pytest.raises(KeyboardInterrupt):
            adopt(path, dst)
        # while it was written the folder did not have DST's name (a kill there leaves no DST that looks finished)
        exists, writing_into = seen[-1]
        assert not exists and writing_into.startswith(".out.adopting-")
        assert not dst.exists() and list(tmp_path.iterdir()) == []  # and the temporary sibling is removed
        return
    src, dst, match = {
        "dst-inside-release": (path, path / "adopted", "the destination is inside the release folder"),
        "source-adopted": (adopted["dense"], dst, r"is an adopted folder itself; adopt the release folder"),
    }[case]
    with pytest.raises(kc.ConversionError, match=match):
        adopt(src, dst)
    assert not dst.exists()


def test_the_release_folder_is_never_written(release, adopted, converted_logits):
    """After every adoption and load above (this file's last test): the release's entries, bytes and mtimes are as
    written."""
    path, before = release
    assert tree_state(path) == before


def _replace_with_another_release_shard(release, tmp_path):
    """The first shard replaced by the same-named shard of a release of other widths (other shapes: other header)."""
    other = testing.write_release_checkpoint(tmp_path / "other", seed=9, num_layers=2, num_experts=8).path
    name = next(p.name for p in sorted(release.glob("*.safetensors"))  # the shard holding the experts
                if (other / p.name).is_file() and (other / p.name).stat().st_size != p.stat().st_size)
    os.replace(other / name, release / name)
    return name


def _same_header_other_values(release, tmp_path):
    """The first shard rewritten with the same header and other tensor values (a restored or re-made copy)."""
    name = sorted(p.name for p in release.glob("*.safetensors"))[0]
    data = bytearray((release / name).read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end:] = bytes(len(data) - header_end)  # every value zero, same bytes count
    (release / (name + ".new")).write_bytes(bytes(data))
    os.replace(release / (name + ".new"), release / name)
    return name


@pytest.mark.parametrize("change, outcome", [
    pytest.param(_replace_with_another_release_shard, "refused", id="adopt-release-shard-replaced"),
    pytest.param(_same_header_other_values, "warned", id="adopt-release-shard-rewritten-same-header"),
])
def test_a_release_changed_after_adoption_is_named_at_load(release, tmp_path, change, outcome):
    """Through AutoModelForCausalLM with trust_remote_code, as users load an adopted folder: the record's fingerprints
    (size, safetensors header digest, modification time of each linked file) are checked against the release."""
    copy = tmp_path / "k3"
    shutil.copytree(release[0], copy)
    adopt(copy, tmp_path / "adopted")
    record = json.loads((tmp_path / "adopted" / ADOPTION_RECORD_NAME).read_text())
    assert set(record["fingerprints"]) == set(record["links"])
    name = change(copy, tmp_path)
    if outcome == "refused":
        with pytest.raises(ValueError, match=f"{name}: changed since `kimik3 adopt` wrote .*: its size was") as error:
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adopted", trust_remote_code=True)
        assert type(error.value).__name__ == "KimiK3LoadError" and "Adopt the release again" in str(error.value)
    else:
        with pytest.warns(UserWarning, match=rf"the release files \['{name}'\] were modified after adoption"):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adopted", trust_remote_code=True)


def test_an_unchanged_release_loads_without_a_word_about_it(adopted, recwarn):
    transformers.AutoModelForCausalLM.from_pretrained(adopted["dense"], trust_remote_code=True)
    assert not [w for w in recwarn if "after adoption" in str(w.message)]
