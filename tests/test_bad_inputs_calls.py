"""Calls that computed something else or failed naming nothing (docs/bad_inputs.md, "Calls"): attention masks with
a hole or a right-padded prompt continued by generate, generate's beam and lookup counts, labels of another length,
a cache of another copy of the code, a device_map that loads nothing or names no module, a missing subfolder. Models
are loaded from a tiny folder through the Auto classes with trust_remote_code, as users load them."""

import importlib
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from kimik3.modeling.cache_kimi_k3 import KimiK3Cache
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM
from kimik3.tiny import write_tiny_folder

HOLE = "has padding at position {} between real tokens"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("calls") / "k3"
    write_tiny_folder(path, num_hidden_layers=2)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def _ids(rows: int = 1, length: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mask, position", [
    pytest.param([[1, 1, 1, 0, 1, 1, 1, 1]], 3, id="mask-hole-in-the-middle"),
    pytest.param([[0, 0, 1, 0, 1, 1, 1, 1]], 3, id="mask-hole-after-left-padding"),
])
def test_a_mask_with_a_hole_is_refused_in_forward(model, mask, position):
    with pytest.raises(ValueError, match=re.escape(HOLE.format(position))):
        model(_ids(), attention_mask=torch.tensor(mask))


@pytest.mark.parametrize("use_cache", [False, True], ids=["mask-right-padded-forward", "mask-right-padded-prefill"])
def test_right_padding_in_a_forward_is_exact_for_the_real_tokens(model, use_cache):
    ids = _ids(length=8, seed=1)
    with torch.no_grad():
        alone = model(ids[:, :5]).logits
        padded = model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]), use_cache=use_cache).logits
    torch.testing.assert_close(padded[:, :5], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache_implementation", [None, "static"],
                         ids=["generate-right-padded-batch", "generate-right-padded-batch-static"])
def test_generate_on_a_right_padded_batch_is_refused(model, cache_implementation):
    ids = _ids(rows=2, length=5, seed=2)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match=re.escape(HOLE.format(3)) + ".*padding_side='left'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                       cache_implementation=cache_implementation)


@pytest.mark.parametrize("option", [
    pytest.param({"num_beams": 0}, id="generate-num-beams-0"),
    pytest.param({"num_beams": -1}, id="generate-num-beams-minus-1"),
    pytest.param({"prompt_lookup_num_tokens": 0}, id="generate-prompt-lookup-0"),
    pytest.param({"prompt_lookup_num_tokens": -1}, id="generate-prompt-lookup-minus-1"),
    pytest.param({"num_return_sequences": 0}, id="generate-num-return-sequences-0"),
])
def test_generate_counts_must_be_positive(model, option):
    (key, value), = option.items()
    with pytest.raises(ValueError, match=re.escape(f"generate({key}={value}): a positive whole number")):
        model.generate(_ids(), max_new_tokens=2, do_sample=False, **option)


@pytest.mark.parametrize("length", [5, 9], ids=["labels-shorter", "labels-longer"])
def test_labels_of_another_length_are_refused_by_shape(model, length):
    with pytest.raises(ValueError, match=re.escape(f"labels have shape (1, {length}) but input_ids (1, 8)")):
        model(_ids(), labels=_ids(length=length))


@pytest.mark.parametrize("call", ["forward", "generate"], ids=["cache-of-another-code-copy",
                                                                "cache-of-another-code-copy-generate"])
def test_a_cache_of_another_copy_of_the_code_names_both(model, call):
    foreign = KimiK3Cache(model.config)  # the installed package's class; the model runs its folder's copy
    with pytest.raises(TypeError, match="another copy of the Kimi K3 code \\(kimik3.modeling.cache_kimi_k3, made for "
                                        ".*; this model runs transformers_modules\\..*cache_kimi_k3") as error:
        if call == "forward":
            model(_ids(), past_key_values=foreign, use_cache=True)
        else:
            model.generate(_ids(), past_key_values=foreign, max_new_tokens=2, do_sample=False)
    assert "importlib.import_module(type(model).__module__).KimiK3Cache(model.config)" in str(error.value)
    # both configs named (here the same folder's: the cache was made from the model's own config)
    assert str(error.value).count(f"{model.config._name_or_path}: 2 layers, MLA at [1]") == 2
    # what the message says to do works
    own = importlib.import_module(type(model).__module__).KimiK3Cache(model.config)
    with torch.no_grad():
        assert model(_ids(), past_key_values=own, use_cache=True).logits.shape[1] == 8


@pytest.mark.parametrize("device_map, message", [
    pytest.param({"": "meta"}, "puts weights on the meta device, where they are never loaded", id="device-map-meta"),
    pytest.param("meta", "puts weights on the meta device", id="device-map-meta-string"),
    pytest.param({"model.layers.999": "cpu", "": "cpu"}, "device_map names ['model.layers.999'], which "
                 "KimiK3ForCausalLM does not have (its 2 layers are model.layers.0 to model.layers.1",
                 id="device-map-unknown-module"),
])
def test_a_device_map_that_loads_nothing_real_is_refused(folder, device_map, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, device_map=device_map)


def test_a_device_map_of_real_modules_loads(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                 device_map={"model.layers.0": "cpu", "": "cpu"})
    assert model.device.type == "cpu"


@pytest.mark.parametrize("subfolder", ["nope"], ids=["load-subfolder-missing"])
def test_a_missing_subfolder_is_named(folder, subfolder):
    with pytest.raises(ValueError, match=re.escape(f"subfolder '{subfolder}' is not a folder in it (its folders: "
                                                   "['custom_generate'])")):
        KimiK3ForCausalLM.from_pretrained(folder, subfolder=subfolder)


@pytest.mark.parametrize("where", ["inside", "leading"], ids=["generate-pad-id-inside-the-prompt",
                                                               "generate-pad-id-leading"])
def test_a_mask_generate_infers_marks_only_leading_pad_ids(model, where):
    """With no mask, generate() infers one from pad_token_id; a pad id after the first real token (in the text, or
    generated) is a token there, never a hole: the same tokens as the mask that says so."""
    pad = model.generation_config.pad_token_id
    ids = _ids(length=8, seed=3)
    if where == "inside":
        ids[0, 4] = pad
        mask = torch.ones_like(ids)
    else:
        ids[0, :2] = pad
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
    inferred = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    given = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=pad)
    assert torch.equal(inferred, given)


@pytest.mark.parametrize("layers", [4], ids=["cache-of-another-k3-folder"])
def test_a_cache_of_another_k3_models_folder_names_both_configs(model, folder, tmp_path, layers):
    """Two K3 folders loaded with trust_remote_code run two copies of the code: the cache one model made is refused
    by the other with both folders and their layouts named (it said "needs a KimiK3Cache, got KimiK3Cache")."""
    other_folder = tmp_path / "other"
    write_tiny_folder(other_folder, num_hidden_layers=layers)
    other = AutoModelForCausalLM.from_pretrained(other_folder, trust_remote_code=True)
    with torch.no_grad():
        cache = other(_ids(), use_cache=True).past_key_values
        with pytest.raises(TypeError) as error:
            model(_ids(), past_key_values=cache, use_cache=True)
    message = str(error.value)
    assert f"made for {other_folder}: {layers} layers, MLA at [3]" in message
    assert f"({folder}: 2 layers, MLA at [1])" in message

