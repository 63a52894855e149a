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
"""Decode at the wall: plain compiled generate() against the decode loop (modeling_kimik3/generate_kimi_k3.py;
docs/design.md, Decode loop), side by side in one run, on the benchmark model of bench_k3.py (random bf16 weights,
K3's widths, 8 layers), greedy, at each batch x context:

  plain  generate(cache_implementation="static") as transformers runs it (torch.compile, CUDA graphs, one host
         sync a step): bench_k3.measure_generate_decode, its wall ms per step (median of steady steps) and its GPU
         kernel time per step (torch.profiler over 5 steps)
  loop   the same call through the decode loop: wall ms per step = the difference of two whole generate() calls of
         n and 2n new tokens over n (prefill, capture and the first block cancel out), and as a streamer sees it
         (BlockClock: the median time between two steady blocks' tokens over the block's steps), GPU kernel time from
         torch.profiler over whole blocks (started and stopped by a streamer at block boundaries)

with the HBM roofline of the step (bench_k3.decode_roofline: weights read + cache read / 4.3 TB/s) and the ratios
the issue's targets name (wall / GPU kernel time, wall / roofline). 64K contexts are a static cache of random state
(bench_k3.K3Driver.synthetic_cache: timing depends only on shapes), 4K contexts really prefilled; eos ids off, so
both run exactly the tokens asked for. `--dry-run`: the tiny model on the CPU, tiny contexts, no profiler (a test
runs it).

    python benchmarks/bench_decode_loop.py --out benchmarks/results/decode_loop_h200.json
    python benchmarks/bench_decode_loop.py --batches 1 --contexts 4096   # one configuration per command
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_k3  # noqa: E402
from _k3bench_utils import copy_bytes_per_s, ensure_kimik3, free_cuda  # noqa: E402

K = 1024


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class BlockProfiler:
    """A streamer that counts put() calls (the prompt, then one per generated step; the loop makes them in bursts
    after each block's read) and runs torch.profiler from the end of block `first` to the end of block `first +
    blocks`: exactly `blocks` whole blocks of decode steps run inside the window."""

    def __init__(self, block_steps, first=1, blocks=2):
        self.block_steps, self.first, self.blocks = block_steps, first, blocks
        self.puts, self.profiler = 0, None

    def _boundary(self, block):  # put index of the last token of decode block `block` (0: prompt, 1: prefill's)
        return 1 + (block + 1) * self.block_steps

    def put(self, value):
        if self.puts == self._boundary(self.first):
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.profiler.start()
        elif self.puts == self._boundary(self.first + self.blocks) and self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.stop()
        self.puts += 1

    def end(self):
        pass

    def kernel_table(self):
        if self.profiler is None:
            return None
        return bench_k3.kernel_table(self.profiler, steps=self.blocks * self.block_steps)


class BlockClock:
    """A streamer that notes the time of each block's tokens arriving (the loop hands a block's tokens over after its
    one read, so consecutive arrivals are one block of steps apart): the wall time of a step as a user's streamer
    sees it, from steady blocks only (the first two hold the warm-up steps and the capture)."""

    def __init__(self, block_steps):
        self.block_steps, self.puts, self.stamps = block_steps, 0, []

    def put(self, value):
        if self.puts >= 2 and (self.puts - 1) % self.block_steps == 0:  # the last token of a decode block
            self.stamps.append(time.perf_counter())
        self.puts += 1

    def end(self):
        pass

    def ms_per_step(self):
        gaps = sorted((b - a) * 1e3 / self.block_steps for a, b in zip(self.stamps[2:], self.stamps[3:]))
        return (round(gaps[len(gaps) // 2], 3), len(gaps)) if gaps else (None, 0)


def _prompt(model, batch, context, synthetic, max_len):
    """(input ids, generate() keyword arguments) of a greedy call at this context."""
    device = model.device
    if synthetic:  # the context is a cache of random state; only the last prompt token runs
        ids = torch.randint(3, model.config.vocab_size - 1, (batch, context + 1), device=device)
        from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD

        return ids, {CACHE_FIELD: bench_k3.K3Driver(model).synthetic_cache(batch, context, max_len)}
    # an empty static cache of one length for every call: generate() would size its own to each call's
    # max_new_tokens, and a new buffer length recompiles the step
    from kimik3.modeling.cache_kimi_k3 import KimiK3StaticCache
    from kimik3.modeling.compat_kimi_k3 import CACHE_FIELD

    ids = torch.randint(3, model.config.vocab_size - 1, (batch, context), device=device)
    return ids, {CACHE_FIELD: KimiK3StaticCache(model.config, max_cache_len=max_len)}


def measure_loop(model, stats, batch, context, new_tokens, block_steps, synthetic, profile):
    from kimik3.modeling.generate_kimi_k3 import generate

    device = model.device

    def call(tokens, streamer=None, ids_and_kwargs=None):
        ids, kwargs = ids_and_kwargs or _prompt(model, batch, context, synthetic, context + 2 * new_tokens + 2)
        _sync(device)
        start = time.perf_counter()
        out = generate(ids, model=model, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                       do_sample=False, eos_token_id=None, pad_token_id=0, decode_block_steps=block_steps,
                       streamer=streamer, **kwargs)
        _sync(device)
        return time.perf_counter() - start, out

    call(new_tokens)  # compiles the step (first call for this shape)
    short, _ = call(new_tokens)
    long, _ = call(2 * new_tokens)
    per_step = (long - short) / new_tokens
    row = {"block_steps": block_steps, "ms_per_step": round(per_step * 1e3, 3),
           "generate_s": [round(short, 3), round(long, 3)], "tokens_per_s": round(batch / per_step, 1)}
    clock = BlockClock(block_steps)
    call(2 * new_tokens, streamer=clock)
    row["streamer_ms_per_step"], row["streamer_blocks"] = clock.ms_per_step()
    if profile and device.type == "cuda":
        profiler = BlockProfiler(block_steps, first=1, blocks=max(1, (new_tokens // block_steps) - 3))
        call(new_tokens, streamer=profiler)
        row["profile"] = profiler.kernel_table()
    return row


def tokens_equal(model, batch, context, new_tokens, block_steps):
    """Whether the loop's greedy tokens are plain generate()'s for one real prompt (fp32 on the CPU: exactly;
    bf16 compiled on the GPU the two compiled graphs may round apart, so this is a figure there, not a test)."""
    from transformers import GenerationMixin

    from kimik3.modeling.generate_kimi_k3 import generate

    ids = torch.randint(3, model.config.vocab_size - 1, (batch, context), device=model.device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=0, cache_implementation="static")
    plain = GenerationMixin.generate(model, ids, **kwargs)
    return bool(torch.equal(generate(ids, model=model, decode_block_steps=block_steps, **kwargs), plain))


def run_configuration(model, stats, batch, context, args, device):
    synthetic = context > 4 * K and not args.dry_run
    roof = bench_k3.decode_roofline(stats, model.config, batch, context)
    if args.loop_only:  # the loop alone: the kernels' figures side by side, without plain generate()'s compile
        loop = measure_loop(model, stats, batch, context, args.new_tokens, args.block_steps, synthetic,
                            profile=device.type == "cuda")
        loop["gpu_kernel_ms_per_step"] = (loop.get("profile") or {}).get("gpu_kernel_ms_per_step")
        _over_roofline(loop, roof["hbm_roofline_ms"], "x_of_hbm_roofline", "streamer_x_hbm_roofline")
        free_cuda()
        return {"batch": batch, "context": context, "synthetic_context": synthetic,
                "hbm_roofline_ms": roof["hbm_roofline_ms"], "bytes_per_step": roof["bytes_per_step"], "loop": loop}
    plain = bench_k3.measure_generate_decode(model, stats, batch, context, compiled=True,
                                             new_tokens=args.new_tokens, steady_from=min(8, args.new_tokens // 2),
                                             synthetic=synthetic, profile=device.type == "cuda")
    plain_row = {"ms_per_step": plain["ms_per_step"], "ms_per_step_p10_p90": plain["ms_per_step_p10_p90"],
                 "gpu_kernel_ms_per_step": (plain.get("profile") or {}).get("gpu_kernel_ms_per_step"),
                 "cudagraph_skips": plain["cudagraph_skips"], "graph_breaks": plain["graph_breaks"]}
    free_cuda()
    loop = measure_loop(model, stats, batch, context, args.new_tokens, args.block_steps, synthetic,
                        profile=device.type == "cuda")
    gpu = (loop.get("profile") or {}).get("gpu_kernel_ms_per_step")
    loop["gpu_kernel_ms_per_step"] = gpu
    if not synthetic:
        loop["tokens_equal_plain"] = tokens_equal(model, batch, context, min(args.new_tokens, 2 * args.block_steps),
                                                  args.block_steps)
    row = {"batch": batch, "context": context, "synthetic_context": synthetic,
           "hbm_roofline_ms": roof["hbm_roofline_ms"], "bytes_per_step": roof["bytes_per_step"],
           "plain": plain_row, "loop": loop}
    for part in (plain_row, loop):
        _over_roofline(part, roof["hbm_roofline_ms"], "x_of_hbm_roofline", "streamer_x_hbm_roofline")
        if part.get("gpu_kernel_ms_per_step"):
            part["wall_x_gpu_kernel_time"] = round(part["ms_per_step"] / part["gpu_kernel_ms_per_step"], 3)
    if loop.get("streamer_ms_per_step") and gpu:
        loop["streamer_x_gpu_kernel_time"] = round(loop["streamer_ms_per_step"] / gpu, 3)
    row["loop_speedup_at_the_wall"] = round(plain_row["ms_per_step"] / loop["ms_per_step"], 3)
    free_cuda()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, tiny contexts (seconds)")
    parser.add_argument("--out", default=None, help="JSON file, written after every configuration")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--block-steps", type=int, default=None, help="the loop's steps per host read")
    parser.add_argument("--loop-only", action="store_true",
                        help="time the loop alone (no plain generate(), no token comparison)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--experts-format", choices=("dense", "mxfp4"), default="dense",
                        help="mxfp4: the routed experts packed as in the release (roofline: the packed bytes)")
    parser.add_argument("--mxfp4-gemv-rows", type=int, nargs="+", default=None,
                        help="mxfp4: each configuration once per value of kernels.mxfp4.MXFP4_GEMV_ROWS_PER_EXPERT "
                             "(routed rows per expert up to which the packed GEMV runs, beyond it the tiles)")
    parser.add_argument("--mxfp4-settings", nargs="+", default=None,
                        help="mxfp4: each configuration once per value, a comma-separated list of NAME=VALUE "
                             "assignments to kernels.mxfp4's module constants ('' for the defaults; VALUE an "
                             "integer, None or a word), e.g. 'MXFP4_GEMV_ROWS_PER_EXPERT=1,MXFP4_WORD_TILES=tf32'")
    args = parser.parse_args(argv)
    ensure_kimik3()
    from kimik3.modeling.generate_kimi_k3 import DEFAULT_BLOCK_STEPS

    args.block_steps = args.block_steps or DEFAULT_BLOCK_STEPS
    if args.dry_run:
        from kimik3.tiny import build_tiny_model

        torch.manual_seed(0)
        model = build_tiny_model(num_hidden_layers=2, seed=0).eval()
        args.batches, args.contexts = args.batches or [2], args.contexts or [16]
        args.new_tokens, args.block_steps = args.new_tokens or 4, min(args.block_steps, 2)
    else:
        from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

        make = bench_k3.build_packed if args.experts_format == "mxfp4" else bench_k3.build
        model = make(KimiK3ForCausalLM, bench_k3.k3_config(args.layers, args.experts))
        args.batches, args.contexts = args.batches or [1, 8], args.contexts or [4 * K, 64 * K]
        args.new_tokens = args.new_tokens or 48
    device = model.device
    stats = bench_k3.byte_stats(model)
    results = {"machine": {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
                           or "cpu", "torch": torch.__version__,
                           "transformers": __import__("transformers").__version__},
               "experts_format": args.experts_format, "new_tokens": args.new_tokens,
               "block_steps": args.block_steps,
               # the roofline's inputs, and the memory the model holds: a packed format's adapter points must stay
               # stride-0 views (no bytes), or both grow by the dense experts' size
               "byte_stats": stats,
               "allocated_bytes_after_build": torch.cuda.memory_allocated() if device.type == "cuda" else None,
               # the card's own copy rate: each row's roofline is at the H200 kind's 4.3 TB/s (the issue's), and at
               # this rate as well, so a run on another card reads against its own HBM
               "device_copy_bytes_per_s": copy_bytes_per_s() if device.type == "cuda" else None,
               "decode": []}
    for context in args.contexts:
        for batch in args.batches:
            for rows in args.mxfp4_gemv_rows or [None]:
                for settings in args.mxfp4_settings or [None]:
                    if rows is not None or settings is not None:  # Triton's kernels: imported only when asked for
                        _apply_mxfp4_settings(rows, settings)
                    row = run_configuration(model, stats, batch, context, args, device)
                    _this_device_roofline(row, results["device_copy_bytes_per_s"])
                    row["mxfp4_gemv_rows_per_expert"] = rows
                    row["mxfp4_settings"] = settings
                    results["decode"].append(row)
                    if args.out:
                        partial = Path(args.out).with_suffix(".partial")
                        partial.write_text(json.dumps(results, indent=1) + "\n")
                        partial.replace(args.out)
                    print(json.dumps(row), flush=True)
    return results


def _over_roofline(part, roofline_ms, key, streamer_key):
    """A part's wall clock over a roofline, as `key`, and its streamer's clock, where it has one, as `streamer_key`."""
    part[key] = round(part["ms_per_step"] / roofline_ms, 3)
    if part.get("streamer_ms_per_step"):
        part[streamer_key] = round(part["streamer_ms_per_step"] / roofline_ms, 3)


def _this_device_roofline(row, copy_rate):
    """The row's roofline at this card's measured copy rate, and each part's wall against it."""
    if not copy_rate:
        return
    row["hbm_roofline_ms_this_device"] = round(row["bytes_per_step"] / copy_rate * 1e3, 3)
    for part in (row[name] for name in ("plain", "loop") if name in row):
        _over_roofline(part, row["hbm_roofline_ms_this_device"], "x_this_device_roofline",
                       "streamer_x_this_device_roofline")


_MXFP4_DEFAULTS = {}


def _apply_mxfp4_settings(rows, settings):
    """kernels.mxfp4's module constants for one configuration: MXFP4_GEMV_ROWS_PER_EXPERT = rows (unless None) and
    the NAME=VALUE list `settings` ('' or None: the defaults; VALUE an integer, None or a word), every other one at
    its default; then a fresh trace, since the packed path and its kernels are chosen at trace time."""
    from kimik3.kernels import mxfp4

    if not _MXFP4_DEFAULTS:
        _MXFP4_DEFAULTS.update({name: getattr(mxfp4, name) for name in dir(mxfp4) if name.startswith("MXFP4_")})
    for name, value in _MXFP4_DEFAULTS.items():
        setattr(mxfp4, name, value)
    if rows is not None:
        mxfp4.MXFP4_GEMV_ROWS_PER_EXPERT = rows
    for item in filter(None, (settings or "").split(",")):
        name, _, value = item.partition("=")
        if name.strip() not in _MXFP4_DEFAULTS:
            raise SystemExit(f"--mxfp4-settings: kernels.mxfp4 has no constant {name.strip()!r}")
        value = value.strip()
        setattr(mxfp4, name.strip(), None if value == "None" else int(value) if value.lstrip("-").isdigit() else value)
    torch._dynamo.reset()


if __name__ == "__main__":
    main()
