"""The remote-code path: a saved folder loads with trust_remote_code in a fresh process, from flat files only."""

import json
import subprocess
import sys

import torch

from kimik3.cli import main
from kimik3.configuration import released_config_dict, tiny_text_config_dict
from kimik3.memory import load_text_config, memory_table
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
from kimik3.remote_code import save_with_code
from kimik3.tiny import build_tiny_model, tiny_tokenizer_overrides

FRESH = """
import json, sys, torch
sys.modules["kimik3"] = None  # the installed package is not there: the folder's flat files must be enough
from transformers import AutoConfig, AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(ids).logits
    gen = model.generate(ids, max_new_tokens=4, do_sample=False)
print(json.dumps({"module": type(model).__module__, "cls": type(model).__name__,
                  "logits": logits[0, -1, :8].tolist(), "gen": gen.tolist()}))
"""


def _fresh_process(directory, ids):
    result = subprocess.run([sys.executable, "-c", FRESH, str(directory), json.dumps(ids.tolist())],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tiny_folder_round_trips_in_a_fresh_process(tmp_path):
    assert main(["tiny", str(tmp_path), "--layers", "4", "--seed", "5"]) == 0
    files = {p.name for p in tmp_path.iterdir()}
    assert {"configuration_kimi_k3.py", "modeling_kimi_k3.py", "cache_kimi_k3.py", "ops_kimi_k3.py",
            "config.json", "model.safetensors"} <= files
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k3.KimiK3ForCausalLM"
    ids = torch.randint(3, 128, (1, 7))
    result = _fresh_process(tmp_path, ids)
    assert result["module"].startswith("transformers_modules.") and result["cls"] == "KimiK3ForCausalLM"
    model = build_tiny_model(num_hidden_layers=4, seed=5, **tiny_tokenizer_overrides())
    with torch.no_grad():
        expected = model(ids).logits[0, -1, :8]
        expected_gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(torch.tensor(result["logits"]), expected, atol=1e-5, rtol=1e-5)
    assert result["gen"] == expected_gen.tolist()


def test_composite_release_style_config_resolves_to_our_classes(tmp_path):
    """A folder whose config.json is the release's top-level schema (auto_map names included) runs our code."""
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForConditionalGeneration

    release = released_config_dict()
    release["text_config"] = {**release["text_config"], **tiny_text_config_dict(num_hidden_layers=4)}
    release["text_config"].pop("quantization_config")
    config = KimiK3Config(**release)
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(config).eval()
    save_with_code(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k3.KimiK3ForConditionalGeneration"
    assert saved["auto_map"]["AutoConfig"] == "configuration_kimi_k3.KimiK3Config"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.1.mlp.experts.gate_up_proj" in names
    assert "language_model.lm_head.weight" in names
    ids = torch.randint(3, 128, (1, 6))
    result = _fresh_process(tmp_path, ids)
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
