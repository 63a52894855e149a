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
"""Kimi K3 inference benchmark on one GPU (random bf16 weights, K3's exact widths, 8 layers).

Model: hidden 7168, 96 heads, MLA (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128, output gate), KDA 96 x 128
(lower-bounded gate, full-rank output gate), latent MoE (latent 3584, expert width 3072, top-16 of 64 experts,
2 shared experts), SiTU, Block AttnRes (block 12), vocab 163840; layers (KDA, KDA, KDA, MLA) x 2, layer 0 dense.

Measured, each in its own try/except under one time budget, JSON written after every measurement:
  kernels      per-op fast path vs reference at K3 shapes (kernels_moe: routed experts; kernels_attention: the
               MLA prefill attention through each PyTorch backend that returns the log-sum-exp)
  fast.*       our model with `kimik3.kernels` fast paths (fla-core KDA/conv, Triton, grouped_mm, bmm MLA decode)
  generate.*   decode steps of generate(), eager (dynamic cache) vs compiled (cache_implementation="static": torch
               compile with CUDA graphs), side by side; compiled_grouped_mm / compiled_fla_conv: the compiled step
               with one decode kernel switched back (routed experts on grouped_mm, KDA convs on fla's kernels)
  ref.*        the same model forced onto the pure-PyTorch reference ops
  kimi_linear.* transformers' in-tree KimiLinearForCausalLM at the closest config (64 experts, top-16, expert width
               1536, hidden 7168, same layer schedule; uses fla when importable, as transformers does)
  prefill_1m   chunked prefill of a 1M-token prompt through the cache, after 3 warm-up chunks on a throwaway cache
               (progress printed and recorded per chunk)
Each result carries the HBM roofline (decode: bytes read per step / 4.3 TB/s) or the bf16 roofline (prefill:
FLOPs / 790 TFLOP/s). Decode at 64K context uses a cache filled with random values of the right shapes (timing
depends only on shapes); at 4K the context is really prefilled.

    python benchmarks/bench_k3.py --out benchmarks/results/h200.json --budget-s 480
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _k3bench_utils import (  # noqa: E402
    BF16_FLOPS_PER_S,
    HBM_BYTES_PER_S,
    KDA_OPERANDS,
    Runner,
    copy_bytes_per_s,
    ensure_kimik3,
    event_us,
    expected_distinct_experts,
    free_cuda,
    peak_gib,
    reset_peak,
    round_sig,
    timed,
    with_setting,
)

K = 1024
DEV = "cuda"


# ------------------------------------------------------------------------------------------------------------
# models


def k3_config(num_layers=8, num_experts=64):
    from kimik3.configuration import release_layer_schedule
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig

    kda, full = release_layer_schedule(num_layers)
    return KimiK3TextConfig(
        vocab_size=163840, hidden_size=7168, intermediate_size=33792, num_hidden_layers=num_layers,
        num_attention_heads=96, num_key_value_heads=96, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, rms_norm_eps=1e-5, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
        linear_attn_config={"full_attn_layers": full, "kda_layers": kda, "gate_lower_bound": -5.0, "head_dim": 128,
                            "num_heads": 96, "short_conv_kernel_size": 4, "use_full_rank_gate": True},
        attn_res_block_size=12, num_experts=num_experts, num_experts_per_token=16, num_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        first_k_dense_replace=1, moe_layer_freq=1, moe_renormalize=True, routed_scaling_factor=1.0,
        max_position_embeddings=1 << 21, use_cache=True,
    )


def kimi_linear_config(num_layers=8):
    from transformers import KimiLinearConfig

    from kimik3.configuration import release_layer_schedule

    kda, full = release_layer_schedule(num_layers)  # the same schedule as K3's, for a like-for-like comparison
    return KimiLinearConfig(
        vocab_size=163840, hidden_size=7168, intermediate_size=33792, moe_intermediate_size=1536,
        num_hidden_layers=num_layers, num_attention_heads=96, num_key_value_heads=96, n_shared_experts=2,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        num_experts_per_tok=16, num_local_experts=64, linear_head_dim=128, linear_num_heads=96,
        linear_conv_kernel_dim=4, max_position_embeddings=1 << 21,
        linear_attn_config={"full_attn_layers": full, "kda_layers": kda, "head_dim": 128, "num_heads": 96,
                            "short_conv_kernel_size": 4},
        first_k_dense_replace=1,
    )


def build(model_cls, config):
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    if DEV == "meta":  # shapes and dtypes only (a byte model): no values to check
        return model
    with torch.no_grad():  # random weights; never leave uninitialised memory (NaN/inf) in a parameter
        for p in model.parameters():
            # integer tensors (packed codes, scale bytes) are always finite; a packed format's adapter points are
            # stride-0 views of one element (checking them would allocate a bool per dense value)
            if p.is_floating_point() and 0 not in p.stride() and not bool(torch.isfinite(p).all()):
                p.normal_(0.0, 0.02)
    return model


def build_packed(model_cls, config):
    """The benchmark model with its routed experts packed as MXFP4 (the release format): random valid codes, E8M0
    scales 2^-9..2^-6 so the weights have a trained size."""
    config.experts_format = "mxfp4"
    model = build(model_cls, config)
    with torch.no_grad():
        for name, buffer in model.named_parameters():
            if name.endswith("_packed"):
                buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, device=buffer.device))
            elif name.endswith("_scale"):
                buffer.copy_(torch.randint(118, 122, buffer.shape, dtype=torch.uint8, device=buffer.device))
    return model


def byte_stats(model):
    """Parameter bytes by role. 3-D `*experts*` parameters are routed experts [E, out, in]."""
    stats = {"dense_params": 0, "dense_bytes": 0, "embed_bytes": 0, "lm_head_params": 0, "lm_head_bytes": 0,
             "expert_params_per_expert": 0, "expert_bytes_per_expert": 0, "num_experts": 0, "moe_layers": set()}
    # packed MXFP4 experts are parameters without gradient (uint8 codes + E8M0 scales): their bytes are what a decode
    # step reads
    for name, p in model.named_parameters():
        if 0 in p.stride():  # a packed format's adapter points: stride-0 views of one element, no bytes to read
            continue
        nbytes = p.numel() * p.element_size()
        if "embed_tokens" in name:
            stats["embed_bytes"] += nbytes
        elif "lm_head" in name:
            stats["lm_head_params"] += p.numel()
            stats["lm_head_bytes"] += nbytes
        elif p.dim() == 3 and "experts" in name:
            stats["num_experts"] = p.shape[0]
            stats["moe_layers"].add(name.split(".experts")[0])
            stats["expert_params_per_expert"] += p.numel() // p.shape[0]
            stats["expert_bytes_per_expert"] += nbytes // p.shape[0]
        else:
            stats["dense_params"] += p.numel()
            stats["dense_bytes"] += nbytes
    n_moe = len(stats.pop("moe_layers"))
    stats["moe_layers"] = n_moe
    if n_moe:  # per layer
        stats["expert_params_per_expert"] //= n_moe
        stats["expert_bytes_per_expert"] //= n_moe
    stats["total_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if 0 not in p.stride())
    return stats


def layer_counts(config):
    types = list(config.layer_types)
    return types.count("full_attention"), types.count("linear_attention")


def decode_roofline(stats, config, batch, context):
    """Bytes read per decode step (all sequences of the batch advance one token) and the HBM-bound time."""
    n_mla, n_kda = layer_counts(config)
    heads, dk = 96, 128
    top_k = getattr(config, "num_experts_per_token", None) or getattr(config, "num_experts_per_tok")
    experts_hit = expected_distinct_experts(stats["num_experts"], top_k, batch) if stats["num_experts"] else 0
    weights = stats["dense_bytes"] + stats["lm_head_bytes"] + stats["moe_layers"] * experts_hit * stats[
        "expert_bytes_per_expert"]
    latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
    cache = n_mla * batch * context * latent_dim * 2 + n_kda * batch * heads * dk * dk * 4 * 2
    total = weights + cache
    return {"bytes_per_step": int(total), "weight_bytes": int(weights), "cache_bytes": int(cache),
            "expected_experts_hit_per_layer": round(experts_hit, 2),
            "hbm_roofline_ms": round(total / HBM_BYTES_PER_S * 1e3, 3)}


def prefill_flops(stats, config, tokens, batch=1):
    n_mla, n_kda = layer_counts(config)
    heads, dk, chunk = 96, 128, 64
    top_k = getattr(config, "num_experts_per_token", None) or getattr(config, "num_experts_per_tok")
    linear = 2 * tokens * (stats["dense_params"] + stats["moe_layers"] * top_k * stats["expert_params_per_expert"])
    lm_head = 2 * stats["lm_head_params"]  # logits for the last position only
    mla = n_mla * heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * tokens * tokens
    kda = n_kda * heads * tokens * (6 * dk * dk + 3 * chunk * dk + chunk * chunk)  # Kimi Linear report's count
    total = batch * (linear + mla + kda) + batch * lm_head
    return {"flops": float(total), "flops_linear": float(batch * linear), "flops_mla_attention": float(batch * mla),
            "flops_kda": float(batch * kda), "bf16_roofline_s": round_sig(total / BF16_FLOPS_PER_S)}


# ------------------------------------------------------------------------------------------------------------
# model drivers (K3 takes `cache=`, transformers' Kimi Linear `past_key_values=`)


class K3Driver:
    name = "k3"

    def __init__(self, model):
        self.model = model
        from kimik3.modeling.cache_kimi_k3 import KimiK3Cache, KimiK3StaticCache

        self.cache_cls, self.static_cache_cls = KimiK3Cache, KimiK3StaticCache

    def new_cache(self):
        return self.cache_cls(self.model.config)

    def forward(self, ids, cache):
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits, cache

    def synthetic_cache(self, batch, context, max_cache_len=None):
        """A cache holding `context` tokens of random state, written through the cache's own accessors as a
        prefill writes it (static with `max_cache_len`: latents at the head of preallocated buffers, a
        device-side position and key-validity mask, every buffer at a fixed address)."""
        cfg = self.model.config
        cache = (self.cache_cls(cfg) if max_cache_len is None
                 else self.static_cache_cls(cfg, max_cache_len=max_cache_len))
        cache.begin_step(batch, context, None, torch.device(DEV))
        width = cfg.linear_num_heads * cfg.linear_head_dim
        for layer, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                cache.update_latents(torch.randn(batch, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                                 device=DEV, dtype=torch.bfloat16), layer)
            else:
                conv_states = tuple(
                    torch.randn(batch, width, cfg.linear_conv_kernel_size - 1, device=DEV, dtype=torch.bfloat16)
                    for _ in range(3))
                recurrent_state = 0.01 * torch.randn(
                    batch, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim, device=DEV)
                cache.update_kda_state(conv_states, recurrent_state, layer)
        cache.advance(context)
        return cache


class HFDriver:
    name = "kimi_linear"

    def __init__(self, model):
        self.model = model

    def new_cache(self):
        return None

    def forward(self, ids, cache):
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        new_cache = getattr(out, "past_key_values", None)
        if new_cache is None:
            new_cache = getattr(out, "cache", None)
        return out.logits, new_cache

    def synthetic_cache(self, batch, context):
        raise NotImplementedError


def prefill(driver, ids, chunk=None):
    cache = driver.new_cache()
    total = ids.shape[1]
    chunk = chunk or total
    logits = None
    for start in range(0, total, chunk):
        logits, cache = driver.forward(ids[:, start:start + chunk], cache)
    return logits, cache


def random_ids(batch, length, vocab=163840):
    return torch.randint(0, vocab - 1, (batch, length), device=DEV)


def measure_prefill(driver, stats, tokens, batch=1, repeats=2, warmup=1, chunk=None):
    ids = random_ids(batch, tokens)
    with torch.inference_mode():
        for _ in range(warmup):
            prefill(driver, ids, chunk)
        reset_peak()
        seconds, all_times = timed(lambda: prefill(driver, ids, chunk), repeats=repeats)
    flops = prefill_flops(stats, driver.model.config, tokens, batch)
    return {
        "batch": batch, "tokens": tokens, "chunk": chunk, "seconds": round(seconds, 4),
        "times_s": [round(t, 4) for t in all_times], "tokens_per_s": round(batch * tokens / seconds, 1),
        "peak_mem_gib": peak_gib(), "achieved_tflops": round(flops["flops"] / seconds / 1e12, 1),
        "fraction_of_bf16_peak": round(flops["flops"] / seconds / BF16_FLOPS_PER_S, 3),
        "fraction_of_this_machines_gemm": (
            round(flops["flops"] / seconds / MEASURED_CEILINGS["bf16_gemm_flops_per_s"], 3)
            if MEASURED_CEILINGS else None),
        "bf16_roofline_s": flops["bf16_roofline_s"], "flops": flops,
    }


def measure_decode(driver, stats, batch, context, steps=10, warmup=3, synthetic=False):
    with torch.inference_mode():
        t_prefill = None
        if synthetic:
            cache = driver.synthetic_cache(batch, context)
        else:
            t = time.perf_counter()
            _, cache = prefill(driver, random_ids(batch, context), chunk=None if batch * context <= 32 * K else
                               max(1, 32 * K // batch))
            torch.cuda.synchronize()
            t_prefill = time.perf_counter() - t
        tok = random_ids(batch, 1)
        for _ in range(warmup):
            logits, cache = driver.forward(tok, cache)
            tok = logits[:, -1:].argmax(-1)
        reset_peak()  # no empty_cache here: timed steps must reuse the allocator's warm blocks
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            logits, cache = driver.forward(tok, cache)
            tok = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - t) / steps
    roof = decode_roofline(stats, driver.model.config, batch, context)
    return {
        "batch": batch, "context": context, "synthetic_context": synthetic, "steps": steps,
        "ms_per_step": round(per_step * 1e3, 3), "ms_per_token_per_sequence": round(per_step * 1e3, 3),
        "tokens_per_s": round(batch / per_step, 1), "peak_mem_gib": peak_gib(),
        "context_prefill_s": None if t_prefill is None else round(t_prefill, 2),
        "x_of_hbm_roofline": round(per_step * 1e3 / roof["hbm_roofline_ms"], 2), **roof,
    }


# ------------------------------------------------------------------------------------------------------------
# decode through generate(): eager (dynamic cache) vs compiled (static cache, CUDA graphs)


class _StepClock:
    """A logits processor that stamps the wall time after every forward of generate() (device synchronised), so the
    intervals are whole decode steps as generate() runs them (forward, sampling, bookkeeping). With `profile_steps`
    (first, count) it also runs torch.profiler over exactly those decode steps (CUDA-graph replays included)."""

    def __init__(self, profile_steps=None):
        self.stamps = []
        self.profile_steps = profile_steps
        self.profiler = None

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if self.profile_steps is not None:
            first, count = self.profile_steps
            if len(self.stamps) == first:
                from torch.profiler import ProfilerActivity, profile

                self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.profiler.start()
            elif len(self.stamps) == first + count and self.profiler is not None:
                self.profiler.stop()
        return scores

    def kernel_table(self):
        return None if self.profiler is None else kernel_table(self.profiler, steps=self.profile_steps[1])


KERNEL_TABLE_TOP = 25  # --kernel-table-top


def kernel_table(prof, steps=1, top=None):
    """GPU kernel time per profiled step (of `steps`) from a finished torch.profiler run: total, launches, and the
    top kernels by time."""
    top = KERNEL_TABLE_TOP if top is None else top
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {"gpu_kernel_ms_per_step": round(sum(e.self_device_time_total for e in kernels) / steps / 1e3, 3),
            "kernel_launches_per_step": sum(e.count for e in kernels) / steps,
            "top_kernels": [{"name": e.key[:120], "ms_per_step": round(e.self_device_time_total / steps / 1e3, 4),
                             "calls_per_step": e.count / steps} for e in ranked]}


class _LastStepInputs:
    """Wraps `prepare_inputs_for_generation` on one model instance for one generate() call and keeps the inputs of
    its last decode step, so the compiled step can be called again outside generate() (`compiled_call_breakdown`)."""

    def __init__(self, model):
        self.model, self.inputs = model, None

    def __enter__(self):
        prepare = self.model.prepare_inputs_for_generation

        def recording(*args, **kwargs):
            self.inputs = prepare(*args, **kwargs)
            return self.inputs

        self.model.prepare_inputs_for_generation = recording
        return self

    def __exit__(self, *exc):
        del self.model.prepare_inputs_for_generation  # the class's method again


def compiled_call_breakdown(model, inputs, calls=20):
    """Where a compiled decode step's wall time goes: the step generate() compiled (`model._compiled_call`, the same
    CUDA-graph tree) called again with the last step's inputs (same shapes: a replay, no recompile), 1) back to back
    without synchronising (GPU-bound: kernel time + the gaps between kernels of the graph), 2) synchronised after
    every call (+ the host's cost of one call: guards, CUDA-graph-tree bookkeeping, launch), and the host time of one
    call when the GPU is busy. generate()'s step minus (2) is generate()'s own work per step."""
    fn = getattr(model, "_compiled_call", None)
    if fn is None or inputs is None:
        return None
    from torch._dynamo.utils import counters

    from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD

    position = inputs[CACHE_FIELD].position  # the static cache's write position (a device tensor)
    graphs_before = counters["stats"].get("unique_graphs", 0)

    def step():  # the same position every call: the static cache never runs out (one extra 1-element kernel)
        fn(**inputs, return_dict=True)
        position.sub_(1)

    def timed_calls(synchronise=False):  # seconds of each of `calls` calls
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            step()
            if synchronise:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return times

    def median_ms(times):
        return round(sorted(times)[calls // 2] * 1e3, 3)

    with torch.no_grad():  # generate()'s grad mode: the same guards
        position.sub_(1)  # the last step's position (generate() stops with the buffer full)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        host = timed_calls()
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - start) / calls
        serial = timed_calls(synchronise=True)
        host_profile = _host_profile(step, calls)
        # the same calls without Dynamo's guard evaluation (only safe here: nothing changes between the calls)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            unguarded = timed_calls()
        torch.cuda.synchronize()
    return {"back_to_back_ms_per_call": round(pipelined * 1e3, 3),
            "synchronised_ms_per_call": median_ms(serial),
            "host_ms_per_call": median_ms(host),
            "host_ms_per_call_without_guard_eval": median_ms(unguarded),
            "recompiled": counters["stats"].get("unique_graphs", 0) != graphs_before,
            "host_profile": host_profile}


def _host_profile(step, calls, top=16):
    """The Python functions a compiled call spends its host time in (cProfile over `calls` unsynchronised calls; the
    profiler's own overhead inflates every figure alike): µs per call, own time and with callees."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    rows = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}

    def entry(key, value):
        path, line, name = key
        return {"fn": f"{'/'.join(Path(path).parts[-2:])}:{line}({name})", "calls_per_call": value[1] / calls,
                "own_us": round(value[2] / calls * 1e6, 1), "cum_us": round(value[3] / calls * 1e6, 1)}

    by_own = sorted(rows.items(), key=lambda kv: -kv[1][2])[:top]
    by_cum = sorted(rows.items(), key=lambda kv: -kv[1][3])[:top]
    return {"by_own_time": [entry(*kv) for kv in by_own], "by_cumulative_time": [entry(*kv) for kv in by_cum]}


def measure_generate_decode(model, stats, batch, context, compiled, new_tokens=48, steady_from=8,
                            synthetic=False, profile=False):
    """ms per decode step of `generate()` (greedy, `new_tokens` tokens): eager with the dynamic cache and the fast
    ops, or `cache_implementation="static"`, which generate() compiles by itself on CUDA (torch.compile,
    mode="reduce-overhead": CUDA graphs). The first `steady_from` steps (compilation, CUDA-graph warm-up and
    recording) are reported apart; the figure is the median of the later steps. `synthetic`: the context is a
    cache of random state (only the last prompt token runs), as for the eager 64K decode above. `profile`: also
    the GPU kernel table of 5 steady steps (torch.profiler around those steps only)."""
    from torch._dynamo.utils import counters

    from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD

    torch._dynamo.reset()  # each configuration compiles its own static-shape graph
    counters.clear()
    free_cuda()
    device = model.device
    clock = _StepClock((steady_from + 4, 5) if profile else None)
    ids = torch.randint(3, model.config.vocab_size - 1, (batch, context + (1 if synthetic else 0)), device=device)
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
              "do_sample": False, "logits_processor": [clock], "pad_token_id": 0}
    if compiled and synthetic:
        kwargs[CACHE_FIELD] = K3Driver(model).synthetic_cache(batch, context, context + new_tokens + 1)
    elif compiled:
        kwargs["cache_implementation"] = "static"
    else:
        kwargs["disable_compile"] = True
        if synthetic:
            kwargs[CACHE_FIELD] = K3Driver(model).synthetic_cache(batch, context)
    if device.type == "cuda":
        reset_peak()
        torch.cuda.synchronize()
    start = time.perf_counter()
    with _LastStepInputs(model) as last_step:
        model.generate(ids, **kwargs)
    total = time.perf_counter() - start
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    if clock.profile_steps is not None:  # the profiled steps run slower: not part of the timing
        first, count = clock.profile_steps
        steps_timed = [x for j, x in enumerate(steps) if not first - 1 <= j <= first + count - 1]
    else:
        steps_timed = steps
    steady = sorted(steps_timed[steady_from:])
    per_step = steady[len(steady) // 2]
    roof = decode_roofline(stats, model.config, batch, context)
    return {
        "batch": batch, "context": context, "compiled": compiled, "synthetic_context": synthetic,
        "new_tokens": new_tokens, "ms_per_step": round(per_step * 1e3, 3),
        "ms_per_step_p10_p90": [round(steady[len(steady) // 10] * 1e3, 3),
                                round(steady[-(len(steady) // 10) - 1] * 1e3, 3)],
        "first_steps_ms": [round(x * 1e3, 1) for x in steps[:steady_from]],
        "prefill_s": round(clock.stamps[0] - start, 3), "generate_total_s": round(total, 2),
        "tokens_per_s": round(batch / per_step, 1), "peak_mem_gib": peak_gib() if device.type == "cuda" else None,
        "x_of_hbm_roofline": round(per_step * 1e3 / roof["hbm_roofline_ms"], 2),
        "dynamo_unique_graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0), **roof,
        **({"profile": clock.kernel_table()} if profile else {}),
        **({"compiled_call": _with_generate_overhead(compiled_call_breakdown(model, last_step.inputs), per_step)}
           if compiled and device.type == "cuda" else {}),
    }


def _with_generate_overhead(breakdown, per_step):
    if breakdown is not None:
        breakdown["generate_ms_per_step_beyond_synchronised_call"] = round(
            per_step * 1e3 - breakdown["synchronised_ms_per_call"], 3)
    return breakdown


# ------------------------------------------------------------------------------------------------------------
# sections


# This machine's own ceilings, measured by section_env: the prefill also reports its fraction of these, which
# separates the model's efficiency from the speed of the machine it ran on (kind-wide constants above stay the target)
MEASURED_CEILINGS = {}


def _gemm_us():
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return event_us(lambda: torch.mm(a, b), 20)


def measure_ceilings():
    """This machine's 8192^3 bf16 GEMM (FLOP/s) and 2 GiB device-to-device copy (bytes read + written per second),
    each the mean of back-to-back calls timed by CUDA events."""
    gemm_us, copy_rate = _gemm_us(), copy_bytes_per_s(2**31)
    free_cuda()
    return {"bf16_gemm_flops_per_s": round(2 * 8192**3 / (gemm_us * 1e-6)), "hbm_copy_bytes_per_s": round(copy_rate)}


def section_env():
    import triton
    import transformers

    info = {
        "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
        "gpu_mem_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "hbm_bytes_per_s_assumed": HBM_BYTES_PER_S, "bf16_flops_per_s_assumed": BF16_FLOPS_PER_S,
    }
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except ImportError as exc:
        info["fla"] = f"not importable: {exc}"
    import kimik3.kernels as kk

    info["kimik3_import"] = ensure_kimik3()
    info["fast_ops"] = kk.available_ops()
    MEASURED_CEILINGS.update(measure_ceilings())
    info["measured_on_this_machine"] = dict(MEASURED_CEILINGS)
    return info


def _op_bencher(res):
    """bench(name, fast_fn, ref_fn, repeats): ms (median after 2 warm-up calls) of both into res[name]."""

    def bench(name, fast_fn, ref_fn, repeats=10):
        entry = {}
        for label, fn in (("fast_ms", fast_fn), ("ref_ms", ref_fn)):
            if fn is None:
                continue
            try:
                with torch.inference_mode():
                    sec, _ = timed(fn, repeats=repeats, warmup=2)
                entry[label] = round(sec * 1e3, 4)
            except Exception as exc:  # noqa: BLE001
                entry[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if isinstance(entry.get("fast_ms"), float) and isinstance(entry.get("ref_ms"), float):
            entry["speedup"] = round(entry["ref_ms"] / entry["fast_ms"], 2)
        res[name] = entry

    return bench


def section_kernels():
    """Per-op timings at K3 shapes (ms, median of 10 after warm-up): fast path vs reference."""
    import kimik3.kernels as kk
    from kimik3.modeling import ops_kimi_k3 as ops

    res = {}
    bench = _op_bencher(res)
    bf = torch.bfloat16
    # MLA absorbed decode
    for batch, ctx in ((1, 4 * K), (1, 64 * K), (8, 64 * K)):
        q = torch.randn(batch, 96, 1, 576, device=DEV, dtype=bf)
        c = torch.randn(batch, ctx, 576, device=DEV, dtype=bf)
        fast = kk.load("mla_decode")
        cache_bytes = c.numel() * 2
        bench(f"mla_decode_b{batch}_t{ctx // K}k", lambda: fast(q, c, 0.07, 512),
              (lambda: ops.mla_decode(q, c, 0.07, 512)) if ctx <= 4 * K else None)
        res[f"mla_decode_b{batch}_t{ctx // K}k"]["cache_bytes"] = cache_bytes
        if isinstance(res[f"mla_decode_b{batch}_t{ctx // K}k"].get("fast_ms"), float):
            res[f"mla_decode_b{batch}_t{ctx // K}k"]["fast_effective_TBps"] = round(
                cache_bytes / (res[f"mla_decode_b{batch}_t{ctx // K}k"]["fast_ms"] * 1e-3) / 1e12, 2)
        del q, c
    # SiTU on [8K*16, 3072] halves
    h = torch.randn(8 * K * 2, 6144, device=DEV, dtype=bf)
    fast = kk.load("situ_glu")
    bench("situ_glu_16k_x_3072", lambda: fast(h[:, :3072], h[:, 3072:], 4.0, 25.0),
          lambda: ops.situ_glu(h[:, :3072], h[:, 3072:], 4.0, 25.0))
    del h
    # AttnRes over 9 candidates at 8K tokens and at 1 token
    for tokens in (8 * K, 1):
        cands = [torch.randn(1, tokens, 7168, device=DEV, dtype=bf) for _ in range(9)]
        nw, pw = torch.ones(7168, device=DEV, dtype=bf), torch.randn(1, 7168, device=DEV, dtype=bf) * 0.02
        fast = kk.load("block_attn_res_mix")
        bench(f"attn_res_9cand_{tokens}tok", lambda: fast(cands, nw, pw, 1e-5),
              lambda: ops.block_attn_res_mix(cands, nw, pw, 1e-5))
        del cands
    # KDA chunk (8K) and recurrent step (B=1, B=8)
    for batch, t in ((1, 8 * K),):
        q, k_, v = (torch.randn(batch, t, 96, 128, device=DEV, dtype=bf) for _ in range(3))
        g = ops.kda_gate(torch.randn(batch, t, 96, 128, device=DEV), torch.zeros(96, device=DEV),
                         torch.zeros(96 * 128, device=DEV), -5.0)
        beta = torch.rand(batch, t, 96, device=DEV)
        fast = kk.load("chunk_kda")
        bench("chunk_kda_b1_t8k", (lambda: fast(q, k_, v, g, beta, use_qk_l2norm_in_kernel=True)) if fast else None,
              lambda: ops.chunk_kda(q, k_, v, g, beta, use_qk_l2norm_in_kernel=True), repeats=3)
        del q, k_, v, g, beta
    for batch in (1, 8):
        q, k_, v = (torch.randn(batch, 1, 96, 128, device=DEV, dtype=bf) for _ in range(3))
        g = -torch.rand(batch, 1, 96, 128, device=DEV)
        beta = torch.rand(batch, 1, 96, device=DEV)
        h0 = torch.randn(batch, 96, 128, 128, device=DEV) * 0.01
        with torch.inference_mode():
            fast = kk.load("fused_recurrent_kda")
        bench(f"fused_recurrent_kda_b{batch}",
              (lambda: fast(q, k_, v, g, beta, initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)) if fast else None,
              lambda: ops.fused_recurrent_kda(q, k_, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True))
    # MXFP4 dequant of one layer of 64 experts (gate_up)
    packed = torch.randint(0, 256, (64, 6144, 1792), device=DEV, dtype=torch.uint8)
    scale = torch.randint(110, 130, (64, 6144, 112), device=DEV, dtype=torch.uint8)
    fast = kk.load("mxfp4_dequant")
    bench("mxfp4_dequant_64x6144x3584", lambda: fast(packed, scale, bf),
          lambda: ops.dequantize_mxfp4(packed, scale, bf), repeats=3)
    return res


def section_moe_kernels():
    """Routed experts at K3 widths (64 experts, top-16, latent 3584, expert width 3072; ms, median of 5 after
    warm-up): bf16 experts through grouped_mm against the reference loop, and packed MXFP4 experts (at 1 and 8
    tokens also through each packed kernel, GEMV and 16-row tiles, whole MoE and matmuls alone)."""
    import kimik3.kernels as kk
    from kimik3.modeling import ops_kimi_k3 as ops

    res = {}
    bench = _op_bencher(res)
    bf = torch.bfloat16
    gate_up = torch.randn(64, 6144, 3584, device=DEV, dtype=bf) * 0.02
    down = torch.randn(64, 3584, 3072, device=DEV, dtype=bf) * 0.02
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    for n in (1, 8, 8 * K):
        x = torch.randn(n, 3584, device=DEV, dtype=bf)
        w, idx = torch.rand(n, 64, device=DEV).topk(16, dim=-1)
        fast = kk.load("moe_experts")
        name = f"moe_experts_n{n}"
        bench(name, lambda: fast(x, idx, w, gate_up, down, 4.0, 25.0),
              lambda: ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0), repeats=5)
        active = int(torch.unique(idx).numel())
        res[name]["hbm_roofline_ms"] = round(active * expert_bytes / HBM_BYTES_PER_S * 1e3, 4)
        if n <= 8:  # decode sizes: the few-rows Triton matmul (fast_ms) against grouped_mm for the same experts
            with torch.inference_mode():
                sec, _ = without_few_rows_kernel(lambda: timed(lambda: fast(x, idx, w, gate_up, down, 4.0, 25.0),
                                                               repeats=5, warmup=2))
                res[name]["grouped_mm_ms"] = round(sec * 1e3, 4)
                grouped = without_few_rows_kernel(lambda: fast(x, idx, w, gate_up, down, 4.0, 25.0)).float()
                res[name]["rel_err_vs_grouped_mm"] = float(
                    (fast(x, idx, w, gate_up, down, 4.0, 25.0).float() - grouped).norm() / grouped.norm())
    # The same experts packed as MXFP4 (release format): the Triton grouped matmul that dequantises tiles in
    # registers, against dequantising the whole stack first and then the bf16 grouped GEMMs (the fast path before),
    # and against bf16 experts. Roofline: the packed bytes of the experts routed to, read once.
    packed = [(torch.randint(0, 256, (*t.shape[:-1], t.shape[-1] // 2), device=DEV, dtype=torch.uint8),
               torch.randint(110, 122, (*t.shape[:-1], t.shape[-1] // 32), device=DEV, dtype=torch.uint8))
              for t in (gate_up, down)]
    packed_args = (packed[0][0], packed[0][1], packed[1][0], packed[1][1], 4.0, 25.0)
    bytes_per_expert = sum(t[0].numel() + t[1].numel() for t in packed) // 64
    fast_mxfp4, fast_bf16 = kk.load("moe_experts_mxfp4"), kk.load("moe_experts")
    from kimik3.kernels.mxfp4 import moe_experts_mxfp4_dequantised

    for n in (1, 8, 8 * K):
        x = torch.randn(n, 3584, device=DEV, dtype=bf)
        w, idx = torch.rand(n, 64, device=DEV).topk(16, dim=-1)
        name = f"moe_experts_mxfp4_n{n}"
        bench(name, lambda: fast_mxfp4(x, idx, w, *packed_args),
              lambda: moe_experts_mxfp4_dequantised(x, idx, w, *packed_args), repeats=5)
        with torch.inference_mode():
            sec, _ = timed(lambda: fast_bf16(x, idx, w, gate_up, down, 4.0, 25.0), repeats=5, warmup=2)
        entry = res[name]
        entry["ref_is"] = "Triton dequant of the whole stack + bf16 grouped_mm"
        entry["bf16_experts_ms"] = round(sec * 1e3, 4)
        active = int(torch.unique(idx).numel())
        entry["packed_bytes_read"] = active * bytes_per_expert
        entry["hbm_roofline_ms"] = round(active * bytes_per_expert / HBM_BYTES_PER_S * 1e3, 4)
        if isinstance(entry.get("fast_ms"), float):
            entry["fast_effective_TBps"] = round(active * bytes_per_expert / (entry["fast_ms"] * 1e-3) / 1e12, 2)
        with torch.inference_mode():
            before = moe_experts_mxfp4_dequantised(x, idx, w, *packed_args).float()
            entry["rel_err_vs_dequant_then_grouped_mm"] = float(
                (fast_mxfp4(x, idx, w, *packed_args).float() - before).norm() / before.norm())
        if n <= 8:  # decode sizes: the GEMV (one program per routed row) against the 16-row tile kernel
            entry.update(_mxfp4_gemv_vs_tiles(x, idx, w, packed, packed_args, fast_mxfp4, active * bytes_per_expert))
    return res


def _mxfp4_gemv_vs_tiles(x, idx, w, packed, packed_args, fast_mxfp4, packed_bytes):
    """moe_experts_mxfp4 with its matmuls forced onto each packed kernel (ms and effective TB/s of the packed bytes,
    routing and combine included), and the two matmuls alone (gate_up on the expert-sorted rows, down on rows of
    the expert width; 20 back-to-back calls per timing, so the host synchronisation is amortised)."""
    res, outs = {}, {}
    routed = idx.reshape(-1)
    rows = x.index_select(0, torch.argsort(routed, stable=True) // idx.shape[-1])  # as moe.py sorts them
    ends = torch.cumsum(torch.bincount(routed, minlength=packed[0][0].shape[0]), 0).to(torch.int32)
    act = torch.randn(rows.shape[0], packed[1][0].shape[-1] * 2, device=DEV, dtype=x.dtype)
    # "gemv_portable_decode": the GEMV with its codes decoded one at a time (the f16-pair PTX decode off)
    ops_by_kernel = {"gemv": ("gemv", torch.ops.kimik3.mxfp4_gemv),
                     "gemv_portable_decode": ("gemv", torch.ops.kimik3.mxfp4_gemv),
                     "tiles": ("tiles", torch.ops.kimik3.mxfp4_grouped_matmul)}
    with torch.inference_mode():
        for kernel, (path, matmul) in ops_by_kernel.items():
            decode = without_ptx_decode if kernel == "gemv_portable_decode" else (lambda fn: fn())
            sec, _ = decode(lambda: with_mxfp4_kernel(path, lambda: timed(
                lambda: fast_mxfp4(x, idx, w, *packed_args), repeats=5, warmup=2)))
            res[f"{kernel}_ms"] = round(sec * 1e3, 4)
            res[f"{kernel}_effective_TBps"] = round(packed_bytes / sec / 1e12, 2)
            outs[kernel] = decode(lambda: with_mxfp4_kernel(path, lambda: fast_mxfp4(x, idx, w, *packed_args))).float()

            def both_matmuls_20x(matmul=matmul):
                for _ in range(20):
                    matmul(rows, *packed[0], ends)
                    matmul(act, *packed[1], ends)

            sec, _ = decode(lambda: timed(both_matmuls_20x, repeats=5, warmup=1))
            res[f"{kernel}_matmuls_only_ms"] = round(sec / 20 * 1e3, 4)
            res[f"{kernel}_matmuls_only_effective_TBps"] = round(packed_bytes / (sec / 20) / 1e12, 2)
    res["rel_err_gemv_vs_tiles"] = float((outs["gemv"] - outs["tiles"]).norm() / outs["tiles"].norm())
    res["rel_err_gemv_vs_portable_decode"] = float(
        (outs["gemv"] - outs["gemv_portable_decode"]).norm() / outs["gemv_portable_decode"].norm())
    return res


def section_attention_kernels():
    """MLA prefill attention (96 heads, q/k dim 192, v dim 128) with its log-sum-exp, through each PyTorch backend that
    returns one: flash (V zero-padded to 192: our fast path), cuDNN (native v dim) and memory-efficient. Useful
    TFLOP/s count 2*Sq*Sk*(192+128) per head (half of it when causal), not the padding. Outputs are compared with
    the flash path."""
    res = {}
    bf = torch.bfloat16
    scale = 192 ** -0.5

    def flash(q, k, v, causal):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, torch.nn.functional.pad(v, (0, 64)), 0.0, causal, scale=scale)[:2]
        return out[..., :128], lse

    def cudnn(q, k, v, causal):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse

    def efficient(q, k, v, causal):
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse

    for sq, sk, causal in ((8 * K, 8 * K, True), (16 * K, 16 * K, False), (64 * K, 16 * K, False)):
        q = torch.randn(1, 96, sq, 192, device=DEV, dtype=bf)
        k = torch.randn(1, 96, sk, 192, device=DEV, dtype=bf)
        v = torch.randn(1, 96, sk, 128, device=DEV, dtype=bf)
        flops = 2 * 96 * sq * sk * (192 + 128) * (0.5 if causal else 1.0)
        entry = res[f"q{sq // K}k_k{sk // K}k{'_causal' if causal else ''}"] = {"useful_flops": flops}
        base = None
        for name, fn in (("flash_padded_v", flash), ("cudnn", cudnn), ("efficient", efficient)):
            try:
                with torch.inference_mode():
                    sec, _ = timed(lambda: fn(q, k, v, causal), repeats=5, warmup=2)
                    out, lse = fn(q, k, v, causal)
                row = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 1),
                       "x_of_bf16_peak": round(flops / sec / BF16_FLOPS_PER_S, 3)}
                lse = lse.float().reshape(1, 96, sq)
                if base is None:
                    base = (out.float(), lse)
                else:
                    row["max_abs_diff_out_vs_flash"] = float((out.float() - base[0]).abs().max())
                    row["max_abs_diff_lse_vs_flash"] = float((lse - base[1]).abs().max())
                entry[name] = row
                del out, lse
            except Exception as exc:  # noqa: BLE001 - a backend that refuses the shapes is a result too
                entry[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        del q, k, v, base
        free_cuda()
    return res


def without_few_rows_kernel(fn):
    """fn() with the bf16 routed experts on grouped_mm at every size (the few-rows Triton matmul off)."""
    from kimik3.kernels import moe

    return with_setting(moe, "FEW_ROWS_PER_EXPERT", 0, fn)


def with_mxfp4_kernel(kernel, fn):
    """fn() with the packed routed experts' matmuls on `kernel` ("gemv" or "tiles") up to the tile kernel's limit of
    rows per expert (the dequantised stack beyond, as always)."""
    from kimik3.kernels import mxfp4

    return with_setting(mxfp4, "MXFP4_GEMV_ROWS_PER_EXPERT",
                         {"gemv": mxfp4.MXFP4_TILE_ROWS_PER_EXPERT, "tiles": 0}[kernel], fn)


def with_mxfp4_prefill(path, fn):
    """fn() with the packed routed experts' prefill matmuls on `path`: "gemm" (the packed grouped GEMM at any number
    of rows per expert), "gemm_bytes" (the same on the byte-decoding GEMM, `MXFP4_GEMM_WORDS` off) or "dequantised"
    (chunks of experts dequantised for grouped_mm, from the tiles' limit on)."""
    from kimik3.kernels import mxfp4

    rows = {"gemm": 1 << 40, "gemm_bytes": 1 << 40, "dequantised": 0}[path]
    return with_setting(mxfp4, "MXFP4_GEMM_ROWS_PER_EXPERT", rows, lambda: with_setting(
        mxfp4, "MXFP4_GEMM_WORDS", path != "gemm_bytes", fn))


def without_conv_step_kernel(fn):
    """fn() with every KDA conv on fla's kernels (pad, conv, final window, slice), the one-launch step kernel off."""
    from kimik3.kernels import conv

    return with_setting(conv, "CONV_STEP_MAX_TOKENS", 0, fn)


def without_ptx_decode(fn):
    """fn() with the packed GEMV decoding one code at a time (its f16-pair PTX decode off)."""
    from kimik3.kernels import mxfp4

    return with_setting(mxfp4, "MXFP4_PTX_DECODE", False, fn)


def with_kda_operands(tag: str, fn):
    """fn() with fla's chunk_kda handed the operands of `tag` (bf16 as given; fp16: 11 significant bits at bf16's
    bytes; f32: f32 intermediates, TF32 dots)."""
    from kimik3.kernels import kda

    return with_setting(kda, "KDA_CHUNK_OPERANDS", KDA_OPERANDS[tag], fn)


def with_reference_ops(names: str, fn):
    """fn() with the ops in the comma list `names` on their references (KIMIK3_REFERENCE_ONLY), the others fast."""
    previous = os.environ.get("KIMIK3_REFERENCE_ONLY")
    os.environ["KIMIK3_REFERENCE_ONLY"] = names
    try:
        return fn()
    finally:
        os.environ["KIMIK3_REFERENCE_ONLY"] = previous if previous is not None else "0"


def set_reference(flag: bool):
    os.environ["KIMIK3_REFERENCE_ONLY"] = "1" if flag else "0"


def main():
    global KERNEL_TABLE_TOP
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/bench_k3.json")
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--skip", default="", help="comma list of section prefixes to skip")
    parser.add_argument("--only", default="", help="comma list of section prefixes to run (builds run as needed)")
    parser.add_argument("--prefill-1m-budget-s", type=float, default=240.0)  # warm 1M: ~155 s (docs/benchmarks.md)
    parser.add_argument("--chunk-1m", type=int, default=32 * K)
    parser.add_argument("--mla-prefill-block-size", type=int, default=None,
                        help="the benchmark model's mla_prefill_block_size (the fewest keys per expanded block of the "
                             "blockwise prefill over a cache; a block also holds at least twice the chunk's tokens; "
                             "default: the config's)")
    parser.add_argument("--kernel-table-top", type=int, default=KERNEL_TABLE_TOP,
                        help="kernels listed per profiled decode step (all of them: a large number)")
    args = parser.parse_args()
    KERNEL_TABLE_TOP = args.kernel_table_top
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    run = Runner(Path(args.out), args.budget_s)
    skip = tuple(s for s in args.skip.split(",") if s)
    only = tuple(s for s in args.only.split(",") if s)

    def wanted(name):
        if skip and name.startswith(skip):
            return False
        if not only or name.startswith(only) or name == "env":
            return True
        if name == "k3.build":
            return any(o.startswith(("fast", "ref", "prefill_1m", "generate")) for o in only)
        if name == "mxfp4.build":
            return any(o.startswith("mxfp4") for o in only)
        if name == "kimi_linear.build":
            return any(o.startswith("kimi_linear") for o in only)
        return False

    def sec(name, fn, need_s=0.0):
        if not wanted(name):
            return None
        return run.section(name, fn, need_s)

    ensure_kimik3()
    sec("env", section_env)
    sec("kernels", section_kernels, 30)
    sec("kernels_moe", section_moe_kernels, 30)
    sec("kernels_attention", section_attention_kernels, 20)

    # ---------------------------------------------------------------- our model
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    holder = {}

    def build_k3():
        t = time.perf_counter()
        config = k3_config(args.layers, args.experts)
        if args.mla_prefill_block_size is not None:
            config.mla_prefill_block_size = args.mla_prefill_block_size
        holder["model"] = build(KimiK3ForCausalLM, config)
        holder["driver"] = K3Driver(holder["model"])
        holder["stats"] = byte_stats(holder["model"])
        return {"build_s": round(time.perf_counter() - t, 1), "params_gib": round(holder["stats"]["total_bytes"] / 2**30,
                                                                                   2),
                "layer_types": list(holder["model"].config.layer_types),
                "mla_prefill_block_size": holder["model"].config.mla_prefill_block_size, **holder["stats"]}

    sec("k3.build", build_k3, 30)
    if "driver" in holder:
        drv, stats = holder["driver"], holder["stats"]
        set_reference(False)
        sec("fast.prefill_8k", lambda: measure_prefill(drv, stats, 8 * K, repeats=5), 20)
        # the same prefill with the one-pass norm and gate twins back on their references, one more op each time,
        # and with the router's upcast twin on its reference (what each twin gains, in the same process)
        for tag, names in (("rms_norm", "rms_norm"), ("norms", "rms_norm,gated_rms_norm"),
                           ("norms_gate", "rms_norm,gated_rms_norm,kda_gate"), ("router", "router_logits")):
            sec(f"fast_reference_{tag}.prefill_8k", lambda n=names: with_reference_ops(
                n, lambda: measure_prefill(drv, stats, 8 * K, repeats=3)), 20)
        for tag in KDA_OPERANDS:
            sec(f"fast_kda_{tag}.prefill_8k", lambda t=tag: with_kda_operands(
                t, lambda: measure_prefill(drv, stats, 8 * K, repeats=5)), 20)
            sec(f"fast_kda_{tag}.prefill_64k", lambda t=tag: with_kda_operands(
                t, lambda: measure_prefill(drv, stats, 64 * K, repeats=1, warmup=1)), 40)
        sec("fast.decode_b1_4k", lambda: measure_decode(drv, stats, 1, 4 * K, steps=20), 15)
        sec("fast.decode_b8_4k", lambda: measure_decode(drv, stats, 8, 4 * K, steps=10), 20)
        sec("fast.prefill_64k", lambda: measure_prefill(drv, stats, 64 * K, repeats=1, warmup=1), 40)
        sec("fast.decode_b1_64k", lambda: measure_decode(drv, stats, 1, 64 * K, steps=10, synthetic=True), 10)
        sec("fast.decode_b8_64k", lambda: measure_decode(drv, stats, 8, 64 * K, steps=10, synthetic=True), 10)

        def decode_profile():
            """GPU kernel time vs wall time of one decode step (B=1, 4K context): how far launch overhead is from
            the HBM roofline. torch.profiler, 3 profiled steps after 3 warm-up steps."""
            from torch.profiler import ProfilerActivity, profile

            steps = 3
            with torch.inference_mode():
                cache = drv.synthetic_cache(1, 4 * K)
                tok = random_ids(1, 1)
                for _ in range(3):
                    logits, cache = drv.forward(tok, cache)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        logits, cache = drv.forward(tok, cache)
                    torch.cuda.synchronize()
            table = kernel_table(prof, steps=steps, top=12)
            roof = decode_roofline(stats, drv.model.config, 1, 4 * K)
            return {**table, "hbm_roofline_ms": roof["hbm_roofline_ms"],
                    "gpu_kernel_x_of_roofline": round(table["gpu_kernel_ms_per_step"] / roof["hbm_roofline_ms"], 2)}

        sec("fast.decode_profile_b1_4k", decode_profile, 15)

        def prefill_profile():
            """GPU kernel time of one 8K prefill (after the timed runs: warm), grouped by kernel: where the FLOPs do
            not reach the bf16 peak. torch.profiler over one prefill (the table's "step")."""
            from torch.profiler import ProfilerActivity, profile

            ids = random_ids(1, 8 * K)
            with torch.inference_mode():
                prefill(drv, ids)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    prefill(drv, ids)
                    torch.cuda.synchronize()
            return kernel_table(prof, top=30)  # one step: the prefill

        sec("fast.prefill_profile_8k", prefill_profile, 20)

        model = holder["model"]
        for batch, context in ((1, 4 * K), (8, 4 * K), (1, 64 * K), (8, 64 * K)):
            tag, synthetic = f"b{batch}_{context // K}k", context > 4 * K
            sec(f"generate.eager.decode_{tag}",
                lambda b=batch, c=context, s=synthetic: measure_generate_decode(model, stats, b, c, False,
                                                                                synthetic=s), 15)
            sec(f"generate.compiled.decode_{tag}",
                lambda b=batch, c=context, s=synthetic: measure_generate_decode(model, stats, b, c, True,
                                                                                synthetic=s, profile=True), 60)
            # the same step with the routed experts through grouped_mm instead of the few-rows Triton matmul
            sec(f"generate.compiled_grouped_mm.decode_{tag}",
                lambda b=batch, c=context, s=synthetic: without_few_rows_kernel(
                    lambda: measure_generate_decode(model, stats, b, c, True, synthetic=s, profile=True)), 60)
            if context > 4 * K:  # the same step with the MLA decode traced from its reference (the op off)
                sec(f"generate.compiled_reference_mla.decode_{tag}",
                    lambda b=batch, c=context, s=synthetic: with_reference_ops(
                        "mla_decode", lambda: measure_generate_decode(model, stats, b, c, True, synthetic=s,
                                                                      profile=True)), 60)
            # the same step with the KDA convs on fla's kernels instead of the step kernel
            sec(f"generate.compiled_fla_conv.decode_{tag}",
                lambda b=batch, c=context, s=synthetic: without_conv_step_kernel(
                    lambda: measure_generate_decode(model, stats, b, c, True, synthetic=s, profile=True)), 60)
        torch._dynamo.reset()
        free_cuda()

        def cache_bytes():
            out = {}
            with torch.inference_mode():
                for tokens in (2 * K, 4 * K):
                    _, cache = prefill(drv, random_ids(1, tokens))
                    out[tokens] = cache.live_bytes()
                    del cache
            per_token = (out[4 * K]["total"] - out[2 * K]["total"]) / (2 * K)
            return {"live_bytes_2k": out[2 * K], "live_bytes_4k": out[4 * K],
                    "bytes_per_token": per_token,
                    "constant_bytes_per_sequence": out[4 * K]["total"] - per_token * 4 * K}

        sec("fast.cache_bytes", cache_bytes, 10)

        set_reference(True)
        sec("ref.prefill_8k", lambda: measure_prefill(drv, stats, 8 * K, repeats=1, warmup=0), 60)
        sec("ref.decode_b1_4k", lambda: measure_decode(drv, stats, 1, 4 * K, steps=5, warmup=1, synthetic=True), 30)
        set_reference(False)

        def prefill_1m():
            total, chunk = 1024 * K, args.chunk_1m
            progress = []
            # warm-up on a throwaway cache: the first chunks compile and autotune the Triton kernels (84 s of the
            # first chunk on a fresh machine: docs/benchmarks_history.md), which is not the prefill's own time
            t0 = time.perf_counter()
            with torch.inference_mode():
                warm_cache = drv.new_cache()
                for _ in range(3):
                    drv.forward(random_ids(1, chunk), warm_cache)
                torch.cuda.synchronize()
            del warm_cache
            warmup_s = round(time.perf_counter() - t0, 2)
            print(json.dumps({"prefill_1m.warmup_s": warmup_s}), flush=True)
            free_cuda()
            reset_peak()
            cache = drv.new_cache()
            deadline = time.monotonic() + min(args.prefill_1m_budget_s, max(run.left() - 20, 0))  # after the warm-up
            t0 = time.perf_counter()
            status = "completed"
            with torch.inference_mode():
                for start in range(0, total, chunk):
                    if time.monotonic() > deadline:
                        status = "stopped: time budget"
                        break
                    try:
                        drv.forward(random_ids(1, chunk), cache)
                        torch.cuda.synchronize()
                    except torch.cuda.OutOfMemoryError as exc:
                        status = f"CUDA OOM at {start} tokens: {str(exc)[:200]}"
                        break
                    progress.append({"tokens": start + chunk, "elapsed_s": round(time.perf_counter() - t0, 2),
                                     "peak_mem_gib": peak_gib()})
                    print(json.dumps({"prefill_1m.progress": progress[-1]}), flush=True)  # kept if cut off
            done = progress[-1]["tokens"] if progress else 0
            elapsed = progress[-1]["elapsed_s"] if progress else None
            flops = prefill_flops(stats, drv.model.config, total)
            return {"status": status, "tokens_done": done, "elapsed_s": elapsed, "warmup_s": warmup_s, "chunk": chunk,
                    "peak_mem_gib": peak_gib(), "progress": progress[:: max(1, len(progress) // 16)],
                    "bf16_roofline_s_1m": flops["bf16_roofline_s"],
                    "cache_live_bytes": cache.live_bytes() if done else None}

        sec("prefill_1m_chunked", prefill_1m, 90)
        holder.clear()
        del drv
        free_cuda()

    # ---------------------------------------------------------------- packed MXFP4 experts (the release format)
    def build_mxfp4():
        t = time.perf_counter()
        model = build_packed(KimiK3ForCausalLM, k3_config(args.layers, args.experts))
        holder["model"], holder["stats"] = model, byte_stats(model)
        return {"build_s": round(time.perf_counter() - t, 1),
                "params_gib": round(holder["stats"]["total_bytes"] / 2**30, 2), **holder["stats"]}

    sec("mxfp4.build", build_mxfp4, 30)
    if "model" in holder:
        model, stats = holder["model"], holder["stats"]
        mxfp4_driver = K3Driver(model)
        # prefill with the packed experts' matmuls on the default rule (mxfp4.MXFP4_GEMM_ROWS_PER_EXPERT) and, side
        # by side, forced onto the packed grouped GEMM (the word GEMM, then the byte GEMM) and onto the chunks of
        # dequantised experts
        for tokens in (8 * K, 32 * K):
            sec(f"mxfp4.prefill_default_{tokens // K}k",
                lambda t=tokens: measure_prefill(mxfp4_driver, stats, t, repeats=3 if t <= 8 * K else 2), 30)
            for path in ("gemm", "gemm_bytes", "dequantised"):
                sec(f"mxfp4.prefill_{path}_{tokens // K}k", lambda t=tokens, p=path: with_mxfp4_prefill(
                    p, lambda: measure_prefill(mxfp4_driver, stats, t, repeats=3 if t <= 8 * K else 2)), 30)
        for batch in (1, 8):
            sec(f"mxfp4.generate.eager.decode_b{batch}_4k",
                lambda b=batch: measure_generate_decode(model, stats, b, 4 * K, False), 15)
            sec(f"mxfp4.generate.compiled.decode_b{batch}_4k",
                lambda b=batch: measure_generate_decode(model, stats, b, 4 * K, True, profile=True), 60)
            # the same step with the packed matmuls on the 16-row tile kernel instead of the GEMV
            sec(f"mxfp4.generate.compiled_tiles.decode_b{batch}_4k",
                lambda b=batch: with_mxfp4_kernel("tiles", lambda: measure_generate_decode(
                    model, stats, b, 4 * K, True, profile=True)), 60)
        torch._dynamo.reset()
        holder.clear()
        del model
        free_cuda()

    # ---------------------------------------------------------------- transformers' Kimi Linear
    def build_kl():
        from transformers import KimiLinearForCausalLM

        t = time.perf_counter()
        holder["model"] = build(KimiLinearForCausalLM, kimi_linear_config(args.layers))
        holder["driver"] = HFDriver(holder["model"])
        holder["stats"] = byte_stats(holder["model"])
        return {"build_s": round(time.perf_counter() - t, 1),
                "params_gib": round(holder["stats"]["total_bytes"] / 2**30, 2), **holder["stats"]}

    sec("kimi_linear.build", build_kl, 60)
    if "driver" in holder:
        drv, stats = holder["driver"], holder["stats"]
        sec("kimi_linear.prefill_8k", lambda: measure_prefill(drv, stats, 8 * K, repeats=2), 30)
        sec("kimi_linear.decode_b1_4k", lambda: measure_decode(drv, stats, 1, 4 * K, steps=10), 20)
        sec("kimi_linear.decode_b8_4k", lambda: measure_decode(drv, stats, 8, 4 * K, steps=5), 25)
        sec("kimi_linear.prefill_64k", lambda: measure_prefill(drv, stats, 64 * K, repeats=1, warmup=0), 60)
        holder.clear()
        del drv
        free_cuda()
    run.emit("done", {"wall_s": round(args.budget_s - run.left(), 1)})
    print(json.dumps({"sections": list(run.results)}))  # every line of the output is one JSON object


if __name__ == "__main__":
    main()
