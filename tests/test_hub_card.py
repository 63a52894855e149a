"""The model card of converted, sliced and saved folders, and save_with_card / push_with_card (with huggingface_hub's
commit operations intercepted, no network) giving folders that a fresh process loads with trust_remote_code."""

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from kimik3.convert.converter import convert
from kimik3.convert.testing import write_release_checkpoint
from kimik3.hub_card import CARD_MARKER, converted_model_card, is_kimik3_card, push_with_card, save_with_card
from kimik3.memory import load_text_config
from kimik3.remote_code import remote_code_files
from kimik3.modeling.saving_kimi_k3 import CUSTOM_GENERATE_FILE

TOKENIZER_CODE = "tokenization_kimi_k3.py"
# the model's save writes its import closure; the tokenizer's save adds its own file
CODE_FILES = {p.name for p in remote_code_files()} - {TOKENIZER_CODE}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny release-layout checkpoint (with vision tensors) converted whole, and converted sliced + text only."""
    root = tmp_path_factory.mktemp("card")
    release = write_release_checkpoint(root / "release", seed=0, num_layers=4)
    whole, sliced = root / "whole", root / "sliced"
    convert(release.path, whole, experts_format="mxfp4", progress=False)
    convert(release.path, sliced, num_layers=2, text_only=True, progress=False)
    return release, whole, sliced


def _card(directory: Path):
    text = (directory / "README.md").read_text()
    return text, ModelCard(text).data.to_dict()


def test_converted_card_metadata_and_tables_come_from_the_folder(converted):
    release, whole, sliced = converted
    text, meta = _card(whole)
    assert is_kimik3_card(text)
    config = json.loads((whole / "config.json").read_text())
    text_config = load_text_config(whole / "config.json")
    assert meta["library_name"] == "transformers" and "custom_code" in meta["tags"] and "mxfp4" in meta["tags"]
    assert meta["pipeline_tag"] == "image-text-to-text" and "vision_config" in config  # vision tensors carried
    # a local folder (not of the release's shape) names no Hub repo: no base_model, no relation; still the release's
    # license, linked
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert meta["license"] == "other" and meta["license_name"] == "kimi-k3"
    assert meta["license_link"] == "https://huggingface.co/moonshotai/Kimi-K3/blob/main/LICENSE"
    num_mla = text_config.layer_types.count("full_attention")
    dense = [str(i) for i, t in enumerate(text_config.mlp_layer_types) if t == "dense"]
    assert dense and f"| dense MLP instead of MoE | layer{'s' if len(dense) > 1 else ''} {', '.join(dense)} (width " \
        in text  # layer indices, not read as a count
    assert f"| layers | {len(text_config.layer_types)} ({len(text_config.layer_types) - num_mla} KDA, " in text
    assert f"{text_config.num_experts} routed experts, top-{text_config.num_experts_per_token}" in text
    assert f"| {text_config.max_position_embeddings:,} |" in text  # cache table ends at the folder's own context
    assert "## Conversion provenance (`kimik3_conversion.json`)" in text and str(release.path) in text
    assert "`<|end_of_msg|>` (id 163586" in text and "apply_chat_template" in text
    assert "Not measured" in text
    # the tower is implemented: the card shows the image usage and says what is not supported (video)
    assert "## Images" in text and "processor.apply_chat_template(messages" in text
    assert "video input is not supported" in text and "no vision weights" not in text
    # the card is a pure function of provenance + config (a resumed conversion writes the same bytes)
    provenance = json.loads((whole / "kimik3_conversion.json").read_text())
    assert converted_model_card(provenance, config) == text

    text, meta = _card(sliced)
    assert meta["pipeline_tag"] == "text-generation" and "base_model_relation" not in meta
    assert "sliced to 2 layers" in text and "| layers | 2 (" in text and "This is a sliced model" in text
    assert "mxfp4" not in meta["tags"]
    assert "This folder holds no vision weights: inputs are text only" in text and "## Images" not in text


@pytest.mark.parametrize("source, base", [
    pytest.param("/data/k3-small", None, id="card-base-local-absolute-path"),
    pytest.param("rel", None, id="card-base-local-relative-name"),
    pytest.param("./org/name", None, id="card-base-dot-slash-path"),
    pytest.param("someone/k3-release", "someone/k3-release", id="card-base-hub-repo-id"),
    pytest.param("/home/u/.cache/huggingface/hub/models--moonshotai--Kimi-K3/snapshots/0123abcd", "moonshotai/Kimi-K3",
                 id="card-base-hub-cache-snapshot"),
    pytest.param("/data/k3-full", "moonshotai/Kimi-K3", id="card-base-local-folder-of-the-release-shape"),
])
def test_converted_card_base_model_is_only_ever_a_hub_repo_id(converted, source, base):
    whole = converted[1]
    provenance = {**json.loads((whole / "kimik3_conversion.json").read_text()), "source": source}
    if source.endswith("k3-full"):
        provenance.update(source_num_layers=93, source_num_experts=896)
    meta = ModelCard(converted_model_card(provenance, json.loads((whole / "config.json").read_text()))).data.to_dict()
    assert meta.get("base_model") == base
    assert meta.get("base_model_relation") == ("quantized" if base else None)
    assert meta["license_link"].endswith("moonshotai/Kimi-K3/blob/main/LICENSE")


def test_save_pretrained_card_says_what_was_done_and_keeps_a_users_readme(converted, tmp_path, monkeypatch):
    """A re-save of unchanged weights is not called fine-tuned: the card compares the saved tensors with the folder
    the model came from (dtype, shape, sampled bytes) and keeps that folder's base and relation; changed weights are
    a fine-tune of that base. Here the fixture's shape stands for the release's, so the converted folder's base is
    the release."""
    import kimik3.hub_card as hub_card
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration

    monkeypatch.setattr(hub_card, "RELEASE_SHAPE", (4, 8))
    model = KimiK3ForConditionalGeneration.from_pretrained(converted[1])
    (tmp_path / "README.md").write_text("# my notes\n")
    save_with_card(model, tmp_path)
    assert (tmp_path / "README.md").read_text() == "# my notes\n"
    assert CODE_FILES <= {p.name for p in tmp_path.iterdir()}
    (tmp_path / "README.md").write_text(f"---\nlicense: mit\n---\n{CARD_MARKER}\nold card\n")
    save_with_card(model, tmp_path)
    text, meta = _card(tmp_path)
    assert "old card" not in text and "fine-tuned" not in text
    assert meta["base_model"] == "moonshotai/Kimi-K3" and meta["base_model_relation"] == "quantized"
    assert "# Kimi K3 (saved again, weights unchanged)" in text
    assert meta["pipeline_tag"] == "image-text-to-text" and "## Images" in text  # the model holds the tower

    with torch.no_grad():  # one optimizer-like in-place update of one tensor
        model.language_model.model.layers[1].self_attn.q_proj.weight.mul_(1.01)
    save_with_card(model, tmp_path / "tuned")
    text, meta = _card(tmp_path / "tuned")
    assert meta["base_model"] == "moonshotai/Kimi-K3" and meta["base_model_relation"] == "finetune"
    assert "# Kimi K3, fine-tuned" in text and "1 of its tensors differ" in text

    # saved again from the fine-tuned folder, unchanged: still a fine-tune of the release (the folder's card says so)
    save_with_card(KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "tuned"), tmp_path / "again")
    meta = _card(tmp_path / "again")[1]
    assert meta["base_model"] == "moonshotai/Kimi-K3" and meta["base_model_relation"] == "finetune"


@pytest.mark.parametrize("card_base, base", [
    pytest.param("rel", None, id="saved-card-base-local-path-dropped"),
    pytest.param("someone/k3", "someone/k3", id="saved-card-base-hub-repo-kept"),
])
def test_saved_card_base_model_from_the_sources_card_is_a_hub_repo_id(converted, tmp_path, card_base, base):
    """A folder whose card names a local path as its base (written before this rule) does not pass it on."""
    from kimik3.hub_card import saved_model_card

    source = tmp_path / "source"
    source.mkdir()
    (source / "README.md").write_text(f"---\nlicense: other\nbase_model: {card_base}\n---\n# a card\n")
    meta = ModelCard(saved_model_card(load_text_config(converted[2] / "config.json"), str(source))).data.to_dict()
    assert meta.get("base_model") == base and "base_model_relation" not in meta  # nothing to compare with
    assert meta["license"] == "other"


def _k3_tokenizer(tmp_path):
    """The K3 fast tokenizer from the installed package over a synthetic ranks file (what `kimik3 tiny` writes)."""
    from kimik3.modeling.tokenization_kimi_k3 import KimiK3TokenizerFast
    from kimik3.tokenizer_files import write_tokenizer_folder

    write_tokenizer_folder(tmp_path / "tokenizer", num_ranks=512)
    return KimiK3TokenizerFast.from_pretrained(tmp_path / "tokenizer")


@pytest.fixture
def fake_hub(monkeypatch):
    """huggingface_hub's Hub calls answered from a dict (repo -> {path: bytes}); any real HTTP request fails."""
    from huggingface_hub import HfApi, repocard
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.utils import _http

    repos, commits = {}, []

    def create_repo(self, repo_id, **kwargs):
        repos.setdefault(repo_id, {})
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            source = op.path_or_fileobj
            files[op.path_in_repo] = Path(source).read_bytes() if isinstance(source, str) else bytes(source)
        repos[repo_id].update(files)
        commits.append((repo_id, sorted(files)))
        return f"https://hub.invalid/{repo_id}/commit/{len(commits)}"

    def download(repo_id, filename, *args, local_dir=None, **kwargs):
        if filename not in repos.get(repo_id, {}):
            raise EntryNotFoundError(f"{repo_id}/{filename}")
        path = Path(monkeypatch_dir) / repo_id.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(repos[repo_id][filename])
        return str(path)

    import tempfile

    monkeypatch_dir = tempfile.mkdtemp()
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    monkeypatch.setattr(HfApi, "hf_hub_download", lambda self, repo_id, filename, **kw: download(repo_id, filename))
    monkeypatch.setattr(repocard, "hf_hub_download", download)
    _http.set_client_factory(lambda: pytest.fail("a real HTTP request was attempted"))
    yield repos, commits
    _http.set_client_factory(_http.default_client_factory)


