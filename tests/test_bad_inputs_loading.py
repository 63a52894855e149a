"""Loading a folder with from_pretrained: which files a folder may name (docs/bad_inputs.md, "Loading a folder").

Every refusal here happens in files_kimi_k3.check_pretrained_folder, before transformers reads a file; each damaged
folder would load (from the wrong place) or fail with another message without it, so each case checks the message."""

import json
import os
import re
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import kimik3.convert as kc
from kimik3.convert import testing
from kimik3.modeling import files_kimi_k3 as ck
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM
from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration

INDEX = "model.safetensors.index.json"
Q = "language_model.model.layers.0.self_attn.q_proj.weight"
K = "language_model.model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The release layout: 2 layers, 2 MXFP4 experts, no vision, 3 shards (~270 kB)."""
    return testing.write_release_checkpoint(tmp_path_factory.mktemp("release") / "k3", seed=11, num_layers=2,
                                            num_experts=2, vision=False, return_dense=False).path


@pytest.fixture(scope="module")
def pristine_converted(pristine, tmp_path_factory):
    """Our layout, in 3 shards, with our code files."""
    dst = tmp_path_factory.mktemp("converted") / "out"
    kc.convert(pristine, dst, max_shard_size="100KB", progress=False)
    return dst


@pytest.fixture
def folder(request, pristine, pristine_converted, tmp_path):
    """A fresh copy of the release (`release`) or converted (`converted`) folder at tmp/models/k3; tmp/models and
    tmp/elsewhere are outside it."""
    target = tmp_path / "models" / "k3"
    shutil.copytree(pristine if request.param == "release" else pristine_converted, target)
    (tmp_path / "elsewhere").mkdir()
    return target


def weight_map(root):
    return json.loads((root / INDEX).read_text())["weight_map"]


def set_weight_map(root, change):
    index = json.loads((root / INDEX).read_text())
    change(index["weight_map"])
    (root / INDEX).write_text(json.dumps(index))


