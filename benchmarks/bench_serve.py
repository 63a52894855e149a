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
"""`kimik3 serve`'s engine (kimik3/serve.py) against sequential `generate()`, side by side in one run, on the
bench_k3.py model (random bf16 weights, K3's widths, 8 layers, 64 experts) on one GPU:

  concurrency   N requests (a `--prompt`-token prompt each, `--new-tokens` greedy tokens) submitted at once to the
                engine, for N in --concurrency: tokens/s over all of them, mean and max request latency, mean time
                to first token; against `generate()` of the same prompts one after the other (eager, dynamic cache:
                the engine's own forward), timed over --sequential of them; once for each engine decode step in
                --decode-steps (`Engine(decode_step=)`: plain, fixed, captured), each level run once untimed first
                (a captured step's buckets are captured on their first steps)
  long          --long-concurrency requests of a --long-prompt-token prompt each (longer than a chunk), submitted at
                once: the engine reading them in lockstep (one batch, a row each, `Engine._read_lockstep`) against
                each read alone (the engine before it): mean and max time to first token, prefill forwards, the same
                tokens
  speculative   `Engine(speculative_tokens=)` off and on (--speculative-tokens, prompt lookup) at --spec-concurrency
                greedy requests, on each of --spec-decode-steps: tokens/s, forwards, rounds, proposed and accepted
                tokens; on the model's own tokens (random weights: whatever prompt lookup finds in them) and on the
                model steered by a hook on its logits to continue a 16-token cycle its prompts end in (every proposal
                accepted: the most speculation can give at that width)
  agent         an agent-like session: a --shared-prefix-token prefix (system prompt and tools), then --turns turns,
                each prompt the previous one + the reply + --turn-tokens new tokens: time to first token a turn with
                the prefix store, and without it (every turn read whole)

The engine is driven directly (its jobs and mailboxes, no HTTP: the web layer's cost is not measured here).

    python benchmarks/bench_serve.py --out benchmarks/results/bench_serve.json
    python benchmarks/bench_serve.py --quick        # CPU smoke test on a tiny model
"""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def run_jobs(engine, prompts, new_tokens, stagger=0.0):
    """Submits one greedy job a prompt; returns per job (seconds to the first token, seconds to the end, tokens)."""
    from kimik3.engine import Job, Sampling

    loop = asyncio.get_running_loop()
    start = time.perf_counter()

    async def one(ids, delay):
        await asyncio.sleep(delay)
        job = Job(ids, Sampling(max_tokens=new_tokens, temperature=0.0), loop)
        submitted = time.perf_counter()
        engine.submit([job])
        first = None
        while True:
            item = await job.mailbox.get()
            if item is None:
                break
            if isinstance(item, Exception):
                raise item
            if first is None:
                first = time.perf_counter() - submitted
        return first, time.perf_counter() - submitted, list(job.new_ids)

    rows = await asyncio.gather(*(one(ids, i * stagger) for i, ids in enumerate(prompts)))
    wall = time.perf_counter() - start
    while engine.busy():  # a stream ends before its row leaves the batch (in the engine's thread)
        await asyncio.sleep(0.001)
    return rows, wall


