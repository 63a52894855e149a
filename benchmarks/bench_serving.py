#!/usr/bin/env python3
# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Serving benchmark: prefix reuse and speculative decoding with Kimi K3 as the target (issue 13, section 3).

Side by side in one run, on the bench_k3.py model (random bf16 weights, K3's exact widths, 8 layers) on one GPU:
  ttft          time to first token for a 64K prompt whose first 60K tokens are in the prefix store (lookup, copy,
                prefill of the 4K rest) vs a cold chunked prefill of all 64K
  block_hit     TTFT of a 64K prompt sharing its first 119 blocks (59.5K tokens) with a stored 64K prompt, the hit at a
                block boundary inside it: stored with KDA snapshots at every 512-token block end under a byte budget
                (kept_snapshot_blocks), with the old 40-block spacing (whose worst case is just below 60K: 20K
                tokens replayed), against the exact-match TTFT (the stored prompt is the shared prefix itself) and
                cold, side by side; tokens replayed, first token and logits against cold, the snapshots' bytes and
                what writing them costs the stored prompt's prefill
  spec          decode tokens/s at batch 1: plain compiled decode (cache_implementation="static") vs assisted
                decoding with a 2-layer slice of the target as draft and with prompt lookup on a repetitive text,
                with acceptance rates (drafted tokens the target accepted)
  spec_static   speculative decoding on the static cache (generate_kimi_k3.py's speculative rounds, compiled and
                captured on CUDA) against plain compiled static decode, side by side per target: the target is the
                benchmark model with the residual outputs of its layers past a 2-layer slice's (attention o_proj,
                the feed-forward's last projections) scaled by alpha, the draft that slice (taken before damping), so
                that the acceptance rate, measured by the loop itself, runs from ~0 (alpha 1) towards 1 (alpha 0);
                per alpha and batch size: tokens/s of plain, of the draft (with the loop's fallback to plain blocks
                while rounds are slower, and with rounds throughout) and of prompt lookup (a random target does not
                repeat its prompt: the ~0% point), the acceptance rates, plain steps, fallbacks and the speedups
  spec_bound    the HBM-bandwidth bound of spec_static's rounds (no GPU needed: the models are built on the meta
                device): bytes a plain step reads against a round's (k draft steps with logits, one without, the
                target's verify of k + 1 tokens with the experts those tokens route to), so the best
                speedup over plain decode any implementation of these rounds can reach, per k and acceptance rate
  snapshots     bytes held by KDA state snapshots at 64K and 1M tokens for the default interval (the benchmark
                model measured at 64K; the release's 69 KDA layers from the config), and the rollback record
                bytes per verified token against one set of KDA states
Random weights: acceptance rates say nothing about a trained draft; tokens/s per accepted token do.

    python benchmarks/bench_serving.py                 # H200
    python benchmarks/bench_serving.py --quick         # CPU smoke test on a tiny model, seconds
    python benchmarks/bench_serving.py --only spec_static --alphas 1,0.3,0.1,0.03,0 --batches 1,4

Prints one JSON line of results (and writes it to --out when given).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _k3bench_utils import ensure_kimik3, round_sig  # noqa: E402

K = 1024


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _seconds(fn):
    _sync()
    start = time.perf_counter()
    result = fn()
    _sync()
    return time.perf_counter() - start, result


SECTIONS = ("ttft", "block_hit", "spec", "spec_static", "spec_bound", "snapshots")


def build_models(quick: bool, layers: int, experts: int, experts_format: str = "dense", meta: bool = False):
    """The benchmark model on the GPU (the tiny one on the CPU with `quick`); `meta`: on the meta device, shapes
    and dtypes only (the byte model of spec_bound)."""
    if quick:
        from kimik3.tiny import build_tiny_model

        # one AttnRes block over all layers, as the benchmark model has: a target damped to alpha = 0 is then its
        # slice exactly (a block boundary inside the target would bank a vector the slice never banks)
        return build_tiny_model(num_hidden_layers=6, seed=3, attn_res_block_size=6), "cpu"
    import bench_k3

    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    device = "meta" if meta else "cuda"
    previous, bench_k3.DEV = bench_k3.DEV, device
    try:
        builder = bench_k3.build_packed if experts_format == "mxfp4" else bench_k3.build
        return builder(KimiK3ForCausalLM, bench_k3.k3_config(layers, experts)), device
    finally:
        bench_k3.DEV = previous


@torch.no_grad()
def chunked_prefill(model, ids, cache, chunk):
    logits = None
    for start in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits
    return logits


def section_ttft(model, device, prompt_len, prefix_len, chunk, interval):
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache
    from kimik3.modeling.serving_kimi_k3 import KimiK3PrefixStore

    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab - 1, (1, prompt_len), device=device)
    config = model.config

    def cold():
        return chunked_prefill(model, prompt, KimiK3Cache(config), chunk)

    cold()  # warm-up (kernels, autotune)
    cold_s, cold_logits = _seconds(cold)

    store = KimiK3PrefixStore()
    insert_s, _ = _seconds(lambda: store.insert(
        prompt[0, :prefix_len], _filled(model, prompt[:, :prefix_len], chunk, interval)))

    def reuse():
        reused, cache = store.lookup(prompt[0])
        return chunked_prefill(model, prompt[:, reused:], cache, chunk), reused

    reuse()
    reuse_s, (reuse_logits, reused) = _seconds(reuse)
    return {
        "prompt_tokens": prompt_len, "stored_prefix_tokens": prefix_len, "reused_tokens": reused,
        "cold_ttft_s": round_sig(cold_s), "reuse_ttft_s": round_sig(reuse_s),
        "speedup": round_sig(cold_s / reuse_s), "store_insert_s": round_sig(insert_s),
        "first_token_equal": bool(torch.equal(cold_logits.argmax(-1), reuse_logits.argmax(-1))),
        "first_logits_max_abs_diff": float((cold_logits.float() - reuse_logits.float()).abs().max()),
        "store": store.stats(),
    }


