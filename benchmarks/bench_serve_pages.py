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
"""What the paged running batch of `kimik3 serve` (KimiK3PagedCache; docs/design.md, Serving) copies and costs:

  regroup   the engine driven on a tiny model (`kimik3 tiny`, fp32, one MLA layer) with 12 requests of 50-500 tokens
            joining and leaving: the latent bytes the regroups copied (the engine's `latent_bytes_copied`: each
            joining row's own latents) against what a left-padded batch rebuilt at every regroup copies (every row
            padded to the longest, computed from the rows after each regroup); with --max-cache-bytes, the
            preemptions and the tokens recomputed
  twins     the same engine with 3 requests of n=4 (sampled, seeded; prompts of 130-500 tokens, 16 tokens each):
            latent bytes written into pages and the most pages held at a decode step, with the twins sharing their
            prompt's full pages and with every twin writing pages of its own (as before the sharing)
  sessions  the same engine with its prefix store, 6 sessions whose prompts share a 600-token prefix (an agent's system
            prompt and tools) and differ in a 40-token message, each arriving once the one before has joined the
            batch (greedy, 24 tokens each): latent bytes written into pages, the most pages held at a decode step and
            the prompt tokens taken from the store, with a prompt that starts from a running row's stored prompt
            holding that row's full pages and with every row writing pages of its own (as before)
  step      one MLA layer's cache work in a decode step at K3's latent width (576 values, bf16; 8 rows of 1K-4K
            tokens): the paged cache's write + gather (and its slot set-up, once a step) against torch.cat of the
            padded batch, on the CPU or --device

    python benchmarks/bench_serve_pages.py
    python benchmarks/bench_serve_pages.py --max-cache-bytes 400000 --device cuda
"""

import argparse
import asyncio
import importlib
import tempfile
import time
from types import SimpleNamespace

import torch


def regroup(max_cache_bytes: int | None, block_size: int) -> dict:
    from kimik3.chat import load_chat
    from kimik3.engine import Engine, Job, Sampling
    from kimik3.tiny import write_tiny_folder

    folder = tempfile.mkdtemp() + "/tiny"
    write_tiny_folder(folder, num_hidden_layers=2, seed=3)
    _, model = load_chat(folder)
    config = model.config
    per_token = config.mla_cache_dim * 4 * sum(kind == "full_attention" for kind in config.layer_types)
    engine = Engine(model, None, max_requests=16, prefill_chunk=64, prefix_cache_bytes=0, block_size=block_size,
                    max_cache_bytes=max_cache_bytes)
    padded = []
    regroup_rows = engine._regroup

    def counted(add=()):
        regroup_rows(add)
        lengths = engine.paged.lengths
        padded.append(len(lengths) * max(lengths, default=0) * per_token)

    engine._regroup = counted
    generator = torch.Generator().manual_seed(0)
    lengths = [50, 400, 120, 300, 80, 250, 200, 350, 60, 150, 500, 90]
    max_tokens = [8, 64, 16, 48, 24, 32, 40, 12, 56, 20, 28, 36]

    async def run():
        loop = asyncio.get_running_loop()
        jobs = []
        for index, (length, tokens) in enumerate(zip(lengths, max_tokens)):
            ids = torch.randint(3, 400, (length,), generator=generator).tolist()
            jobs.append(Job(ids, Sampling(max_tokens=tokens, temperature=0.0), loop))
            engine.submit(jobs[-1:])
            await asyncio.sleep(0.005 * (index % 3))
        for job in jobs:
            while await job.mailbox.get() is not None:
                pass

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    stats = engine.stats
    return {"regroups": stats["regroups"], "paged_bytes": stats["latent_bytes_copied"],
            "padded_bytes": sum(padded), "pool_bytes_copied": engine.paged.pool_bytes_copied,
            "pool_bytes": engine.paged.pool_bytes(), "preemptions": stats["preemptions"],
            "tokens_recomputed": stats["tokens_recomputed"], "prompt_bytes": sum(lengths) * per_token}


