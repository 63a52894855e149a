"""Speculative decoding with K3 as the target: rejected draft tokens are rolled back by replaying the recorded KDA
recurrence inputs (no projection, no prefix re-run), so greedy assisted decoding is exactly plain greedy decoding."""

import pytest
import torch

from k3_test_utils import cache_of
from kimik3.memory import load_text_config
from kimik3.draft import slice_draft_model
from kimik3.modeling.cache_kimi_k3 import KimiK3Cache, snapshot_bytes
from kimik3.modeling.rewind_kimi_k3 import KimiK3Rewind, rewind_record_bytes_per_token
from kimik3.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(num_hidden_layers=6, seed=3)


@pytest.fixture(scope="module")
def repetitive_prompt():
    torch.manual_seed(11)
    phrase = torch.randint(3, 128, (1, 9))
    return torch.cat([phrase, phrase, phrase[:, :4]], dim=1)


@pytest.fixture
def rollbacks_only(monkeypatch):
    """Counts the tokens each crop removes and fails if any crop falls back to a snapshot (whose tokens up to the
    target the model would run again)."""
    removed = []
    crop = KimiK3Cache.crop

    def counting_crop(self, max_length):
        before = self.get_seq_length()
        crop(self, max_length)
        removed.append(before - self.get_seq_length())

    def no_replay(self, target, devices):
        raise AssertionError(f"crop({target}) went back to a snapshot instead of replaying the recorded recurrence")

    monkeypatch.setattr(KimiK3Cache, "crop", counting_crop)
    monkeypatch.setattr(KimiK3Rewind, "_restore_snapshot", no_replay)
    return removed


def _plain(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs)


def _assert_same_greedy_run(assisted, plain):
    assert torch.equal(assisted.sequences, plain.sequences)
    for got, expected in zip(assisted.scores, plain.scores, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_prompt_lookup_greedy_is_plain_greedy(model, repetitive_prompt, rollbacks_only):
    plain = _plain(model, repetitive_prompt, max_new_tokens=16)
    assisted = _plain(model, repetitive_prompt, max_new_tokens=16, prompt_lookup_num_tokens=4)
    _assert_same_greedy_run(assisted, plain)
    assert any(rollbacks_only), "no draft token was rejected: the rollback was not exercised"


def test_sliced_draft_greedy_is_plain_greedy(model, repetitive_prompt, rollbacks_only):
    draft = slice_draft_model(model, 2)
    assert draft.config.layer_types == ["linear_attention", "full_attention"]  # convert --num-layers' schedule
    torch.testing.assert_close(draft.model.layers[0].self_attn.q_proj.weight,
                               model.model.layers[0].self_attn.q_proj.weight)
    # transformers reads the draft length from the draft's generation config; drafts of 3 tokens, never cut short
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    plain = _plain(model, repetitive_prompt, max_new_tokens=9)
    assisted = _plain(model, repetitive_prompt, max_new_tokens=9, assistant_model=draft)
    _assert_same_greedy_run(assisted, plain)
    assert max(rollbacks_only) >= 2  # target and draft caches both roll back, by several tokens at once


def test_rollback_is_the_state_of_the_shorter_sequence_and_small(model):
    """Verify 5 tokens, keep 2: the KDA states, conv windows and MLA latents are those of a cache that only ever saw
    the kept tokens, and the record costs far less than one KDA state per verified token."""
    torch.manual_seed(5)
    prefix, block = torch.randint(3, 128, (1, 7)), torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        cache = cache_of(model(prefix, use_cache=True))
        # transformers 5.25's hybrid-cache API, as its assisted, prompt-lookup, MTP and DFlash generators call it
        assert cache.is_croppable and cache.get_recurrent_states_to_keep() == 0
        cache.activate_past_recording(recurrent_states_to_keep=5)
        assert cache.is_recording_past() and cache.get_recurrent_states_to_keep() == 5
        model(block, past_key_values=cache, use_cache=True)
        recorded = cache.rewind.record_bytes()
        cache.crop(-3)
        assert cache.rewind.pending_tokens == 0  # rolled back at the crop: nothing left for the model to run
        cache.crop(0)  # 5.25 crops by 0 after a round that kept every token: nothing removed, the record let go
        assert cache.get_seq_length() == 9 and cache.rewind.pending_tokens == 0
        shorter = cache_of(model(torch.cat([prefix, block[:, :2]], 1), use_cache=True))
        assert cache.get_seq_length() == 9
        # f32 projections of 5 + 2 rows against 9 rows (matmul batching): CPU kernels round them differently by
        # up to ~2e-6 (seen on an AMD EPYC); a state or window of the wrong tokens is off by orders more
        for layer in model.config.kda_layer_indices:
            (conv, state), (conv_ref, state_ref) = cache.kda_state(layer), shorter.kda_state(layer)
            torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)
            for window, window_ref in zip(conv, conv_ref, strict=True):
                torch.testing.assert_close(window, window_ref, atol=1e-5, rtol=1e-5)
        for layer in model.config.mla_layer_indices:
            torch.testing.assert_close(cache.layers[layer].latents, shorter.layers[layer].latents,
                                       atol=1e-5, rtol=1e-5)
        following = torch.randint(3, 128, (1, 1))
        torch.testing.assert_close(model(following, past_key_values=cache).logits,
                                   model(following, past_key_values=shorter).logits, atol=1e-5, rtol=0)

    assert recorded["tokens"] == 5
    assert recorded["per_token"] == rewind_record_bytes_per_token(model.config, dtype_bytes=4)  # f32 tiny model
    # The release: the record per verified token is a small fraction of one set of KDA states
    release = load_text_config()
    assert rewind_record_bytes_per_token(release) * 16 < snapshot_bytes(release)


def test_static_cache_refuses_assisted_decoding_by_name(model, repetitive_prompt):
    with pytest.raises(ValueError, match="cropped|Static cache"):  # 5.24 | 5.17 wording
        model.generate(repetitive_prompt, max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=2,
                       cache_implementation="static")


def _ks_statistic(samples: torch.Tensor) -> float:
    u, _ = samples.double().sort()
    n = u.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(ranks / n - u, u - (ranks - 1) / n).max())


def test_speculative_sampling_draws_from_the_target_distribution():
    """Seeded: sample 72 tokens with a disagreeing draft (many rejections and rewinds), then check every sampled
    token against the target's own conditional distribution given the tokens before it (one uncached forward).
    Randomised probability-integral transforms of exact draws are i.i.d. uniform; a state that kept a rejected
    token would sample from other conditionals."""
    target = build_tiny_model(num_hidden_layers=2, seed=1, vocab_size=16)
    draft = build_tiny_model(num_hidden_layers=2, seed=2, vocab_size=16)
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    prompt = torch.tensor([[5, 9, 3, 12]])
    torch.manual_seed(0)
    out = target.generate(prompt, do_sample=True, max_new_tokens=72, min_new_tokens=72, assistant_model=draft,
                          top_k=0, pad_token_id=0)
    with torch.no_grad():
        probs = target(out[:, :-1]).logits[0, prompt.shape[1] - 1 :].float().softmax(-1)
    tokens = out[0, prompt.shape[1] :]
    below = probs.cumsum(-1).gather(-1, tokens[:, None])[:, 0] - probs.gather(-1, tokens[:, None])[:, 0]
    pit = below + torch.rand(tokens.numel(), generator=torch.Generator().manual_seed(1)) * probs.gather(
        -1, tokens[:, None])[:, 0]
    assert _ks_statistic(pit) < 1.63 / tokens.numel() ** 0.5  # alpha = 0.01
