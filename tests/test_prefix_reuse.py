"""Prefix reuse: a prompt cache computed once serves many continuations exactly; KDA state snapshots let a cache go
back to any earlier token; the block-hash prefix store finds the longest reusable prefix."""

import copy
import pytest
import torch

from k3_test_utils import cache_of
from kimik3.memory import load_text_config, snapshot_memory
from kimik3.modeling.cache_kimi_k3 import KimiK3Cache, KimiK3StaticCache, snapshot_bytes
from kimik3.modeling.rewind_kimi_k3 import kept_snapshot_blocks
from kimik3.modeling.serving_kimi_k3 import KimiK3PrefixStore, block_hashes, build_prompt_cache
from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD
from kimik3.tiny import build_tiny_model

INTERVAL = 8  # tokens between snapshots in these tests (the release default is 40 blocks of 512)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(num_hidden_layers=6, seed=3)


@pytest.fixture(scope="module")
def prefix():
    return torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def prompt_cache(model, prefix):
    return build_prompt_cache(model, prefix, snapshot_interval=INTERVAL)


def _greedy(model, ids, **kwargs):  # the cache goes in under the installed transformers' name (CACHE_FIELD)
    return model.generate(ids, max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True,
                          **kwargs)


def _assert_same_run(reused, cold):
    assert torch.equal(reused.sequences, cold.sequences)
    for got, expected in zip(reused.scores, cold.scores, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def _model_calls(model):
    calls = []
    handle = model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                                   with_kwargs=True)
    return calls, handle


def test_one_prompt_cache_serves_many_continuations_exactly(model, prefix, prompt_cache):
    assert sorted(prompt_cache.rewind.snapshots) == [8, 16, 24]
    for seed in (1, 2):
        suffix = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(seed))
        ids = torch.cat([prefix, suffix], 1)
        calls, handle = _model_calls(model)
        reused = _greedy(model, ids, **{CACHE_FIELD: copy.deepcopy(prompt_cache)})
        handle.remove()
        assert calls[0] == 4  # only the suffix is prefilled
        _assert_same_run(reused, _greedy(model, ids))
    assert prompt_cache.get_seq_length() == 30  # the stored cache is untouched


def test_left_padded_batch_reuses_its_prompt_cache_exactly(model):
    rows = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 6, 10)]
    width = max(len(r) for r in rows)
    prefix = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]) for r in rows]).long()
    cache = build_prompt_cache(model, prefix, attention_mask=mask, snapshot_interval=4)
    suffix = torch.randint(3, 128, (3, 3), generator=torch.Generator().manual_seed(0))
    ids, full_mask = torch.cat([prefix, suffix], 1), torch.cat([mask, torch.ones(3, 3, dtype=torch.long)], 1)
    reused = _greedy(model, ids, attention_mask=full_mask, **{CACHE_FIELD: copy.deepcopy(cache)})
    _assert_same_run(reused, _greedy(model, ids, attention_mask=full_mask))
    # Rewinding inside the padded prefix replays with the recorded padding (tokens 8..11, before the next forward)
    cache.crop(11)
    with torch.no_grad():
        fresh = cache_of(model(prefix[:, :11], attention_mask=mask[:, :11], use_cache=True))
        for following in (cache, fresh):
            model(prefix[:, 11:12], attention_mask=mask[:, :12], past_key_values=following, use_cache=True)
    layer = model.config.kda_layer_indices[-1]
    torch.testing.assert_close(cache.kda_state(layer)[1], fresh.kda_state(layer)[1], atol=1e-6, rtol=1e-5)


def test_snapshots_do_not_change_the_prefill(model, prefix):
    with torch.no_grad():
        plain = model(prefix, use_cache=True)
        cache = KimiK3Cache(model.config, snapshot_interval=INTERVAL, snapshot_device="cpu")
        snapped = model(prefix, past_key_values=cache, use_cache=True)
    # f32, the chunked recurrence split at the snapshot offsets: the same sums in another order, which CPU kernels
    # round differently by up to ~1e-6 (seen on an AMD EPYC); a wrong carried state would be off by orders more
    torch.testing.assert_close(snapped.logits, plain.logits, atol=1e-5, rtol=1e-5)
    layer = model.config.kda_layer_indices[0]
    torch.testing.assert_close(cache.kda_state(layer)[1], cache_of(plain).kda_state(layer)[1], atol=1e-5, rtol=1e-5)
    assert cache.rewind.snapshot_bytes_held() == 3 * snapshot_bytes(model.config, dtype_bytes=4)


