"""Model inputs: malformed ids, masks, embeddings and caches get a ValueError naming the shapes, and padding is exact
by selection (a NaN/Inf in a padded position never reaches a real token). Case ids are listed in docs/bad_inputs.md."""

import pytest
import torch

from k3_test_utils import cache_of
from kimik3.configuration import tiny_text_config_dict
from kimik3.tiny import build_tiny_model
from kimik3.modeling.cache_kimi_k3 import KimiK3Cache
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD

VOCAB, HIDDEN, PAD = 128, 64, 0


@pytest.fixture(scope="module")
def model():
    # 4 layers: KDA, KDA, KDA, MLA, with Block AttnRes (blocks of 2) and MoE from layer 1 on; f32
    return build_tiny_model(num_hidden_layers=4, seed=5)


def _ids(batch, length, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _config(**layer_lists) -> KimiK3TextConfig:
    cfg = tiny_text_config_dict()
    cfg["linear_attn_config"].update(layer_lists)
    return KimiK3TextConfig(**cfg)


def _filled_cache(model, batch, length):
    with torch.no_grad():
        return cache_of(model(_ids(batch, length), use_cache=True))


# ----------------------------------------------------------------------------------------------------------------
# Malformed inputs: each case gives the forward kwargs and a pattern its ValueError must contain.

BAD_INPUTS = [
    pytest.param(lambda m: {"input_ids": _ids(1, 5)[0]}, r"input_ids must be 2-D .*got shape \(5,\)", id="ids-1d"),
    pytest.param(lambda m: {"input_ids": _ids(1, 5)[..., None]}, r"input_ids must be 2-D .*got shape \(1, 5, 1\)",
                 id="ids-3d"),
    pytest.param(lambda m: {"input_ids": torch.tensor([[5, 7, VOCAB]])},
                 r"ids from 5 to 128, outside the vocabulary \[0, vocab_size=128\)", id="ids-out-of-vocab"),
    pytest.param(lambda m: {"input_ids": torch.tensor([[5, -1, 7]])},
                 r"ids from -1 to 7, outside the vocabulary \[0, vocab_size=128\)", id="ids-negative"),
    pytest.param(lambda m: {"input_ids": torch.zeros(1, 0, dtype=torch.long)},
                 r"input_ids has shape \(1, 0\).*at least one token", id="empty-sequence"),
    pytest.param(lambda m: {"input_ids": torch.zeros(0, 4, dtype=torch.long)},
                 r"input_ids has shape \(0, 4\).*at least one sequence", id="empty-batch"),
    pytest.param(lambda m: {"inputs_embeds": torch.zeros(1, 0, HIDDEN)},
                 r"inputs_embeds has shape \(1, 0, 64\)", id="embeds-empty-sequence"),
    pytest.param(lambda m: {"inputs_embeds": torch.zeros(1, 5, HIDDEN - 1)},
                 r"hidden_size=64\]; got shape \(1, 5, 63\)", id="embeds-wrong-width"),
    pytest.param(lambda m: {"inputs_embeds": torch.zeros(5, HIDDEN)},
                 r"hidden_size=64\]; got shape \(5, 64\)", id="embeds-2d"),
    pytest.param(lambda m: {"input_ids": _ids(2, 5), "attention_mask": torch.ones(2, 6, dtype=torch.long)},
                 r"attention_mask has shape \(2, 6\) but input_ids has shape \(2, 5\) and the cache holds 0 tokens",
                 id="mask-longer-than-ids"),
    pytest.param(lambda m: {"input_ids": _ids(2, 5), "attention_mask": torch.ones(2, 4, dtype=torch.long)},
                 r"attention_mask has shape \(2, 4\) but input_ids has shape \(2, 5\)", id="mask-shorter-than-ids"),
    pytest.param(lambda m: {"input_ids": _ids(2, 5), "attention_mask": torch.ones(3, 5, dtype=torch.long)},
                 r"2-D padding attention_mask \[batch=2, length\]; got shape \(3, 5\)", id="mask-other-batch"),
    pytest.param(lambda m: {"input_ids": _ids(2, 5), "attention_mask": torch.ones(2, 1, 5, 5, dtype=torch.bool)},
                 r"got shape \(2, 1, 5, 5\) for input_ids of shape \(2, 5\)", id="mask-4d"),
    pytest.param(lambda m: {"input_ids": _ids(2, 2), "attention_mask": torch.ones(2, 2, dtype=torch.long),
                            "past_key_values": _filled_cache(m, 2, 3)},
                 r"the cache holds 3 tokens: the mask must cover the cached and the new tokens, length 3 \+ 2 = 5",
                 id="mask-without-cached-part"),
    pytest.param(lambda m: {"input_ids": _ids(1, 1), "past_key_values": _filled_cache(m, 2, 3)},
                 r"The cache holds 2 sequences but input_ids has batch size 1 \(shape \(1, 1\)\)",
                 id="cache-other-batch"),
    pytest.param(lambda m: {"inputs_embeds": torch.zeros(2, 4, HIDDEN).index_fill_(1, torch.tensor([2]), float("nan"))},
                 r"non-finite values at a real \(unmasked\) token: batch 0, position 2 \(2 such tokens",
                 id="nan-real-embeds"),
    pytest.param(lambda m: {"inputs_embeds": torch.zeros(2, 4, HIDDEN).index_put_((torch.tensor([1]), torch.tensor([3])),
                                                                                  torch.tensor(float("inf"))),
                            "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])},
                 r"batch 1, position 3 \(1 such tokens", id="inf-real-embeds"),
]

BAD_INPUTS += [
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "past_key_values": KimiK3Cache(
        KimiK3TextConfig(**tiny_text_config_dict(num_hidden_layers=2)))},
                 r"The cache was made for a model of another config: layer_types 2 layers, MLA at \[1\] \(this "
                 r"model: 4 layers, MLA at \[3\]\)", id="cache-other-config-layers"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "past_key_values": KimiK3Cache(
        KimiK3TextConfig(**{**tiny_text_config_dict(), "kv_lora_rank": 16}))},
                 r"another config: kv_lora_rank 16 \(this model: 32\)", id="cache-other-config-width"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "past_key_values": KimiK3Cache(_config(kda_layers=[1, 2, 4],
                                                                                         full_attn_layers=[3]))},
                 r"another config: layer_types 4 layers, MLA at \[2\] \(this model: 4 layers, MLA at \[3\]\)",
                 id="cache-other-layer-kinds"),
    pytest.param(lambda m: {"input_ids": _ids(2, 3), "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])},
                 r"attention_mask \(shape \(2, 3\)\) has no real token in batch row\(s\) \[1\]",
                 id="mask-row-all-zero"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "attention_mask": torch.tensor([[1.0, 0.5, 1.0]])},
                 r"attention_mask \(shape \(1, 3\), dtype torch.float32\) must hold only 0 \(padding\) and 1 "
                 r"\(a real token\); it holds 0.5 \(1 such entries\)", id="mask-float-half"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "attention_mask": torch.tensor([[2.0, 2.0, 1.0]])},
                 r"it holds 2.0 \(2 such entries\)", id="mask-float-two"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "attention_mask": torch.tensor([[1.0, float("nan"), 1.0]])},
                 r"must hold only 0 \(padding\) and 1 .*it holds nan", id="mask-float-nan"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "attention_mask": torch.tensor([[1, -1, 1]])},
                 r"it holds -1 \(1 such entries\)", id="mask-int-minus-one"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3).float()},
                 r"input_ids must hold integer token ids \(torch.long or torch.int32\); got dtype torch.float32",
                 id="ids-float"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3) > 5}, r"got dtype torch.bool", id="ids-bool"),
    pytest.param(lambda m: {"input_ids": [[1, 2, 3]]}, r"input_ids must be a torch.Tensor, got list",
                 id="ids-a-list"),
    pytest.param(lambda m: {"input_ids": _ids(1, 3), "attention_mask": [[1, 1, 1]]},
                 r"attention_mask must be a torch.Tensor, got list", id="mask-a-list"),
    pytest.param(lambda m: {"inputs_embeds": torch.ones(1, 3, HIDDEN, dtype=torch.long)},
                 r"inputs_embeds must have the model's dtype torch.float32; got torch.int64", id="embeds-int64"),
    pytest.param(lambda m: {"inputs_embeds": torch.ones(1, 3, HIDDEN, dtype=torch.float64)},
                 r"inputs_embeds must have the model's dtype torch.float32; got torch.float64", id="embeds-float64"),
]