@torch.no_grad()
def _filled(model, ids, chunk, interval, max_snapshot_bytes=None):
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

    cache = KimiK3Cache(model.config, snapshot_interval=interval, max_snapshot_bytes=max_snapshot_bytes)
    chunked_prefill(model, ids, cache, chunk)
    return cache


def section_block_hit(model, device, prompt_len, shared_len, chunk, block, old_interval, budgets):
    """Cold vs exact match vs a hit at a block boundary inside a longer stored prompt (per-block snapshots under a
    budget, and the old sparse spacing): each stored prompt is prefilled once (timed: what the snapshots cost), each
    reuse is a lookup, the copy and the chunked prefill of the rest (its pending replay included), timed after a
    warm-up."""
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache, snapshot_bytes
    from kimik3.modeling.serving_kimi_k3 import KimiK3PrefixStore

    config = model.config
    vocab = config.vocab_size
    prompt = torch.randint(3, vocab - 1, (1, prompt_len), device=device)
    other = torch.cat([prompt[:, :shared_len], torch.randint(3, vocab - 1, (1, prompt_len - shared_len),
                                                            device=device)], 1)
    one = snapshot_bytes(config, dtype_bytes=4)

    def cold():
        return chunked_prefill(model, prompt, KimiK3Cache(config), chunk)

    cold()  # warm-up (kernels, autotune)
    cold_s, cold_logits = _seconds(cold)
    results = {"prompt_tokens": prompt_len, "shared_tokens": shared_len, "block_tokens": block,
               "cold_ttft_s": round_sig(cold_s)}
    # the first budget is "block_hit"; tighter ones show how the policy's guarantee thins
    stores = {"exact_match": (prompt[:, :shared_len], block, None)}
    for number, snapshots in enumerate(budgets):
        stores["block_hit" if number == 0 else f"block_hit_{snapshots}_snapshots"] = (other, block, snapshots * one)
    stores["block_hit_old_spacing"] = (other, old_interval, None)
    for label, (stored, interval, max_bytes) in stores.items():
        store = KimiK3PrefixStore(block_size=block)
        fill_s, cache = _seconds(lambda: _filled(model, stored, chunk, interval, max_bytes))
        store.insert(stored[0], cache)

        def reuse():
            reused, hit = store.lookup(prompt[0])
            pending = hit.rewind.pending_tokens
            return chunked_prefill(model, prompt[:, reused:], hit, chunk), reused, pending

        reuse()
        reuse_s, (logits, reused, pending) = _seconds(reuse)
        boundaries = range(block, stored.shape[1] + 1, block)
        replays = [b - cache.rewind.restore_position(b) for b in boundaries]
        entry = {"ttft_s": round_sig(reuse_s), "reused_tokens": reused, "replayed_tokens": pending,
                 "stored_tokens": stored.shape[1], "snapshot_interval": interval,
                 "stored_prefill_s": round_sig(fill_s), "snapshots": len(cache.rewind.snapshots),
                 "snapshot_bytes": cache.rewind.snapshot_bytes_held(), "max_snapshot_bytes": max_bytes,
                 "dense_blocks": cache.rewind.dense_blocks,
                 "replay_tokens_at_block_boundaries": {"max": max(replays), "max_last_16_blocks": max(replays[-16:]),
                                                       "mean": round_sig(sum(replays) / len(replays))},
                 "first_token_equal_cold": bool(torch.equal(cold_logits.argmax(-1), logits.argmax(-1))),
                 "first_logits_max_abs_diff_cold": float((cold_logits.float() - logits.float()).abs().max())}
        results[label] = entry
        print(json.dumps({"block_hit." + label: entry}), file=sys.stderr, flush=True)
        del store, cache
        if device == "cuda":
            torch.cuda.empty_cache()
    exact = results["exact_match"]["ttft_s"]
    results["x_exact_match"] = {label: round_sig(results[label]["ttft_s"] / exact)
                                for label in stores if label != "exact_match"}
    results["x_exact_match"]["cold"] = round_sig(cold_s / exact)
    # what writing per-block snapshots costs a prefill: the block-hit store's prompt against a cold prefill
    results["snapshot_write_overhead"] = round_sig(results["block_hit"]["stored_prefill_s"] / cold_s)
    return results


