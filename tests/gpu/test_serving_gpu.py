"""Prefix reuse and speculative decoding on CUDA, where the KDA recurrence, its rollback replay and the conv run
through the fast kernels (fla-core when importable; its chunked form uses tf32 dots, hence 5e-3 on the scores):
same tokens as plain decoding, snapshots offloaded to CPU."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    from kimik3.tiny import build_tiny_model

    return build_tiny_model(num_hidden_layers=6, hidden_size=128, num_heads=4, head_dim=64, seed=3).cuda()


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True, **kwargs)


def _assert_same_run(got, expected, atol):
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_assisted_greedy_is_plain_greedy_on_cuda(model):
    from kimik3.modeling.serving_kimi_k3 import slice_draft_model

    phrase = torch.randint(3, 128, (1, 16), device="cuda")
    ids = torch.cat([phrase, phrase, phrase[:, :6]], 1)
    plain = _greedy(model, ids)
    _assert_same_run(_greedy(model, ids, prompt_lookup_num_tokens=4), plain, atol=5e-3)
    draft = slice_draft_model(model, 2)
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    _assert_same_run(_greedy(model, ids, assistant_model=draft), plain, atol=5e-3)


def test_prompt_cache_with_cpu_snapshots_reuses_exactly_on_cuda(model):
    from kimik3.modeling.serving_kimi_k3 import KimiK3PrefixStore, build_prompt_cache

    prefix = torch.randint(3, 128, (1, 200), device="cuda")
    cache = build_prompt_cache(model, prefix, snapshot_interval=64, snapshot_device="cpu")
    assert sorted(cache.snapshots) == [64, 128, 192]
    assert all(state.device.type == "cpu" for states in cache.snapshots.values() for _, state in states.values())
    ids = torch.cat([prefix, torch.randint(3, 128, (1, 5), device="cuda")], 1)
    cold = _greedy(model, ids)
    _assert_same_run(_greedy(model, ids, past_key_values=copy.deepcopy(cache)), cold, atol=5e-3)
    store = KimiK3PrefixStore(block_size=64)
    store.insert(prefix[0], cache)
    diverging = torch.cat([prefix[:, :150], torch.randint(3, 128, (1, 5), device="cuda")], 1)
    reused, partial = store.lookup(diverging)  # 128 tokens: restored from the CPU snapshot, nothing replayed
    assert reused == 128 and partial.kda_state(model.config.kda_layer_indices[0])[1].device.type == "cuda"
    _assert_same_run(_greedy(model, diverging, past_key_values=partial), _greedy(model, diverging), atol=5e-3)