def twins(block_size: int) -> dict:
    from kimik3.chat import load_chat
    from kimik3.engine import Engine, Job, Sampling
    from kimik3.tiny import write_tiny_folder

    folder = tempfile.mkdtemp() + "/tiny"
    write_tiny_folder(folder, num_hidden_layers=2, seed=3)
    _, model = load_chat(folder)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (length,), generator=generator).tolist() for length in (300, 500, 130)]
    report = {}
    for shared in (True, False):
        engine = Engine(model, None, max_requests=12, prefill_chunk=64, prefix_cache_bytes=0, block_size=block_size)
        if not shared:  # every twin written into pages of its own
            add_rows = engine.paged.add_rows
            engine.paged.add_rows = lambda caches, twins=None, shared=None: add_rows(caches)
        peak, decode = [0], engine._decode

        def watched():
            decode()
            peak[0] = max(peak[0], engine.paged.pages_held)

        engine._decode = watched

        async def run():
            loop = asyncio.get_running_loop()
            requests = []
            for ids in prompts:
                sampling = Sampling(max_tokens=16, temperature=1.0, seed=5)
                jobs = [Job(ids, sampling, loop)]
                jobs += [Job(ids, sampling, loop, index, twin=jobs[0]) for index in range(1, 4)]
                engine.submit(jobs)
                requests.append(jobs)
            for jobs in requests:
                for job in jobs:
                    while await job.mailbox.get() is not None:
                        pass
            return [job.new_ids for jobs in requests for job in jobs]

        try:
            tokens = asyncio.run(run())
        finally:
            engine.stop()
        report["shared" if shared else "own"] = {"bytes": engine.stats["latent_bytes_copied"], "peak_pages": peak[0],
                                                 "tokens": tokens}
    report["same_tokens"] = report["shared"]["tokens"] == report["own"]["tokens"]
    return report


def sessions(block_size: int) -> dict:
    from kimik3.chat import load_chat
    from kimik3.engine import Engine, Job, Sampling
    from kimik3.tiny import write_tiny_folder

    folder = tempfile.mkdtemp() + "/tiny"
    write_tiny_folder(folder, num_hidden_layers=2, seed=3)
    _, model = load_chat(folder)
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 400, (600,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, 400, (40,), generator=generator).tolist() for _ in range(6)]
    report = {}
    for shared in (True, False):
        engine = Engine(model, None, max_requests=8, prefill_chunk=128, block_size=block_size)
        if not shared:  # every row writes pages of its own, as before the sharing
            engine._shared_pages = lambda job: None
        peak, decode, jobs = [0], engine._decode, []

        def watched():  # in the engine's thread: the next session comes once the last one has joined
            decode()
            peak[0] = max(peak[0], engine.paged.pages_held)
            if len(jobs) < len(prompts) and jobs[-1] in engine.batch:
                jobs.append(Job(prompts[len(jobs)], jobs[0].sampling, jobs[0].loop))
                engine.submit(jobs[-1:])

        engine._decode = watched

        async def run():
            loop = asyncio.get_running_loop()
            jobs.append(Job(prompts[0], Sampling(max_tokens=24, temperature=0.0), loop))
            engine.submit(jobs[-1:])
            while len(jobs) < len(prompts) or any(not job.done for job in jobs):
                await asyncio.sleep(0.005)
            return [job.new_ids for job in jobs]

        try:
            tokens = asyncio.run(run())
        finally:
            engine.stop()
        report["shared" if shared else "own"] = {
            "bytes": engine.stats["latent_bytes_copied"], "peak_pages": peak[0], "tokens": tokens,
            "pages_shared": engine.stats["pages_shared"], "prompt_tokens_reused": engine.stats["prompt_tokens_reused"]}
    report["same_tokens"] = report["shared"]["tokens"] == report["own"]["tokens"]
    return report


