"""The first hour with a folder: the plain install has what `kimik3 tiny` needs, the Auto classes give what
transformers' own models give (AutoModel the base model, AutoModelForImageTextToText the composite model), and the
text-generation and image-text-to-text pipelines run on a tiny folder by name and given the objects, with no warning."""

import ast
import contextlib
import json
import logging
import sys
import warnings
from importlib.metadata import distribution
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """`kimik3 tiny`'s text folder, and a copy with a tiny composite model (vision tower on the tiny vocabulary and
    14-pixel patches) saved over the text one, with both in-process models."""
    import shutil

    from kimik3.convert import testing
    from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration
    from kimik3.modeling.tokenization_kimi_k3 import KimiK3TokenizerFast
    from kimik3.remote_code import save_with_code
    from kimik3.tiny import TINY_NUM_RANKS, write_tiny_folder
    from kimik3.tokenizer_files import special_token_ids

    root = tmp_path_factory.mktemp("auto")
    text, vision = root / "text", root / "vision"
    text_model, _ = write_tiny_folder(text, num_hidden_layers=2)
    shutil.copytree(text, vision)
    ids = special_token_ids(TINY_NUM_RANKS)
    media_pad = KimiK3TokenizerFast.from_pretrained(vision).convert_tokens_to_ids("<|media_pad|>")
    raw = testing.tiny_release_config(num_layers=2, num_experts=4, vision_overrides={"patch_size": 14},
                                      config_overrides={"vocab_size": TINY_NUM_RANKS + 256, **ids})
    raw.update(ids, media_placeholder_token_id=media_pad)
    torch.manual_seed(3)
    composite = KimiK3ForConditionalGeneration(KimiK3Config(**raw)).eval()
    composite.generation_config.update(**ids)
    save_with_code(composite, vision)
    return {"text": text, "vision": vision, "text_model": text_model, "composite": composite}


def _image(seed=0, width=28, height=28):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# What transformers 5.17's generating pipelines log for every model given generate arguments (they pass their own
# generation_config, and text-generation its max_length, beside them) and, for text-generation, for every BPE
# tokenizer (its postprocess asks for the WordPiece space clean-up); 5.24 logs none of them
TRANSFORMERS_517_PIPELINE_NOISE = ("Passing `generation_config` together with generation-related arguments",
                                   "Both `max_new_tokens` (=", "Ignoring clean_up_tokenization_spaces=True for BPE")