@pytest.mark.parametrize("make_inputs, message", BAD_INPUTS)
def test_bad_model_input_is_a_value_error_naming_the_shapes(model, make_inputs, message):
    inputs = make_inputs(model)
    cache = inputs.get("past_key_values")
    seen = cache.get_seq_length() if cache is not None else None
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(**inputs)
    if cache is not None:  # rejected before any layer wrote to it
        assert cache.get_seq_length() == seen


GOOD_MASKS = [
    pytest.param(0, 6, id="mask-covers-the-ids"),
    pytest.param(4, 2, id="mask-covers-cache-and-new"),
    pytest.param(5, 1, id="mask-covers-cache-and-one-decode-token"),
]


@pytest.mark.parametrize("past, new", GOOD_MASKS)
def test_a_mask_of_the_whole_sequence_is_accepted_and_exact(model, past, new):
    """generate()'s convention: the mask covers the cached and the new tokens."""
    ids = _ids(2, past + new)
    mask = torch.ones(2, past + new, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = cache_of(model(ids[:, :past], attention_mask=mask[:, :past], use_cache=True)) if past else None
        last = model(ids[:, past:], attention_mask=mask, past_key_values=cache).logits
    torch.testing.assert_close(last, full[:, past:], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Padding is exact by selection: NaN/Inf at padded positions vs zeros there, bit-identical at real positions.

def _padded_mask(side):
    mask = torch.ones(3, 9, dtype=torch.long)
    if side == "left":
        mask[0, :4], mask[2, :1] = 0, 0
    else:
        mask[0, 5:], mask[2, 8:] = 0, 0
    return mask


def _run(model, mask, **inputs):
    """Logits, every layer's hidden states, router logits and the cache of one forward, plus one decode step."""
    with torch.no_grad():
        out = model(attention_mask=mask, use_cache=True, output_hidden_states=True, output_router_logits=True,
                    **inputs)
        cache = cache_of(out)
        if not mask[:, -1].all():  # right padding: continuing it is refused (tests/test_bad_inputs_calls.py)
            return out, cache, None
        step_mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
        step = model(_ids(mask.shape[0], 1, seed=9), attention_mask=step_mask, past_key_values=cache).logits
    return out, cache, step


def _assert_real_positions_bit_identical(model, mask, got, expected):
    (out, cache, step), (ref, ref_cache, ref_step) = got, expected
    real = mask.bool()
    assert torch.isfinite(ref.logits[real]).all()
    assert torch.equal(out.logits[real], ref.logits[real])
    # hidden states after every layer: the block attention residual sums and mixes
    for h, r in zip(out.hidden_states[1:], ref.hidden_states[1:]):
        assert torch.equal(h[real], r[real])
    # router logits of real tokens (MoE routing)
    for h, r in zip(out.router_logits, ref.router_logits):
        assert torch.equal(h[real.reshape(-1)], r[real.reshape(-1)])
    # KDA recurrent states, conv windows, MLA latents at real positions
    for layer in model.config.kda_layer_indices:
        (conv, state), (ref_conv, ref_state) = cache.kda_state(layer), ref_cache.kda_state(layer)
        assert torch.equal(state, ref_state)
        for a, b in zip(conv, ref_conv):
            assert torch.equal(a, b)
    for layer in model.config.mla_layer_indices:
        latents = cache.layers[layer].latents[:, : mask.shape[1]]
        assert torch.isfinite(latents).all()  # padded keys too: the decode step below reads them with weight 0
        assert torch.equal(latents[real], ref_cache.layers[layer].latents[:, : mask.shape[1]][real])
    # the next decode step over the cache (MLA attends over the padded keys, KDA continues the state)
    if ref_step is not None:
        assert torch.isfinite(ref_step).all() and torch.equal(step, ref_step)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("value", [
    pytest.param(float("nan"), id="nan-pad-embedding-row"),
    pytest.param(float("inf"), id="inf-pad-embedding-row"),
])
def test_non_finite_pad_embedding_row_never_reaches_real_tokens(model, value, side):
    mask = _padded_mask(side)
    ids = _ids(3, 9).masked_fill(mask == 0, PAD)
    row = model.get_input_embeddings().weight[PAD]
    saved = row.detach().clone()
    try:
        with torch.no_grad():
            row.fill_(value)
        got = _run(model, mask, input_ids=ids)
        with torch.no_grad():
            row.zero_()
        expected = _run(model, mask, input_ids=ids)
    finally:
        with torch.no_grad():
            row.copy_(saved)
    _assert_real_positions_bit_identical(model, mask, got, expected)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("value", [
    pytest.param(float("nan"), id="nan-padded-embeds"),
    pytest.param(float("inf"), id="inf-padded-embeds"),
    pytest.param(float("-inf"), id="neg-inf-padded-embeds"),
])
def test_non_finite_padded_inputs_embeds_never_reach_real_tokens(model, value, side):
    mask = _padded_mask(side)
    embeds = model.get_input_embeddings()(_ids(3, 9)).detach()
    padded = (mask == 0).unsqueeze(-1)
    got = _run(model, mask, inputs_embeds=embeds.masked_fill(padded, value))
    expected = _run(model, mask, inputs_embeds=embeds.masked_fill(padded, 0.0))
    _assert_real_positions_bit_identical(model, mask, got, expected)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("value", [
    pytest.param(float("nan"), id="kda-nan-padded-hidden"),
    pytest.param(float("inf"), id="kda-inf-padded-hidden"),
])
def test_kda_layer_selects_padding_itself(model, value, side):
    """The KDA layer on its own (packed documents reach it with their own mask): non-finite hidden states at padded
    positions leave the real outputs, the recurrent state and the conv windows exactly as zeros there do."""
    layer_idx = model.config.kda_layer_indices[0]
    kda = model.model.layers[layer_idx].self_attn
    mask = _padded_mask(side).bool()
    hidden = torch.randn(3, 9, HIDDEN, generator=torch.Generator().manual_seed(4))
    results = []
    for fill in (value, 0.0):
        cache = KimiK3Cache(model.config)
        with torch.no_grad():
            out = kda(hidden.masked_fill(~mask.unsqueeze(-1), fill), token_mask=mask, cache=cache)
        conv, state = cache.kda_state(layer_idx)
        results.append((out, state, conv))
    (out, state, conv), (ref, ref_state, ref_conv) = results
    assert torch.isfinite(ref[mask]).all() and torch.equal(out[mask], ref[mask])
    assert torch.isfinite(ref_state).all() and torch.equal(state, ref_state)
    assert all(torch.equal(a, b) for a, b in zip(conv, ref_conv))


# ----------------------------------------------------------------------------------------------------------------
# Good neighbours of the value checks: accepted, with the outputs of the plain inputs.

@pytest.mark.parametrize("mask", [
    pytest.param(lambda m: m.bool(), id="mask-bool"),
    pytest.param(lambda m: m.float(), id="mask-float-zeros-and-ones"),
    pytest.param(lambda m: m.int(), id="mask-int32"),
])
def test_masks_of_other_dtypes_holding_0_and_1_are_accepted(model, mask):
    ids = _ids(2, 5)
    plain = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        expected = model(ids, attention_mask=plain).logits
        got = model(ids, attention_mask=mask(plain)).logits
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", [pytest.param("same", id="cache-of-an-equal-config"),
                                  pytest.param("int32", id="ids-int32")])