def shard_named_elsewhere(name_of):
    """Moves the shard holding Q to a place `name_of(folder, shard)` names (the file created there, so a loader
    following the name would load it) and points the index there."""
    def damage(root):
        shard = weight_map(root)[Q]
        name, path = name_of(root, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(root / shard, path)
        set_weight_map(root, lambda wm: wm.update({t: name for t, s in wm.items() if s == shard}))
        return {}
    return damage


def moved_out(name):
    """`name` (a file of the folder) becomes a symlink to a copy of itself outside the folder."""
    def damage(root):
        target = root.parent.parent / "elsewhere" / name
        shutil.move(root / name, target)
        (root / name).symlink_to(target)
        return {}
    return damage


def make_dangling(root, name):
    (root / name).unlink()
    (root / name).symlink_to(root / "gone.safetensors")
    return {}


def set_config(change):
    def damage(root):
        config = json.loads((root / "config.json").read_text())
        change(config)
        (root / "config.json").write_text(json.dumps(config))
        return {}
    return damage


def subfolder_linked_out(root):
    """subfolder="text": a symlink to a whole model outside the folder."""
    outside = root.parent.parent / "elsewhere" / "model"
    shutil.copytree(root, outside)
    (root / "text").symlink_to(outside)
    return {"subfolder": "text"}


def second_copy_of_q(root):
    """Q also in another shard's header, with other values; the index still names the first."""
    shards = sorted(set(weight_map(root).values()))
    home = weight_map(root)[Q]
    other = next(s for s in shards if s != home)
    tensors = load_file(str(root / other))
    tensors[Q] = -load_file(str(root / home))[Q]
    save_file(tensors, str(root / other), metadata={"format": "pt"})
    return {}


def set_weight_map_text(root, change):
    """The weight_map as JSON text, edited as text (to write what json.dumps cannot, a key twice)."""
    index = json.loads((root / INDEX).read_text())
    text = change(json.dumps(index["weight_map"]))
    (root / INDEX).write_text('{"metadata": %s, "weight_map": %s}' % (json.dumps(index.get("metadata", {})), text))
    return {}


def q_named_in_another_shard(root):
    home = weight_map(root)[Q]
    other = next(s for s in sorted(set(weight_map(root).values())) if s != home)
    set_weight_map(root, lambda wm: wm.__setitem__(Q, other))
    return {}


def q_unlisted(root):
    set_weight_map(root, lambda wm: wm.pop(Q))
    return {}


def nested_json(name):
    def damage(root):
        (root / name).write_text("[" * 100_000 + "]" * 100_000)
        return {}
    return damage


def nested_header(root):
    shard = root / weight_map(root)[Q]
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    raw = ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    return {}


def overlapping_offsets(root):
    shard = root / weight_map(root)[Q]
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header[K]["data_offsets"] = list(header[Q]["data_offsets"])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    return {}


def replaced_by(make, name_of):
    """The file `name_of(folder)` replaced by what `make(path)` creates (a FIFO, a directory)."""
    def damage(root):
        path = root / name_of(root)
        path.unlink()
        make(path)
        return {}
    return damage


def single_file_beside_index(root, outside: bool):
    """model.safetensors next to the index (transformers reads it first and ignores the index): a copy of the
    first shard, in the folder or linked from outside it."""
    shard = root / sorted(set(weight_map(root).values()))[0]
    target = root.parent.parent / "elsewhere" / "model.safetensors" if outside else root / "model.safetensors"
    shutil.copyfile(shard, target)
    if outside:
        (root / "model.safetensors").symlink_to(target)
    return {}


def weights_named_by_config(root):
    """config.json's `transformers_weights` names another index of the folder, which names a shard outside it."""
    index = json.loads((root / INDEX).read_text())
    shard = index["weight_map"][Q]
    shutil.copyfile(root / shard, root.parent / "outside.safetensors")
    index["weight_map"] = {t: "../outside.safetensors" if s == shard else s for t, s in index["weight_map"].items()}
    (root / "other.safetensors.index.json").write_text(json.dumps(index))
    return set_config(lambda c: c.update(transformers_weights="other.safetensors.index.json"))(root)


def gguf_linked_out(root):
    """gguf_file="model.gguf", a plain name, but the file a symlink to one outside the folder."""
    (root.parent.parent / "elsewhere" / "model.gguf").write_bytes(b"GGUF")
    (root / "model.gguf").symlink_to(root.parent.parent / "elsewhere" / "model.gguf")
    return {"gguf_file": "model.gguf"}


def pickled_checkpoint(root, keep_safetensors: bool):
    """pytorch_model.bin (a pickle; its content does not matter, it is never opened), alone or next to the
    safetensors weights with use_safetensors=False."""
    (root / "pytorch_model.bin").write_bytes(b"not opened")
    if keep_safetensors:
        return {"use_safetensors": False}
    for shard in set(weight_map(root).values()):
        (root / shard).unlink()
    (root / INDEX).unlink()
    return {}


OUTSIDE = "is a symlink to"
REFUSED_SHARD = "refusing shard name"
LOADING_CASES = [
    pytest.param("release", shard_named_elsewhere(lambda r, s: ("../outside.safetensors",
                                                                r.parent / "outside.safetensors")),
                 [INDEX, REFUSED_SHARD, "'../outside.safetensors'"], id="load-release-shard-parent-path"),
    pytest.param("converted", shard_named_elsewhere(lambda r, s: ("../outside.safetensors",
                                                                  r.parent / "outside.safetensors")),
                 [INDEX, REFUSED_SHARD, "'../outside.safetensors'"], id="load-converted-shard-parent-path"),
    pytest.param("converted", shard_named_elsewhere(lambda r, s: (str(r.parent / "abs.safetensors"),
                                                                  r.parent / "abs.safetensors")),
                 [REFUSED_SHARD, "abs.safetensors"], id="load-shard-absolute-path"),
    pytest.param("release", shard_named_elsewhere(lambda r, s: ("..\\outside.safetensors",
                                                                r / "..\\outside.safetensors")),
                 [REFUSED_SHARD, "outside.safetensors"], id="load-shard-backslash-path"),
    pytest.param("release", shard_named_elsewhere(lambda r, s: ("C:outside.safetensors", r / "C:outside.safetensors")),
                 [REFUSED_SHARD, "'C:outside.safetensors'"], id="load-shard-windows-drive"),
    pytest.param("converted", shard_named_elsewhere(lambda r, s: ("./a/../../outside.safetensors",
                                                                  r.parent / "outside.safetensors")),
                 [REFUSED_SHARD, "./a/../../outside.safetensors"], id="load-shard-dot-slash-up"),
    pytest.param("converted", shard_named_elsewhere(lambda r, s: ("sub/" + s, r / "sub" / s)),
                 [REFUSED_SHARD, "sub/"], id="load-shard-in-subfolder"),
    pytest.param("release", shard_named_elsewhere(lambda r, s: ("model\x00.safetensors", r / "unused.safetensors")),
                 [REFUSED_SHARD, "\\x00"], id="load-shard-nul-byte"),
    pytest.param("release", lambda r: moved_out(weight_map(r)[Q])(r), [OUTSIDE, "outside the folder"],
                 id="load-shard-symlink-out"),
    pytest.param("converted", moved_out(INDEX), [INDEX, OUTSIDE], id="load-index-symlink-out"),
    pytest.param("converted", moved_out("config.json"), ["config.json", OUTSIDE], id="load-config-symlink-out"),
    pytest.param("converted", moved_out("generation_config.json"), ["generation_config.json", OUTSIDE],
                 id="load-generation-config-symlink-out"),
    pytest.param("converted", moved_out("modeling_kimi_k3.py"), ["modeling_kimi_k3.py", OUTSIDE],
                 id="load-code-file-symlink-out"),
    pytest.param("converted", subfolder_linked_out, ["text", OUTSIDE], id="load-subfolder-symlink-out"),
    pytest.param("converted", lambda r: {"subfolder": "../k3"}, ["refusing subfolder '../k3'"],
                 id="load-subfolder-parent-path"),
    pytest.param("converted", lambda r: {"variant": "../../x"}, ["refusing variant='../../x'", "plain name"],
                 id="load-variant-path"),
    pytest.param("release", lambda r: make_dangling(r, weight_map(r)[Q]), ["shard file is missing (the index names it"],
                 id="load-shard-dangling-symlink"),
    pytest.param("converted", set_config(lambda c: c["auto_map"].update(AutoConfig="../evil.KimiK3Config")),
                 ["config.json", "auto_map.AutoConfig = '../evil.KimiK3Config'", "`module.Class`"],
                 id="load-auto-map-parent-path"),
    pytest.param("release", set_config(lambda c: c["auto_map"].update(
                     AutoModel="someone/else--modeling_kimi_k3.KimiK3ForConditionalGeneration")),
                 ["auto_map.AutoModel", "names code from another Hub repo"], id="load-auto-map-other-repo"),
    pytest.param("release", second_copy_of_q, [Q, "is also in", "which the index", "must come from one shard"],
                 id="load-release-tensor-in-two-shards"),
    pytest.param("converted", second_copy_of_q, [Q, "is also in", "must come from one shard"],
                 id="load-converted-tensor-in-two-shards"),
    pytest.param("release", q_unlisted, [Q, "the index", "missing from the index"], id="load-tensor-not-in-index"),
    pytest.param("converted", q_named_in_another_shard,
                 [Q, "the index names this tensor but the shard's header lacks it", "(it is in "],
                 id="load-tensor-in-the-wrong-shard"),
    pytest.param("converted", lambda r: set_weight_map_text(r, lambda text: text.replace(
                     "{", '{"' + Q + '": "elsewhere.safetensors", ', 1)),
                 [INDEX, f"the key `{Q}` appears twice"], id="load-index-duplicate-tensor"),
    pytest.param("release", set_config(lambda c: c["text_config"].update(
                     auto_map={"AutoModel": "../modeling_kimi_linear.KimiLinearModel"})),
                 ["auto_map.AutoModel = '../modeling_kimi_linear.KimiLinearModel'"],
                 id="load-text-auto-map-parent-path"),
    pytest.param("release", nested_json("config.json"), ["config.json", "nested too deeply"],
                 id="load-config-deeply-nested"),
    pytest.param("converted", nested_json(INDEX), [INDEX, "nested too deeply"], id="load-index-deeply-nested"),
    pytest.param("release", nested_header, ["corrupted safetensors header", "nested too deeply"],
                 id="load-header-deeply-nested"),
    pytest.param("release", overlapping_offsets, ["safetensors, tensor `", "overlaps", Q, K],
                 id="load-release-overlap-offsets"),
    pytest.param("release", replaced_by(os.mkfifo, lambda r: weight_map(r)[Q]), ["is a FIFO, not a shard file"],
                 id="load-shard-is-fifo"),
    pytest.param("converted", replaced_by(os.mkfifo, lambda r: "config.json"),
                 ["config.json: is a FIFO, not a JSON file"], id="load-config-is-fifo"),
    pytest.param("converted", replaced_by(os.mkdir, lambda r: weight_map(r)[Q]), ["is a directory, not a shard file"],
                 id="load-shard-is-directory"),
    pytest.param("release", set_config(lambda c: c["text_config"].update(num_hidden_layers=10**9)),
                 ["config.json", "`text_config.num_hidden_layers` = 1,000,000,000", "layers 0..1", "none of layer 2"],
                 id="load-num-hidden-layers-huge"),
    pytest.param("converted", lambda r: single_file_beside_index(r, outside=True),
                 ["holds both model.safetensors and model.safetensors.index.json", "two sources"],
                 id="load-single-file-symlink-out-beside-index"),
    pytest.param("release", lambda r: single_file_beside_index(r, outside=False),
                 ["holds both model.safetensors and model.safetensors.index.json"],
                 id="load-single-file-beside-index"),
    pytest.param("converted", weights_named_by_config, ["other.safetensors.index.json", REFUSED_SHARD,
                                                        "'../outside.safetensors'"],
                 id="load-transformers-weights-other-index"),
    pytest.param("converted", set_config(lambda c: c.update(transformers_weights="sub/x.safetensors")),
                 ["config.json", "refusing `transformers_weights` file name 'sub/x.safetensors'"],
                 id="load-transformers-weights-path"),
    pytest.param("converted", gguf_linked_out, ["model.gguf", OUTSIDE, "outside the folder"],
                 id="load-gguf-file-symlink-out"),
    pytest.param("converted", lambda r: pickled_checkpoint(r, keep_safetensors=False),
                 ["pytorch_model.bin: a pickled checkpoint is never loaded"], id="load-pickle-only"),
    pytest.param("converted", lambda r: pickled_checkpoint(r, keep_safetensors=True),
                 ["pytorch_model.bin: a pickled checkpoint is never loaded", "use_safetensors=False"],
                 id="load-pickle-use-safetensors-false"),
]


@pytest.mark.parametrize("folder, damage, fragments", LOADING_CASES, indirect=["folder"])
def test_a_folder_naming_files_it_must_not_is_refused_before_reading(folder, damage, fragments):
    options = damage(folder)
    outcome = {}

    def load():  # a config of 10^9 layers would take hours to build, a FIFO blocks a reader: give up after 60 s
        try:
            KimiK3ForConditionalGeneration.from_pretrained(folder, **options)
        except Exception as exc:  # noqa: BLE001 - the assertion below says what it was
            outcome["error"] = exc

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "from_pretrained hangs"
    error = outcome.get("error")
    assert isinstance(error, ck.KimiK3LoadError), f"loaded, or failed otherwise: {error!r}"
    for fragment in fragments:
        assert fragment in str(error), str(error)


@pytest.mark.parametrize("folder", [pytest.param("release", id="load-base-multimodal-index-symlink-out")],
                         indirect=True)
def test_the_multimodal_base_model_checks_before_it_reads_the_index(folder, monkeypatch):
    """KimiK3MultimodalModel (what AutoModel gives for a composite folder) reads the index to decide on the vision
    tower: the folder is checked first, so an index linked out of the folder is refused before it is read."""
    from kimik3.modeling import multimodal_kimi_k3 as mk

    read = []
    real = mk._checkpoint_tensor_names
    monkeypatch.setattr(mk, "_checkpoint_tensor_names", lambda *a, **k: read.append(a) or real(*a, **k))
    moved_out(INDEX)(folder)
    with pytest.raises(ck.KimiK3LoadError, match="outside the folder"):
        mk.KimiK3MultimodalModel.from_pretrained(folder)
    assert read == []


@pytest.mark.parametrize("folder", [pytest.param("converted", id="load-auto-remote-code-shard-parent-path")],
                         indirect=True)
def test_the_remote_code_copy_checks_too(folder):
    """AutoModel with trust_remote_code runs the folder's own copy of files_kimi_k3.py: the same rule."""
    shard_named_elsewhere(lambda r, s: ("../outside.safetensors", r.parent / "outside.safetensors"))(folder)
    with pytest.raises(ValueError, match=r"refusing shard name '\.\./outside\.safetensors'") as info:
        AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True)
    assert type(info.value).__module__.startswith("transformers_modules.")  # raised by the copy, not the package