FRESH = """
import json, sys, torch
sys.modules["kimik3"] = None  # the installed package is not there: the folders' flat files must be enough
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {}
for directory in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor(json.loads(sys.argv[1]))).logits[0, -1, :8].tolist()
    out[directory] = {"cls": type(model).__name__, "module": type(model).__module__, "logits": logits}
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2], trust_remote_code=True)
out["chat"] = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
out["ids"] = tokenizer("Hello, 世界 ok")["input_ids"]
print(json.dumps(out))
"""


def test_push_to_hub_and_remote_save_load_in_a_fresh_process(converted, fake_hub, tmp_path, fresh_python):
    from transformers import AutoModelForCausalLM

    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration

    repos, commits = fake_hub
    ids = torch.randint(3, 128, (1, 6))
    # 1. the class from the installed package, pushed with a tokenizer next to it
    model = KimiK3ForConditionalGeneration.from_pretrained(converted[1]).eval()
    push_with_card(model, "someone/k3-finetune")
    tokenizer = _k3_tokenizer(tmp_path)
    tokenizer.push_to_hub("someone/k3-finetune")
    model_files = {"config.json", "generation_config.json", "model.safetensors", "README.md"} | CODE_FILES | {
        CUSTOM_GENERATE_FILE}
    assert commits[0] == ("someone/k3-finetune", sorted(model_files))
    tokenizer_files = set(commits[1][1])
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tiktoken.model", TOKENIZER_CODE} <= \
        tokenizer_files
    pushed = repos["someone/k3-finetune"]
    assert set(pushed) == model_files | tokenizer_files
    card = pushed["README.md"].decode()  # the tokenizer's push kept the model's card
    # pushed as loaded: not a fine-tune; the converted fixture folder names no Hub repo, so no base either
    assert is_kimik3_card(card) and "base_model_relation" not in ModelCard(card).data.to_dict()
    assert "# Kimi K3 (saved again, weights unchanged)" in card and ModelCard(card).data.license_link
    config = json.loads(pushed["config.json"])
    assert config["auto_map"]["AutoModelForCausalLM"] == "multimodal_kimi_k3.KimiK3ForConditionalGeneration"
    package_code = {p.name: p.read_bytes() for p in remote_code_files()}
    assert all(pushed[name] == package_code[name] for name in CODE_FILES)
    hub_copy = tmp_path / "from-hub"
    hub_copy.mkdir()
    for name, data in pushed.items():
        (hub_copy / name).parent.mkdir(exist_ok=True)  # custom_generate/generate.py
        (hub_copy / name).write_bytes(data)

    # 2. the class from a folder's flat files (trust_remote_code), saved again
    remote = AutoModelForCausalLM.from_pretrained(converted[1], trust_remote_code=True).eval()
    assert type(remote).__module__.startswith("transformers_modules.")
    resaved = tmp_path / "resaved"
    save_with_card(remote, resaved)
    assert CODE_FILES | {"README.md", "config.json"} <= {p.name for p in resaved.iterdir()}
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == config["auto_map"]

    returncode, stdout, error = fresh_python(FRESH, json.dumps(ids.tolist()), str(hub_copy), str(resaved))
    assert returncode == 0, error
    loaded = json.loads(stdout.strip().splitlines()[-1])
    with torch.no_grad():
        expected = model(ids).logits[0, -1, :8].float()
    for directory in (hub_copy, resaved):
        entry = loaded[str(directory)]
        assert entry["cls"] == "KimiK3ForConditionalGeneration" and entry["module"].startswith("transformers_modules.")
        torch.testing.assert_close(torch.tensor(entry["logits"]), expected, atol=1e-5, rtol=1e-5)
    # the pushed tokenizer, loaded through its copied code, renders and encodes as the installed one
    assert loaded["chat"] == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert loaded["ids"] == tokenizer("Hello, 世界 ok")["input_ids"]