def test_crop_works_for_every_length(model, prefix, prompt_cache):
    """Any n: the nearest snapshot at or below n is restored and the tokens between are replayed by the next
    forward, before its own token (at a snapshot nothing is replayed); the states are then those of a prefill of
    n + 1 tokens (here: snapshots taken at every token)."""
    reference = build_prompt_cache(model, prefix, snapshot_interval=1)
    mla = model.config.mla_layer_indices[0]
    for n in range(1, 30):
        calls, handle = _model_calls(model)
        cache = prompt_cache.copy_prefix(n)
        assert cache.get_seq_length() == n and calls == []  # rewinding runs nothing of the model
        assert cache.rewind.pending_tokens == n % INTERVAL
        with torch.no_grad():
            model(prefix[:, n:n + 1], past_key_values=cache, use_cache=True)
        handle.remove()
        # the forward of one token (its pre-hook fires first) runs the pending tokens inside, before its own
        assert cache.get_seq_length() == n + 1 and calls == [1] + ([n % INTERVAL] if n % INTERVAL else [])
        for layer in model.config.kda_layer_indices:
            (conv, state), (conv_ref, state_ref) = cache.kda_state(layer), reference.rewind.snapshots[n + 1][layer]
            torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(conv, conv_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.layers[mla].latents, reference.layers[mla].latents[:, :n + 1],
                                   atol=1e-5, rtol=1e-5)
    assert prompt_cache.get_seq_length() == 30  # copy_prefix leaves the source alone
    following = torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(3))
    cache = copy.deepcopy(prompt_cache)
    cache.crop(-9)  # negative: remove that many
    with torch.no_grad():
        expected = model(torch.cat([prefix[:, :21], following], 1)).logits[:, -1]
        torch.testing.assert_close(model(following, past_key_values=cache).logits[:, -1], expected,
                                   atol=1e-5, rtol=0)


def test_snapshot_memory_stays_under_its_bound(model, prefix):
    """Three snapshots' worth of bytes: the policy (kept_snapshot_blocks) keeps the block ends nearest the end and
    thins further back, planned before each forward, so its own snapshots never exceed the bound."""
    one = snapshot_bytes(model.config, dtype_bytes=4)
    cache = KimiK3Cache(model.config, snapshot_interval=4, max_snapshot_bytes=3 * one)
    with torch.no_grad():
        model(prefix[:, :20], past_key_values=cache, use_cache=True)  # 5 block ends would not fit
        assert sorted(cache.rewind.snapshots) == [8, 16, 20] and cache.rewind.dense_blocks == 2
        model(prefix[:, 20:], past_key_values=cache, use_cache=True)  # 7 blocks: 16 stays, 8 and 20 go
        assert sorted(cache.rewind.snapshots) == [16, 24, 28]
        model(torch.cat([prefix, prefix], 1)[:, 30:], past_key_values=cache, use_cache=True)  # 15 blocks
    # even a 1-block window keeps 4 there (15, 14, 12, 8): the 3 most recent
    assert sorted(cache.rewind.snapshots) == [48, 56, 60] and cache.rewind.dense_blocks == 1
    assert cache.rewind.snapshot_bytes_held() <= 3 * one
    with pytest.raises(ValueError, match="snapshot_interval"):
        KimiK3Cache(model.config, snapshot_interval=0)


def test_prefix_store_returns_the_longest_reusable_prefix(model, prefix, prompt_cache):
    store = KimiK3PrefixStore(block_size=INTERVAL)
    store.insert(prefix, copy.deepcopy(prompt_cache))
    assert len(block_hashes(prefix, INTERVAL)) == 3
    extended = torch.cat([prefix, torch.tensor([[5, 6, 7]])], 1)
    reused, cache = store.lookup(extended)
    assert reused == 30 and cache.get_seq_length() == 30
    _assert_same_run(_greedy(model, extended, **{CACHE_FIELD: cache}), _greedy(model, extended))

    diverging = torch.cat([prefix[:, :20], torch.tensor([[9, 9, 9, 9]])], 1)  # shares 20 tokens: 2 whole blocks
    reused, cache = store.lookup(diverging)
    assert reused == 16
    _assert_same_run(_greedy(model, diverging, **{CACHE_FIELD: cache}), _greedy(model, diverging))

    assert store.lookup(prefix)[0] == 24  # at most len - 1 tokens: the last block boundary below 30
    assert store.lookup(torch.tensor([[4, 4, 4]])) == (0, None)
    stats = store.stats()
    assert stats["hits"] == 3 and stats["misses"] == 1 and stats["tokens_reused"] == 30 + 16 + 24
    assert stats["bytes_held"] >= prompt_cache.live_bytes()["total"] + prompt_cache.rewind.snapshot_bytes_held()
    with pytest.raises(ValueError, match="30 tokens"):
        store.insert(prefix[:, :10], prompt_cache)


