"""generate(), left padding, beam search and the hybrid cache."""

import pytest
import torch

from k3_test_utils import cache_of
from kimik3.tiny import build_tiny_model
from kimik3.configuration import tiny_text_config_dict
from kimik3.modeling.cache_kimi_k3 import (
    KimiK3Cache,
    KimiK3KDAStateLayer,
    KimiK3LatentLayer,
    KimiK3StaticCache,
    KimiK3StaticKDAStateLayer,
    KimiK3StaticLatentLayer,
    analytic_cache_bytes,
)
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(num_hidden_layers=6, seed=3)


def test_generate_creates_the_hybrid_cache(model):
    ids = torch.randint(3, 128, (1, 6))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    cache = cache_of(out)
    assert isinstance(cache, KimiK3Cache) and cache.get_seq_length() == 10
    with torch.no_grad():
        seq = ids
        for _ in range(5):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out.sequences, seq)


def test_left_padded_batch_generates_exactly_what_each_prompt_does_alone(model):
    prompts = [torch.randint(3, 128, (n,)) for n in (9, 4, 1, 6)]
    alone = [model.generate(p[None], max_new_tokens=6, do_sample=False)[0, len(p):] for p in prompts]
    width = max(len(p) for p in prompts)
    batch = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    together = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)[:, width:]
    for row, expected in zip(together, alone):
        assert torch.equal(row, expected)


def test_padding_never_reaches_kda_state_or_conv_window(model):
    prompt = torch.randint(3, 128, (1, 7))
    padded = torch.cat([torch.randint(3, 128, (1, 5)), prompt], 1)  # garbage tokens under a zero mask
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], 1).long()
    with torch.no_grad():
        alone = cache_of(model(prompt, use_cache=True))
        masked = cache_of(model(padded, attention_mask=mask, use_cache=True))
    for layer in model.config.kda_layer_indices:
        (masked_conv, masked_state), (alone_conv, alone_state) = masked.kda_state(layer), alone.kda_state(layer)
        torch.testing.assert_close(masked_state, alone_state, atol=1e-6, rtol=1e-5)
        for a, b in zip(masked_conv, alone_conv):
            torch.testing.assert_close(a, b)


def test_beam_search_runs_and_matches_greedy_for_one_step(model):
    ids = torch.randint(3, 128, (2, 5))
    beams = model.generate(ids, max_new_tokens=4, num_beams=3, do_sample=False, num_return_sequences=2)
    assert beams.shape == (4, 9)
    one_step_beam = model.generate(ids, max_new_tokens=1, num_beams=3, do_sample=False)
    one_step_greedy = model.generate(ids, max_new_tokens=1, num_beams=1, do_sample=False)
    assert torch.equal(one_step_beam, one_step_greedy)
    # beam search scores its best beam at least as high as greedy's sequence
    with torch.no_grad():
        def logprob(seq):
            lp = torch.log_softmax(model(seq).logits[:, 4:-1].float(), -1)
            return lp.gather(-1, seq[:, 5:, None]).sum()
        best = model.generate(ids[:1], max_new_tokens=4, num_beams=4, do_sample=False, length_penalty=0.0)
        greedy = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        assert logprob(best) >= logprob(greedy) - 1e-5


def test_sampling_with_several_return_sequences(model):
    """Each prompt is repeated num_return_sequences times, every sampled token is one of the top_k tokens of the
    model's own logits at that step (checked by a teacher-forced forward over the whole sequence), the samples differ
    and are not greedy, and a seed reproduces them."""
    ids = torch.randint(3, 128, (2, 5))
    k, returns, new = 5, 3, 4

    def sample(seed):
        torch.manual_seed(seed)
        return model.generate(ids, max_new_tokens=new, do_sample=True, num_return_sequences=returns, top_k=k)

    out = sample(1)
    assert out.shape == (2 * returns, 5 + new)
    assert torch.equal(out[:, :5], ids.repeat_interleave(returns, dim=0))  # rows grouped per prompt
    with torch.no_grad():
        logits = model(out).logits[:, 4:-1]  # the logits each new token was drawn from
    top = logits.topk(k, dim=-1).indices
    assert (top == out[:, 5:, None]).any(-1).all()
    assert (out[:, 5:] != logits.argmax(-1)).any()  # sampled, not greedy
    for group in out[:, 5:].view(2, returns, new):
        assert len({tuple(row.tolist()) for row in group}) > 1  # the returned sequences of a prompt differ
    assert torch.equal(sample(1), out)
    assert not torch.equal(sample(2), out)