def test_save_pretrained_with_push_to_hub_uploads_the_complete_folder(fake_hub, tmp_path):
    # transformers' own push inside save_pretrained uploads before our code files and auto_map are written; the
    # complete folder goes up instead, to repo_id (or the folder's name), in one commit with the message given
    from kimik3.tiny import build_tiny_model

    repos, commits = fake_hub
    folder = tmp_path / "k3-pushed"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's, not the save's")  # as transformers: only what the save wrote
    build_tiny_model().save_pretrained(folder, push_to_hub=True, repo_id="someone/k3-pushed", commit_message="first")
    build_tiny_model().save_pretrained(tmp_path / "k3-by-name", push_to_hub=True)
    assert [repo for repo, _ in commits] == ["someone/k3-pushed", "k3-by-name"]
    pushed = repos["someone/k3-pushed"]
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"notes.txt"}
    assert set(pushed) == on_disk and CODE_FILES | {CUSTOM_GENERATE_FILE, "README.md", "model.safetensors"} <= on_disk
    assert all(pushed[name] == (folder / name).read_bytes() for name in on_disk)
    assert json.loads(pushed["config.json"])["auto_map"]["AutoModelForCausalLM"].endswith("KimiK3ForCausalLM")
    assert not (tmp_path / "someone").exists()  # the repo id names no folder