def test_prefix_store_evicts_least_recently_used_past_its_bound(model, prefix, prompt_cache):
    other = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    store = KimiK3PrefixStore(block_size=INTERVAL, max_bytes=int(1.5 * KimiK3PrefixStore(INTERVAL).bytes_held()
                                                                 + 1.5 * _held(prompt_cache)))
    store.insert(prefix, prompt_cache)
    store.insert(other, build_prompt_cache(model, other, snapshot_interval=INTERVAL))
    assert store.stats()["entries"] == 1 and store.lookup(torch.cat([prefix, other], 1)) == (0, None)


def _held(cache):
    return cache.live_bytes()["total"] + cache.rewind.snapshot_bytes_held()


def test_kimik3_memory_reports_snapshot_memory(capsys):
    release = load_text_config()
    rows = snapshot_memory(release, [65536, 1048576])
    per = 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2)
    assert [r["snapshots"] for r in rows] == [3, 51] and rows[0]["bytes_per_snapshot"] == per
    assert rows[1]["snapshot_bytes"] == 51 * per
    from kimik3.cli import main

    assert main(["memory", "--tokens", "65536", "--snapshot-blocks", "20", "--units", "GB"]) == 0
    out = capsys.readouterr().out
    assert "KDA state snapshots for prefix reuse, one every 10240 tokens" in out
    # 6 snapshots of one every 20 blocks in 64K tokens, in the table's unit
    assert f"{6 * per / 1e9:,.3f} GB" in out.split("KDA state snapshots")[1]


@pytest.mark.parametrize("option, value", [("snapshot_interval", -4), ("snapshot_interval", True),
                                           ("snapshot_interval", 2.5), ("max_snapshot_bytes", 0),
                                           ("max_rewind_tokens", -1), ("max_rewind_tokens", False)])
def test_cache_options_must_be_positive_integers(model, option, value):
    with pytest.raises(ValueError, match=f"{option} must be a positive integer or None, got {value!r}"):
        KimiK3Cache(model.config, **{option: value})


def test_prefix_store_refuses_what_it_cannot_key(model, prefix, prompt_cache):
    store = KimiK3PrefixStore(block_size=INTERVAL)
    with pytest.raises(ValueError, match=r"one prompt at a time .*got \(2, 30\)"):
        store.lookup(torch.cat([prefix, prefix]))
    with pytest.raises(TypeError, match="needs a growing KimiK3Cache"):
        store.insert(prefix[0], KimiK3StaticCache(model.config, max_cache_len=64))
    with pytest.raises(TypeError, match="needs a growing KimiK3Cache"):
        store.insert(prefix[0], {"not": "a cache"})
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        KimiK3PrefixStore(block_size=0)
    assert store.stats()["entries"] == 0