def test_an_equal_config_cache_and_int32_ids_are_accepted(model, case):
    ids = _ids(1, 4)
    with torch.no_grad():
        expected = model(ids).logits
        if case == "same":  # a copy of the config (a cache made from a reloaded config.json)
            got = model(ids, past_key_values=KimiK3Cache(KimiK3TextConfig(**model.config.to_dict()))).logits
        else:
            got = model(ids.int()).logits
    assert torch.equal(got, expected)


# ----------------------------------------------------------------------------------------------------------------
# Labels, media placeholders without images, generate's length and its token ids.

@pytest.mark.parametrize("labels, message", [
    pytest.param(torch.tensor([[5, VOCAB, -100]]), r"labels \(shape \(1, 3\)\) hold 128 at \[0, 1\]: labels must "
                 r"be ids in \[0, vocab_size=128\) or -100 \(ignored\)", id="labels-out-of-vocab"),
    pytest.param(torch.tensor([[5, -5, -100]]), r"hold -5 at \[0, 1\]", id="labels-negative-not-ignore-index"),
    pytest.param(torch.tensor([[5.0, 6.0, 7.0]]), r"labels must hold integer token ids; got dtype torch.float32",
                 id="labels-float"),
])
def test_bad_labels_are_a_value_error(model, labels, message):
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(_ids(1, 3), labels=labels)