def sequential(model, prompts, new_tokens):
    times, outputs = [], []
    with torch.no_grad():
        for ids in prompts:
            sync()
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
            sync()
            times.append(time.perf_counter() - start)
            outputs.append(out[0, len(ids):].tolist())
    return times, outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sequential", type=int, default=4)
    parser.add_argument("--shared-prefix", type=int, default=32768)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=256)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--long-prompt", type=int, default=8192)
    parser.add_argument("--long-concurrency", type=int, default=8)
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--spec-concurrency", default="1,8")
    parser.add_argument("--spec-decode-steps", default=None,
                        help="the decode steps the speculative section runs under (default captured,plain on CUDA, "
                             "fixed on the CPU)")
    parser.add_argument("--sections", default="concurrency,long,agent")
    parser.add_argument("--decode-steps", default=None,
                        help="the engine's decode steps the concurrency section compares (default "
                             "plain,captured,compiled on CUDA, plain,fixed on the CPU)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))

    from kimik3.engine import Engine

    if args.quick:
        from kimik3.tiny import build_tiny_model

        model = build_tiny_model(seed=0).eval()
        args.concurrency, args.prompt, args.new_tokens, args.sequential = "1,4", 40, 8, 2
        args.shared_prefix, args.turns, args.turn_tokens, args.prefill_chunk = 600, 2, 20, 64
        args.long_prompt, args.long_concurrency, args.spec_concurrency = 300, 4, "1,4"
        env = {"device": "cpu"}
    else:
        import bench_k3

        from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

        model = bench_k3.build(KimiK3ForCausalLM, bench_k3.k3_config(8, 64)).eval()
        env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.decode_steps is None:
        args.decode_steps = "plain,captured,compiled" if torch.cuda.is_available() and not args.quick else \
            "plain,fixed"
    model.generation_config.eos_token_id = None  # every request runs its --new-tokens
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, vocab - 1, (n,), generator=generator).tolist()

    results = {"env": env, "args": vars(args)}

    def emit(key, value):
        results[key] = value
        print(json.dumps({key: value}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))

    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [ids(args.prompt) for _ in range(max(levels))]
    if "concurrency" in sections:
        concurrency(model, args, prompts, levels, emit)
    if "long" in sections:
        long_prompts = [ids(args.long_prompt) for _ in range(args.long_concurrency)]
        outputs = {}
        for label, lockstep in (("warmup", True), ("lockstep", True), ("alone", False)):
            engine = Engine(model, None, max_requests=args.long_concurrency + 1, prefill_chunk=args.prefill_chunk,
                            prefix_cache_bytes=0)
            if not lockstep:  # every prompt read alone, chunk by chunk (the engine before the lockstep)
                engine._read_lockstep = set
            try:
                rows, wall = asyncio.run(run_jobs(engine, long_prompts, args.new_tokens))
            finally:
                engine.stop()
            outputs[label] = [tokens for _, _, tokens in rows]
            if label != "warmup":
                emit(f"long_{label}", {
                    "requests": args.long_concurrency, "prompt_tokens": args.long_prompt, "wall_s": round(wall, 4),
                    "mean_ttft_s": round(sum(r[0] for r in rows) / len(rows), 4),
                    "max_ttft_s": round(max(r[0] for r in rows), 4),
                    "prefill_forwards": engine.stats["prefill_forwards"],
                    "same_tokens_as_lockstep": outputs[label] == outputs["lockstep"]})
    if "speculative" in sections:
        speculative(model, args, ids, emit)
    if "agent" in sections:
        agent(model, args, ids, emit)