def test_pending_tokens_follow_copies_and_row_reorders(model):
    """A crop between snapshots leaves tokens for the next forward: they survive deepcopy, a second crop and a
    reorder of the rows (their ids are reordered with them), and the forward after gives a prefill's logits."""
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = cache_of(model(ids[:, :12], past_key_values=KimiK3Cache(model.config, snapshot_interval=8)))
        cache.crop(11)
        cache.crop(10)  # again while tokens are pending: still from the snapshot at 8
        assert cache.get_seq_length() == 10 and cache.rewind.pending_tokens == 2
        copied = copy.deepcopy(cache)
        copied.reorder_cache(torch.tensor([1, 0]))
        rows = ids[[1, 0]]
        got = model(rows[:, 10:11], past_key_values=copied).logits
        expected = model(rows[:, :11]).logits[:, -1:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cache.rewind.pending_tokens == 2 and copied.rewind.pending_tokens == 0  # the source is untouched


def test_crop_needing_a_replay_of_embeddings_is_refused_at_the_crop(model, prefix):
    cache = KimiK3Cache(model.config, snapshot_interval=INTERVAL)
    with torch.no_grad():
        model(inputs_embeds=model.get_input_embeddings()(prefix[:, :20]), past_key_values=cache)
    cache.crop(16)  # at a snapshot: nothing to replay
    assert cache.get_seq_length() == 16 and cache.rewind.pending_tokens == 0
    with pytest.raises(NotImplementedError, match=r"crop\(12\).*nearest snapshot is at 8 .*inputs_embeds"):
        cache.crop(12)
    assert cache.get_seq_length() == 16  # left as it was


# ----------------------------------------------------------------------------------------------------------------
# Hits at any block boundary (docs/design.md, Rewinding): snapshots at block ends written by the prefill itself,
# kept sparse under a byte budget by kept_snapshot_blocks

BLOCK = 16  # the tiny model's KDA chunk size: a block end is a chunk end, as 512 is for the release's 64


@pytest.fixture(scope="module")
def stored():
    return torch.randint(3, 128, (1, 5 * BLOCK + 7), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def block_store(model, stored):
    calls, handle = _model_calls(model)
    cache = build_prompt_cache(model, stored, snapshot_interval=BLOCK)
    handle.remove()
    # one forward wrote every block end: nothing was replayed to get them
    assert calls == [stored.shape[1]] and cache.rewind.replayed_tokens == 0
    assert sorted(cache.rewind.snapshots) == [BLOCK * i for i in range(1, 6)]
    store = KimiK3PrefixStore(block_size=BLOCK)
    store.insert(stored, cache)
    return store


@pytest.mark.parametrize("shared, hit", [(BLOCK, BLOCK), (3 * BLOCK, 3 * BLOCK), (5 * BLOCK, 5 * BLOCK),
                                         (3 * BLOCK + 9, 3 * BLOCK), (5 * BLOCK + 7, 5 * BLOCK + 7)])
def test_block_boundary_hits_equal_a_cold_run_and_replay_less_than_a_block(model, stored, block_store, shared, hit):
    """First block, a middle one, the last full one, a prompt diverging mid-block (hit at the boundary below) and
    the whole stored prompt: the state comes from the snapshot written there, nothing (< a block) is replayed, and
    greedy tokens and every step's logits equal a cold run's (atol 1e-5, the tolerance of this file's reuse tests)."""
    tail = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(shared))
    ids = torch.cat([stored[:, :shared], tail], 1)
    reused, cache = block_store.lookup(ids)
    assert reused == hit and cache.get_seq_length() == hit
    assert cache.rewind.pending_tokens < BLOCK
    got = _greedy(model, ids, **{CACHE_FIELD: cache})
    assert cache.rewind.replayed_tokens < BLOCK  # counted by the rewind component as the model ran them
    _assert_same_run(got, _greedy(model, ids))


def _replay_bound(distance, dense):
    """The policy's guarantee (kept_snapshot_blocks), in tokens: a hit at the block `distance` blocks before the end
    of a cache replays nothing inside the dense window, else fewer than 2**(level + 1) blocks."""
    level = (distance // dense + 1).bit_length() - 1
    return 0 if level == 0 else (2 ** (level + 1) - 1) * BLOCK


def test_policy_guarantee_and_budget_hold_as_prompts_are_inserted_and_evicted(model):
    one = snapshot_bytes(model.config, dtype_bytes=4)
    budget = 4 * one
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (90, 150, 135)]
    caches, windows = [], {}
    for ids in prompts:
        cache = KimiK3Cache(model.config, snapshot_interval=BLOCK, max_snapshot_bytes=budget)
        with torch.no_grad():
            for start in range(0, ids.shape[1], 40):  # a chunked prefill: earlier forwards' snapshots get thinned
                model(ids[:, start:start + 40], past_key_values=cache, use_cache=True)
                assert cache.rewind.snapshot_bytes_held() <= budget and len(cache.rewind.snapshots) <= 4
        blocks, dense = ids.shape[1] // BLOCK, cache.rewind.dense_blocks
        assert dense >= 2  # 4 snapshots over 8-9 blocks: two dense block ends, then every 2nd, 4th
        for b in range(1, blocks + 1):
            assert b * BLOCK - cache.rewind.restore_position(b * BLOCK) <= _replay_bound(blocks - b, dense)
        caches.append(cache)
        windows[ids.shape[1]] = dense
    store = KimiK3PrefixStore(block_size=BLOCK, max_bytes=int(2.5 * _held(caches[1])))
    for number, (ids, cache) in enumerate(zip(prompts, caches)):
        store.insert(ids, cache)
        assert store.bytes_held() <= store.max_bytes
        held = prompts[max(number - 1, 0):number + 1]  # two fit: the oldest goes
        assert store.stats()["entries"] == len(held)
        for other in prompts[:number + 1]:
            blocks = other.shape[1] // BLOCK
            for b in range(1, blocks + 1):
                diverging = torch.cat([other[:, :b * BLOCK], torch.tensor([[1, 2]])], 1)
                reused, hit = store.lookup(diverging)
                if not any(p is other for p in held):
                    assert reused == 0  # evicted: its blocks are no hit any more
                    continue
                assert reused == b * BLOCK
                assert hit.rewind.pending_tokens <= _replay_bound(blocks - b, windows[other.shape[1]])
    # a hit that the budget made replay: the replay through the model's next forward equals a cold run
    ids = torch.cat([prompts[2][:, :3 * BLOCK], torch.tensor([[5, 6, 7]])], 1)
    reused, cache = store.lookup(ids)
    pending = cache.rewind.pending_tokens
    assert reused == 3 * BLOCK and pending == 3 * BLOCK  # 4 snapshots over 8 blocks: 8, 7, 6, 4
    _assert_same_run(_greedy(model, ids, **{CACHE_FIELD: cache}), _greedy(model, ids))
    assert cache.rewind.replayed_tokens == pending


def test_lookup_takes_the_stored_prompt_with_the_nearest_usable_state(model, stored, block_store):
    """The newest entry sharing the prefix has no snapshot there (none taken; or filled from inputs_embeds, so not
    replayable): the lookup takes the older one, whose block-end snapshot needs no replay."""
    store = KimiK3PrefixStore(block_size=BLOCK)
    store.insert(stored, block_store._entries[next(iter(block_store._entries))][1])
    store.insert(stored[:, :4 * BLOCK + 3], build_prompt_cache(model, stored[:, :4 * BLOCK + 3],
                                                               snapshot_interval=None))
    with torch.no_grad():
        embedded = KimiK3Cache(model.config)
        model(inputs_embeds=model.get_input_embeddings()(stored[:, :4 * BLOCK + 1]), past_key_values=embedded)
    store.insert(stored[:, :4 * BLOCK + 1], embedded)
    ids = torch.cat([stored[:, :4 * BLOCK + 2], torch.tensor([[9, 9]])], 1)
    reused, cache = store.lookup(ids)
    assert (reused, cache.rewind.pending_tokens) == (4 * BLOCK + 1, 0)  # the embedded one's live state
    ids = torch.cat([stored[:, :4 * BLOCK], torch.tensor([[9, 9]])], 1)
    reused, cache = store.lookup(ids)
    assert (reused, cache.rewind.pending_tokens) == (4 * BLOCK, 0)
    assert store.stats()["tokens_replayed"] == 0


def test_kept_snapshot_blocks_is_monotone_and_bounded():
    for dense in (1, 2, 3, 8):
        previous = set()
        for blocks in range(1, 200):
            kept = kept_snapshot_blocks(blocks, dense)
            assert set(range(max(blocks - dense + 1, 1), blocks + 1)) <= set(kept)  # the dense window
            assert set(previous) - set(kept) <= set(range(1, blocks + 1)) - set(kept)
            # a block kept now was kept at every shorter length from it on
            assert all(i in previous or i == blocks for i in kept)
            assert len(kept) <= dense * (blocks // dense + 1).bit_length()
            for i in range(1, blocks + 1):  # the replay bound
                below = max((k for k in kept if k <= i), default=0)
                assert i - below <= _replay_bound(blocks - i, dense) // BLOCK
            previous = set(kept)
        assert set(kept_snapshot_blocks(150, dense)) <= set(kept_snapshot_blocks(150, dense + 1))


@pytest.mark.parametrize("case", [pytest.param("budget", id="snapshot-budget-below-one-state"),
                                  pytest.param("grid", id="prefix-store-snapshots-off-the-block-grid")])
def test_block_snapshot_options_refused_by_name(model, stored, case):
    one = snapshot_bytes(model.config, dtype_bytes=4)
    if case == "budget":
        with pytest.raises(ValueError, match=f"max_snapshot_bytes={one - 1} holds no KDA state snapshot: one is "
                                             f"{one} bytes"):
            KimiK3Cache(model.config, snapshot_interval=BLOCK, max_snapshot_bytes=one - 1)
        return
    store = KimiK3PrefixStore(block_size=BLOCK)
    with pytest.raises(ValueError, match=f"snapshots every 12 tokens.*store's {BLOCK}-token blocks"):
        store.insert(stored[:, :24], build_prompt_cache(model, stored[:, :24], snapshot_interval=12))
    assert store.stats()["entries"] == 0
