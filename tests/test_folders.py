"""Every model folder the project writes tokenizes and processes: `kimik3 tiny` (text, and `--vision` with a tower),
and a fine-tune's outputs (the LoRA adapter folder and its `merged/` model, examples/finetune_tiny.py) load with
AutoTokenizer and AutoProcessor (trust_remote_code) and run a chat turn; the vision folder runs an image through its
processor and tower. (A converted release: tests/test_convert_roundtrip.py.)"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512 + 256  # kimik3.tiny.TINY_NUM_RANKS ranks + the reserved specials


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    from kimik3.tiny import write_tiny_folder

    root = tmp_path_factory.mktemp("tiny")
    write_tiny_folder(root / "text", num_hidden_layers=2)
    write_tiny_folder(root / "vision", num_hidden_layers=2, vision=True)
    return root


@pytest.fixture(scope="module")
def lora_output(tiny_folders, tmp_path_factory):
    """One LoRA step of the example on the tiny folder, saved: the adapter in OUTPUT, the merged model in merged/."""
    pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location("finetune_tiny", ROOT / "examples" / "finetune_tiny.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    output = tmp_path_factory.mktemp("finetune") / "out"
    example.train(str(tiny_folders / "text"), steps=1, lora=True, output=str(output), quiet=True)
    return output


def _folder(kind, tiny_folders, request) -> Path:
    if kind.startswith("lora"):
        output = request.getfixturevalue("lora_output")
        return output / "merged" if kind == "lora-merged" else output
    return tiny_folders / kind.removeprefix("tiny-")


@pytest.mark.parametrize("kind", ["tiny-text", "lora-adapter", "lora-merged"])  # tiny --vision: below
def test_each_folder_loads_its_tokenizer_and_processor(kind, tiny_folders, request):
    folder = _folder(kind, tiny_folders, request)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    processor = transformers.AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    assert type(tokenizer).__name__ == "KimiK3TokenizerFast" and len(tokenizer) == VOCAB
    assert type(processor).__name__ == "KimiK3Processor"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Which river is longest?"}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert "Which river is longest?" in tokenizer.decode(ids)
    if kind == "lora-adapter":  # no model weights here: the adapter names its base
        assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    else:  # the vocabulary the weights were trained on
        config = json.loads((folder / "config.json").read_text())
        assert config["vocab_size"] == VOCAB and config["eos_token_id"] == tokenizer.eos_token_id


def test_tiny_vision_folder_runs_an_image_through_processor_and_tower(tiny_folders):
    from PIL import Image

    folder = tiny_folders / "vision"
    processor = transformers.AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert type(tokenizer).__name__ == "KimiK3TokenizerFast" and len(tokenizer) == len(processor.tokenizer) == VOCAB
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "KimiK3ForConditionalGeneration" and model.vision_tower is not None
    assert model.config.media_placeholder_token_id == processor.tokenizer.convert_tokens_to_ids("<|media_pad|>")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    assert inputs["pixel_values"].shape[0] == 4 * 6  # 60x40 -> 84x56 pixels: 4x6 patches of 14
    with torch.no_grad():
        with_image = model(**inputs).logits[0, -1]
        inputs["pixel_values"] = inputs["pixel_values"] + 1
        other_image = model(**inputs).logits[0, -1]
    assert torch.isfinite(with_image).all() and not torch.equal(with_image, other_image)  # the tower is used
    # the text model is build_tiny_model's (same weights), its A_log at the live length like every folder of ours
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        heads = model.config.get_text_config().linear_num_heads
        assert handle.get_slice("language_model.model.layers.0.self_attn.A_log").get_shape() == [heads]