def test_push_keeps_a_users_card_on_the_hub(converted, fake_hub):
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    repos, _ = fake_hub
    repos["someone/k3"] = {"README.md": b"---\nlicense: mit\n---\n# written by hand\n"}
    push_with_card(KimiK3ForCausalLM.from_pretrained(converted[2]), "someone/k3", tags=["extra"])
    card = repos["someone/k3"]["README.md"].decode()
    assert "written by hand" in card and not is_kimik3_card(card) and "extra" in ModelCard(card).data.tags


def test_compare_saved_weights_tells_unchanged_changed_cast_subset_and_incomparable(tmp_path):
    from safetensors.torch import save_file

    from kimik3.hub_card import compare_saved_weights

    weights = {"a.weight": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b.bias": torch.ones(3)}

    def folder(name, tensors):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name

    source = folder("source", weights)
    middle = weights["a.weight"].clone()
    middle[32, 0] += 1  # one element in the middle sample
    cases = {
        "unchanged": folder("same", {k: v.clone() for k, v in weights.items()}),
        "changed": folder("tuned", {**weights, "a.weight": middle}),
        "cast": folder("cast", {k: v.to(torch.bfloat16) for k, v in weights.items()}),
        "subset": folder("subset", {"b.bias": weights["b.bias"]}),
    }
    for outcome, saved in cases.items():
        assert compare_saved_weights(saved, source)["outcome"] == outcome, outcome
    assert compare_saved_weights(cases["changed"], source)["changed"] == ["a.weight"]
    assert compare_saved_weights(folder("other", {"model.a.weight": weights["a.weight"]}), source) is None
    assert compare_saved_weights(source, source) is None
    assert compare_saved_weights(source, tmp_path / "absent") is None
