"""transformers' conventions for a model, held as its common model tests hold in-tree models, on folders loaded the way
users load them (saved with the code, reloaded through the Auto classes with trust_remote_code): a base model's folder
loaded with the head and back (missing tensors initialised and reported, unexpected ones reported; the release layout
keeps its strict checks: tests/test_release_loading.py), configs with a small vocabulary and no token ids,
`eos_token_id=-1` (never stop), resized embeddings, and the `_supports_*` / `_can_compile_fullgraph` flags each held
to what they claim (the compiled static decode: tests/test_static_cache.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402

from kimik3.configuration import tiny_text_config_dict  # noqa: E402
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig  # noqa: E402
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model  # noqa: E402
from kimik3.tiny import build_tiny_model  # noqa: E402


def _ids(vocab: int, n: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def head_model():
    return build_tiny_model(num_hidden_layers=2, seed=1)


def test_a_base_models_folder_loads_with_the_head_initialised_and_reported(head_model, tmp_path):
    base = KimiK3Model(head_model.config)
    base.load_state_dict(head_model.model.state_dict())
    base.save_pretrained(tmp_path / "base")
    assert "lm_head.weight" not in load_file(tmp_path / "base" / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "base", trust_remote_code=True,
                                                       output_loading_info=True)
    assert type(model).__module__.startswith("transformers_modules.")
    assert set(info["missing_keys"]) == {"lm_head.weight"} and not info["unexpected_keys"]
    for name, tensor in base.state_dict().items():
        assert torch.equal(model.model.state_dict()[name], tensor), name
    head = model.lm_head.weight
    std = head_model.config.initializer_range
    assert torch.isfinite(head).all() and 0.5 * std < head.std().item() < 2 * std  # _init_weights' normal(0, std)


def test_a_head_models_folder_loads_as_the_base_model(head_model, tmp_path):
    head_model.save_pretrained(tmp_path / "head")
    base, info = AutoModel.from_pretrained(tmp_path / "head", trust_remote_code=True, output_loading_info=True)
    assert type(base).__name__ == "KimiK3Model" and not info["missing_keys"]
    ids = _ids(head_model.config.vocab_size)
    with torch.no_grad():
        expected = head_model.model(ids).last_hidden_state
        # same weights: the same function (the order of a few float sums may differ between two models)
        torch.testing.assert_close(base.eval()(ids).last_hidden_state, expected, rtol=0, atol=1e-5)


def test_an_unknown_tensor_in_our_layout_is_reported_not_refused(head_model, tmp_path):
    folder = tmp_path / "extra"
    head_model.save_pretrained(folder)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.extra_scale"] = torch.ones(3)
    save_file(tensors, weights, metadata={"format": "pt"})
    model, info = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, output_loading_info=True)
    assert set(info["unexpected_keys"]) == {"model.layers.0.extra_scale"} and not info["missing_keys"]
    ids = _ids(head_model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, head_model(ids).logits, rtol=0, atol=1e-5)


def test_a_small_vocabulary_without_token_ids_builds_saves_and_generates(tmp_path):
    raw = tiny_text_config_dict(num_hidden_layers=2)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        raw.pop(key, None)
    raw["vocab_size"] = 99  # below every release id
    config = KimiK3TextConfig(**raw)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (None, None, None)
    torch.manual_seed(0)
    KimiK3ForCausalLM(config).save_pretrained(tmp_path / "small")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "small", trust_remote_code=True)
    assert model.config.vocab_size == 99 and model.config.eos_token_id is None
    out = model.generate(_ids(99), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 14)
    # the release's ids stay the defaults where the vocabulary holds them
    assert KimiK3TextConfig().eos_token_id == 163586
    # an id given explicitly is still checked against the vocabulary, by name
    with pytest.raises(ValueError, match="eos_token_id.*vocab_size=99"):
        KimiK3TextConfig(**{**raw, "eos_token_id": 120})


def test_eos_minus_one_never_stops(head_model):
    config = KimiK3TextConfig(**{**head_model.config.to_dict(), "eos_token_id": -1})
    assert config.eos_token_id == -1
    model = KimiK3ForCausalLM(config).eval()
    model.load_state_dict(head_model.state_dict())
    # greedy would stop at the old eos: with -1 it runs to max_new_tokens, the same tokens up to there
    ids = _ids(config.vocab_size, seed=3)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 12)
    forced = head_model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(out, forced)
    # forced eos is an id the last step's logits are set to: -1 would pick the last row, so it stays refused
    with pytest.raises(ValueError, match="forced_eos_token_id`: -1 must be a token id"):
        model.generate(ids, max_new_tokens=2, forced_eos_token_id=-1)
    with pytest.raises(ValueError, match="eos_token_id.*-2"):
        KimiK3TextConfig(**{**head_model.config.to_dict(), "eos_token_id": -2})


def test_resized_embeddings_keep_the_old_logits_and_save_the_new_size(head_model, tmp_path):
    import copy

    model = copy.deepcopy(head_model)
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 10, pad_to_multiple_of=8)
    new_vocab = model.config.vocab_size
    assert new_vocab % 8 == 0 and new_vocab >= vocab + 10
    assert model.get_input_embeddings().weight.shape[0] == model.get_output_embeddings().weight.shape[0] == new_vocab
    ids = _ids(vocab, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :vocab], head_model(ids).logits, rtol=0, atol=1e-5)
        new_ids = torch.cat([ids, torch.tensor([[new_vocab - 1]])], dim=1)
        assert torch.isfinite(model(new_ids).logits).all()
    model.save_pretrained(tmp_path / "resized")
    assert json.loads((tmp_path / "resized" / "config.json").read_text())["vocab_size"] == new_vocab
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "resized", trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(new_ids).logits, model(new_ids).logits, rtol=0, atol=1e-5)


def test_attention_backend_flag_holds_a_registered_attention_function_gets_the_kwargs(head_model):
    """`_supports_attention_backend` (what vLLM's and TGI's transformers backends read): an attention function
    registered with transformers runs every MLA prefill, receives the keyword arguments given to forward, and its
    output is the model's."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert type(head_model).is_backend_compatible() is True
    calls = []

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, kwargs.get("k3_marker")))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("k3_recording", recording_attention)
    ids = _ids(head_model.config.vocab_size, seed=5)
    with torch.no_grad():
        expected = head_model(ids).logits
        head_model.set_attn_implementation("k3_recording")
        try:
            logits = head_model(ids, k3_marker="seen").logits
        finally:
            head_model.set_attn_implementation("sdpa")
    mla_layers = [i for i, kind in enumerate(head_model.config.layer_types) if kind == "full_attention"]
    assert sorted(layer for layer, _ in calls) == mla_layers and {m for _, m in calls} == {"seen"}
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_support_flags_say_what_is_supported():
    """The flags of the model classes, each held to a test that fails when it lies: sdpa (tests/test_model.py's
    eager == sdpa), the attention backend (above), fullgraph compile (tests/test_static_cache.py), assisted decoding
    on a stateful cache (`_is_stateful` False: tests/test_speculative.py); flash and flex are not claimed (MLA's
    192/128 head dims)."""
    flags = {name: getattr(KimiK3ForCausalLM, name) for name in (
        "_supports_sdpa", "_supports_attention_backend", "_can_compile_fullgraph", "_is_stateful",
        "_supports_flash_attn", "_supports_flex_attn")}
    assert flags == {"_supports_sdpa": True, "_supports_attention_backend": True, "_can_compile_fullgraph": True,
                     "_is_stateful": False, "_supports_flash_attn": False, "_supports_flex_attn": False}


def test_hidden_states_selected_by_index_as_speculative_generators_ask(head_model):
    """transformers 5.25's MTP and DFlash candidate generators ask the target for some hidden states only
    (`output_hidden_states=-1` or a list of indices); the others come back as None. (K3 ships no MTP layers, and no
    DFlash draft exists for it: the target's side is what this project owns.)"""
    from transformers.utils import output_capturing

    if not hasattr(output_capturing, "selected_hidden_states"):
        pytest.skip(f"transformers {transformers.__version__} selects no hidden states by index (5.25 does)")
    ids = _ids(head_model.config.vocab_size, seed=6)
    with torch.no_grad():
        every = head_model(ids, output_hidden_states=True).hidden_states
        some = head_model(ids, output_hidden_states=[1, -1]).hidden_states
    assert len(some) == len(every) == head_model.config.num_hidden_layers + 1
    for index, (chosen, full) in enumerate(zip(some, every)):
        if index in (1, len(every) - 1):
            assert torch.equal(chosen, full)
        else:
            assert chosen is None
