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
"""What `kimik3 serve` spends on a streamed token outside the model (kimik3/serve.py), on the CPU: the engine's
side of a token (`Engine._emit`: sampling from given logits, the stop-sequence check) and the response's (a
chat stream's `Reply.events`: the reply's text, reasoning / content / tool-call deltas, the SSE chunk), for a reply of
--tokens tokens scripted to the K3 format (a long reasoning, then the response), a stop sequence set. No model runs:
each token's logits pick the script's token. Reported: microseconds a token over the first and the last --window
tokens, and the whole reply's CPU seconds.

    python benchmarks/bench_serve_stream.py --folder DIR [--tokens 4096] [--out FILE]

DIR: a model folder's tokenizer (kimik3 tiny writes one). Run it under two installs of the package to compare them.
"""

import argparse
import asyncio
import functools
import json
import platform
import time
import types
from pathlib import Path

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--out")
    args = parser.parse_args()

    import kimik3
    from kimik3 import serve
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.folder, trust_remote_code=True)
    sentence = "The river bends twice, and the ferry waits where the water runs slow. "
    script = tokenizer.encode("".join([sentence] * (args.tokens // 8)) + "<|close|>think<|sep|><|open|>response<|sep|>"
                              + "".join([sentence] * 4), add_special_tokens=False)[:args.tokens]
    vocab = max(len(tokenizer), max(script) + 1)
    # the engine's side of a token without a model or its thread: one process (no replicas), the leader
    engine = types.SimpleNamespace(tokenizer=tokenizer, eos=set(), _sample=serve.Engine._sample, leader=True,
                                   replicas=None)
    engine._choose = functools.partial(serve.Engine._choose, engine)
    times = []

    async def run():
        loop = asyncio.get_running_loop()
        job = serve.Job([1, 2, 3], serve.Sampling(max_tokens=len(script) + 1, temperature=0.0, stop=["#STOP#"]), loop)
        app = types.SimpleNamespace(tokenizer=tokenizer, model_name="bench")
        reply = serve.Reply(app, [job], True, 3)
        sent = []

        async def consume():
            async for event in reply.events(None):
                sent.append(event)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0)
        logits = torch.full((vocab,), -1e4)
        for token in script:
            start = time.perf_counter()
            logits.fill_(-1e4)
            logits[token] = 0.0
            serve.Engine._emit(engine, job, logits)
            await asyncio.sleep(0)  # the token reaches the mailbox (posted as from the engine's thread)
            await asyncio.sleep(0)  # the stream takes it and sends what it makes visible
            while job.mailbox.qsize():
                await asyncio.sleep(0)
            times.append(time.perf_counter() - start)
        job.finish_reason = "length"
        job.post(None)
        await consumer
        return sent

    cpu = time.process_time()
    sent = asyncio.run(run())
    cpu = time.process_time() - cpu
    chunks = [json.loads(e[6:]) for e in sent if e.startswith("data: {")]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"])
    w = args.window
    result = {"env": {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                      "torch": torch.__version__, "kimik3": str(Path(kimik3.__file__).parent)},
              "tokens": len(script), "events": len(chunks), "reasoning_chars": len(reasoning),
              "us_per_token_first": round(sorted(times[:w])[w // 2] * 1e6, 1),
              "us_per_token_last": round(sorted(times[-w:])[w // 2] * 1e6, 1),
              "cpu_s_whole_reply": round(cpu, 3)}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