@pytest.mark.parametrize("path, make", [
    pytest.param("./k3-missing", None, id="load-missing-dot-path"),
    pytest.param("data/k3/v1", None, id="load-missing-nested-path"),
    pytest.param("models/k3-missing", "models", id="load-missing-path-under-local-folder"),
])
def test_a_missing_local_path_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, path, make):
    monkeypatch.chdir(tmp_path)
    if make:
        (tmp_path / make).mkdir()
    import huggingface_hub.file_download as download

    def no_network(*args, **kwargs):
        raise AssertionError("a Hub lookup was tried")

    monkeypatch.setattr(download, "hf_hub_download", no_network)
    for model_class in (KimiK3ForConditionalGeneration, KimiK3ForCausalLM):
        with pytest.raises(ck.KimiK3LoadError, match="^" + re.escape(f"{path}: no such folder (a local path: not "
                                                                     "looked up on the Hub")):
            model_class.from_pretrained(path)


@pytest.mark.parametrize("text, local", [
    pytest.param("moonshotai/Kimi-K3", False, id="repo-id-not-a-local-folder"),
])
def test_a_repo_id_still_goes_to_the_hub(tmp_path, monkeypatch, text, local):
    monkeypatch.chdir(tmp_path)
    assert ck.looks_like_local_path(text) is local
    (tmp_path / "moonshotai").mkdir()  # ... unless its org is a folder here
    assert ck.looks_like_local_path(text)
    for path in ("./k3", "/abs/k3", "~/k3", "a/b/c", "k3/", "a\\b", "a--b/c", "a/..", ""):
        assert ck.looks_like_local_path(path), path


