"""The decode loop of generate(cache_implementation="static") (modeling_kimik3/generate_kimi_k3.py; docs/design.md,
Decode loop): its tokens are plain generate()'s (greedy, fp32, exactly), its host reads come once per block of steps,
its samples are seeded and drawn from transformers' processed distribution, what it does not run goes to
transformers' loop, and a saved folder installs it as the model's generate."""

import importlib.util
import math
from pathlib import Path

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationMixin
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import kimik3.modeling.generate_kimi_k3 as loop
from k3_test_utils import Recorder, assert_same_streamer_calls
from kimik3.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(num_hidden_layers=4, seed=3).eval()


@pytest.fixture(scope="module")
def batch():
    """Three prompts of different lengths, left-padded."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=generator) for n in (9, 4, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    return ids, mask


class Spy:
    """Counts the loop's decode steps and its host reads (each read is the block's one synchronisation)."""

    def __init__(self, monkeypatch):
        self.steps = self.reads = 0
        step, read = loop.decode_step, loop.DecodeLoop._read

        def counted_step(*args):
            self.steps += 1
            return step(*args)

        def counted_read(this, count, *args):
            self.reads += 1
            return read(this, count, *args)

        monkeypatch.setattr(loop, "decode_step", counted_step)
        monkeypatch.setattr(loop.DecodeLoop, "_read", counted_read)


def plain(model, *args, **kwargs):
    return GenerationMixin.generate(model, *args, cache_implementation="static", **kwargs)


def ours(model, *args, **kwargs):
    return loop.generate(*args, model=model, cache_implementation="static", **kwargs)


@pytest.mark.parametrize("new_tokens,block", [(1, 3), (7, 3), (9, 8)])
def test_greedy_tokens_are_plain_generates_and_the_host_reads_once_per_block(model, batch, monkeypatch, new_tokens,
                                                                             block):
    ids, mask = batch
    expected = plain(model, ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    spy = Spy(monkeypatch)
    got = ours(model, ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
               decode_block_steps=block)
    assert torch.equal(got, expected)
    # the prefill gives the first token; the other new_tokens - 1 are decode steps, read once per block
    assert spy.steps == new_tokens - 1
    assert spy.reads == 1 + math.ceil((new_tokens - 1) / block)


def test_eos_mid_batch_pads_finished_rows_and_stops_where_generate_stops(model, batch, monkeypatch):
    ids, mask = batch
    free = plain(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    width = ids.shape[1]
    eos = int(free[1, width + 2])  # row 1's third new token: that row stops mid-block, the others run on
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = plain(model, ids, **kwargs)
    assert (expected[1, width + 3:] == 0).all() and (expected[0, width:] != 0).all()
    assert torch.equal(ours(model, ids, decode_block_steps=5, **kwargs), expected)
    # one row alone: every row has stopped inside a block, which ran to its end; the tokens end at the eos
    spy = Spy(monkeypatch)
    one = ours(model, ids[1:2, -4:], max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0,
               decode_block_steps=5)
    assert torch.equal(one, plain(model, ids[1:2, -4:], max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0))
    assert one.shape[1] == 4 + 3 and spy.steps == 5 and spy.reads == 2


def test_a_streamer_gets_the_calls_of_transformers_loop(model, batch):
    ids, mask = batch
    theirs, mine = Recorder(), Recorder()
    plain(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, streamer=theirs)
    ours(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, streamer=mine, decode_block_steps=4)
    assert_same_streamer_calls(mine, theirs, 1 + 6 + 1)


SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)


def test_sampling_is_seeded(model, batch):
    ids, mask = batch

    def sampled(seed=None, generator=None):
        if seed is not None:
            torch.manual_seed(seed)
        return ours(model, ids, attention_mask=mask, max_new_tokens=6, generator=generator, **SAMPLING)

    first = sampled(seed=1)
    assert torch.equal(sampled(seed=1), first)
    assert not torch.equal(sampled(seed=2), first)
    assert torch.equal(sampled(generator=torch.Generator().manual_seed(9)),
                       sampled(generator=torch.Generator().manual_seed(9)))


def processed(logits):
    """transformers' own processing of these sampling settings: the distribution generate() samples from."""
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    return torch.softmax(processors(None, logits.clone()), dim=-1)