class VerifyCounter:
    """Counts the target's verify forwards (every forward after the prefill) and the tokens they check."""

    def __init__(self, model):
        self.lengths = []
        self.handle = model.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None:
            self.lengths.append(ids.shape[1])

    def acceptance(self, prompt_len: int, new_tokens: int) -> dict:
        """Assisted decoding verifies the first drafts in the prefill forward itself; every forward adds its
        accepted drafts plus one token of the target's own."""
        self.handle.remove()
        drafted = (self.lengths[0] - prompt_len) + sum(n - 1 for n in self.lengths[1:])
        accepted = new_tokens - len(self.lengths)
        return {"rounds": len(self.lengths), "drafted": drafted,
                "acceptance_rate": round_sig(max(accepted, 0) / drafted) if drafted else None}


def section_spec(model, device, context, new_tokens, draft_layers, lookup_tokens, assistant_tokens, compiled):
    from kimik3.draft import slice_draft_model

    vocab = model.config.vocab_size
    phrase = torch.randint(3, vocab - 1, (1, 64), device=device)
    repetitive = phrase.repeat(1, max(1, context // 64))
    greedy = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    results = {"context": repetitive.shape[1], "new_tokens": new_tokens}

    def tok_s(label, **kwargs):
        # warm-up; the compiled run warms up with the timed run's own lengths (a static cache of another length is
        # another graph: a second compilation inside the timed run)
        warm = greedy if kwargs.get("cache_implementation") == "static" else \
            {**greedy, "max_new_tokens": 4, "min_new_tokens": 4}
        model.generate(repetitive, **warm, **kwargs)
        # the counting hook only on assisted runs: inside a compiled step it would be traced (and recompiled)
        assisted = "assistant_model" in kwargs or "prompt_lookup_num_tokens" in kwargs
        counter = VerifyCounter(model) if assisted else None
        seconds, out = _seconds(lambda: model.generate(repetitive, **greedy, **kwargs))
        entry = {"s": round_sig(seconds), "tok_s": round_sig(new_tokens / seconds)}
        if counter is not None:
            entry.update(counter.acceptance(repetitive.shape[1], new_tokens))
        results[label] = entry
        print(json.dumps({"spec." + label: entry}), file=sys.stderr, flush=True)  # kept if a time limit stops the run
        return out

    def same_tokens(label, out, against):
        # bf16 with random weights: the top two logits are often within rounding, so differently shaped kernels
        # (one token vs a verified block, eager vs compiled) can pick different tokens; the first difference says
        # where (the fp32 tests hold exact equality)
        results[label]["tokens_equal_plain"] = bool(torch.equal(out, against))
        new = out[:, repetitive.shape[1]:] != against[:, repetitive.shape[1]:]
        results[label]["first_different_token"] = int(new.int().argmax()) if bool(new.any()) else None

    plain = tok_s("plain_dynamic")
    if compiled:
        static = tok_s("plain_compiled_static", cache_implementation="static")
        same_tokens("plain_compiled_static", static, plain)
    draft = slice_draft_model(model, draft_layers)
    # transformers reads these from the draft's own generation config: a constant draft length, and no early stop
    # on the draft's confidence (random weights are never confident)
    draft.generation_config.num_assistant_tokens = assistant_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    drafted = tok_s("draft_slice", assistant_model=draft)
    results["draft_slice"]["draft_layers"] = draft_layers
    same_tokens("draft_slice", drafted, plain)
    looked_up = tok_s("prompt_lookup", prompt_lookup_num_tokens=lookup_tokens)
    same_tokens("prompt_lookup", looked_up, plain)
    results["round_costs"] = round_costs(model, draft, repetitive, assistant_tokens)
    return results


@torch.no_grad()
def round_costs(model, draft, context, k):
    """What one assisted round costs, measured on the same context, and the tokens/s it gives at a given acceptance
    rate (random weights accept almost nothing, a trained draft accepts much more): a draft step, a plain target step,
    and the target's verify forward of k + 1 tokens with the rollback recording on, then a rollback of k tokens."""
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

    def step_ms(net, tokens, verify=False, repeats=10):
        cache = KimiK3Cache(net.config)
        net(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
        length = cache.get_seq_length()
        times = []
        for _ in range(repeats + 2):
            if verify:
                cache.activate_past_recording()
            seconds, _ = _seconds(lambda: net(input_ids=context[:, :tokens], past_key_values=cache, use_cache=True))
            # a verify block is rolled back to the context (a replay of the recorded inputs); plain steps just
            # extend the context by one token each
            rollback_s, _ = _seconds(lambda: cache.crop(length)) if verify else (0.0, None)
            times.append((seconds, rollback_s))
        times = sorted(times[2:])
        return times[len(times) // 2][0] * 1e3, times[len(times) // 2][1] * 1e3

    draft_ms, _ = step_ms(draft, 1)
    target_ms, _ = step_ms(model, 1)
    verify_ms, rollback_ms = step_ms(model, k + 1, verify=True)
    round_ms = k * draft_ms + verify_ms + rollback_ms
    projected = {}
    for rate in (0.5, 0.7, 0.9):
        tokens = (1 - rate ** (k + 1)) / (1 - rate)  # expected tokens a round yields (accepted drafts + 1)
        projected[str(rate)] = {"tok_s": round_sig(tokens / round_ms * 1e3),
                                "x_plain_eager": round_sig(tokens / round_ms * target_ms)}
    return {"draft_step_ms": round_sig(draft_ms), "target_step_ms": round_sig(target_ms),
            f"target_verify_{k + 1}_tokens_ms": round_sig(verify_ms), "rollback_ms": round_sig(rollback_ms),
            "round_ms": round_sig(round_ms), "plain_eager_tok_s": round_sig(1e3 / target_ms),
            "projected_by_acceptance_rate": projected}


# Parameters whose output is a layer's residual contribution: scaling them by alpha scales what the layer adds
DAMPED_SUFFIXES = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight",
                   "mlp.routed_expert_up_proj.weight")


def damp_layers(model, kept_layers, alpha: float, originals: dict) -> int:
    """Scale the residual outputs of every layer not in `kept_layers` by alpha (from their original weights, kept
    in `originals` on the first call); returns the parameters scaled."""
    scaled = 0
    for index, layer in enumerate(model.model.layers):
        if index in kept_layers:
            continue
        latent = getattr(layer.mlp, "is_latent", True)
        for name, param in layer.named_parameters():
            if not (name.endswith(DAMPED_SUFFIXES) or (not latent and name == "mlp.experts.down_proj")):
                continue
            key = (index, name)
            if key not in originals:
                originals[key] = param.detach().clone()
            with torch.no_grad():
                param.copy_(originals[key] * alpha)
            scaled += 1
    return scaled


def first_different_token(out, against, start: int):
    """The first new-token position (from `start`) where any row of `out` differs from `against`; None if none."""
    new = out[:, start:] != against[:, start:]
    return int(new.any(dim=0).int().argmax()) if bool(new.any()) else None


@torch.no_grad()
def section_spec_static(model, device, context, new_tokens, draft_layers, proposals, alphas, batches, compiled,
                        repeats=3, warm_up=True):
    """Plain compiled static decode vs speculative rounds (a damped target and its slice; prompt lookup), see the
    module docstring. `proposals`: the k (tokens proposed per round) to run, a list: a verify of k + 1 tokens routes
    them to more experts than one token reads, so the best k depends on the acceptance rate. Every timed call is
    one generate() of `new_tokens` tokens (no eos), after a warm-up call of the same shapes (`warm_up`); the median
    of `repeats`."""
    from transformers import GenerationMixin

    import kimik3.modeling.generate_kimi_k3 as loop
    from kimik3.convert.schedule import layer_map
    from kimik3.draft import slice_draft_model

    kept, _ = layer_map(model.config, draft_layers)
    draft = slice_draft_model(model, draft_layers)  # from the undamped target: its layers are never damped
    originals: dict = {}
    vocab = model.config.vocab_size
    phrase = torch.randint(3, vocab - 1, (1, 64), device=device)
    prompt = phrase.repeat(1, max(1, context // 64))
    settings = dict(cache_implementation="static", do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                    pad_token_id=0, decode_compile=compiled)
    results = {"context": prompt.shape[1], "new_tokens": new_tokens, "proposals": proposals,
               "draft_layers": kept, "compiled": compiled, "rows": []}

    def timed(ids, **kwargs):
        start = time.perf_counter()
        if warm_up:  # the same shapes: compilation and capture on CUDA, the first calls' set-up on CPU
            loop.generate(ids, model=model, **settings, **kwargs)
        runs = []
        for _ in range(repeats):
            report = {}
            seconds, out = _seconds(lambda: loop.generate(ids, model=model, decode_report=report, **settings,
                                                          **kwargs))
            runs.append((seconds, out, report))
        seconds, out, report = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
        entry = {"s": round_sig(seconds), "tok_s": round_sig(ids.shape[0] * new_tokens / seconds),
                 "call_s": round_sig(time.perf_counter() - start)}  # warm-up (compilation) and repeats
        if report.get("rounds"):
            entry.update(rounds=report["rounds"], acceptance_rate=round_sig(report["accepted"] / report["proposed"]),
                         tokens_per_round=round_sig((report["accepted"] + report["rounds"]) / report["rounds"]),
                         plain_steps=report["steps"], fallbacks=report["fallbacks"])
        return entry, out

    for alpha in alphas:
        results["damped_parameters"] = damp_layers(model, kept, alpha, originals)
        for batch in batches:
            ids = prompt.repeat(batch, 1)
            row = {"alpha": alpha, "batch": batch}
            row["plain"], plain_out = timed(ids)
            # plain decode's own bf16 noise: transformers' eager generate() (dynamic cache) against the compiled
            # static decode above, the same greedy decoding in other kernels; where they first differ is the scale
            # the speculative rounds' first differences below are read against
            eager = GenerationMixin.generate(model, ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                             max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
            row["plain"]["eager_first_different_token"] = first_different_token(eager, plain_out, prompt.shape[1])
            print(json.dumps({"spec_static.entry": {"alpha": alpha, "batch": batch, "plain": row["plain"]}}),
                  file=sys.stderr, flush=True)  # kept if a time limit stops the run
            # draft: as generate() runs it (plain blocks while the rounds are slower); draft_rounds: rounds
            # throughout, the rounds' own speed at this acceptance
            runs = [(f"{name}_k{k}", kwargs) for k in proposals for name, kwargs in (
                ("draft", dict(assistant_model=draft, num_assistant_tokens=k)),
                ("draft_rounds", dict(assistant_model=draft, num_assistant_tokens=k, decode_fallback=False)),
                ("prompt_lookup", dict(prompt_lookup_num_tokens=k)))]
            for label, kwargs in runs:
                row[label], out = timed(ids, **kwargs)
                row[label]["x_plain"] = round_sig(row[label]["tok_s"] / row["plain"]["tok_s"])
                # bf16: the verify's shapes differ from a decode step's, so a near-tie may go the other way (the
                # fp32 CPU tests hold equality); where the first difference is says whether it is noise
                row[label]["first_different_token"] = first_different_token(out, plain_out, prompt.shape[1])
                print(json.dumps({"spec_static.entry": {"alpha": alpha, "batch": batch, label: row[label]}}),
                      file=sys.stderr, flush=True)  # kept if a time limit stops the run
            results["rows"].append(row)
            print(json.dumps({"spec_static.row": row}), file=sys.stderr, flush=True)
    damp_layers(model, kept, 1.0, originals)  # the model as it was, for the sections after this one
    return results


def section_spec_bound(model, context, draft_layers, proposals, rates=(0.0, 0.5, 0.7, 0.8, 0.9, 1.0)):
    """The bound of a speculative round at b=1 from bytes read (bench_k3's byte model: every weight a step uses
    once, the routed experts the tokens are expected to hit under uniform routing, the cache): a plain step reads
    S bytes for one token; a round reads the draft's k steps with logits and one decoder-only step (the k-th proposal
    enters the draft's cache without logits) and the target's verify,
    whose k + 1 tokens read the experts of k + 1 rows; at acceptance rate a it yields (1 - a^(k+1)) / (1 - a)
    tokens. Bound = tokens x S / round bytes. `free_draft_bound_x_plain`: the same with a draft that reads nothing
    (tokens x S / verify bytes), what no draft of any kind can beat at that acceptance rate."""
    import types

    from bench_k3 import byte_stats, decode_roofline

    from kimik3.convert.schedule import layer_map

    kept, _ = layer_map(model.config, draft_layers)
    others = {f"model.layers.{index}." for index in range(model.config.num_hidden_layers) if index not in kept}
    # the slice's parameters are the target's of the kept layers and the rest (embedding, norms, head): the same
    # byte model without building the slice (it would copy weights, which a meta model has none of)
    draft = types.SimpleNamespace(
        named_parameters=lambda: ((n, p) for n, p in model.named_parameters() if not n.startswith(tuple(others))),
        parameters=lambda: (p for n, p in model.named_parameters() if not n.startswith(tuple(others))))
    draft_config = types.SimpleNamespace(**{**model.config.to_dict(), "layer_types": [
        model.config.layer_types[index] for index in kept]})
    target_stats, draft_stats = byte_stats(model), byte_stats(draft)
    plain = decode_roofline(target_stats, model.config, 1, context)
    draft_step = decode_roofline(draft_stats, draft_config, 1, context)["bytes_per_step"]
    results = {"context": context, "draft_layers": draft_layers, "plain_step_bytes": plain["bytes_per_step"],
               "draft_step_bytes": draft_step, "draft_lm_head_bytes": draft_stats["lm_head_bytes"],
               "hbm_roofline_plain_ms": plain["hbm_roofline_ms"], "rows": []}
    for k in proposals:
        # the verify: the weights of a (k + 1)-row step, the cache read once (one sequence)
        verify = decode_roofline(target_stats, model.config, k + 1, context)
        verify_bytes = verify["weight_bytes"] + plain["cache_bytes"]
        round_bytes = (k + 1) * draft_step - draft_stats["lm_head_bytes"] + verify_bytes
        row = {"k": k, "verify_bytes": verify_bytes, "verify_x_plain_step": round_sig(verify_bytes / plain[
            "bytes_per_step"]), "round_bytes": round_bytes, "bound_x_plain": {}, "free_draft_bound_x_plain": {}}
        for rate in rates:
            tokens = k + 1 if rate == 1.0 else (1 - rate ** (k + 1)) / (1 - rate)
            row["bound_x_plain"][str(rate)] = round_sig(tokens * plain["bytes_per_step"] / round_bytes)
            row["free_draft_bound_x_plain"][str(rate)] = round_sig(tokens * plain["bytes_per_step"] / verify_bytes)
        results["rows"].append(row)
    return results


@torch.no_grad()
def section_snapshots(model, device, interval, measured_tokens):
    from kimik3.memory import load_text_config, snapshot_memory
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache, snapshot_bytes
    from kimik3.modeling.rewind_kimi_k3 import rewind_record_bytes_per_token

    config = model.config
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    cache = KimiK3Cache(config, snapshot_interval=interval)
    ids = torch.randint(3, config.vocab_size - 1, (1, measured_tokens), device=device)
    chunked_prefill(model, ids, cache, min(measured_tokens, 8 * K))
    cache.activate_past_recording()
    model(input_ids=ids[:, :5], past_key_values=cache, use_cache=True, logits_to_keep=1)  # a 5-token verify step
    recorded = cache.rewind.record_bytes()
    release = load_text_config()
    return {
        "interval_tokens": interval,
        "bench_model": {"measured_tokens": measured_tokens, "snapshots": len(cache.rewind.snapshots),
                        "snapshot_bytes_held": cache.rewind.snapshot_bytes_held(),
                        "bytes_per_snapshot": snapshot_bytes(config, dtype_bytes=dtype_bytes),
                        "rollback_bytes_per_verified_token": recorded["per_token"],
                        "kda_state_bytes": snapshot_bytes(config, dtype_bytes=dtype_bytes)},
        "release": {"rows": snapshot_memory(release, [64 * K, 1024 * K]),  # the default interval
                    "rollback_bytes_per_verified_token": rewind_record_bytes_per_token(release),
                    "kda_states_bytes": snapshot_bytes(release)},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model on CPU, short prompts (smoke test)")
    parser.add_argument("--out", help="also write the JSON line here")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--only", default="",
                        help=f"comma list of sections, run in this order ({', '.join(SECTIONS)})")
    parser.add_argument("--experts-format", choices=["dense", "mxfp4"], default="dense",
                        help="the benchmark model's routed experts: bf16 or packed MXFP4 (spec_bound)")
    parser.add_argument("--alphas", default=None,
                        help="spec_static: comma list of the damping factors of the target's layers past the "
                             "draft's (default 1,0.3,0.1,0.03,0; --quick 1,0)")
    parser.add_argument("--batches", default=None, help="spec_static: comma list of batch sizes (default 1,4; "
                                                         "--quick 1)")
    parser.add_argument("--proposals", default=None, help="spec_static: comma list of the tokens proposed per "
                                                           "round (default 2,4; --quick 2)")
    parser.add_argument("--budget-snapshots", default=None,
                        help="block_hit: comma list of the stored prompt's max_snapshot_bytes, in snapshots of one "
                             "sequence (default 64,16; --quick 6,3)")
    args = parser.parse_args()
    ensure_kimik3()
    from kimik3.modeling.rewind_kimi_k3 import DEFAULT_SNAPSHOT_INTERVAL, KDA_BLOCK_SIZE

    torch.manual_seed(0)
    named = list(dict.fromkeys(filter(None, args.only.split(","))))  # --only's sections, in its order, once each
    if unknown := [name for name in named if name not in SECTIONS]:  # refused before the model is built
        parser.error(f"--only: no section {', '.join(unknown)} (sections: {', '.join(SECTIONS)})")
    model, device = build_models(args.quick, args.layers, args.experts, args.experts_format,
                                 meta=named == ["spec_bound"] and not args.quick)
    if args.quick:
        sizes = dict(prompt_len=160, prefix_len=128, chunk=64, interval=32, context=48, new_tokens=12,
                     measured=96, block=16, shared_len=7 * 16)  # the old spacing's 64: 48 tokens replayed
    else:
        # 119 blocks shared: just below the old spacing's 61440, its worst case near 60K
        sizes = dict(prompt_len=64 * K, prefix_len=60 * K, chunk=8 * K, interval=DEFAULT_SNAPSHOT_INTERVAL,
                     context=1024, new_tokens=128, measured=64 * K, block=KDA_BLOCK_SIZE,
                     shared_len=119 * KDA_BLOCK_SIZE)
    budgets = [int(n) for n in (args.budget_snapshots or ("6,3" if args.quick else "64,16")).split(",")]
    alphas = [float(a) for a in (args.alphas or ("1,0" if args.quick else "1,0.3,0.1,0.03,0")).split(",")]
    batches = [int(b) for b in (args.batches or ("1" if args.quick else "1,4")).split(",")]
    proposals = [int(k) for k in (args.proposals or ("2" if args.quick else "2,4")).split(",")]
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else device, "quick": args.quick,
               "model_layers": model.config.num_hidden_layers, "dtype": str(model.dtype)}
    sections = {
        "ttft": lambda: section_ttft(model, device, sizes["prompt_len"], sizes["prefix_len"], sizes["chunk"],
                                     sizes["interval"]),
        "block_hit": lambda: section_block_hit(model, device, sizes["prompt_len"], sizes["shared_len"],
                                               sizes["chunk"], sizes["block"], 4 * sizes["block"] if args.quick
                                               else DEFAULT_SNAPSHOT_INTERVAL, budgets),
        "spec": lambda: section_spec(model, device, sizes["context"], sizes["new_tokens"], draft_layers=2,
                                     lookup_tokens=4, assistant_tokens=4, compiled=device == "cuda"),
        "spec_static": lambda: section_spec_static(model, device, sizes["context"], sizes["new_tokens"],
                                                   draft_layers=2, alphas=alphas, proposals=proposals,
                                                   batches=batches, compiled=device == "cuda",
                                                   repeats=1 if args.quick else 3),
        "spec_bound": lambda: section_spec_bound(model, sizes["context"], 2, proposals),
        "snapshots": lambda: section_snapshots(model, device, sizes["interval"], sizes["measured"]),
    }
    assert tuple(sections) == SECTIONS
    order = named or list(sections)
    for name in order:  # in the order --only names them: a time limit keeps the first ones
        run = sections[name]
        start = time.perf_counter()
        try:
            results[name] = run()
        except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name]["section_s"] = round(time.perf_counter() - start, 1)
        if device == "cuda":
            torch.cuda.empty_cache()
        # after every section, so a run stopped by a time limit keeps what it measured
        print(json.dumps({name: results[name]}, default=str), file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, default=str) + "\n")
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
