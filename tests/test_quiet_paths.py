"""The normal paths say nothing but their own output: no Python warning and no logged warning from the demo, loading,
generate() and a short fine-tune (full with checkpointing, and LoRA) on the tiny model, on whichever transformers 5.x
is installed. (Deprecated names, the release's max_length clashing with max_new_tokens, export's per-tensor notes
were such warnings.)"""

import contextlib
import importlib.util
import logging
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def no_warnings():
    """Fails if anything inside warns (warnings module, or a logger at WARNING or above: transformers' own loggers do
    not propagate to the root, so both are watched)."""
    handler = _Collect()
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    said = [f"{w.category.__name__}: {w.message}" for w in caught]
    said += [f"log {r.name}: {r.getMessage()}" for r in handler.records]
    assert not said, "\n".join(said)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("finetune_tiny", ROOT / "examples" / "finetune_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, example):
    return example.write_tiny_model(tmp_path_factory.mktemp("quiet") / "model")


def test_demo_is_quiet_and_names_no_vanished_path():
    from kimik3.demo import run_demo

    lines = []
    with no_warnings():
        assert run_demo(new_tokens=2, say=lines.append)
    assert len(lines) == 8 and not any("/tmp" in line or "\\" in line for line in lines)


def test_load_and_generate_are_quiet(tiny_dir):
    from transformers import AutoModelForCausalLM

    with no_warnings():
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, trust_remote_code=True, dtype=torch.float32)
        out = model.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5)


@pytest.mark.parametrize("lora", [False, True], ids=["full+checkpointing", "lora+checkpointing"])
def test_short_fine_tune_is_quiet(example, tiny_dir, tmp_path, lora):
    with no_warnings():
        result, _ = example.train(tiny_dir, steps=1, lora=lora, checkpointing=True, balancing=True, quiet=True,
                                  output=str(tmp_path / "out"))
    assert result["steps"] == 1
    if lora:  # the adapter names the base model folder, which still exists
        import json

        config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
        assert Path(config["base_model_name_or_path"]).is_dir()


def test_lora_without_peft_says_what_to_install(example, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now fails as on a machine without it
    with pytest.raises(SystemExit) as exited:
        example.require_peft()
    assert 'pip install -e ".[train]"' in str(exited.value.code)


def test_export_of_an_f32_folder_reports_its_casts_in_one_line(tiny_dir, tmp_path):
    from safetensors import safe_open

    from kimik3.convert.exporter import export

    release_f32 = ("A_log", "dt_bias", "conv1d", "o_norm", "e_score_correction_bias")
    with safe_open(str(Path(tiny_dir) / "model.safetensors"), "pt") as f:
        # F32 tensors the release stores as BF16 (the routed experts are re-quantised, not cast)
        cast = [name for name in f.keys() if f.get_slice(name).get_dtype() == "F32" and ".experts." not in name
                and not any(part in name for part in release_f32)]
    summary = export(tiny_dir, tmp_path / "release", progress=False)
    casts = [note for note in summary["notes"] if "cast from" in note]
    assert len(cast) > 2 and len(casts) == 1
    assert casts[0].startswith(f"{len(cast)} tensor(s) cast from F32 to the release's BF16: `")
    assert casts[0].endswith(f" and {len(cast) - 2} more") and set(casts[0].split("`")[1::2]) <= set(cast)


def test_release_folder_loads_and_generates_quietly(tmp_path):
    """The release layout as it is on disk (its generation_config.json sets max_length to the context length, its
    config.json names the model type `kimi_k3`): loading it directly and generate(max_new_tokens=...) say nothing, and
    the loader's own options do not end up in the generation config."""
    from transformers import logging as hf_logging

    from kimik3.convert import testing
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration

    release = testing.write_release_checkpoint(tmp_path / "release", num_layers=2, num_experts=4, vision=False,
                                               return_dense=False)
    assert '"max_length"' in (release.path / "generation_config.json").read_text()
    hf_logging.disable_progress_bar()
    try:
        with no_warnings():
            model = KimiK3ForConditionalGeneration.from_pretrained(release.path, dtype=torch.float32)
            out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    finally:
        hf_logging.enable_progress_bar()
    assert out.shape == (1, 6)
    saved = model.generation_config.to_dict()
    assert "vision" not in saved and "experts_format" not in saved