def step(device: str, repeats: int = 20) -> dict:
    cache_code = importlib.import_module("kimik3.modeling.cache_kimi_k3")
    width, lengths = 576, [1024, 4096, 2048, 3000, 1500, 3500, 2500, 4000]
    rows, longest = len(lengths), max(lengths)
    config = SimpleNamespace(layer_types=["full_attention"], linear_num_heads=1, linear_head_dim=1,
                             linear_conv_kernel_size=2, kda_chunk_size=64, mla_cache_dim=width)
    options = {"dtype": torch.bfloat16, "device": device}
    dense, new = torch.randn(rows, longest, width, **options), torch.randn(rows, 1, width, **options)

    def timed(fn) -> float:
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats * 1e3

    report = {"cat_ms": timed(lambda: torch.cat([dense, new], dim=1))}
    for size in (16, 64):
        paged = cache_code.KimiK3PagedCache(config, block_size=size)
        caches = []
        for length in lengths:
            cache = cache_code.KimiK3Cache(config)
            cache.layers[0].update(torch.randn(1, length, width, **options))
            cache._seen_tokens = length
            caches.append(cache)
        paged.add_rows(caches)

        def decode_step():
            paged.begin_step(rows, 1, None, None)
            paged.update_latents(new, 0)

        report[f"paged_{size}_ms"] = timed(decode_step)
        report[f"paged_{size}_setup_ms"] = timed(lambda: paged.begin_step(rows, 1, None, None))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-cache-bytes", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    moved = regroup(args.max_cache_bytes, args.block_size)
    print(f"regroup: {moved['regroups']} regroups; latents copied {moved['paged_bytes']:,} bytes paged "
          f"({moved['paged_bytes'] / moved['regroups']:,.0f} a regroup) against {moved['padded_bytes']:,} for a "
          f"padded batch rebuilt each time ({moved['padded_bytes'] / moved['regroups']:,.0f} a regroup); the prompts "
          f"hold {moved['prompt_bytes']:,}; pool {moved['pool_bytes']:,} bytes, its growth copied "
          f"{moved['pool_bytes_copied']:,}; {moved['preemptions']} preemptions, {moved['tokens_recomputed']} tokens "
          "recomputed")
    pair = twins(args.block_size)
    print(f"twins ({args.block_size}-token pages, 3 requests of n=4): latents written into pages "
          f"{pair['shared']['bytes']:,} bytes shared against {pair['own']['bytes']:,} each twin its own; most pages "
          f"held at a step {pair['shared']['peak_pages']} against {pair['own']['peak_pages']}; the same tokens: "
          f"{pair['same_tokens']}")
    agents = sessions(args.block_size)
    print(f"sessions ({args.block_size}-token pages, 6 sessions sharing a 600-token prefix, each arriving once the "
          f"one before has joined): latents written into pages {agents['shared']['bytes']:,} bytes with the running "
          f"rows' pages held against {agents['own']['bytes']:,} each row its own; most pages held at a step "
          f"{agents['shared']['peak_pages']} against {agents['own']['peak_pages']}; pages held instead of written "
          f"{agents['shared']['pages_shared']}; prompt tokens from the store "
          f"{agents['shared']['prompt_tokens_reused']} and {agents['own']['prompt_tokens_reused']}; the same tokens: "
          f"{agents['same_tokens']}")
    cost = step(args.device)
    print(f"step ({args.device}, one MLA layer, 8 rows of 1K-4K tokens, bf16): torch.cat of the padded batch "
          f"{cost['cat_ms']:.2f} ms; paged write + gather {cost['paged_16_ms']:.2f} ms at 16-token pages "
          f"(set-up {cost['paged_16_setup_ms']:.2f}), {cost['paged_64_ms']:.2f} ms at 64 "
          f"(set-up {cost['paged_64_setup_ms']:.2f})")


if __name__ == "__main__":
    main()
