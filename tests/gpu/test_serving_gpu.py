"""Prefix reuse and speculative decoding on CUDA, where the KDA recurrence, its rewind replay and the conv run
through the fast kernels (fla-core when importable), snapshots offloaded to CPU. Each reused or speculative run
must give the plain run's tokens; on the reference ops its scores match to f32 rounding, and on the fast kernels
(fla's chunked form uses tf32 dots) it may differ from the plain run by at most twice the plain run's own distance
from the exact scores (the f32 model on its reference ops, teacher-forced on the plain tokens)."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from gpu_helpers import reference_only  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from kimik3.tiny import build_tiny_model

    return build_tiny_model(num_hidden_layers=6, hidden_size=128, num_heads=4, head_dim=64, seed=3).cuda()


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True, **kwargs)


def _exact_scores(model, run, prompt_len):
    """The scores `run` should have had: one teacher-forced forward of its tokens on the reference ops."""
    with reference_only(), torch.no_grad():
        logits = model(run.sequences).logits[:, prompt_len - 1:-1].float()
    return logits.unbind(1)


def _max_score_gap(scores, other):
    """max |a - b| where both are finite (min_new_tokens masks EOS with -inf in the scores, not in the logits)."""
    gap = 0.0
    for a, b in zip(scores, other, strict=True):
        finite = torch.isfinite(a) & torch.isfinite(b)
        gap = max(gap, (a[finite].float() - b[finite].float()).abs().max().item())
    return gap


def _served_tokens(engine, prompts, max_tokens):
    """Greedy jobs for `prompts` (max_tokens each) submitted to `engine` at once; their tokens when all have ended."""
    import asyncio

    from kimik3.engine import Job, Sampling

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, Sampling(max_tokens=n, temperature=0.0), loop) for ids, n in zip(prompts, max_tokens)]
        engine.submit(jobs)
        for job in jobs:
            while (item := await job.mailbox.get()) is not None:
                assert not isinstance(item, Exception), item
        return [job.new_ids for job in jobs]

    return asyncio.run(run())


def _assert_same_tokens(got, expected):
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores, strict=True):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))


def _assert_same_run(got, expected, exact_scores):
    """Same tokens; scores within twice the plain run's own distance from its exact scores (`_exact_scores`)."""
    _assert_same_tokens(got, expected)
    rounding = _max_score_gap(expected.scores, exact_scores)
    gap = _max_score_gap(got.scores, expected.scores)
    print(f"score gap to the plain run {gap:.3e}; the plain run's distance from the exact scores {rounding:.3e}")
    assert gap <= 2 * rounding + 1e-5, (gap, rounding)


def test_assisted_greedy_is_plain_greedy_on_cuda(model):
    from kimik3.draft import slice_draft_model

    phrase = torch.randint(3, 128, (1, 16), device="cuda")
    ids = torch.cat([phrase, phrase, phrase[:, :6]], 1)
    draft = slice_draft_model(model, 2)
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    with reference_only():
        plain_on_reference = _greedy(model, ids)
    plain = _greedy(model, ids)
    exact_scores = _exact_scores(model, plain, ids.shape[1])
    for assistance in ({"prompt_lookup_num_tokens": 4}, {"assistant_model": draft}):
        with reference_only():  # the rewind replay alone: equal to f32 rounding
            assisted = _greedy(model, ids, **assistance)
        _assert_same_tokens(assisted, plain_on_reference)
        assert _max_score_gap(assisted.scores, plain_on_reference.scores) < 1e-4
        _assert_same_run(_greedy(model, ids, **assistance), plain, exact_scores)


def test_prompt_cache_with_cpu_snapshots_reuses_exactly_on_cuda(model):
    from kimik3.modeling.serving_kimi_k3 import KimiK3PrefixStore, build_prompt_cache

    prefix = torch.randint(3, 128, (1, 200), device="cuda")
    cache = build_prompt_cache(model, prefix, snapshot_interval=64, snapshot_device="cpu")
    assert sorted(cache.rewind.snapshots) == [64, 128, 192]
    assert all(state.device.type == "cpu" for states in cache.rewind.snapshots.values() for _, state in states.values())
    ids = torch.cat([prefix, torch.randint(3, 128, (1, 5), device="cuda")], 1)
    cold = _greedy(model, ids)
    _assert_same_run(_greedy(model, ids, past_key_values=copy.deepcopy(cache)), cold,
                     _exact_scores(model, cold, ids.shape[1]))
    store = KimiK3PrefixStore(block_size=64)
    store.insert(prefix[0], cache)
    diverging = torch.cat([prefix[:, :150], torch.randint(3, 128, (1, 5), device="cuda")], 1)
    reused, partial = store.lookup(diverging)  # 128 tokens: restored from the CPU snapshot, nothing replayed
    assert reused == 128 and partial.kda_state(model.config.kda_layer_indices[0])[1].device.type == "cuda"
    cold = _greedy(model, diverging)
    _assert_same_run(_greedy(model, diverging, past_key_values=partial), cold,
                     _exact_scores(model, cold, diverging.shape[1]))


