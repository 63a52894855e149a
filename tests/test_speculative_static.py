"""Speculative decoding on the static cache (modeling_kimik3/generate_kimi_k3.py, speculative rounds; the rewind:
cache_kimi_k3.py `begin_round` / `rewind_round`, rewind_kimi_k3.py `KimiK3StaticRewind`; docs/design.md, Decode loop
and Rewinding): greedy speculative tokens are plain greedy tokens in fp32 with drafts that agree, disagree and
partly agree and with prompt lookup; the acceptance the loop reports is the one the test computes from plain
greedy runs; the rolled-back KDA states and conv windows are those of plain decoding of the kept tokens."""

import math
import statistics

import pytest
import torch
from transformers import GenerationMixin

import kimik3.modeling.generate_kimi_k3 as loop
from k3_test_utils import Recorder, assert_same_streamer_calls
from kimik3.draft import slice_draft_model
from kimik3.modeling.cache_kimi_k3 import KimiK3StaticCache
from kimik3.tiny import build_tiny_model

NEW = 10


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(num_hidden_layers=4, seed=3).eval()


@pytest.fixture(scope="module")
def drafts(model):
    return {"agrees": model, "disagrees": build_tiny_model(num_hidden_layers=2, seed=9).eval(),
            "slice": slice_draft_model(model, 2)}


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def expected(model, prompt):
    return plain(model, prompt, max_new_tokens=NEW)


def plain(model, ids, **kwargs):
    return GenerationMixin.generate(model, ids, cache_implementation="static", do_sample=False, **kwargs)


def speculative(model, ids, report=None, **kwargs):
    kwargs.setdefault("eos_token_id", None)
    kwargs.setdefault("decode_fallback", False)  # rounds throughout: the acceptance is counted round by round
    return loop.generate(ids, model=model, cache_implementation="static", do_sample=False, decode_report=report,
                         **kwargs)


def rounds_acceptance(draft, sequence, prompt_length, rounds, proposals):
    """The acceptance a greedy round computes, from plain greedy runs: from the last kept token on, the draft's k
    greedy tokens against the target's, the leading matches accepted, the next round after the first rejection."""
    accepted, last = [], prompt_length  # index of the round's last token in `sequence`
    for _ in range(rounds):
        proposal = plain(draft, sequence[:, : last + 1], max_new_tokens=proposals, eos_token_id=None)
        proposal = proposal[0, last + 1:]
        target = sequence[0, last + 1: last + 1 + proposals]
        agree = (proposal[: len(target)] == target).long().cumprod(0).sum().item()
        accepted.append(agree)
        last += agree + 1
    return accepted


@pytest.mark.parametrize("kind", ["agrees", "disagrees", "slice"])
def test_draft_greedy_is_plain_greedy_and_the_acceptance_is_the_computed_one(model, drafts, prompt, expected, kind):
    report = {}
    got = speculative(model, prompt, report, max_new_tokens=NEW, assistant_model=drafts[kind],
                      num_assistant_tokens=3, decode_block_steps=1)
    assert torch.equal(got, expected)
    assert report["rounds"] >= 2 and report["proposed"] == 3 * report["rounds"]
    # the whole plain run, long enough for every round's proposals
    long = plain(model, prompt, max_new_tokens=NEW + 4 * report["rounds"], eos_token_id=None)
    computed = rounds_acceptance(drafts[kind], long, prompt.shape[1], report["rounds"], 3)
    assert report["accepted"] == sum(computed)
    if kind == "agrees":
        assert computed == [3] * report["rounds"]
    elif kind == "disagrees":
        assert sum(computed) == 0
    else:
        assert 0 < sum(computed) < report["proposed"]  # partial agreement: both branches of the acceptance ran


def test_prompt_lookup_greedy_is_plain_greedy(model):
    phrase = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([phrase, phrase, phrase[:, :3]], dim=1)
    report = {}
    got = speculative(model, ids, report, max_new_tokens=NEW, prompt_lookup_num_tokens=3)
    assert torch.equal(got, plain(model, ids, max_new_tokens=NEW))
    assert report["rounds"] >= 2