def hub_cache_snapshot(source: Path, cache: Path, outside_link: str | None = None) -> Path:
    """A Hub cache of `o/n` at one revision as huggingface_hub lays it out: snapshots/<rev>/* are symlinks into
    blobs/; `outside_link` names a file linked outside the cache instead."""
    repo = cache / "models--o--n"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for path in source.iterdir():
        blob = (cache.parent / "elsewhere" / path.name) if path.name == outside_link else repo / "blobs" / path.name
        blob.parent.mkdir(exist_ok=True)
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.mark.parametrize("case", [pytest.param("blobs", id="load-hub-cache-links-into-blobs")])
def test_a_hub_cache_snapshot_links_into_its_blobs(pristine, tmp_path, case):
    snapshot = hub_cache_snapshot(pristine, tmp_path / "cache")
    by_path = KimiK3ForConditionalGeneration.from_pretrained(snapshot)
    by_id = KimiK3ForConditionalGeneration.from_pretrained("o/n", cache_dir=tmp_path / "cache", local_files_only=True)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(by_path(ids).logits, by_id(ids).logits)


@pytest.mark.parametrize("case", [pytest.param("outside", id="load-hub-cache-link-outside-blobs")])
def test_a_hub_cache_snapshot_linking_elsewhere_is_refused(pristine, tmp_path, case):
    shard = weight_map(pristine)[Q]
    hub_cache_snapshot(pristine, tmp_path / "cache", outside_link=shard)
    with pytest.raises(ck.KimiK3LoadError, match=rf"{shard}: is a symlink to .*elsewhere.*outside the folder"):
        KimiK3ForConditionalGeneration.from_pretrained("o/n", cache_dir=tmp_path / "cache", local_files_only=True)


