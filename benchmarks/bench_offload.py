"""Routed experts in host memory (`experts_offload="host"`) against the same slice held on the GPU, and against
accelerate's whole-module CPU offload of the expert modules, in one process on one GPU.

The model is bench_k3's slice at K3's widths (default: 4 layers, 896 experts per MoE layer, packed MXFP4, random
codes: the router's choices are near-uniform, the worst case for a cache of experts). For each placement:

* decode: eager steps of the model's forward over its dynamic cache (greedy), batch 1 and 8 after a `--context`
  prompt; ms per step (median of the steady steps), the expert cache's hit rate and the bytes it moved per step, and
  the bound those bytes give at the measured host-to-device bandwidth (pinned memory);
* prefill: `--prefill` tokens in one chunk (the experts each layer's routes choose cross once per chunk).

The offload copies on the cache's copy stream (section `offload`: the latent down-projection and the shared experts
run while the chosen experts cross), and with `one_stream` also on the compute stream (`side_stream = False`). Then
(section `host`) the chosen experts the cache lacks computed where they live (`experts_compute`): "host" (always on
the CPU, the format's kernel over the packed bytes; decode only, a long chunk's every route on the CPU takes
minutes) and "auto" (per forward, whichever the rates measured at the start say is faster), decode and prefill;
section `loop` times generate()'s decode loop on a static cache (`loop_decode`: the slice on the GPU captured
whole, and with the experts in host memory the step captured piece by piece between the routes' reads, each of
"device", "host" and "auto"; section `loop_held`: every expert placed on the GPU, so that only the routes' reads
and the pieces differ from the slice on the GPU; with `profile`, a cProfile of the steady blocks to
`--profile-out`); section `stream` runs "host" with the routes read by the host (`in_stream = False`), then
computed on the CPU in the stream's order (the default on CUDA: no read, the loop's step captured whole), eager and
in the loop, and `stream_held` the latter with every expert placed on the GPU (the stream's host step then computes
nothing: its fixed cost per layer); `--host-threads` repeats the "host" decode at other kernel thread counts; section `split` times
the CPU route's stages per MoE layer (the whole route, the CPU's share, the waits before and after it) and section
`profile` writes torch's profiler table of a few such steps at batch 1 (`--profile-out`; `--profile-trace` for
their timeline). The `host_experts` rows time one MoE layer's share of
a decode step on the CPU alone (the kernel, and the reference it replaces) against moving the same experts, with the host's measured DRAM
read bandwidth and the kernel's fraction of it.

    python benchmarks/bench_offload.py --out benchmarks/results/bench_offload.json [--sections gpu,offload,host,accelerate]

`--cache-fraction` sets the device cache as a share of one layer's experts (default 0.25). Writes one JSON object;
every section is also printed as it ends.
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_k3  # noqa: E402
from _k3bench_utils import ensure_kimik3, free_cuda, peak_gib, reset_peak  # noqa: E402


def h2d_bytes_per_s(num_bytes=1 << 30, repeats=5):
    """Pinned host -> device copy rate, the median of `repeats` copies of `num_bytes`."""
    host = torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return num_bytes / times[len(times) // 2]


def decode(model, batch, context, steps, cache_stats=None, around_steps=contextlib.nullcontext):
    """ms per eager decode step (median of the steps after the first 2) and, with the offload, what the expert cache
    did over the timed steps. `around_steps()`: a context the steps run in (not the prompt: a profiler's)."""
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

    ids = torch.randint(3, model.config.vocab_size - 1, (batch, context), device="cuda")
    experts_cache = getattr(model, "experts_cache", None)
    compute = getattr(experts_cache, "compute", None)
    with torch.inference_mode():
        cache = KimiK3Cache(model.config)
        if compute == "host":  # the prompt is a prefill: "auto" decides it, as it would in use
            experts_cache.compute = "auto"
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        if compute is not None:
            experts_cache.compute = compute
        token = logits[:, -1:].argmax(-1)
        times, before = [], None
        with around_steps():
            for step in range(steps):
                if step == 2 and cache_stats is not None:
                    before = cache_stats()
                torch.cuda.synchronize()
                start = time.perf_counter()
                logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
    steady = sorted(times[2:])
    out = {"batch": batch, "context": context, "steps_timed": len(steady),
           "ms_per_step": round(steady[len(steady) // 2] * 1e3, 3), "tokens_per_s": round(batch / steady[len(steady)
                                                                                                      // 2], 2)}
    if cache_stats is not None:
        after = cache_stats()
        moves, hits = after["moves"] - before["moves"], after["hits"] - before["hits"]
        out.update(hit_rate=round(hits / max(hits + moves, 1), 4),
                   moved_bytes_per_step=(after["moved_bytes"] - before["moved_bytes"]) // len(steady))
        if "host_routes" in after:
            out.update(host_routes_per_step=(after["host_routes"] - before["host_routes"]) / len(steady),
                       host_experts_per_step=(after["host_experts"] - before["host_experts"]) / len(steady))
    return out


def loop_decode(model, batch, context, blocks=8, warm_blocks=2, profiler=None):
    """ms per step of generate()'s decode loop on a static cache (greedy, 8 steps a block): the whole step captured
    as one CUDA graph for a model on the GPU, the step captured piece by piece between the routes' reads with the
    experts in host memory (generate_kimi_k3's `piecewise_decode_step`). Timed between the loop's host reads (each
    ends a block), after the first token's read and `warm_blocks` blocks (compile, warm-up, capture); `compile_s`:
    the first call's wall time beyond its steady blocks. `profiler` (a cProfile.Profile): enabled over the timed
    blocks."""
    from kimik3.modeling import generate_kimi_k3 as loop

    ids = torch.randint(3, model.config.vocab_size - 1, (batch, context), device="cuda")
    reads, read = [], loop.DecodeLoop._read

    def timed_read(this, count, *args):
        going = read(this, count, *args)
        reads.append((time.perf_counter(), count))
        if profiler is not None and len(reads) == 1 + warm_blocks:
            profiler.enable()
        return going

    loop.DecodeLoop._read = timed_read
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            loop.generate(ids, model=model, cache_implementation="static", do_sample=False,
                          max_new_tokens=1 + loop.DEFAULT_BLOCK_STEPS * (warm_blocks + blocks))
        wall = time.perf_counter() - start
    finally:
        loop.DecodeLoop._read = read
        if profiler is not None:
            profiler.disable()
    steady = reads[1 + warm_blocks:]
    seconds = (steady[-1][0] - reads[warm_blocks][0]) / sum(count for _, count in steady)
    out = {"batch": batch, "context": context, "steps_timed": sum(count for _, count in steady),
           "ms_per_step": round(seconds * 1e3, 3), "tokens_per_s": round(batch / seconds, 2),
           "compile_s": round(wall - seconds * loop.DEFAULT_BLOCK_STEPS * (warm_blocks + blocks), 1)}
    cache = getattr(model, "experts_cache", None)
    if cache is not None:
        out["compute"] = cache.compute
    return out


def prefill(model, tokens, repeats=2):
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

    ids = torch.randint(3, model.config.vocab_size - 1, (1, tokens), device="cuda")
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first call warms up (Triton autotuning, allocator)
            reset_peak()
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(input_ids=ids, past_key_values=KimiK3Cache(model.config), use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    seconds = sorted(times[1:])[len(times[1:]) // 2]
    return {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
            "peak_mem_gib": peak_gib()}


def host_experts(module, batch, config, bandwidth, repeats=5):
    """ms for one MoE layer's routed experts of a decode step at `batch` on the host, over its offloaded stacks: the
    format's CPU kernel (what `experts_compute="host"` runs) and the reference (a compact copy of the chosen experts
    dequantised and multiplied in bf16), every host core, against the time the same experts take to cross."""
    from kimik3.kernels import mxfp4_host
    from kimik3.modeling.host_experts_kimi_k3 import host_routes
    from kimik3.modeling.offload_kimi_k3 import expert_bytes

    torch.set_num_threads(os.cpu_count())
    generator = torch.Generator().manual_seed(batch)
    top = torch.stack([torch.randperm(module.num_experts, generator=generator)[:config.num_experts_per_tok]
                       for _ in range(batch)])
    flat = top.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = torch.randn(batch, module.latent_size, generator=generator).to(torch.bfloat16)[order // top.shape[1]]
    sorted_ids = flat[order]
    ids = torch.unique(flat).tolist()
    betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
    stacks, fmt = module.stacks(), module.format

    def run(x, i, w, compact):
        return fmt.run(x, i, w, compact, betas)

    def median(situ, repeats=repeats):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            _, kernel = host_routes(rows, sorted_ids, ids, stacks, fmt, run, situ)
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[len(times[1:]) // 2], kernel

    kernel_s, used = median(betas)
    reference_s, _ = median(None, repeats=1)  # seconds a call at b=8 on the reference
    moved = len(ids) * expert_bytes(stacks)
    return {"batch": batch, "experts": len(ids), "host_threads": torch.get_num_threads(),
            "kernel": mxfp4_host.isa() if used else f"not built: {mxfp4_host.unavailable_reason()}",
            "ms_per_layer_kernel": round(kernel_s * 1e3, 3), "ms_per_layer_reference": round(reference_s * 1e3, 3),
            "kernel_bytes_per_s": round(moved / kernel_s), "ms_per_layer_to_move_them": round(moved / bandwidth * 1e3, 3)}


def split_timings(model, cache, moe_layers, batch, context, steps):
    """Where a decode step's CPU route spends its time, per MoE layer (`experts_compute="host"`): `route`, from the
    CPU's share starting (`HostShare`, which the block starts before its shared experts) to `routed_split` returning
    the layer's sum; `host`, the CPU's share itself (`host_routes`: the kernel and its bookkeeping, on the worker
    thread); `until_host`, the wait from the route's start to that share's start (the rows reaching host memory, the
    thread handing over); `after_host`, from its end to the route's (the outputs queued back, the sums). The route's
    own cost is `route - host`. Medians over the steady steps' layers; the step's own time beside them."""
    from kimik3.modeling import host_experts_kimi_k3, offload_kimi_k3

    spans = {"route": [], "host": [], "until_host": [], "after_host": []}
    share, split, host = offload_kimi_k3.HostShare, offload_kimi_k3.routed_split, host_experts_kimi_k3.host_routes
    started, ended = [], []

    class TimedShare(share):
        def __init__(self, *args, **kwargs):
            started.append(time.perf_counter())
            super().__init__(*args, **kwargs)

    def timed_split(*args, **kwargs):
        out = split(*args, **kwargs)
        now = time.perf_counter()
        spans["route"].append(now - started[-1])
        spans["after_host"].append(now - ended[-1])
        return out

    def timed_host(*args, **kwargs):
        begin = time.perf_counter()
        spans["until_host"].append(begin - started[-1])
        out = host(*args, **kwargs)
        ended.append(time.perf_counter())
        spans["host"].append(ended[-1] - begin)
        return out

    patched = (TimedShare, timed_split, timed_host)
    offload_kimi_k3.HostShare, offload_kimi_k3.routed_split, host_experts_kimi_k3.host_routes = patched
    try:
        cache.compute = "host"
        cache.clear()
        row = decode(model, batch, context, steps)
    finally:
        offload_kimi_k3.HostShare, offload_kimi_k3.routed_split, host_experts_kimi_k3.host_routes = share, split, host
        cache.compute = "device"
    for name, values in spans.items():  # the steady steps' layers (a layer whose experts were all held ran no split)
        steady = sorted(values[-(steps - 2) * moe_layers:])
        row[f"{name}_ms_median"] = round(steady[len(steady) // 2] * 1e3, 3)
    row["splits"] = len(spans["route"])
    return row


def profile_table(model, cache, context, steps=4, rows=40, trace=None):
    """torch.profiler's table (CPU and CUDA self-time, the top `rows` ops) of `steps` batch-1 decode steps under
    `experts_compute="host"` (the steps alone, not the prompt), after the same warm-up as `decode`: where the CPU
    route's time goes that the stage timings do not name (synchronisations, copies, the device idle while the CPU
    computes). `trace`: a path for the steps' Chrome trace too (every thread's and the GPU's timeline)."""
    from torch.profiler import ProfilerActivity, profile

    cache.compute, cache.side_stream = "host", True
    cache.clear()
    decode(model, 1, context, 4)  # warm the cache and the kernel
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    try:
        decode(model, 1, context, steps, around_steps=lambda: profiler)
    finally:
        cache.compute = "device"
    if trace:
        profiler.export_chrome_trace(trace)
    averages = profiler.key_averages()
    return "\n\n".join(averages.table(sort_by=key, row_limit=rows)
                        for key in ("self_cpu_time_total", "self_cuda_time_total"))


def dram_read_bytes_per_s(num_bytes=4 << 30, repeats=5):
    """The host's memory read rate: a reduction over `num_bytes` (larger than a server's last-level cache), every
    host core, the median of `repeats`."""
    torch.set_num_threads(os.cpu_count())
    buffer = torch.ones(num_bytes // 8, dtype=torch.int64)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / sorted(times[1:])[len(times[1:]) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/bench_offload.json")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prefill", default="8192,65536", help="prefill chunk sizes, comma-separated")
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--skip-accelerate", action="store_true")
    parser.add_argument("--batches", default="1,8", help="decode batch sizes, comma-separated")
    parser.add_argument("--host-threads", default="",
                        help="comma-separated thread counts of the host kernel (KIMIK3_HOST_THREADS) to decode with "
                             "under experts_compute='host' (eager and in the decode loop; streamed on CUDA), after the "
                             "other sections (e.g. 16,15,12)")
    parser.add_argument("--profile-out", default="bench_offload_profile.txt")
    parser.add_argument("--profile-trace", default="", help="also write the profiled steps' Chrome trace here")
    parser.add_argument("--sections", default="gpu,offload,host,accelerate",
                        help="which to run, comma-separated: gpu (the slice on the GPU), offload (copies on the copy "
                             "stream), one_stream (copies on the compute stream), host "
                             "(experts_compute host/auto and the CPU kernel), loop (generate()'s decode loop: the "
                             "slice captured whole on the GPU, piecewise with the experts in host memory), "
                             "loop_gpu (loop's first part alone), loop_device (loop's copies alone: the chosen "
                             "experts the cache lacks copied to the GPU), loop_held (piecewise with every expert "
                             "placed on the GPU), stream (experts_compute host with the routes read by the host, then "
                             "computed in the stream's order: eager and the decode loop), stream_only (the stream's "
                             "half alone), stream_auto (the same, auto), dram (the host's DRAM read and the kernel "
                             "alone), stream_held (streamed with every expert placed on the GPU), "
                             "split (where the CPU route's time goes, "
                             "per MoE layer), profile (torch.profiler's table of b=1 host decode steps, to "
                             "--profile-out), accelerate")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    ensure_kimik3()
    from kimik3.modeling.modeling_kimi_k3 import KimiK3Experts, KimiK3ForCausalLM
    from kimik3.modeling.host_experts_kimi_k3 import measure_host_rates
    from kimik3.modeling.offload_kimi_k3 import expert_bytes, offload_routed_experts

    results = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, "args": vars(args)}

    def emit(key, value):
        results[key] = value
        print(json.dumps({key: value}), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))

    config = bench_k3.k3_config(args.layers, args.experts)
    config.experts_format = "mxfp4"
    model = bench_k3.build(KimiK3ForCausalLM, config)
    with torch.no_grad():  # random valid codes; E8M0 scales 2^-9..2^-6 (bench_k3's packed model)
        for name, p in model.named_parameters():
            if name.endswith("_packed"):
                p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device=p.device))
            elif name.endswith("_scale"):
                p.copy_(torch.randint(118, 122, p.shape, dtype=torch.uint8, device=p.device))
    experts = [m for m in model.modules() if isinstance(m, KimiK3Experts)]
    per_expert = expert_bytes(experts[0].stacks())
    emit("model", {"layers": args.layers, "experts": args.experts, "moe_layers": len(experts),
                   "bytes_per_expert": per_expert, "routed_bytes": per_expert * args.experts * len(experts)})
    bandwidth = h2d_bytes_per_s()
    emit("h2d_bytes_per_s_pinned", round(bandwidth))

    batches = tuple(int(b) for b in args.batches.split(","))
    chunks = [int(c) for c in args.prefill.split(",") if c]
    if "gpu" in sections:
        for batch in batches:
            emit(f"gpu.decode_b{batch}", decode(model, batch, args.context, args.steps))
        for tokens in chunks:
            emit(f"gpu.prefill_{tokens}", prefill(model, tokens))
    if "loop" in sections or "loop_gpu" in sections:  # the slice on the GPU through the captured decode loop
        for batch in batches:
            emit(f"gpu.loop_decode_b{batch}", loop_decode(model, batch, args.context))

    capacity = max(1, int(args.experts * args.cache_fraction))
    cache = offload_routed_experts(experts, "host", capacity * per_expert * len(experts))
    model.experts_cache = cache  # as a loaded model holds it (decode reads its `compute`)
    free_cuda()

    def stats():
        return {"moves": cache.moves, "hits": cache.hits, "moved_bytes": cache.moved_bytes,
                "host_experts": cache.host_experts, "host_routes": cache.host_routes}

    emit("offload.cache", {"experts_per_layer": cache.capacity, "budget_bytes": cache.budget_bytes,
                           "uniform_hit_rate": round(cache.capacity / args.experts, 4)})
    placements = [(False, "offload_one_stream")] if "one_stream" in sections else []
    placements += [(True, "offload")] if "offload" in sections else []
    for side_stream, tag in placements:
        cache.side_stream = side_stream
        cache.clear()
        for batch in batches:
            row = decode(model, batch, args.context, args.steps, stats)
            row["transfer_bound_ms"] = round(row["moved_bytes_per_step"] / bandwidth * 1e3, 3)
            emit(f"{tag}.decode_b{batch}", row)
        for tokens in chunks:
            before = cache.moved_bytes
            row = prefill(model, tokens, repeats=1)
            row["moved_bytes_per_prefill"] = (cache.moved_bytes - before) // 2  # warm-up + one timed call
            row["transfer_bound_s"] = round(row["moved_bytes_per_prefill"] / bandwidth, 3)
            emit(f"{tag}.prefill_{tokens}", row)
    def kernel_alone():
        """The host's DRAM read and the kernel alone over one layer's chosen experts (sections host and dram)."""
        dram = dram_read_bytes_per_s()
        emit("host.dram_read_bytes_per_s", round(dram))
        for batch in batches:
            row = host_experts(experts[0], batch, model.config, bandwidth)
            row["kernel_fraction_of_dram_read"] = round(row["kernel_bytes_per_s"] / dram, 3)
            emit(f"host_experts.decode_b{batch}", row)

    if "host" in sections:
        kernel_alone()
        cache.rates = measure_host_rates(experts[0], torch.device("cuda"))
        emit("host.rates", {"copy_bytes_per_s": round(cache.rates.copy_bytes_per_s),
                            "host_bytes_per_s": round(cache.rates.host_bytes_per_s),
                            "host_flops": round(cache.rates.host_flops)})
        cache.side_stream, cache.in_stream = True, False  # the routes read by the host (section stream: both)
        for compute in ("host", "auto"):
            cache.compute = compute
            cache.clear()
            for batch in batches:
                row = decode(model, batch, args.context, args.steps, stats)
                emit(f"compute_{compute}.decode_b{batch}", row)
            # every route of a long chunk on the CPU runs at its compute rate (minutes a chunk): prefill is
            # "auto"'s, which copies a chunk's experts once the rates say so
            for tokens in chunks if compute == "auto" else ():
                emit(f"compute_{compute}.prefill_{tokens}", prefill(model, tokens, repeats=1))
        cache.compute = "device"
    loop_computes = ("device", "host", "auto") if "loop" in sections else ("device",) if "loop_device" in sections else ()
    if loop_computes:  # the decode loop with the step captured piece by piece between the routes' reads
        if "host" not in sections and "auto" in loop_computes:  # "auto" decides by the rates measured here
            cache.rates = measure_host_rates(experts[0], torch.device("cuda"))
        cache.side_stream, cache.in_stream = True, False  # the routes read by the host (section stream: both)
        for compute in loop_computes:
            cache.compute = compute
            cache.clear()
            for batch in batches:
                emit(f"loop_{compute}.decode_b{batch}", loop_decode(model, batch, args.context))
        cache.compute = "device"
    def hold_every_expert(compute: str) -> int:
        """Every expert of every layer placed on the GPU, under `compute`; returns the capacity to give back at the
        section's end (the sections after it run under the budget)."""
        budgeted = cache.capacity
        cache.compute, cache.capacity = compute, args.experts
        cache.clear()
        for module in experts:
            cache.place(module.offload.layer, list(range(args.experts)), module.stacks(), torch.device("cuda"))
        return budgeted

    if "loop_held" in sections:  # every expert placed on the GPU: what the routes' reads and the pieces cost alone
        budgeted = hold_every_expert("device")
        # batch 1: at 8 the compact stacks of the chosen experts no longer fit beside every expert
        emit("held.decode_b1", decode(model, 1, args.context, args.steps, stats))
        emit("loop_held.decode_b1", loop_decode(model, 1, args.context))
        if "profile" in sections:  # where the host's time goes in steady piecewise steps (the device idles then)
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            loop_decode(model, 1, args.context, blocks=4, profiler=profiler)
            text = io.StringIO()
            for order in ("tottime", "cumulative"):
                pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
            Path(args.profile_out).write_text(text.getvalue())
            emit("loop_held.profile", {"written": args.profile_out})
        cache.clear()
        cache.capacity = budgeted
    if "dram" in sections and "host" not in sections:
        kernel_alone()
    if {"stream", "stream_only", "stream_auto"} & sections:
        # "host" with the routes read by the host against computed in the stream's order (stream_only: the latter
        # alone); "auto" (streamed where the rates measured here say the CPU is faster)
        runs = [("host", False, "read")] if "stream" in sections else []
        runs += [("host", None, "stream")] if {"stream", "stream_only"} & sections else []
        runs += [("auto", None, "stream_auto")] if "stream_auto" in sections else []
        if "stream_auto" in sections:
            cache.rates = measure_host_rates(experts[0], torch.device("cuda"))
            emit("stream_auto.rates", {"copy_bytes_per_s": round(cache.rates.copy_bytes_per_s),
                                       "host_bytes_per_s": round(cache.rates.host_bytes_per_s),
                                       "host_flops": round(cache.rates.host_flops)})
        cache.side_stream = True
        for compute, in_stream, tag in runs:
            cache.compute, cache.in_stream = compute, in_stream
            cache.clear()
            for batch in batches:
                emit(f"{tag}.decode_b{batch}", decode(model, batch, args.context, args.steps, stats))
                emit(f"{tag}.loop_decode_b{batch}", loop_decode(model, batch, args.context))
        cache.in_stream, cache.compute = None, "device"
    if "stream_held" in sections:  # every expert placed on the GPU, streamed: what the stream's host step costs alone
        budgeted = hold_every_expert("host")
        emit("stream_held.decode_b1", decode(model, 1, args.context, args.steps, stats))
        emit("stream_held.loop_decode_b1", loop_decode(model, 1, args.context))
        cache.clear()
        cache.capacity, cache.compute = budgeted, "device"
    if "split" in sections:
        cache.side_stream = True
        for batch in batches:
            emit(f"split.decode_b{batch}", split_timings(model, cache, len(experts), batch, args.context,
                                                          args.steps))
    if "profile" in sections and "loop_held" not in sections:
        Path(args.profile_out).write_text(profile_table(model, cache, args.context, trace=args.profile_trace))
        emit("profile", {"written": args.profile_out})
    for threads in [int(t) for t in args.host_threads.split(",") if t]:
        os.environ["KIMIK3_HOST_THREADS"] = str(threads)
        cache.compute, cache.side_stream = "host", True
        cache.clear()
        for batch in batches:
            emit(f"compute_host_threads{threads}.decode_b{batch}", decode(model, batch, args.context, args.steps, stats))
            emit(f"compute_host_threads{threads}.loop_decode_b{batch}", loop_decode(model, batch, args.context))
        cache.compute = "device"
        os.environ.pop("KIMIK3_HOST_THREADS")

    if args.skip_accelerate or "accelerate" not in sections:
        return
    try:
        from accelerate import cpu_offload
    except ImportError as error:
        emit("accelerate", {"skipped": f"accelerate not importable: {error}"})
        return
    # the same host-resident experts under accelerate's hook: every forward of an expert module moves its whole stacks
    cache.clear()
    for module in experts:
        module.offload = None
        cpu_offload(module, execution_device=torch.device("cuda"))
    free_cuda()
    emit("accelerate.decode_b1", decode(model, 1, args.context, 5))
    emit(f"accelerate.prefill_{chunks[0]}", prefill(model, chunks[0], repeats=1))


if __name__ == "__main__":
    main()