def test_prompt_lookup_proposes_what_follows_the_latest_longest_match():
    lookup = loop.PromptLookup(ngram=2)
    #                         0  1  2  3  4  5  6  7  8  9 10 11
    history = torch.tensor([[5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6, 0, 0, 0],   # "5 6" at 0 and 4: the latest, 4 -> 8 2 9
                            [3, 4, 1, 2, 9, 9, 1, 3, 3, 7, 4, 0, 0, 0],   # "7 4" nowhere, "4" at 1 -> 1 2 9
                            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0]])  # no match: any proposal
    length = torch.tensor([11])
    got = lookup(None, None, length, history, None, None, 3)
    assert got[0].tolist() == [8, 2, 9]
    assert got[1].tolist() == [1, 2, 9]
    assert got.shape == (3, 3)


@pytest.mark.parametrize("keep", [1, 3, 4])
def test_rolled_back_states_are_plain_decodings_of_the_kept_tokens(model, prompt, keep):
    new = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = KimiK3StaticCache(model.config, max_cache_len=32)
        model(input_ids=prompt, cache=reference)
        for index in range(keep):
            model(input_ids=new[:, index: index + 1], cache=reference)
        # the target's way: one verify of 4 tokens; the draft's way: 4 one-token steps; both roll back to `keep`
        verified, stepped = (KimiK3StaticCache(model.config, max_cache_len=32) for _ in range(2))
        for cache in (verified, stepped):
            model(input_ids=prompt, cache=cache)
            cache.enable_rewind(4)
            cache.begin_round()
        verify_logits = model(input_ids=new, cache=verified).logits
        step_logits = torch.cat([model(input_ids=new[:, index: index + 1], cache=stepped).logits
                                 for index in range(4)], dim=1)
        # the verify's T tokens see what T decode steps see (the cached keys, then their own causal prefix)
        torch.testing.assert_close(verify_logits, step_logits, atol=1e-5, rtol=0)
        for cache in (verified, stepped):
            cache.rewind_round(torch.tensor([keep]))
            assert cache.get_seq_length() == prompt.shape[1] + keep
            assert cache.key_valid[0].sum().item() == prompt.shape[1] + keep
            for layer in cache.kda_layer_indices:
                got, want = cache.layers[layer], reference.layers[layer]
                torch.testing.assert_close(got.recurrent_state, want.recurrent_state, atol=1e-6, rtol=0)
                for window, expected_window in zip(got.conv_states, want.conv_states):
                    torch.testing.assert_close(window, expected_window, atol=1e-6, rtol=0)
        # and decoding goes on from there as from the plain cache
        follow = new[:, :1]
        torch.testing.assert_close(model(input_ids=follow, cache=verified).logits,
                                   model(input_ids=follow, cache=reference).logits, atol=1e-5, rtol=0)