@pytest.mark.parametrize("folder", [pytest.param("release", id="load-symlink-inside-folder")], indirect=True)
def test_a_symlink_that_stays_in_the_folder_is_fine(folder):
    shard = weight_map(folder)[Q]
    (folder / "store").mkdir()
    shutil.move(folder / shard, folder / "store" / shard)
    (folder / shard).symlink_to(Path("store") / shard)
    model = KimiK3ForConditionalGeneration.from_pretrained(folder)
    assert torch.equal(model.state_dict()["language_model.model.layers.0.self_attn.q_proj.weight"],
                       load_file(str(folder / shard))[Q])


@pytest.mark.parametrize("fmt", [pytest.param("mxfp4", id="load-text-class-release-mxfp4"),
                                 pytest.param(None, id="load-text-class-release")])
def test_the_text_class_loads_a_release_folder(pristine, fmt):
    """KimiK3ForCausalLM on the release's composite config.json: its nested text_config (was an AttributeError,
    'dict' object has no attribute 'experts_format')."""
    model = KimiK3ForCausalLM.from_pretrained(pristine, experts_format=fmt)
    assert model.config.experts_format == (fmt or "dense")
    experts = model.model.layers[1].mlp.experts
    assert hasattr(experts, "gate_up_proj_packed") == (fmt == "mxfp4")