def chi_square_ok(samples, probs):
    """Pearson's chi-square of the sample counts against `probs`, below df + 6 sqrt(2 df) (p < 1e-5 of failing by
    chance); no sample outside the support."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the processors filtered out was drawn"
    expected = probs[support].double() * samples.numel()
    df = int(support.sum()) - 1
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi2 < df + 6 * math.sqrt(2 * df), chi2, df


def test_the_first_sampled_token_follows_the_processed_distribution(model):
    """Over 1500 rows of one prompt in one generate() (each row its own noise), the first token's counts match
    softmax of transformers' processed scores; the unprocessed softmax does not fit them."""
    prompt = torch.tensor([[5, 17, 99, 42, 7, 64]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1].float()
    probs = processed(logits[None])[0]
    assert 5 <= int((probs > 0).sum()) <= 20  # top-p cut inside the top-k: both filters matter
    torch.manual_seed(0)
    rows = 1500
    out = ours(model, prompt.expand(rows, -1), max_new_tokens=1, eos_token_id=None, **SAMPLING)
    ok, chi2, df = chi_square_ok(out[:, -1], probs)
    assert ok, (chi2, df)
    assert not chi_square_ok(out[:, -1], torch.softmax(logits / 0.7, dim=-1))[0]


def test_sampling_noise_draws_from_softmax_of_the_scores():
    """The token choice alone, 20000 rows of peaked random scores: the Gumbel draw is the categorical of
    softmax(processed scores), and the noise differs by row, by step and by seed."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 64, generator=generator) * 2.0
    probs = processed(logits)[0]
    choice, gates = loop.token_choice(LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20),
                                                           TopPLogitsWarper(0.9)]), sample=True)
    rows = 20000
    keys = loop.row_keys(123, rows, "cpu")
    no_gates, no_lengths = torch.zeros(0, 64, dtype=torch.bool), torch.zeros(0, dtype=torch.long)
    samples = choice(logits.expand(rows, -1), None, torch.tensor([10]), keys, no_gates, no_lengths)
    ok, chi2, df = chi_square_ok(samples, probs)
    assert ok, (chi2, df)
    later = choice(logits.expand(rows, -1), None, torch.tensor([11]), keys, no_gates, no_lengths)
    other_seed = choice(logits.expand(rows, -1), None, torch.tensor([10]), loop.row_keys(124, rows, "cpu"),
                        no_gates, no_lengths)
    assert (later != samples).float().mean() > 0.3 and (other_seed != samples).float().mean() > 0.3
    assert gates == []


def test_min_new_tokens_masks_eos_on_the_device(model, batch):
    ids, mask = batch
    free = plain(model, ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 1])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=4, do_sample=False, eos_token_id=eos,
                  pad_token_id=0)
    assert torch.equal(ours(model, ids, decode_block_steps=3, **kwargs), plain(model, ids, **kwargs))


@pytest.mark.parametrize("kwargs,reason", [
    (dict(num_beams=2), "generation mode beam_search"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate"),
    (dict(repetition_penalty=1.3), "logits processor RepetitionPenaltyLogitsProcessor"),
    (dict(cache_implementation="dynamic"), None),
])
def test_what_the_loop_does_not_run_goes_to_transformers_loop(model, batch, monkeypatch, kwargs, reason):
    ids, mask = batch
    settings = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation="static")
    settings.update(kwargs)
    said = []
    monkeypatch.setattr(loop.logger, "warning_once", said.append)
    spy = Spy(monkeypatch)
    got = loop.generate(ids, model=model, decode_block_steps=2, **settings)
    expected = GenerationMixin.generate(model, ids, **settings)
    sequences = got.sequences if kwargs.get("return_dict_in_generate") else got
    assert torch.equal(sequences, expected.sequences if kwargs.get("return_dict_in_generate") else expected)
    assert spy.steps == 0
    assert (said == []) if reason is None else (len(said) == 1 and reason in said[0]), said


def test_on_cuda_greedy_runs_in_the_loop_and_sampling_only_when_asked(model):
    """Greedy decoding in the captured blocks was measured on a GPU, sampling was not: a CUDA model takes the loop
    for greedy calls and keeps transformers' compiled loop for sampling unless the call gives decode_block_steps
    (silently: the default is not an error)."""
    cuda_model = types.SimpleNamespace(device=torch.device("cuda", 0), generation_config=model.generation_config)
    greedy, sampled = {"cache_implementation": "static", "do_sample": False}, {"cache_implementation": "static",
                                                                               "do_sample": True}
    assert loop.call_refusal(cuda_model, (), greedy) is None
    assert loop.call_refusal(cuda_model, (), sampled) == loop.NOT_ASKED
    assert loop.call_refusal(cuda_model, (), {**sampled, "decode_block_steps": 8}) is None
    assert loop.call_refusal(model, (), sampled) is None  # CPU: the loop by default


def test_bad_block_steps_are_refused(model, batch):
    ids, mask = batch
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="decode_block_steps"):
            ours(model, ids, attention_mask=mask, max_new_tokens=3, do_sample=False, decode_block_steps=bad)


def test_the_step_traces_as_one_graph(batch, monkeypatch):
    """What CUDA captures is `decode_step` compiled with fullgraph=True: no graph break (no host synchronisation in
    the step: model, processors, noise, stop flags), one graph for every step of a sampled generation with eos ids
    and a length gate; the tokens are the eager loop's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    ids, mask = batch
    small = build_tiny_model(num_hidden_layers=2, seed=1).eval()
    monkeypatch.setattr(loop, "_COMPILED_STEP", torch.compile(loop.decode_step, fullgraph=True, backend="eager",
                                                              dynamic=False))
    settings = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=2, eos_token_id=3, pad_token_id=0,
                    decode_block_steps=2, **SAMPLING)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(4)
    eager = ours(small, ids, **settings)
    torch.manual_seed(4)
    assert torch.equal(ours(small, ids, decode_compile=True, **settings), eager)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_a_saved_folder_installs_the_loop_as_the_models_generate(model, batch, tmp_path):
    ids, mask = batch
    model.save_pretrained(tmp_path / "tiny")
    carried = tmp_path / "tiny" / "custom_generate" / "generate.py"
    assert carried.read_bytes() == (ROOT / "modeling_kimik3" / "generate_kimi_k3.py").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", trust_remote_code=True)
    assert loaded.generate.func.__module__.endswith("custom_generate.generate")
    calls = []
    step = loaded.generate.func.__globals__["decode_step"]
    loaded.generate.func.__globals__["decode_step"] = lambda *args: calls.append(1) or step(*args)
    try:
        got = loaded.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              cache_implementation="static", decode_block_steps=2)
    finally:
        loaded.generate.func.__globals__["decode_step"] = step
    assert torch.equal(got, plain(model, ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
    assert len(calls) == 4
    # a folder saved from the loaded model carries the loop again (from the folder it was loaded from)
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "custom_generate" / "generate.py").read_bytes() == carried.read_bytes()


def test_the_benchmarks_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_decode_loop", ROOT / "benchmarks" / "bench_decode_loop.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--dry-run", "--out", str(tmp_path / "out.json")])
    rows = results["decode"]
    assert {(r["batch"], r["context"]) for r in rows} == {(2, 16)}
    for row in rows:
        assert row["loop"]["tokens_equal_plain"] and row["loop"]["ms_per_step"] > 0 and row["plain"]["ms_per_step"] > 0
    # --loop-only: the loop timed alone, no plain generate() and no token comparison
    (row,) = bench.main(["--dry-run", "--loop-only"])["decode"]
    assert row["loop"]["ms_per_step"] > 0 and "plain" not in row and "tokens_equal_plain" not in row["loop"]
    # a card's own roofline: the step's bytes at the copy rate measured on it (none on the CPU)
    assert results["device_copy_bytes_per_s"] is None and "hbm_roofline_ms_this_device" not in row
    bench._this_device_roofline(row, 2e12)
    assert row["hbm_roofline_ms_this_device"] == round(row["bytes_per_step"] / 2e9, 3)
    assert row["loop"]["x_this_device_roofline"] == round(
        row["loop"]["ms_per_step"] / row["hbm_roofline_ms_this_device"], 3)


def test_the_benchmarks_roofline_counts_packed_experts_by_their_bytes(monkeypatch):
    # the packed benchmark model (shapes only, on the meta device): a decode step reads each hit expert's codes and
    # scale bytes, not the stride-0 bf16 adapter points the packed format also registers as parameters
    spec = importlib.util.spec_from_file_location("bench_k3", ROOT / "benchmarks" / "bench_k3.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "DEV", "meta")
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    config = bench.k3_config(2, 64)
    config.experts_format = "mxfp4"
    stats = bench.byte_stats(bench.build(KimiK3ForCausalLM, config))
    inter, latent = config.moe_intermediate_size, config.routed_expert_hidden_size  # gate_up [2I, L], down [L, I]
    packed_bytes = 2 * inter * (latent // 2 + latent // 32) + latent * (inter // 2 + inter // 32)
    assert stats["num_experts"] == 64 and stats["expert_bytes_per_expert"] == packed_bytes
