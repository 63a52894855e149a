"""The remote-code path: a saved folder loads with trust_remote_code in a fresh process, from flat files only."""

import json

import pytest
import torch

from kimik3.chat_format import encode_chat
from kimik3.cli import main
from kimik3.configuration import released_config_dict, tiny_text_config_dict
from kimik3.convert.testing import TINY_VISION
from kimik3.memory import load_text_config, memory_table
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
from kimik3.remote_code import save_with_code
from kimik3.modeling.tokenization_kimi_k3 import KimiK3Tokenizer
from kimik3.tiny import TINY_NUM_RANKS, build_tiny_model, tiny_tokenizer_overrides

FRESH = """
import json, os, sys, torch
sys.modules["kimik3"] = None  # the installed package is not there: the folder's flat files must be enough
from transformers import AutoModelForCausalLM, AutoTokenizer
results = []
for directory, ids in json.loads(sys.argv[1]):
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    ids = torch.tensor(ids)
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    result = {"module": type(model).__module__, "cls": type(model).__name__,
              "logits": logits[0, -1, :8].tolist(), "gen": gen.tolist()}
    if os.path.exists(os.path.join(directory, "tokenizer_config.json")):
        tok = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
        chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                       return_dict=True, return_tensors="pt")["input_ids"]
        reply = model.generate(chat, max_new_tokens=2, do_sample=False)
        result["tokenizer"] = {"module": type(tok).__module__, "len": len(tok), "chat_ids": chat[0].tolist(),
                               "new_tokens": reply.shape[1] - chat.shape[1], "vocab": model.config.vocab_size}
    results.append(result)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The `kimik3 tiny` folder (model + tokenizer) and a folder whose config.json has the release's top-level schema
    (auto_map names included), with the in-process models to compare against."""
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration

    tiny = tmp_path_factory.mktemp("tiny_remote")
    assert main(["tiny", str(tiny), "--layers", "4", "--seed", "5"]) == 0
    release = released_config_dict()
    release["text_config"] = {**release["text_config"], **tiny_text_config_dict(num_hidden_layers=4)}
    release["text_config"].pop("quantization_config")
    # the vision tower at the converter fixture's sizes, its keys the release's: at the release's sizes (~450M
    # parameters) building, saving and loading it in the fresh process was most of this file's time
    release["vision_config"].update(TINY_VISION, text_hidden_size=release["text_config"]["hidden_size"])
    # the release's token ids (163584...) lie outside the tiny vocabulary (128), which the config refuses
    small_ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    release["text_config"].update(small_ids)
    release.update(small_ids, media_placeholder_token_id=100)
    torch.manual_seed(0)
    composite_model = KimiK3ForConditionalGeneration(KimiK3Config(**release)).eval()
    composite = tmp_path_factory.mktemp("composite_remote")
    save_with_code(composite_model, composite)
    tiny_model = build_tiny_model(num_hidden_layers=4, seed=5, **tiny_tokenizer_overrides())
    return {"tiny": (tiny, tiny_model, torch.randint(3, 128, (1, 7))),
            "composite": (composite, composite_model, torch.randint(3, 128, (1, 6)))}


@pytest.fixture(scope="module")
def fresh(folders, fresh_python):
    """The fresh process (conftest's `fresh_python`: kimik3 never imported) loads every folder with
    trust_remote_code."""
    jobs = [[str(directory), ids.tolist()] for directory, _, ids in folders.values()]
    returncode, stdout, error = fresh_python(FRESH, json.dumps(jobs))
    assert returncode == 0, error
    return dict(zip(folders, json.loads(stdout.strip().splitlines()[-1])))


def test_tiny_folder_round_trips_in_a_fresh_process(folders, fresh):
    directory, model, ids = folders["tiny"]
    files = {p.name for p in directory.iterdir()}
    assert {"configuration_kimi_k3.py", "modeling_kimi_k3.py", "cache_kimi_k3.py", "ops_kimi_k3.py",
            "config.json", "model.safetensors"} <= files
    config = json.loads((directory / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k3.KimiK3ForCausalLM"
    result = fresh["tiny"]
    assert result["module"].startswith("transformers_modules.") and result["cls"] == "KimiK3ForCausalLM"
    with torch.no_grad():
        expected = model(ids).logits[0, -1, :8]
        expected_gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(torch.tensor(result["logits"]), expected, atol=1e-5, rtol=1e-5)
    assert result["gen"] == expected_gen.tolist()


def test_tiny_folder_tokenizer_and_chat_template_in_a_fresh_process(folders, fresh):
    directory = folders["tiny"][0]
    tokenizer = KimiK3Tokenizer.from_pretrained(directory)
    result = fresh["tiny"]["tokenizer"]
    assert result["module"].startswith("transformers_modules.")
    assert result["vocab"] == result["len"] == TINY_NUM_RANKS + 256
    assert result["chat_ids"] == encode_chat(tokenizer, [{"role": "user", "content": "Hi"}],
                                             add_generation_prompt=True)
    assert result["new_tokens"] >= 1


def test_composite_release_style_config_resolves_to_our_classes(folders, fresh):
    directory, model, ids = folders["composite"]
    saved = json.loads((directory / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForCausalLM"] == "multimodal_kimi_k3.KimiK3ForConditionalGeneration"
    assert saved["auto_map"]["AutoConfig"] == "configuration_kimi_k3.KimiK3Config"
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.1.mlp.experts.gate_up_proj" in names
    assert "language_model.lm_head.weight" in names
    result = fresh["composite"]
    assert result["cls"] == "KimiK3ForConditionalGeneration"
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(result["logits"]), model(ids).logits[0, -1, :8], atol=1e-5,
                                   rtol=1e-5)


def test_memory_table_at_release_size(capsys):
    rows = memory_table(load_text_config(None), (131072, 1048576))
    for row in rows:
        assert row["official_expanded_kv"] / row["k3_mla_kv"] == 96 * (192 + 128) / 576  # 53.3x
        assert row["all_mla_latent"] == row["k3_mla_kv"] * 93 // 24
    assert rows[0]["k3_kda_state"] == rows[1]["k3_kda_state"] and rows[1]["k3_mla_kv"] == 8 * rows[0]["k3_mla_kv"]
    assert main(["memory"]) == 0
    out = capsys.readouterr().out
    assert "69 KDA, 24 MLA" in out and "1048576" in out


def test_demo_runs_and_cache_matches_analytic(capsys):
    assert main(["demo", "--new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "trust_remote_code" in out and "MISMATCH" not in out and out.count(" ok") == 4


def test_every_file_of_a_folder_gets_the_mode_of_a_normal_file_write(folders, tmp_path):
    """safetensors writes its files 0600 and shutil.copy2 would carry the installed code's mode: `kimik3 tiny` and
    save_pretrained leave every file with the mode `open(path, "w")` gives (0666 less the umask)."""
    import os

    from kimik3.modeling.saving_kimi_k3 import normal_file_mode

    tiny = folders["tiny"][0]
    modes = {p.name: p.stat().st_mode & 0o777 for p in tiny.rglob("*") if p.is_file()}  # custom_generate/ too
    assert set(modes.values()) == {normal_file_mode()}, modes
    before = os.umask(0o002)
    try:
        assert normal_file_mode() == 0o664
        save_with_code(folders["tiny"][1], tmp_path)
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.rglob("*") if p.is_file()}  # custom_generate/ too
    assert modes["model.safetensors"] == 0o664 and set(modes.values()) == {0o664}, modes
