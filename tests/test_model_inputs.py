"""Model inputs: malformed ids, masks, embeddings and caches get a ValueError naming the shapes, and padding is exact
by selection (a NaN/Inf in a padded position never reaches a real token). Case ids are listed in docs/bad_inputs.md."""

import pytest
import torch

from k3_test_utils import cache_of
from kimik3.tiny import build_tiny_model
from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

VOCAB, HIDDEN, PAD = 128, 64, 0


@pytest.fixture(scope="module")
def model():
    # 4 layers: KDA, KDA, KDA, MLA, with Block AttnRes (blocks of 2) and MoE from layer 1 on; f32
    return build_tiny_model(num_hidden_layers=4, seed=5)


def _ids(batch, length, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


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