@pytest.mark.parametrize("case", [pytest.param("ignored", id="labels-ignore-index-accepted")])
def test_labels_with_the_ignore_index_give_a_loss(model, case):
    with torch.no_grad():
        out = model(_ids(1, 3), labels=torch.tensor([[-100, 5, VOCAB - 1]]))
    assert torch.isfinite(out.loss)


MEDIA_PAD = 7


@pytest.mark.parametrize("case", [pytest.param("text", id="media-pad-without-pixels-text-model")])
def test_media_placeholder_without_pixel_values_text_model(model, case):
    """A text config that names `media_placeholder_token_id`: the placeholder marks an image that is not there."""
    ids = torch.tensor([[5, 9, MEDIA_PAD, 11]])
    model.model.media_placeholder_token_id = MEDIA_PAD
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=r"input_ids hold the media placeholder `<\|media_pad\|>` "
                                                              r"\(id 7\) at batch 0, position 2, but no pixel_values"):
            model(ids)
        with torch.no_grad():
            model(_ids(1, 4).clamp(min=MEDIA_PAD + 1))  # other ids are fine
            # a decode step's ids are generated tokens: the placeholder's id continuing a cache is not an image
            cache = cache_of(model(_ids(1, 4).clamp(min=MEDIA_PAD + 1), use_cache=True))
            model(torch.tensor([[MEDIA_PAD]]), past_key_values=cache)
    finally:
        model.model.media_placeholder_token_id = None