@contextlib.contextmanager
def no_warnings(allowed: tuple[str, ...] = ()):
    """Fails on any Python warning or any transformers log record of level WARNING or above inside the block (but
    those that start with one of `allowed`)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(handler)
    messages = [str(w.message) for w in caught] + [record.getMessage() for record in records]
    messages = [m for m in messages if not m.startswith(allowed)]
    assert not messages, messages


# ---------------------------------------------------------------------------------------------------------------
# Plain install


def _install_requires() -> set[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    requires = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    return {r.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower() for r in requires}


def test_the_plain_install_has_what_kimik3_tiny_needs():
    """`pip install -e .` (the README's install for `kimik3 tiny`/`demo`) must bring Pillow: the image processor that
    `kimik3 tiny` writes into every folder is built on transformers' image-processor classes, which transformers
    replaces by placeholders when Pillow is missing (`Received a KimiK3ImageProcessor ... but a
    ImageProcessingMixin was expected`)."""
    from transformers.utils import dummy_vision_objects

    from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor

    placeholders = [c.__name__ for c in KimiK3ImageProcessor.__mro__
                    if c.__module__.startswith("transformers.") and hasattr(dummy_vision_objects, c.__name__)]
    assert "ImageProcessingMixin" in placeholders
    import PIL

    # the distribution that installs the PIL module imported here is a requirement of the plain install
    assert Path(distribution("pillow").locate_file("PIL/__init__.py")).resolve() == Path(PIL.__file__).resolve()
    assert "pillow" in _install_requires()
    readme = (REPO / "README.md").read_text()
    assert "pip install -e . && kimik3 demo" in readme and "kimik3 tiny tiny-k3" in readme


def test_the_processor_needs_no_torchvision(folders):
    """transformers 5.17 turns a `...Fast` image-processor name into a torchvision-only placeholder, and its
    AutoImageProcessor is itself one without torchvision (which has no build beside torch 2.13): the folder names
    only our PIL + numpy class, and AutoProcessor gives it on every supported transformers."""
    import transformers
    from transformers import AutoProcessor

    config = json.loads((folders["vision"] / "processor_config.json").read_text())
    names = [config["image_processor"]["image_processor_type"], *config["auto_map"].values(),
             *config["image_processor"]["auto_map"].values()]
    assert not [name for name in names if name.endswith("Fast")], names
    with no_warnings():
        processor = AutoProcessor.from_pretrained(folders["vision"], trust_remote_code=True)
    assert type(processor.image_processor).__name__ == "KimiK3ImageProcessor"
    assert processor.image_processor.preprocess([_image()])["grid_thws"].tolist() == [[1, 2, 2]]
    if not getattr(type(transformers.AutoImageProcessor), "is_dummy", False):  # a real one (5.24; 5.17 + torchvision)
        with no_warnings():
            image_processor = transformers.AutoImageProcessor.from_pretrained(folders["vision"],
                                                                              trust_remote_code=True)
        assert type(image_processor).__name__ == "KimiK3ImageProcessor"


# ---------------------------------------------------------------------------------------------------------------
# Auto classes


def test_auto_model_is_the_base_model_and_the_head_is_left_out(folders):
    """AutoModel on a folder saved with the head gives the base model (as a Llama folder gives LlamaModel), without a
    warning: its tensors are the full model's but the head, bit for bit, and its last hidden state through the saved
    head is the full model's logits, with images too."""
    from transformers import AutoModel, AutoProcessor

    text_model, composite = folders["text_model"], folders["composite"]
    processor = AutoProcessor.from_pretrained(folders["vision"], trust_remote_code=True)
    inputs = processor(text="<|kimi_image_placeholder|> What is it?", images=[_image()], return_tensors="pt")
    ids = torch.randint(3, 500, (1, 7))
    for kind, full, head in (("text", text_model, text_model.lm_head),
                             ("vision", composite, composite.language_model.lm_head)):
        with no_warnings():
            base = AutoModel.from_pretrained(folders[kind], trust_remote_code=True).eval()
        assert type(base).__module__.startswith("transformers_modules.")
        assert type(base).__name__ == {"text": "KimiK3Model", "vision": "KimiK3MultimodalModel"}[kind]
        assert not any(name.endswith("lm_head.weight") for name, _ in base.named_parameters())
        want = {name: tensor for name, tensor in (full.model if kind == "text" else full).state_dict().items()
                if not name.endswith("lm_head.weight")}
        got = base.state_dict()
        assert set(got) == set(want)
        for name, tensor in got.items():
            assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
        # The folder's f32 tensors load as views of the mmap-ed file (4-byte-aligned offsets), the in-memory model's
        # are 64-byte aligned, and CPU BLAS (MKL) sums a one- to three-row product in an order that depends on its
        # operands' alignment (the vision case's one image token through mm_projector: logits 1.9e-7 apart). In
        # fresh memory like the full model's, the logits below depend on the values alone and must be bit-equal.
        for tensor in (*base.parameters(), *base.buffers()):
            tensor.data = tensor.data.clone()
        with torch.no_grad():
            torch.testing.assert_close(head(base(ids).last_hidden_state), full(ids).logits, rtol=0, atol=0)
    with torch.no_grad():  # the multimodal base model reads images as the full model does
        out = base(**inputs)
        torch.testing.assert_close(head(out.last_hidden_state), composite(**inputs).logits, rtol=0, atol=0)
    assert out.attention_mask.shape == out.last_hidden_state.shape[:2]
    config = json.loads((folders["vision"] / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "multimodal_kimi_k3.KimiK3MultimodalModel"
    assert config["auto_map"]["AutoModelForImageTextToText"] == "multimodal_kimi_k3.KimiK3ForConditionalGeneration"


def test_auto_model_reads_a_release_layout_folder_with_our_code(tmp_path):
    """A release-layout folder holding our code and auto_map (the Hub-repo case): AutoModel's base model goes through
    the same release conversions as the composite model's text model (fused, dequantised experts, A_log un-padded)."""
    import shutil

    from transformers import AutoModel

    from kimik3.convert.testing import write_release_checkpoint
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration
    from kimik3.modeling.saving_kimi_k3 import COMPOSITE_AUTO_MAP
    from kimik3.remote_code import remote_code_files

    release = write_release_checkpoint(tmp_path / "release", seed=1, num_layers=2, num_experts=2)
    for path in remote_code_files():
        shutil.copyfile(path, release.path / path.name)
    (release.path / "config.json").write_text(json.dumps(dict(release.config, auto_map=COMPOSITE_AUTO_MAP)))
    with no_warnings():
        base = AutoModel.from_pretrained(release.path, trust_remote_code=True)
    assert type(base).__name__ == "KimiK3MultimodalModel"
    full = KimiK3ForConditionalGeneration.from_pretrained(release.path).state_dict()
    loaded = base.state_dict()
    assert set(loaded) == set(full) - {"language_model.lm_head.weight"}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, full[name]), name


# ---------------------------------------------------------------------------------------------------------------
# Pipelines


def _card_pipeline_tag(directory: Path) -> str:
    from huggingface_hub import ModelCard

    return ModelCard.load(directory / "README.md").data.pipeline_tag


def test_pipelines_load_the_folders_by_their_cards_pipeline_tag_and_run_without_warnings(folders):
    """pipeline(<the card's pipeline_tag>, model=folder, trust_remote_code=True) for both folders, greedy: the
    answer is the model's own greedy continuation."""
    from transformers import AutoProcessor, AutoTokenizer, pipeline

    assert _card_pipeline_tag(folders["text"]) == "text-generation"
    assert _card_pipeline_tag(folders["vision"]) == "image-text-to-text"
    import transformers

    noise = TRANSFORMERS_517_PIPELINE_NOISE if transformers.__version__.startswith("5.17.") else ()
    with no_warnings(allowed=noise):
        text_pipe = pipeline("text-generation", model=str(folders["text"]), trust_remote_code=True)
        reply = text_pipe("Hello", max_new_tokens=3, do_sample=False, return_full_text=False)[0]["generated_text"]
    tokenizer = AutoTokenizer.from_pretrained(folders["text"], trust_remote_code=True)
    ids = tokenizer("Hello", return_tensors="pt")
    with torch.no_grad():
        expected = text_pipe.model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert reply == tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    messages = [{"role": "user", "content": [{"type": "image", "image": _image(1)},
                                             {"type": "text", "text": "What is it?"}]}]
    with no_warnings(allowed=noise):  # loads AutoModelForImageTextToText, which auto_map names
        image_pipe = pipeline("image-text-to-text", model=str(folders["vision"]), trust_remote_code=True)
        out = image_pipe(text=messages, max_new_tokens=3, generate_kwargs={"do_sample": False})[0]
    assert type(image_pipe.model).__name__ == "KimiK3ForConditionalGeneration"
    for name, tensor in folders["composite"].state_dict().items():
        assert torch.equal(image_pipe.model.state_dict()[name], tensor), name
    processor = AutoProcessor.from_pretrained(folders["vision"], trust_remote_code=True)
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        expected = folders["composite"].generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out["generated_text"][-1] == {
        "role": "assistant",
        "content": processor.decode(expected[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)}


def test_pipelines_given_the_objects_accept_our_classes(folders):
    """A pipeline built from model objects checks their class against transformers' Auto mappings: ours are
    registered there (the package's classes and a folder's remote-code copies), so nothing says "not supported"."""
    from transformers import AutoProcessor, AutoTokenizer, pipeline

    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    processor = AutoProcessor.from_pretrained(folders["vision"], trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folders["text"], trust_remote_code=True)
    text_model = KimiK3ForCausalLM.from_pretrained(folders["text"]).eval()
    assert not type(folders["composite"]).__module__.startswith("transformers_modules.")
    with no_warnings():
        image_pipe = pipeline("image-text-to-text", model=folders["composite"], processor=processor)
        text_pipe = pipeline("text-generation", model=text_model, tokenizer=tokenizer)
    out = image_pipe(text="<|kimi_image_placeholder|> What is it?", images=[_image(2)], max_new_tokens=2,
                     generate_kwargs={"do_sample": False})
    assert isinstance(out[0]["generated_text"], str)
    assert isinstance(text_pipe("Hi", max_new_tokens=2, do_sample=False)[0]["generated_text"], str)


def test_auto_mappings_hold_our_classes_only_under_our_config_classes(folders):
    """The registration keys on our config classes, so no other model resolves to our classes. It is done when a
    class's first model is built (importing the model files changes nothing: test_model_files_do_nothing_on_import):
    the fixture built the two classes with a head, the base models are built here."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, LlamaConfig

    from kimik3.modeling import modeling_kimi_k3 as m
    from kimik3.modeling import multimodal_kimi_k3 as mm

    m.KimiK3Model.from_pretrained(folders["text"])
    mm.KimiK3MultimodalModel.from_pretrained(folders["vision"])
    assert AutoModel._model_mapping[m.KimiK3TextConfig] is m.KimiK3Model
    assert AutoModel._model_mapping[mm.KimiK3Config] is mm.KimiK3MultimodalModel
    assert AutoModelForCausalLM._model_mapping[m.KimiK3TextConfig] is m.KimiK3ForCausalLM
    assert AutoModelForCausalLM._model_mapping[mm.KimiK3Config] is mm.KimiK3ForConditionalGeneration
    assert AutoModelForImageTextToText._model_mapping[mm.KimiK3Config] is mm.KimiK3ForConditionalGeneration
    # the base model inside the multimodal one answers no Auto class
    assert mm.KimiK3TextBackbone not in AutoModel._model_mapping._extra_content.values()
    assert AutoModelForCausalLM._model_mapping[LlamaConfig].__name__ == "LlamaForCausalLM"
    assert "kimik3" not in sys.modules["transformers"].CONFIG_MAPPING


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "modeling_kimik3").glob("*_kimi_k3.py")))
def test_model_files_do_nothing_on_import(name):
    """No import-time side effects: at the top level of every remote-code file, only imports, definitions and
    assignments (the Auto registration, the release conversions and the TP style run when first needed)."""
    tree = ast.parse((REPO / "modeling_kimik3" / name).read_text(encoding="utf-8"))
    calls = [ast.unparse(node) for node in tree.body if isinstance(node, ast.Expr)
             and not isinstance(node.value, ast.Constant)]
    assert calls == []