def test_eos_inside_an_accepted_run_stops_where_plain_generate_stops(model, prompt, expected):
    eos = int(expected[0, prompt.shape[1] + 6])  # inside the second round of 4 accepted tokens
    first = (expected[0, prompt.shape[1]:] == eos).nonzero()[0].item()
    want = plain(model, prompt, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert want.shape[1] == prompt.shape[1] + first + 1
    report = {}
    got = speculative(model, prompt, report, max_new_tokens=NEW, assistant_model=model, num_assistant_tokens=3,
                      eos_token_id=eos, pad_token_id=0, decode_block_steps=1)
    assert torch.equal(got, want) and report["accepted"] == 3 * report["rounds"]


def test_a_padded_batch_accepts_the_rows_common_run(model, drafts):
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=generator) for n in (9, 4, 6)]
    ids = torch.stack([torch.cat([torch.zeros(9 - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(9 - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    free = plain(model, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    eos = int(free[1, 9 + 2])  # one row stops mid-run, the others go on
    kwargs = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    want = plain(model, ids, **kwargs)
    for draft in (model, drafts["slice"]):
        assert torch.equal(speculative(model, ids, assistant_model=draft, num_assistant_tokens=2, **kwargs), want)


def test_a_streamer_gets_the_calls_of_transformers_loop(model, drafts, prompt):
    theirs, mine = Recorder(), Recorder()
    plain(model, prompt, max_new_tokens=9, streamer=theirs)
    speculative(model, prompt, max_new_tokens=9, streamer=mine, assistant_model=drafts["slice"],
                num_assistant_tokens=2)
    assert_same_streamer_calls(mine, theirs, 1 + 9 + 1)


def test_speculative_sampling_goes_to_transformers_saying_why(model, drafts):
    assert loop.call_refusal(model, (), dict(cache_implementation="static", do_sample=True,
                                             assistant_model=drafts["slice"])).startswith("speculative sampling")
    assert loop.call_refusal(model, (), dict(cache_implementation="static", do_sample=False,
                                             assistant_model=drafts["slice"])) is None
    assert loop.call_refusal(model, (), dict(cache_implementation="static", prompt_lookup_num_tokens=3)) is None


def test_a_draft_of_another_vocabulary_is_refused_naming_both(model, prompt):
    other = build_tiny_model(num_hidden_layers=2, seed=1, vocab_size=160).eval()
    with pytest.raises(ValueError, match=r"draft's vocabulary \(160 ids\) is not the target's"):
        speculative(model, prompt, max_new_tokens=4, assistant_model=other)


def test_zero_proposals_are_refused(model, prompt):
    with pytest.raises(ValueError, match=r"0 proposals per round"):
        speculative(model, prompt, max_new_tokens=4, prompt_lookup_num_tokens=0)


def test_the_benchmark_section_runs_every_target_side_by_side(model):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = {name: p.clone() for name, p in model.named_parameters()}
    result = bench.section_spec_static(model, "cpu", context=8, new_tokens=6, draft_layers=2, proposals=[2],
                                       alphas=[0.0], batches=[1], compiled=False, repeats=1, warm_up=False)
    (row,) = result["rows"]
    assert result["damped_parameters"] > 0
    for label in ("draft_k2", "draft_rounds_k2", "prompt_lookup_k2"):
        assert row[label]["rounds"] >= 1 and 0 <= row[label]["acceptance_rate"] <= 1
        assert row[label]["first_different_token"] is None  # fp32: the tokens are plain decode's
        assert row[label]["x_plain"] > 0
    assert row["plain"]["eager_first_different_token"] is None  # fp32: eager generate() is the same decoding
    # the damping is undone: the model's weights are as they were
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_bandwidth_bound_counts_the_slice_a_round_runs(model):
    """spec_bound's byte model of the draft (the target's kept layers, without building the slice) equals the bytes
    of the slice itself, and its bound follows from the bytes: below 1 at 0% acceptance (a round costs more than a
    step), (k + 1) x the step over the round at 100%."""
    import importlib.util
    from pathlib import Path

    from kimik3.draft import slice_draft_model

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from bench_k3 import byte_stats, decode_roofline

    result = bench.section_spec_bound(model, context=16, draft_layers=2, proposals=[1, 3])
    draft = slice_draft_model(model, 2)
    assert result["draft_step_bytes"] == decode_roofline(byte_stats(draft), draft.config, 1, 16)["bytes_per_step"]
    assert result["draft_lm_head_bytes"] == draft.lm_head.weight.nbytes
    for row in result["rows"]:
        k = row["k"]
        assert row["verify_bytes"] > result["plain_step_bytes"]  # k + 1 rows route to more experts than one
        assert row["round_bytes"] == ((k + 1) * result["draft_step_bytes"] - result["draft_lm_head_bytes"]
                                      + row["verify_bytes"])
        assert row["bound_x_plain"]["0.0"] < 1
        expected = (k + 1) * result["plain_step_bytes"] / row["round_bytes"]
        assert row["bound_x_plain"]["1.0"] == pytest.approx(expected, rel=1e-3)
        # a draft that reads nothing: the verify alone, above every real draft's bound, below 1 at 0% acceptance
        free = (k + 1) * result["plain_step_bytes"] / row["verify_bytes"]
        assert row["free_draft_bound_x_plain"]["1.0"] == pytest.approx(free, rel=1e-3)
        assert row["free_draft_bound_x_plain"]["0.0"] < 1
        assert all(row["free_draft_bound_x_plain"][rate] > row["bound_x_plain"][rate] for rate in row["bound_x_plain"])


def test_the_fallback_runs_plain_blocks_and_the_draft_catches_up_before_the_next_round(model, prompt, monkeypatch):
    # rounds always slower at the wall: plain blocks run between the rounds' tries
    monkeypatch.setattr(loop.SpeculativeLoop, "rounds_are_slower",
                        lambda self, rounds, plain: rounds is not None and plain is not None)
    monkeypatch.setattr(loop, "DEFAULT_BLOCK_STEPS", 4)  # plain blocks of 4 steps: fewer tokens to get there
    report = {}
    got = speculative(model, prompt, report, max_new_tokens=32, assistant_model=model, num_assistant_tokens=3,
                      decode_block_steps=1, decode_fallback=True)
    assert torch.equal(got, plain(model, prompt, max_new_tokens=32))
    # three rounds (two warm-up, one timed), three plain blocks to time plain steps, a retried round, plain again
    assert report["steps"] >= 3 * 4 and report["fallbacks"] >= 1 and report["rounds"] >= 4
    # the draft agrees with the target: after catching up with the plain blocks it still proposes the target's tokens
    assert report["accepted"] == report["proposed"]


def test_the_judge_reads_the_rounds_tokens_over_many_rounds_and_their_time_from_clean_blocks(monkeypatch):
    import gc
    import weakref

    monkeypatch.setattr(loop, "_WALL_FIGURES", weakref.WeakKeyDictionary())
    owner = torch.nn.Linear(1, 1)  # any module: the plain rates are kept per model
    judge = loop.WallJudge(owner, ("shape",), ("draft", 1, 4))
    assert judge.round_rate() is None and judge.plain_rate() is None
    judge.plain(8, 8.0)  # plain: a token a second
    # 90% acceptance at k = 4, a round as long as 2.5 plain steps: now and then a round gives 1 token; judged on
    # that round alone the rounds give 0.4 tokens a second; over the latest rounds 1.71
    judge.rounds([5, 5], None)  # warm-up rounds: their tokens count, their time does not
    assert judge.round_rate() is None  # no round timed yet
    judge.rounds([5], 2.5)
    for kept in ([5], [4], [5], [1]):
        judge.rounds(kept, 2.5)
    assert judge.round_rate() == pytest.approx((5 + 5 + 5 + 5 + 4 + 5 + 1) / 7 / 2.5)
    slower = loop.SpeculativeLoop.rounds_are_slower
    assert not slower(None, judge.round_rate(), judge.plain_rate())
    assert slower(None, 1 / 2.5, judge.plain_rate())  # what the last round alone would have said
    # only the latest ROUNDS_JUDGED rounds: acceptance that falls to 0% is seen within them
    judge.rounds([1] * loop.ROUNDS_JUDGED, 2.5 * loop.ROUNDS_JUDGED)
    assert judge.round_rate() == pytest.approx(1 / 2.5)
    assert slower(None, judge.round_rate(), judge.plain_rate())
    # the plain rate and the round's time outlive the call, per model, shape and proposer, and go with the model;
    # a later call judges from WARM_STEPS rounds' tokens on, before it times a round
    later = loop.WallJudge(owner, ("shape",), ("draft", 1, 4))
    assert later.plain_rate() == 1.0 and later.round_rate() is None
    later.rounds([1] * loop.WARM_STEPS, None)
    assert later.round_rate() == pytest.approx(1 / 2.5)
    other = loop.WallJudge(owner, ("shape",), ("lookup", 2, 4))
    other.rounds([1] * loop.WARM_STEPS, None)
    assert other.plain_rate() == 1.0 and other.round_rate() is None  # another proposer: its rounds are not timed
    assert loop.WallJudge(owner, ("other shape",), ("draft", 1, 4)).plain_rate() is None
    assert loop.WallJudge(torch.nn.Linear(1, 1), ("shape",), ("draft", 1, 4)).plain_rate() is None
    del owner, judge, later, other
    gc.collect()
    assert len(loop._WALL_FIGURES) == 0


def test_the_fallback_waits_for_evidence_when_the_rounds_tokens_vary(monkeypatch):
    import weakref

    monkeypatch.setattr(loop, "_WALL_FIGURES", weakref.WeakKeyDictionary())
    slower = loop.SpeculativeLoop.rounds_are_slower
    owner = torch.nn.Linear(1, 1)
    # plain: a token a second; a round 2 seconds, so the rounds pay from 2 tokens a round on. At ~40% acceptance
    # (k = 4) the first rounds kept 1, 3 and 1 tokens: a mean of 5/3 says slower, its error says it cannot tell yet
    judge = loop.WallJudge(owner, ("shape",), ("draft", 1, 4))
    judge.plain(8, 8.0)
    judge.rounds([1, 3], None)
    judge.rounds([1], 2.0)
    assert judge.round_rate() == pytest.approx(5 / 3 / 2)
    assert slower(None, judge.round_rate(), judge.plain_rate())
    spread = statistics.stdev([1, 3, 1]) / math.sqrt(3)
    assert judge.round_rate(optimistic=True) == pytest.approx((5 / 3 + spread) / 2)
    assert not slower(None, judge.round_rate(optimistic=True), judge.plain_rate())
    # more rounds that keep one token narrow the error until the verdict is slower
    for _ in range(4):
        judge.rounds([1], 2.0)
    assert slower(None, judge.round_rate(optimistic=True), judge.plain_rate())
    # at 0% acceptance every round keeps one token: no error, the verdict after the warm-up rounds as before
    zero = loop.WallJudge(owner, ("shape",), ("lookup", 2, 4))
    zero.rounds([1] * loop.WARM_STEPS, 2.0 * loop.WARM_STEPS)
    assert zero.round_rate(optimistic=True) == zero.round_rate() == pytest.approx(0.5)
    assert slower(None, zero.round_rate(optimistic=True), zero.plain_rate())


def test_a_call_after_one_that_timed_plain_blocks_judges_its_rounds_without_timing_them_again(model, prompt,
                                                                                              monkeypatch):
    import weakref

    monkeypatch.setattr(loop, "_WALL_FIGURES", weakref.WeakKeyDictionary())
    monkeypatch.setattr(loop.SpeculativeLoop, "rounds_are_slower", lambda self, rounds, plain: False)
    monkeypatch.setattr(loop, "DEFAULT_BLOCK_STEPS", 4)
    expected = plain(model, prompt, max_new_tokens=32)
    steps = []
    for _ in range(2):
        report = {}
        got = speculative(model, prompt, report, max_new_tokens=32, assistant_model=model, num_assistant_tokens=3,
                          decode_block_steps=1, decode_fallback=True)
        assert torch.equal(got, expected)
        assert report["fallbacks"] == 0
        steps.append(report["steps"])
    # the first call times plain blocks once (warm-up, capture, a clean one: 3 x 4 steps) and the second does not:
    # both end with the same tail of plain steps where the cache has no room for a round
    assert steps[0] - steps[1] == (loop.WARM_STEPS + 1) * 4
    assert sorted(key[0] for key in loop._WALL_FIGURES[model]) == ["plain", "round"]


def test_a_later_call_falls_back_after_its_warm_up_rounds(model, drafts, prompt, monkeypatch):
    import weakref

    monkeypatch.setattr(loop, "_WALL_FIGURES", weakref.WeakKeyDictionary())
    judged_at = {}  # call -> rounds run when the fallback first compares the rates
    call = 0

    def slower(self, rounds, plain):
        if rounds is not None and plain is not None:
            judged_at.setdefault(call, self.rounds_run)
        return rounds is not None and plain is not None

    monkeypatch.setattr(loop.SpeculativeLoop, "rounds_are_slower", slower)
    monkeypatch.setattr(loop, "DEFAULT_BLOCK_STEPS", 4)
    expected = plain(model, prompt, max_new_tokens=32)
    for call in (1, 2):
        report = {}
        got = speculative(model, prompt, report, max_new_tokens=32, assistant_model=drafts["disagrees"],
                          num_assistant_tokens=3, decode_block_steps=1, decode_fallback=True)
        assert torch.equal(got, expected) and report["fallbacks"] >= 1
    # the first call times a round (after the warm-up ones) and plain blocks before it can compare; the second
    # compares after its warm-up rounds, with the first call's figures
    assert judged_at[1] > loop.WARM_STEPS + 1 and judged_at[2] == loop.WARM_STEPS


def test_a_draft_that_is_not_kimi_k3_is_refused(model, prompt):
    with pytest.raises(ValueError, match=r"the draft \(Linear\) is not a Kimi K3 model"):
        speculative(model, prompt, max_new_tokens=4, assistant_model=torch.nn.Linear(2, 2))


def test_a_round_after_the_rows_are_repeated_rewinds_every_row(model, prompt):
    """transformers repeats a cache's rows (`batch_repeat_interleave`, e.g. num_return_sequences): the static
    cache's rewind component repeats its round's base and record with them, so a round on the repeated cache rewinds
    each row to the state a one-row cache reaches."""
    new = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        single, repeated = (KimiK3StaticCache(model.config, max_cache_len=32) for _ in range(2))
        for cache in (single, repeated):
            model(input_ids=prompt, cache=cache)
            cache.enable_rewind(4)
        repeated.batch_repeat_interleave(2)
        for cache, ids in ((single, new), (repeated, new.repeat(2, 1))):
            cache.begin_round()
            model(input_ids=ids, cache=cache)
            cache.rewind_round(torch.tensor([2]))
        for layer in single.kda_layer_indices:
            for row in range(2):
                torch.testing.assert_close(repeated.layers[layer].recurrent_state[row],
                                           single.layers[layer].recurrent_state[0], atol=1e-6, rtol=0)
        with pytest.raises(NotImplementedError, match="copy_prefix: not supported for a static cache"):
            single.copy_prefix(2)