@pytest.mark.parametrize("name", [pytest.param("tiktoken.model", id="load-tokenizer-vocab-symlink-out"),
                                  pytest.param("tokenizer_config.json", id="load-tokenizer-config-symlink-out"),
                                  pytest.param("chat_template.jinja", id="load-chat-template-symlink-out")])
def test_a_tokenizer_file_linked_out_of_the_folder_is_refused(pristine_converted, tmp_path, name):
    """Both tokenizer classes check a local folder's files before transformers reads them: a ranks file or chat
    template linked from elsewhere would be read as the folder's own."""
    from kimik3.modeling.tokenization_kimi_k3 import KimiK3Tokenizer, KimiK3TokenizerFast, TokenizerFileError

    root = tmp_path / "k3"
    root.mkdir()
    for kept in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(pristine_converted / kept, root / kept)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(root / name, tmp_path / "elsewhere" / name)
    (root / name).symlink_to(tmp_path / "elsewhere" / name)
    for cls in (KimiK3TokenizerFast, KimiK3Tokenizer):
        with pytest.raises(TokenizerFileError, match=re.escape(f"{root / name}: is a symlink to ") + ".*outside the"):
            cls.from_pretrained(root)


@pytest.mark.parametrize("folder", [pytest.param("release", id="load-shard-hardlink-accepted")], indirect=True)
def test_a_hardlinked_shard_is_a_file_of_the_folder(folder):
    """A hard link is a name in the folder like any other (making it needed write access to the folder), so a shard
    hard-linked to a file elsewhere loads; the weights are that file's, which is this file's."""
    shard = weight_map(folder)[Q]
    outside = folder.parent.parent / "elsewhere" / shard
    shutil.move(folder / shard, outside)
    os.link(outside, folder / shard)
    model = KimiK3ForConditionalGeneration.from_pretrained(folder)
    assert torch.equal(model.state_dict()[Q].float(), load_file(str(outside))[Q].float())


@pytest.mark.parametrize("name", [pytest.param("preprocessor_config.json", id="load-processor-config-symlink-out")])
def test_a_processor_file_linked_out_of_the_folder_is_refused(pristine_converted, tmp_path, name):
    """KimiK3Processor.from_pretrained (what AutoProcessor runs, in the folder's copy of the code) checks its own
    files before transformers reads them, as the tokenizer does."""
    from kimik3.modeling.processing_kimi_k3 import KimiK3Processor
    from kimik3.modeling.tokenization_kimi_k3 import TokenizerFileError

    root = tmp_path / "k3"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    shutil.copyfile(pristine_converted / name, tmp_path / "elsewhere" / name)
    (root / name).symlink_to(tmp_path / "elsewhere" / name)
    with pytest.raises(TokenizerFileError, match=re.escape(f"{root / name}: is a symlink to ") + ".*outside the"):
        KimiK3Processor.from_pretrained(root)


@pytest.fixture(scope="module")
def tiny_text_folder(tmp_path_factory):
    from kimik3.tiny import write_tiny_folder

    folder = tmp_path_factory.mktemp("auto_map") / "k3"
    write_tiny_folder(folder, num_hidden_layers=2)
    return folder


@pytest.mark.parametrize("reference, message", [
    pytest.param("{outside}/evil.Evil", "code must be named as `module.Class`, with module.py a plain file of the "
                 "folder (no path, no `..`)", id="load-auto-map-absolute-path-auto-class"),
    pytest.param("../outside/evil.Evil", "code must be named as `module.Class`", id="load-auto-map-parent-path-auto-class"),
    pytest.param("modeling_kimi_k3.NoSuchModel", "modeling_kimi_k3.py defines no `NoSuchModel`",
                 id="load-auto-map-missing-class"),
])
def test_auto_map_naming_code_outside_the_folder_is_refused_before_it_runs(tiny_text_folder, tmp_path, reference,
                                                                           message):
    """Through the Auto classes with trust_remote_code, as users load: transformers reads config.json and imports the
    model class its auto_map names. The folder's config class checks that auto_map when it reads the config, so the
    outside file is never imported (it would leave a marker)."""
    folder = tmp_path / "k3"
    shutil.copytree(tiny_text_folder, folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "ran"
    (outside / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil:\n    pass\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = reference.format(outside=outside)
    (folder / "config.json").write_text(json.dumps(config))
    # the error class of the folder's own copy of the code (transformers_modules.k3...), not the installed one
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(error.value).__name__ == "KimiK3LoadError" and "auto_map.AutoModelForCausalLM" in str(error.value)
    assert not marker.exists()
