"""Helper for tests/test_serve_parallel.py, run by the two-rank launch (tests/two_rank_worker.py): `kimik3 serve`'s
engine under tensor parallelism on a tiny folder with a vision tower (OUT/vision), rank 0 serving over HTTP and every
rank computing. Rank 0 sends concurrent requests with the openai client (completions of different lengths, one of
n=2, a streamed chat, a chat with an image, a stream its client leaves early, then one more request) and writes what
came back to OUT/served.json; the other rank follows rank 0's steps until rank 0 stops the engine.

    torchrun --standalone --nproc-per-node 2 tests/two_rank_worker.py ...   (see there)
"""

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist

from k3_test_utils import data_url, noise_image

PROMPTS = [[5, 17, 99, 3, 42], list(range(20, 60)), [9, 1, 120, 33, 8, 77, 2, 50, 61, 62, 63, 64, 65, 66, 67, 68, 69,
                                                      70, 71, 72, 73, 74, 75]]
NEW_TOKENS = 6
FAILING = [3, 3, 3, 3]
CHAT = [{"role": "user", "content": "Which river flows through Vienna?"}]


def run_all(model_dir: str, out_dir: Path) -> None:
    import openai
    import uvicorn

    from kimik3.serve import make_app
    from kimik3.tiny import write_tiny_folder

    folder = out_dir / "vision"
    if dist.get_rank() == 0:
        write_tiny_folder(folder, seed=6, vision=True)
    dist.barrier()
    # fp32: the ranks' partial sums are reduced in another order than one process adds them; greedy tokens must agree
    app, engine = make_app(folder, model_name="tiny", prefill_chunk=16, max_requests=12, dtype="float32",
                           tp_plan="auto")
    if dist.get_rank() != 0:
        engine.thread.join(timeout=240)
        assert not engine.thread.is_alive(), "rank 0 never stopped the engine"
        return
    # rank 0's sampler fails for one prompt: the other rank must hear of it, end that job too and go on
    sample = engine._sample

    def failing(logits, job):
        if job.prompt_ids == FAILING:
            raise ValueError("a sampler that fails on purpose")
        return sample(logits, job)

    engine._sample = failing
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    async def requests():
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                      max_retries=0) as client:
            async def completion(prompt, n=1):
                reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                                        temperature=0, n=n, logprobs=0)
                return [choice.logprobs.tokens for choice in sorted(reply.choices, key=lambda c: c.index)]

            async def chat():
                text = ""
                async for chunk in await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                                                        temperature=0, stream=True):
                    delta = chunk.choices[0].delta if chunk.choices else None
                    text += (getattr(delta, "reasoning_content", None) or "") + (delta.content or "" if delta else "")
                return text

            async def with_image():
                image = {"type": "image_url", "image_url": {"url": data_url(noise_image(1))}}
                reply = await client.chat.completions.create(
                    model="tiny", max_tokens=4, temperature=0, logprobs=True, top_logprobs=20,
                    messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}])
                content = reply.choices[0].logprobs.content
                return [e.token for e in content], [(t.token, t.logprob) for t in content[0].top_logprobs]

            async def left_early():
                stream = await client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=200,
                                                         temperature=0, stream=True)
                async for _ in stream:
                    break
                await stream.close()

            async def failing():
                try:
                    await completion(FAILING)
                except openai.InternalServerError as error:
                    return str(error)
                return "no error"

            results = await asyncio.gather(*(completion(p) for p in PROMPTS), completion(PROMPTS[0], n=2), chat(),
                                           with_image(), left_early(), failing())
            after = await completion(PROMPTS[2])  # the ranks still agree after a cancellation and a failure
            return results, after

    results, after = asyncio.run(requests())
    *served, twins, chat_text, image, _, failure = results
    server.should_exit = True
    thread.join(timeout=10)
    stats = dict(engine.stats)
    engine.stop()
    # what this rank holds of the first layer's output projection: half of it, if the plan sharded the model
    weight = next(p for n, p in engine.model.named_parameters() if n.endswith("layers.0.self_attn.o_proj.weight"))
    held = list((weight.to_local() if hasattr(weight, "to_local") else weight).shape)
    (out_dir / "served.json").write_text(json.dumps({
        "prompts": PROMPTS, "tokens": [tokens[0] for tokens in served], "twins": twins, "chat": chat_text,
        "after": after[0], "stats": stats, "o_proj_held": held, "image": image, "failure": failure}))