def test_the_servers_lockstep_reading_and_shared_pages_give_each_prompts_greedy_tokens_on_cuda(model):
    """`kimik3 serve`'s engine on CUDA (the fast kernels where importable), fp32: three long prompts read in lockstep
    (one batch, every row at the same position), then while the first of another pair decodes, a prompt that starts
    from its stored prompt and joins holding its full pages; each gives the greedy tokens of `generate()` alone."""
    import asyncio

    from kimik3.engine import Engine, Job, Sampling

    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 120, (length,), generator=generator).tolist() for length in (100, 130, 130)]
    engine = Engine(model, None, max_requests=4, prefill_chunk=48, block_size=16)

    async def run(batches):
        loop = asyncio.get_running_loop()
        jobs = []
        for prompts_now, wait_for_join in batches:
            if wait_for_join:  # the earlier job joined the batch (its prompt read and stored)
                while jobs[-1] not in engine.batch:
                    await asyncio.sleep(0.002)
            now = [Job(ids, Sampling(max_tokens=8, temperature=0.0), loop) for ids in prompts_now]
            for job in now:
                engine.submit([job])
            jobs += now
        for job in jobs:
            while (item := await job.mailbox.get()) is not None:
                assert not isinstance(item, Exception), item
        return jobs

    def alone(ids):
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=8, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    try:
        forwards = engine.stats["prefill_forwards"]
        jobs = asyncio.run(run([(prompts, False)]))
        assert engine.stats["prefill_forwards"] - forwards < 9  # alone: 3 chunks each
        assert [job.new_ids for job in jobs] == [alone(ids) for ids in prompts]
        first = prompts[1][:70]
        jobs = asyncio.run(run([([first], False), ([first + [7, 8, 9]], True)]))
        assert engine.stats["pages_shared"] >= 70 // 16  # the second held the first's full pages
        assert [job.new_ids for job in jobs] == [alone(first), alone(first + [7, 8, 9])]
    finally:
        engine.stop()


def test_the_servers_captured_decode_steps_give_each_prompts_greedy_tokens_on_cuda(model):
    """`kimik3 serve`'s decode steps replayed from CUDA graphs (`decode_step="captured"`, the default on one GPU), fp32:
    five requests of different lengths and max_tokens joining and leaving (the rows padded to 1, 2, 4 or 8, the keys
    to a bucket of pages), each with the greedy tokens of `generate()` alone; graphs were captured and replayed, no
    capture failed, and the steps run eagerly at the same shapes (`fixed`) and as they are (`plain`) agree."""
    import asyncio

    from kimik3.engine import Engine, Job, Sampling

    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 120, (length,), generator=generator).tolist() for length in (7, 40, 90, 19, 150)]
    new_tokens = [20, 6, 30, 12, 25]

    async def run(engine):
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, Sampling(max_tokens=n, temperature=0.0), loop) for ids, n in zip(prompts, new_tokens)]
        for position, job in enumerate(jobs):
            if position == 3:  # the last two join a running batch
                while not engine.batch:
                    await asyncio.sleep(0.002)
            engine.submit([job])
        for job in jobs:
            while (item := await job.mailbox.get()) is not None:
                assert not isinstance(item, Exception), item
        return [job.new_ids for job in jobs]

    def alone(ids, n):
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    tokens = {}
    for mode in ("captured", "fixed", "plain"):
        engine = Engine(model, None, max_requests=8, prefill_chunk=64, block_size=16, prefix_cache_bytes=0,
                        decode_step=mode)
        try:
            tokens[mode] = asyncio.run(run(engine))
            if mode == "captured":
                stats, steps = engine.stats, engine.steps
                print({key: stats[key] for key in ("decode_forwards", "decode_graphs", "decode_graph_replays",
                                                   "decode_padding_rows")})
                assert steps.capture_error is None and steps.capture
                # every bucket's second step is its capture; some bucket was replayed again after it
                assert stats["decode_graphs"] >= 2 and stats["decode_graph_replays"] > stats["decode_graphs"]
        finally:
            engine.stop()
    assert tokens["captured"] == [alone(ids, n) for ids, n in zip(prompts, new_tokens)]
    assert tokens["fixed"] == tokens["captured"] and tokens["plain"] == tokens["captured"]