def concurrency(model, args, prompts, levels, emit):
    from kimik3.engine import Engine

    times, reference = sequential(model, prompts[:1] + prompts[:args.sequential], args.new_tokens)
    per_request = sorted(times[1:])[len(times[1:]) // 2]  # after one warm-up
    emit("sequential_generate", {"requests": args.sequential, "s_per_request": round(per_request, 4),
                                 "tokens_per_s": round(args.new_tokens / per_request, 1)})
    tokens_of = {}
    for mode in args.decode_steps.split(","):
        engine = Engine(model, None, max_requests=max(levels) + 1, prefill_chunk=args.prefill_chunk,
                        prefix_cache_bytes=0, decode_step=mode)
        decode, spent = engine._decode, [0.0]

        def timed_decode():  # the engine thread's wall in decode steps (each ends reading its logits on the host)
            start = time.perf_counter()
            decode()
            spent[0] += time.perf_counter() - start

        engine._decode = timed_decode
        try:
            for level in levels:
                asyncio.run(run_jobs(engine, prompts[:level], args.new_tokens))  # warm-up (and captures)
                spent[0] = 0.0
                before = {key: engine.stats[key] for key in ("decode_forwards", "decode_graph_replays",
                                                             "decode_padding_rows")}
                rows, wall = asyncio.run(run_jobs(engine, prompts[:level], args.new_tokens))
                tokens_of[mode, level] = [tokens for _, _, tokens in rows]
                same = all(tokens == want for (_, _, tokens), want in zip(rows, reference[1:]))
                counts = {key: engine.stats[key] - value for key, value in before.items()}
                emit(f"engine_{mode}_c{level}", {
                    "decode_step": mode, "requests": level, "wall_s": round(wall, 4),
                    "tokens_per_s": round(level * args.new_tokens / wall, 1),
                    "speedup_vs_sequential": round(level * per_request / wall, 2),
                    "mean_latency_s": round(sum(r[1] for r in rows) / level, 4),
                    "max_latency_s": round(max(r[1] for r in rows), 4),
                    "mean_ttft_s": round(sum(r[0] for r in rows) / level, 4),
                    "decode_ms_per_step": round(1000 * spent[0] / max(counts["decode_forwards"], 1), 3),
                    **counts, "decode_graphs_held": engine.stats["decode_graphs"],
                    "capture_error": None if engine.steps is None else engine.steps.capture_error,
                    "greedy_equal_to_generate": same if level <= args.sequential else "not compared",
                    "same_tokens_as_first_mode": tokens_of[mode, level] == tokens_of[args.decode_steps.split(",")[0],
                                                                                     level],
                    # where a row's greedy tokens first leave generate()'s (bf16: a near-tie rounded the other way)
                    "first_difference_from_generate": [
                        next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
                        for (_, _, tokens), want in zip(rows, reference[1:])]})
        finally:
            engine.stop()


def speculative(model, args, ids, emit):
    from kimik3.engine import Engine

    if args.spec_decode_steps is None:
        args.spec_decode_steps = "captured,plain" if torch.cuda.is_available() and not args.quick else "fixed"
    vocab = model.config.vocab_size
    cycle = list(range(vocab - 17, vocab - 1))
    following = torch.full((vocab,), -1, dtype=torch.long, device=model.device)
    following[cycle] = torch.tensor(cycle[1:] + cycle[:1], device=model.device)

    def steer(module, inputs, kwargs, output):
        # after a token of the cycle, its next one; elsewhere the model's own logits (tensor ops only: a captured
        # decode step runs this hook inside its graph)
        logits = output.logits
        after = following[kwargs["input_ids"][:, -logits.shape[1]:]]
        steered = torch.full_like(logits, -1e4).scatter_(-1, after.clamp(min=0).unsqueeze(-1), 0.0)
        output.logits = torch.where((after >= 0).unsqueeze(-1), steered, logits)
        return output

    levels = [int(c) for c in args.spec_concurrency.split(",")]
    for workload in ("own", "steered"):
        prompts = [ids(args.prompt - 2 * len(cycle)) + (cycle * 2 if workload == "steered" else
                                                        ids(2 * len(cycle))) for _ in range(max(levels))]
        handle = model.register_forward_hook(steer, with_kwargs=True) if workload == "steered" else None
        try:
            for mode in args.spec_decode_steps.split(","):
                tokens_off = {}
                for proposals in (0, args.speculative_tokens):
                    engine = Engine(model, None, max_requests=max(levels) + 1, prefill_chunk=args.prefill_chunk,
                                    prefix_cache_bytes=0, decode_step=mode, speculative_tokens=proposals)
                    try:
                        for level in levels:
                            asyncio.run(run_jobs(engine, prompts[:level], args.new_tokens))  # warm-up, captures
                            keys = ("decode_forwards", "speculative_rounds", "tokens_proposed", "tokens_accepted")
                            before = {key: engine.stats[key] for key in keys}
                            rows, wall = asyncio.run(run_jobs(engine, prompts[:level], args.new_tokens))
                            counts = {key: engine.stats[key] - value for key, value in before.items()}
                            tokens = [row[2] for row in rows]
                            if not proposals:
                                tokens_off[level] = tokens
                            emit(f"speculative_{workload}_{mode}_k{proposals}_c{level}", {
                                "workload": workload, "decode_step": mode, "speculative_tokens": proposals,
                                "requests": level, "wall_s": round(wall, 4),
                                "tokens_per_s": round(level * args.new_tokens / wall, 1),
                                "mean_latency_s": round(sum(r[1] for r in rows) / level, 4), **counts,
                                "accepted_per_proposed": round(counts["tokens_accepted"] /
                                                               max(counts["tokens_proposed"], 1), 3),
                                "same_tokens_as_off": tokens == tokens_off[level]})
                    finally:
                        engine.stop()
        finally:
            if handle is not None:
                handle.remove()


def agent(model, args, ids, emit):
    from kimik3.engine import Engine

    prefix = ids(args.shared_prefix)
    # the first session is a warm-up (kernels autotuned for the prefill's snapshot offsets and the turns' lengths)
    for label, store in (("warmup", True), ("prefix_store", True), ("no_store", False)):
        engine = Engine(model, None, max_requests=4, prefill_chunk=args.prefill_chunk,
                        prefix_cache_bytes=(8 << 30) if store else 0)
        try:
            # a session of its own: the shared prefix, then its own first message
            prompt, turns = prefix + ids(args.turn_tokens), []
            for turn in range(args.turns):
                computed = engine.stats["prompt_tokens_computed"]
                (row,), _ = asyncio.run(run_jobs(engine, [prompt], args.new_tokens))
                turns.append({"turn": turn + 1, "prompt_tokens": len(prompt), "ttft_s": round(row[0], 4),
                              "prompt_tokens_computed": engine.stats["prompt_tokens_computed"] - computed})
                prompt = prompt + row[2] + ids(args.turn_tokens)
        finally:
            engine.stop()
        if label != "warmup":
            emit(f"agent_{label}", turns)


if __name__ == "__main__":
    main()