def test_cache_bytes_equal_analytic_and_mla_holds_only_the_latent(model):
    ids = torch.randint(3, 128, (3, 11))
    with torch.no_grad():
        cache = cache_of(model(ids, use_cache=True))
        cache = cache_of(model(ids[:, :1], cache=cache))
    config = model.config
    assert cache.live_bytes() == analytic_cache_bytes(config, 12, batch_size=3, dtype_bytes=4)
    for layer in config.mla_layer_indices:
        assert cache.layers[layer].latents.shape == (3, 12, config.kv_lora_rank + config.qk_rope_head_dim)
    for layer in config.kda_layer_indices:
        conv_states, recurrent_state = cache.kda_state(layer)
        assert recurrent_state.dtype == torch.float32
        assert conv_states[0].shape[-1] == config.linear_conv_kernel_size - 1
    # K3 at release size: 576 values/token/MLA layer; KDA state constant in the context length
    from kimik3.memory import load_text_config

    k3 = load_text_config(None)
    small, large = analytic_cache_bytes(k3, 131072), analytic_cache_bytes(k3, 1048576)
    assert large["kda_state"] == small["kda_state"] == 69 * 96 * 128 * 128 * 4
    assert large["mla_kv"] == 24 * 1048576 * 576 * 2 == 8 * small["mla_kv"]


def test_cache_builds_one_layer_object_per_layer_type_dynamic_or_static(model):
    config = model.config
    dynamic, static = KimiK3Cache(config), KimiK3StaticCache(config, max_cache_len=16)
    assert isinstance(static, KimiK3Cache) and static.is_static and not dynamic.is_static
    assert dynamic.rewind is not None and static.rewind is None  # only the growing cache can go back
    with pytest.raises(TypeError, match=r"KimiK3StaticCache\(config, max_cache_len=N\)"):
        KimiK3Cache(config, max_cache_len=16)  # one class per variant: no silent switch
    for layer_type, dynamic_layer, static_layer in zip(config.layer_types, dynamic.layers, static.layers):
        if layer_type == "linear_attention":
            assert type(dynamic_layer) is KimiK3KDAStateLayer and type(static_layer) is KimiK3StaticKDAStateLayer
        else:
            assert type(dynamic_layer) is KimiK3LatentLayer and type(static_layer) is KimiK3StaticLatentLayer
    # generate() compiles the decode step only for a compileable cache
    assert static.is_compileable and not dynamic.is_compileable
    assert dynamic.is_linear == [t == "linear_attention" for t in config.layer_types]
    assert dynamic.get_max_length() == -1 and static.get_max_length() == 16
    assert dynamic.kda_state(config.kda_layer_indices[0]) == (None, None) and not dynamic.has_previous_state()
    dynamic.crop(-2)  # nothing cached yet: a no-op even with KDA layers
    assert dynamic.get_seq_length() == 0
    with pytest.raises(NotImplementedError, match="update_latents"):
        dynamic.update(torch.zeros(1), torch.zeros(1), 0)  # the library's key/value entry point