def test_the_servers_captured_decode_step_in_bf16_is_no_further_from_f32_than_the_plain_step(model):
    """bf16 on the fast kernels: the captured fixed-shape step (rows padded to 4, keys to a bucket) and the plain
    paged step, teacher-forced on the f32 model's tokens over 12 steps, each compared with the f32 model's logits
    (its plain paged step): the captured step's logits are within the plain step's own distance from f32 (twice it,
    plus bf16's step at the logits' scale), so a greedy token that differs between them differs at a near-tie that
    bf16 rounding decides either way."""
    import copy
    import importlib

    from kimik3.engine import DecodeSteps

    low = copy.deepcopy(model).to(torch.bfloat16)
    code = importlib.import_module(type(model).__module__.rpartition(".")[0] + ".cache_kimi_k3")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 120, (length,), generator=generator).tolist() for length in (7, 40, 90)]

    def rows(of):
        paged = code.KimiK3PagedCache(of.config, block_size=16, max_rows=8)
        caches = []
        for ids in prompts:
            cache = code.KimiK3Cache(of.config)
            with torch.no_grad():
                of(input_ids=torch.tensor([ids], device="cuda"), past_key_values=cache, use_cache=True)
            caches.append(cache)
        paged.add_rows(caches)
        return paged

    exact, plain, captured = rows(model), rows(low), rows(low)
    steps = DecodeSteps(low, captured, capture=True)
    tokens = [5, 6, 7]
    for _ in range(12):
        ids = torch.tensor([[token] for token in tokens], device="cuda")
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=exact.attention_mask(1), past_key_values=exact,
                         use_cache=True).logits[:, -1].float()
            ours = low(input_ids=ids, attention_mask=plain.attention_mask(1), past_key_values=plain,
                       use_cache=True).logits[:, -1].float()
            got = steps.run(tokens).float()
        rounding = (ours - want).abs().max().item()
        gap = (got - ours).abs().max().item()
        print(f"captured - plain {gap:.3e}; plain - f32 {rounding:.3e}")
        assert gap <= 2 * rounding + want.abs().max().item() * 2 ** -8, (gap, rounding)
        tokens = want.argmax(-1).tolist()
    assert steps.capture_error is None and steps.counts["decode_graph_replays"] >= 10


def test_the_servers_compiled_decode_steps_give_each_prompts_greedy_tokens_on_cuda(model):
    """`decode_step="compiled"`: each bucket's step torch.compile'd (one graph, no break) and then captured; four
    requests of different lengths, the greedy tokens of `generate()` alone (fp32), nothing fell back."""
    from kimik3.engine import Engine

    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 120, (length,), generator=generator).tolist() for length in (9, 50, 33, 70)]
    engine = Engine(model, None, max_requests=4, prefill_chunk=64, block_size=16, prefix_cache_bytes=0,
                    decode_step="compiled")
    try:
        tokens = _served_tokens(engine, prompts, [10] * len(prompts))
        assert engine.steps.compile_error is None and engine.steps.capture_error is None
        assert engine.stats["decode_graph_replays"] > engine.stats["decode_graphs"] >= 1
    finally:
        engine.stop()
    for ids, got in zip(prompts, tokens):
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert got == out[0, len(ids):].tolist()


def test_the_servers_speculative_rounds_between_captured_steps_give_each_prompts_greedy_tokens_on_cuda(model):
    """`speculative_tokens=4` with the captured decode steps (fp32): the model steered by a hook on its logits (tensor
    ops only, so the captured step runs it in its graph) to continue a 7-token cycle after any token of it; three
    greedy requests, two inside the cycle (prompt lookup's proposals are then the model's tokens) and one outside it
    (its proposals, where it finds any, are mostly rejected; it goes on alone on captured steps): each gets
    `generate()`'s tokens alone under the same steering, the cycle's requests mostly from accepted proposals, and the
    rounds (eager verify forwards that rewrite the KDA slots in place) leave the captured steps' graphs valid: graphs
    were replayed, and no capture failed."""
    from kimik3.engine import Engine

    cycle = list(range(101, 108))
    following = torch.full((model.config.vocab_size,), -1, dtype=torch.long, device="cuda")
    following[cycle] = torch.tensor(cycle[1:] + cycle[:1], device="cuda")

    def steer(module, args, kwargs, output):
        logits = output.logits
        after = following[kwargs["input_ids"][:, -logits.shape[1]:]]
        steered = torch.full_like(logits, -1e4).scatter_(-1, after.clamp(min=0).unsqueeze(-1), 0.0)
        output.logits = torch.where((after >= 0).unsqueeze(-1), steered, logits)
        return output

    prompts = [[5, 6] + cycle * 2 + [101, 102], [9] + cycle + [103], [11, 12, 13, 14, 15]]
    max_tokens = [23, 10, 30]  # the third, outside the cycle, goes on alone: steps with no proposal are captured
    handle = model.register_forward_hook(steer, with_kwargs=True)
    engine = Engine(model, None, max_requests=4, prefill_chunk=64, block_size=4, prefix_cache_bytes=0,
                    decode_step="captured", speculative_tokens=4)
    try:
        tokens = _served_tokens(engine, prompts, max_tokens)
        stats = dict(engine.stats)
        print({key: stats[key] for key in ("decode_forwards", "speculative_rounds", "tokens_proposed",
                                           "tokens_accepted", "decode_graphs", "decode_graph_replays")})
        assert engine.steps.capture_error is None
        want = []
        for ids, n in zip(prompts, max_tokens):
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            want.append(out[0, len(ids):].tolist())
    finally:
        handle.remove()
        engine.stop()
    assert tokens == want
    # the 23-token request in the cycle takes most of its 22 decoded tokens as accepted proposals (4 a round)
    assert stats["speculative_rounds"] > 0 and stats["tokens_accepted"] >= 12
    assert stats["decode_graph_replays"] >= 1