@pytest.mark.parametrize("case", [pytest.param("composite", id="media-pad-without-pixels-composite")])
def test_media_placeholder_without_pixel_values_composite_model(case):
    from kimik3.convert import testing
    from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration

    config = KimiK3Config(**testing.tiny_release_config(num_layers=1, num_experts=2))
    composite = KimiK3ForConditionalGeneration(config, vision=False).eval()
    placeholder = config.media_placeholder_token_id
    with torch.no_grad(), pytest.raises(ValueError, match=rf"media placeholder `<\|media_pad\|>` \(id {placeholder}\) "
                                                          r"at batch 0, position 1, but no pixel_values"):
        composite(torch.tensor([[5, placeholder, 6]]))


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"max_new_tokens": 10**9}, r"generate\(max_new_tokens=1000000000 after a prompt of 5 tokens\) would "
                 r"run to 1000000005 tokens, past max_position_embeddings=8; ask for at most 3 new tokens",
                 id="generate-max-new-tokens-1e9"),
    pytest.param({"max_new_tokens": 4}, r"would run to 9 tokens, past max_position_embeddings=8",
                 id="generate-one-token-past-the-limit"),
    pytest.param({"max_length": 9}, r"generate\(max_length=9\) would run to 9 tokens", id="generate-max-length"),
    pytest.param({"max_new_tokens": 1, "eos_token_id": VOCAB + 5}, r"key `generation_config.eos_token_id`: 133 must "
                 r"be a token id or a list of token ids in \[0, vocab_size=128\)", id="generate-eos-id-out-of-vocab"),
    pytest.param({"max_new_tokens": 1, "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])},
                 r"has no real token in batch row\(s\) \[1\]", id="generate-mask-row-all-zero"),
    pytest.param({"max_new_tokens": 1, "forced_eos_token_id": VOCAB + 5}, r"key `generation_config.forced_eos_token_id"
                 r"`: 133 must be a token id or a list of token ids in \[0, vocab_size=128\)",
                 id="generate-forced-eos-id-out-of-vocab"),
    pytest.param({"max_new_tokens": 2.5}, r"generate\(max_new_tokens=2.5\): a whole number of tokens",
                 id="generate-max-new-tokens-float"),
    pytest.param({"max_new_tokens": True}, r"generate\(max_new_tokens=True\): a whole number",
                 id="generate-max-new-tokens-bool"),
    pytest.param({"max_new_tokens": 1, "forced_bos_token_id": -1}, r"key `generation_config.forced_bos_token_id`: -1 "
                 r"must be a token id", id="generate-forced-bos-id-negative"),
])
def test_generate_refuses_at_the_call(model, kwargs, message):
    """Refused before the prefill runs (the cache stays empty); max_position_embeddings lowered to 8 for the test."""
    ids = _ids(2, 5)
    saved = model.config.max_position_embeddings
    model.config.max_position_embeddings = 8
    cache = KimiK3Cache(model.config)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=message):
            model.generate(ids, do_sample=False, **{CACHE_FIELD: cache}, **kwargs)  # the installed transformers' name
        assert cache.get_seq_length() == 0
        # the neighbour: up to the limit is fine
        out = model.generate(ids, do_sample=False, max_new_tokens=3)
        assert out.shape == (2, 8)
    finally:
        model.config.max_position_embeddings = saved