def test_generate_cache_routes_give_the_same_tokens(model):
    """No cache, a cache generate() creates, a user's dynamic or static cache (filled in place and returned):
    the same greedy tokens. A cache of another kind is refused by name."""
    from transformers import DynamicCache

    ids = torch.randint(3, 128, (2, 5))
    greedy = dict(max_new_tokens=4, do_sample=False)
    default = model.generate(ids, **greedy)
    assert torch.equal(model.generate(ids, use_cache=False, **greedy), default)
    for user_cache in (KimiK3Cache(model.config), KimiK3StaticCache(model.config, max_cache_len=16)):
        out = model.generate(ids, return_dict_in_generate=True, **greedy, **{CACHE_FIELD: user_cache})
        assert torch.equal(out.sequences, default)
        assert cache_of(out) is user_cache and user_cache.get_seq_length() == 5 + 4 - 1
    with pytest.raises(TypeError, match="KimiK3Cache"):
        model.generate(ids, **greedy, **{CACHE_FIELD: DynamicCache()})


def test_cache_batch_operations(model):
    ids = torch.randint(3, 128, (2, 6))
    with torch.no_grad():
        base = cache_of(model(ids, use_cache=True))
        per_row = [cache_of(model(ids[i:i + 1], use_cache=True)) for i in range(2)]
    base.reorder_cache(torch.tensor([1, 0]))
    layer_kda, layer_mla = model.config.kda_layer_indices[0], model.config.mla_layer_indices[0]
    torch.testing.assert_close(base.kda_state(layer_kda)[1][0], per_row[1].kda_state(layer_kda)[1][0],
                               atol=1e-5, rtol=1e-4)
    base.batch_repeat_interleave(3)
    assert base.batch_size == 6 and base.layers[layer_mla].latents.shape[0] == 6
    base.batch_select_indices(torch.tensor([0, 5]))
    torch.testing.assert_close(base.layers[layer_mla].latents[1], per_row[0].layers[layer_mla].latents[0],
                               atol=1e-5, rtol=1e-4)
    base.crop(3)  # KDA layers: the recorded token ids (reordered with the rows) replay from the empty state
    assert base.get_seq_length() == 3 and base.rewind.pending_tokens == 3  # run by the next forward
    with torch.no_grad():
        fresh = cache_of(model(ids[[1, 0], :3], use_cache=True))
        following = ids[[1, 0], 3:4]
        torch.testing.assert_close(model(following, cache=base).logits, model(following, cache=fresh).logits,
                                   atol=1e-5, rtol=1e-4)
    assert base.get_seq_length() == 4 and base.rewind.pending_tokens == 0
    torch.testing.assert_close(base.kda_state(layer_kda)[1], fresh.kda_state(layer_kda)[1], atol=1e-5, rtol=1e-4)
    base.reset()
    assert base.get_seq_length() == 0 and base.live_bytes()["total"] == 0


def test_crop_on_an_mla_only_model_matches_a_shorter_prefill():
    cfg = tiny_text_config_dict(num_hidden_layers=2)
    cfg["linear_attn_config"].update(kda_layers=[], full_attn_layers=[1, 2])
    model = KimiK3ForCausalLM(KimiK3TextConfig(**cfg)).eval()
    ids = torch.randint(3, 128, (1, 10))
    with torch.no_grad():
        cache = cache_of(model(ids, use_cache=True))
        cache.crop(-4)
        assert cache.get_seq_length() == 6
        continued = model(ids[:, 6:7], cache=cache).logits
        fresh = model(ids[:, :7]).logits[:, -1:]
    torch.testing.assert_close(continued, fresh, atol=1e-5, rtol=1e-5)


def test_continue_generation_from_a_returned_cache(model):
    ids = torch.randint(3, 128, (1, 5))
    first = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    more = model.generate(first.sequences, max_new_tokens=3, do_sample=False,
                          **{"past_key_values" if not hasattr(first, "cache") else "cache": cache_of(first)})
    straight = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(more, straight)


def test_generate_from_inputs_embeds_equals_from_ids(model):
    ids = torch.randint(3, 128, (2, 6))
    from_ids = model.generate(ids, max_new_tokens=4, do_sample=False)[:, 6:]
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(from_embeds, from_ids)
