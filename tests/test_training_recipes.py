"""The three recipes of docs/training.md ("Recipes: PEFT LoRA, TRL SFT, lm-eval") run as written, in one fresh
interpreter, in a folder holding `kimik3 tiny k3-tiny`; then what they wrote is checked: the LoRA adapter and its
merged model (loaded back through the Auto classes: equal to the base with the adapter), the TRL fine-tune (trained),
and lm-eval's loglikelihoods and accuracy against the same scores computed here from the merged model."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
# the recipes import TRL and lm-eval in their own interpreter: here only their presence is needed (importing them
# would cost this worker seconds)
for _package in ("trl", "lm_eval"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed (the test and train extras install it)", allow_module_level=True)
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kimik3.tiny import write_tiny_folder  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def recipe_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    recipes = [b for b in blocks if b.startswith("# Recipe ")]
    assert [b.split(":")[0] for b in recipes] == ["# Recipe 1", "# Recipe 2", "# Recipe 3"]
    return recipes


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    work = tmp_path_factory.mktemp("recipes")
    write_tiny_folder(work / "k3-tiny")
    # offline, as CI is: the recipes must not need the Hub
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    script = "\n\n".join(recipe_blocks())
    done = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return work, done.stdout


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def _logged_losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"'loss': '?([0-9.]+)", stdout)]


def test_lora_recipe_saves_an_adapter_whose_merge_loads_as_the_adapted_model(ran):
    work, stdout = ran
    saved = load_file(work / "lora-adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved) and any(".mlp.experts." in k for k in saved)
    ids = torch.tensor([[5, 300, 17, 42, 99, 7, 250, 12]])
    with torch.no_grad():
        adapted_model = PeftModel.from_pretrained(_load(work / "k3-tiny"), work / "lora-adapter").eval()
        adapted = adapted_model(ids).logits
        with adapted_model.disable_adapter():
            base = adapted_model(ids).logits
        merged = _load(work / "lora-merged")(ids).logits
    effect = float((adapted - base).abs().max())
    assert effect > 1e-2  # the adapter was trained away from zero
    # merging moves the adapter into the weights, so fp32 rounds differently (W x + B A x against (W + B A) x through
    # every layer): measured 1e-5 to 3e-5 on logits of size ~1 depending on the CPU. A wrong merge (scale, transpose,
    # a module left out) misses by a share of the adapter's whole effect, so the bound is a thousandth of that effect
    assert float((merged - adapted).abs().max()) < 1e-3 * effect
    assert len(_logged_losses(stdout)) >= 8 + 4 and all(math.isfinite(x) for x in _logged_losses(stdout))


def test_trl_recipe_fine_tunes_a_model_that_loads_back(ran):
    work, _ = ran
    tuned = _load(work / "sft-model").state_dict()
    base = _load(work / "k3-tiny").state_dict()
    assert tuned.keys() == base.keys()
    assert any(not torch.equal(tuned[k], base[k]) for k in base)
    assert (work / "sft-model" / "chat_template.jinja").exists() or "chat_template" in json.loads(
        (work / "sft-model" / "tokenizer_config.json").read_text())


def test_lm_eval_recipe_scores_equal_the_merged_models_own(ran):
    """lm-eval's per-choice loglikelihoods (batch 4, its own padding) equal the sum of the merged model's log
    probabilities of each choice's tokens after the question, as lm-eval splits context and continuation; its accuracy
    is the argmax's."""
    work, _ = ran
    samples = json.loads((work / "eval-samples.json").read_text())
    assert len(samples) == 3
    model = _load(work / "lora-merged")
    tokenizer = AutoTokenizer.from_pretrained(work / "lora-merged", trust_remote_code=True)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        theirs = [float(str(r[0]).strip("()[]'\" ").split(",")[0]) for r in sample["filtered_resps"]]
        mine = []
        for choice in doc["choices"]:
            context = tokenizer(doc["question"], add_special_tokens=False)["input_ids"]
            whole = tokenizer(doc["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            continuation = whole[len(context):]
            with torch.no_grad():
                logits = model(torch.tensor([whole[:-1]])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)[len(context) - 1:]
            mine.append(float(logprobs[torch.arange(len(continuation)), torch.tensor(continuation)].sum()))
        assert mine == pytest.approx(theirs, abs=1e-4), doc
        correct += int(max(range(len(mine)), key=mine.__getitem__) == doc["answer"])
        assert float(sample["acc"]) == float(max(range(len(mine)), key=mine.__getitem__) == doc["answer"])
    printed = re.search(r"'acc,none': ([0-9.]+)", ran[1])
    assert printed and float(printed[1]) == pytest.approx(correct / 3)