# ----------------------------------------------------------------------------------------------------------------
# Images: sizes the image processor cannot cut into patches, and grids that are not whole numbers.

@pytest.mark.parametrize("size", [pytest.param((0, 0), id="image-0x0"), pytest.param((0, 9), id="image-0xN"),
                                  pytest.param((9, 0), id="image-Nx0")])
def test_an_image_without_pixels_is_refused_naming_its_index(size):
    from PIL import Image

    from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor

    processor = KimiK3ImageProcessor()
    with pytest.raises(ValueError, match=rf"^Kimi K3 image processor: image 1 is {size[0]}x{size[1]} pixels: an image "
                                         r"needs at least one pixel on each side"):
        processor.preprocess([Image.new("RGB", (28, 28)), Image.new("RGB", size)])
    with pytest.raises(ValueError, match=rf"the image size is {size[0]}x{size[1]} pixels"):
        processor.num_image_tokens(*size)


@pytest.mark.parametrize("case", [pytest.param("1x1", id="image-1x1-accepted")])
def test_a_one_pixel_image_is_padded_to_one_token(case):
    from PIL import Image

    from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor

    processor = KimiK3ImageProcessor()
    out = processor.preprocess([Image.new("RGB", (1, 1))])
    assert out["grid_thws"].tolist() == [[1, 2, 2]] and processor.num_image_tokens(1, 1) == 1


@pytest.mark.parametrize("grid", [pytest.param([[1, 2.5, 4]], id="grid-thws-float"),
                                  pytest.param([[True, True, True]], id="grid-thws-bool")])
def test_grid_thws_of_non_whole_numbers_is_refused(grid):
    from kimik3.modeling.vision_kimi_k3 import check_image_inputs

    pixels = torch.zeros(8, 3, 4, 4)
    with pytest.raises(ValueError, match=r"grid_thws must hold whole numbers \(frames, patch rows, patch columns\); "
                                         r"got dtype torch\.(float32|bool)"):
        check_image_inputs(pixels, torch.tensor(grid), 4, (2, 2))
