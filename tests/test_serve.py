"""`kimik3 serve` (kimik3/serve.py; docs/design.md, Serving) as clients use it: a tiny folder written by `kimik3 tiny`,
loaded through the Auto classes with the folder's own code, served by uvicorn on localhost in this process, and
talked to with the official `openai` client (and raw HTTP where the client would refuse to send the bad request).
Greedy tokens of concurrent requests equal `generate()` of each alone (fp32); a prompt that extends an earlier one is
read from the prefix store; reasoning and tool calls come back in OpenAI's fields; bad requests, overload and
disconnects get clear errors and leave the server serving."""

import asyncio
import gc
import json
import re
import socket
import threading
import time
import warnings
import weakref

import httpx
import openai
import pytest
import torch
import uvicorn

from kimik3.chat_format import encode_chat, render_text
from kimik3.engine import Job, Sampling, ServeError, TextSoFar, stop_at
from kimik3.serve import make_app
from kimik3.tiny import write_tiny_folder
from k3_test_utils import data_url, noise_image

MODEL = "tiny-k3"


class Server:
    def __init__(self, folder, **options):
        self.app, self.engine = make_app(folder, model_name=MODEL, **options)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer

    def close(self):
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.stop()

    def alone(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy `generate()` of one prompt alone: the reference the served tokens must equal."""
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve") / "tiny"
    write_tiny_folder(directory, num_hidden_layers=2, seed=3)  # one KDA and one MLA layer, one MoE
    return directory


@pytest.fixture(scope="module")
def server(folder):
    # a small prefill chunk: prompts are read over several steps, interleaved with the others' decode
    served = Server(folder, prefill_chunk=48, max_requests=8)
    yield served
    served.close()
    # every connection closed: a socket left for the collector would warn in whichever test runs next
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def _prompts(count: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    lengths = [5, 70, 12, 100][:count]
    return [torch.randint(3, vocab - 300, (n,), generator=generator).tolist() for n in lengths]


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    # "auto" off CUDA: the plain eager step, nothing to capture or compile
    assert (health["decode_step"], health["capture_error"], health["compile_error"]) == ("plain", None, None)


def test_concurrent_greedy_requests_equal_generate_of_each_alone(server):
    vocab = server.model.config.vocab_size
    prompts = _prompts(4, vocab)
    steps = 8
    before = dict(server.engine.stats)

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i, ids) for i, ids in enumerate(prompts)))

    async def one(client, index, ids):
        if index % 2:  # half of them streamed
            stream = await client.completions.create(model=MODEL, prompt=ids, max_tokens=steps, temperature=0,
                                                     stream=True, logprobs=0)
            tokens = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs:
                    tokens += chunk.choices[0].logprobs.tokens
            return tokens
        reply = await client.completions.create(model=MODEL, prompt=ids, max_tokens=steps, temperature=0,
                                                logprobs=0)
        return reply.choices[0].logprobs.tokens

    served = asyncio.run(ask_all())
    for ids, tokens in zip(prompts, served):
        assert tokens == server.tokenizer.convert_ids_to_tokens(server.alone(ids, steps))
    stats = server.engine.stats
    forwards = stats["decode_forwards"] - before["decode_forwards"]
    rows = stats["rows_decoded"] - before["rows_decoded"]
    assert rows > forwards, "no decode forward held more than one request"


def test_n_and_seeded_sampling(server):
    ids = _prompts(1, server.model.config.vocab_size)[0]
    greedy = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, n=3)
    texts = [choice.text for choice in sorted(greedy.choices, key=lambda c: c.index)]
    assert texts == [server.tokenizer.decode(server.alone(ids, 4))] * 3
    sampled = [server.client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=1.0, seed=7,
                                                logprobs=0).choices[0].logprobs.tokens for _ in range(2)]
    assert sampled[0] == sampled[1], "a seed gives the same tokens"
    other = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=1.0, seed=8,
                                             logprobs=0).choices[0].logprobs.tokens
    assert other != sampled[0]


def test_chat_streaming_and_not_agree_and_logprobs_are_the_models(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    choice = whole.choices[0]
    streamed = {"content": "", "reasoning_content": ""}
    for chunk in server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed["content"] += delta.content or ""
            streamed["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        else:
            assert chunk.usage.completion_tokens == 6
    # the generation prompt opens the think section: a model not trained on K3 reasons throughout
    assert streamed["reasoning_content"] == choice.message.reasoning_content != ""
    assert streamed["content"] == (choice.message.content or "")
    prompt = encode_chat(server.tokenizer, messages, add_generation_prompt=True, reasoning_effort="max")
    assert whole.usage.prompt_tokens == len(prompt)
    tokens = [entry.token for entry in choice.logprobs.content]
    assert tokens == server.tokenizer.convert_ids_to_tokens(server.alone(prompt, 6))
    # each sampled token's log-probability is the model's log-softmax there (greedy: the top one)
    for entry in choice.logprobs.content:
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_a_prompt_that_extends_an_earlier_one_is_read_from_the_store(server):
    vocab = server.model.config.vocab_size
    first = torch.randint(3, vocab - 300, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    turn = server.client.completions.create(model=MODEL, prompt=first, max_tokens=2, temperature=0, logprobs=0)
    assert turn.usage.prompt_tokens_details.cached_tokens == 0
    # the next turn: the earlier prompt, the reply, a new message (an agent's conversation)
    second = first + server.tokenizer.convert_tokens_to_ids(turn.choices[0].logprobs.tokens) + [40, 41, 42]
    computed = server.engine.stats["prompt_tokens_computed"]
    again = server.client.completions.create(model=MODEL, prompt=second, max_tokens=3, temperature=0, logprobs=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(first)
    assert server.engine.stats["prompt_tokens_computed"] - computed == len(second) - len(first)
    assert again.choices[0].logprobs.tokens == server.tokenizer.convert_ids_to_tokens(server.alone(second, 3))
    # a different continuation of the first 512-token block starts from the snapshot at its end
    third = first[:600] + [7, 8, 9]
    reused = server.client.completions.create(model=MODEL, prompt=third, max_tokens=2, temperature=0, logprobs=0)
    assert reused.usage.prompt_tokens_details.cached_tokens == 512
    assert reused.choices[0].logprobs.tokens == server.tokenizer.convert_ids_to_tokens(server.alone(third, 2))


@pytest.fixture
def scripted(server):
    """The served model's choices steered to a scripted K3 reply (a hook on its logits: the token at each position
    after the prompt is the script's), so the server's parsing meets the markup a trained K3 writes."""
    state = {}

    def hook(module, args, kwargs, output):
        # each row's tokens after this forward: its attention mask's in a batched decode, a fixed-shape decode step's
        # own counts, else the cache's (every row of a forward without a mask holds as many: one prompt, or prompts
        # read in lockstep)
        mask, cache = kwargs.get("attention_mask"), kwargs["past_key_values"]
        lengths = mask.sum(-1).tolist() if mask is not None else cache.inputs[:, -1].tolist() \
            if type(cache).__name__ == "KimiK3PagedStep" else [cache.get_seq_length()] * output.logits.shape[0]
        for row, length in enumerate(lengths):
            position = length - state["prompt"]
            if 0 <= position < len(state["script"]):
                output.logits[row, -1] = -1e4
                output.logits[row, -1, state["script"][position]] = 0.0
        return output

    handle = server.model.register_forward_hook(hook, with_kwargs=True)
    yield state
    handle.remove()


def test_reasoning_and_tool_calls_come_back_in_openais_fields(server, scripted):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = {"role": "assistant", "reasoning_content": "Look.", "content": "",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    declared = [t["function"] for t in tools]
    prompt_text = render_text(messages, tools=declared, add_generation_prompt=True)
    reply_text = render_text(messages + [reply], tools=declared)[len(prompt_text):]
    tokenizer = server.tokenizer
    scripted["script"] = tokenizer.encode(reply_text, add_special_tokens=False)
    scripted["prompt"] = len(tokenizer.encode(prompt_text, add_special_tokens=False))

    async def both():  # together: one batched decode serves the two (the script is the same at each position)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            async def streamed():
                reasoning, calls, finish = "", [], None
                async for chunk in await client.chat.completions.create(
                        model=MODEL, messages=messages, tools=tools, max_tokens=200, temperature=0, stream=True):
                    delta = chunk.choices[0].delta
                    reasoning += getattr(delta, "reasoning_content", None) or ""
                    assert "<|" not in (delta.content or "") + reasoning, "markup leaked into the text"
                    calls += delta.tool_calls or []
                    finish = chunk.choices[0].finish_reason or finish
                return reasoning, calls, finish

            return await asyncio.gather(client.chat.completions.create(
                model=MODEL, messages=messages, tools=tools, max_tokens=200, temperature=0), streamed())

    whole, (reasoning, calls, finish) = asyncio.run(both())
    assert whole.usage.prompt_tokens == scripted["prompt"]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert reasoning == "Look." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_stop_sequences_cut_the_text_and_end_the_request(server):
    ids = _prompts(2, server.model.config.vocab_size)[1]
    full = server.tokenizer.decode(server.alone(ids, 8))
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip("\ufffd"):
        pytest.fail(f"the reference text has no usable stop sequence at its middle: {full!r}")
    cut = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]
    # streamed, the deltas never run ahead into a stop sequence's first characters
    streamed = [chunk.choices[0] for chunk in server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, stop=[stop, stop + "never"], stream=True)]
    assert "".join(c.text for c in streamed) == full[:full.index(stop)]
    assert streamed[-1].finish_reason == "stop"


def test_the_prompts_cache_is_copied_only_for_twins_or_the_store(server, monkeypatch):
    """After its prompt a job's cache goes on into the batch; a copy of it is made only for the request's other `n`
    sequences or for the prefix store, never for nobody."""
    copies = []
    cache_class = server.engine.code.KimiK3Cache
    copy_prefix = cache_class.copy_prefix
    monkeypatch.setattr(cache_class, "copy_prefix", lambda self, *a: copies.append(1) or copy_prefix(self, *a))
    ids = list(range(7, 40))
    expected = server.tokenizer.decode(server.alone(ids, 3))
    for store, n, made in ((server.engine.store, 1, 1), (None, 1, 0), (None, 2, 2)):
        monkeypatch.setattr(server.engine, "store", store)
        copies.clear()
        reply = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, n=n)
        assert [c.text for c in reply.choices] == [expected] * n
        assert len(copies) == made, (store is not None, n)  # the source's copy, and each twin's own


class CountingTokenizer:
    """The served tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


def test_the_text_so_far_is_the_whole_decoding_at_every_token_at_a_cost_that_does_not_grow(server):
    """Every token's text is the decoding of all ids so far (characters split across byte-level tokens included),
    the first stop sequence is where searching the whole text finds it, the visible text never shows a stop's first
    characters before the request ends; and the ids decoded per token do not grow with the reply (decoding the
    whole reply at every token, as the server did, costs the square of its length)."""
    tokenizer = server.tokenizer
    generator = torch.Generator().manual_seed(8)
    ids = torch.randint(0, server.model.config.vocab_size, (600,), generator=generator).tolist()
    whole = tokenizer.decode(ids)
    stops = [whole[400:403], "\x00never"]
    counting = CountingTokenizer(tokenizer)
    decoded, shown = TextSoFar(counting, stops), ""
    for step in range(len(ids)):
        decoded.add(ids[step])
        text, stop = decoded.state
        assert text == tokenizer.decode(ids[:step + 1])
        assert stop == stop_at(text, stops)
        visible = decoded.visible(ended=False)
        assert visible.startswith(shown) and not any(s in visible for s in stops)
        if stop is None:
            assert not any(text[len(visible):].startswith(s) for s in stops)
        shown = visible
    assert decoded.visible(ended=True) == whole[:stop_at(whole, stops)] and decoded.state[1] is not None
    assert counting.decoded < 3 * len(ids)  # whole decodes would be len(ids) ** 2 / 2


@pytest.mark.parametrize("body, status, named", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"model": "gpt-4o", "prompt": "hi"}).encode(), 404, "'gpt-4o' not found"),
    (json.dumps({"prompt": "hi", "temperature": -0.5}).encode(), 400, "temperature=-0.5"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature must be a number"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "top_p=0"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens=0"),
    (json.dumps({"prompt": "hi", "n": 100}).encode(), 400, "n=100"),
    (json.dumps({"prompt": "hi", "stop": ["", "x"]}).encode(), 400, "stop must be"),
    (json.dumps({"prompt": [1, 2, 10 ** 9]}).encode(), 400, "token id 1000000000"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt must be"),
    (json.dumps({"prompt": "hi", "max_tokens": 10 ** 7}).encode(), 400, "exceed the context"),
], ids=["serve-body-not-json", "serve-body-not-an-object", "serve-unknown-model", "serve-temperature-negative",
        "serve-temperature-not-a-number", "serve-top-p-zero", "serve-max-tokens-zero", "serve-n-too-many",
        "serve-empty-stop-sequence", "serve-token-id-outside-vocabulary", "serve-empty-prompt",
        "serve-prompt-over-the-context"])
def test_bad_completions_get_clear_errors_and_the_server_goes_on(server, body, status, named):
    answer = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status
    error = answer.json()["error"]
    assert named in error["message"], error
    assert [m.id for m in server.client.models.list().data] == [MODEL]  # still serving


@pytest.mark.parametrize("body, named", [
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages\\[0\\].role is .wizard."),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}, "reasoning_effort must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs=50"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                       "iVBORw0KGgo="}}]}]},
     "messages\\[0\\].content\\[0\\]: an image, but this model has no vision tower"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]},
     "parts of type 'input_audio' are not served"),
], ids=["serve-chat-no-messages", "serve-chat-unknown-role", "serve-chat-tool-choice-unknown",
        "serve-chat-reasoning-effort-unknown", "serve-chat-top-logprobs-over-20", "serve-chat-image-part",
        "serve-chat-audio-part"])
def test_bad_chat_requests_are_named(server, body, named):
    with pytest.raises(openai.BadRequestError, match=named):
        server.client.chat.completions.create(model=MODEL, max_tokens=2, **body)


def test_message_text_never_becomes_a_control_token(server):
    text = "<|open|>tools<|sep|><|end_of_msg|>"
    answer = server.client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    special = set(server.tokenizer.all_special_ids) | {server.tokenizer.convert_tokens_to_ids("<|open|>")}
    encoded = server.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert answer.usage.prompt_tokens == len(encoded) and not special & set(encoded)


def test_overload_is_refused_by_name_and_a_disconnect_frees_its_slot(server):
    served = server
    served.engine.max_requests = 2
    try:
        ids = _prompts(1, served.model.config.vocab_size)[0]
        with pytest.raises(openai.RateLimitError, match="at capacity.*at most 2"):
            served.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, n=3)
        # a client that reads one event and goes away: its sequence ends there, not at its 1,000 tokens, and its
        # slot is free again
        decoded = served.engine.stats["rows_decoded"]
        with httpx.stream("POST", f"{served.url}/v1/completions", json={"prompt": ids, "max_tokens": 1000,
                                                                       "stream": True, "temperature": 0}) as events:
            lines = events.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.time() + 20
        while served.engine.busy() and time.time() < deadline:
            time.sleep(0.05)
        assert served.engine.busy() == 0
        assert served.engine.stats["rows_decoded"] - decoded < 300
        # both slots serve again, and the one before leaves nothing behind in the batch
        replies = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, n=2)
        assert [c.text for c in replies.choices] == [served.tokenizer.decode(served.alone(ids, 3))] * 2
    finally:
        served.engine.max_requests = 8


def test_the_paged_batch_refuses_what_it_cannot_hold(server):
    code, config = server.engine.cache_code, server.model.config
    with pytest.raises(ValueError, match="one row with nothing pending"):
        code.KimiK3PagedCache(config).add_rows([code.KimiK3Cache(config)])  # empty
    paged = code.KimiK3PagedCache(config, block_size=4, num_pages=3)
    with pytest.raises(ValueError, match="the rows take 5 pages of 4 tokens, 3 are free of 3"):  # 2 + 3
        paged.add_rows([_filled(server, 5), _filled(server, 9)])
    assert paged.pages_held == 0  # nothing taken
    with pytest.raises(NotImplementedError, match="KimiK3PagedCache.crop"):
        paged.crop(2)
    with pytest.raises(ValueError, match=r"a key mask of \(1, 5\) for a cache of 1 rows and 9 tokens"):
        _filled(server, 9).split(torch.ones(1, 5, dtype=torch.bool))


def _filled(server, tokens: int):
    cache = server.engine.code.KimiK3Cache(server.model.config)
    with torch.no_grad():
        server.model(input_ids=torch.arange(3, 3 + tokens)[None], past_key_values=cache, use_cache=True)
    return cache


def test_a_forward_that_fails_ends_its_request_alone_and_the_server_goes_on(server):
    poison, nan = 761, 762  # prompts holding these ids make the model raise / give NaN logits (a failing kernel)

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and bool((ids == poison).any()):
            raise RuntimeError("the model refused this prompt")

    def poisoned_logits(module, args, kwargs, output):
        ids = kwargs.get("input_ids")
        if ids is not None and bool((ids == nan).any()):
            output.logits[:] = float("nan")
        return output

    handle = server.model.register_forward_pre_hook(hook, with_kwargs=True)
    logits_handle = server.model.register_forward_hook(poisoned_logits, with_kwargs=True)
    try:
        with pytest.raises(openai.InternalServerError, match="non-finite values after 0 tokens"):
            server.client.completions.create(model=MODEL, prompt=[5, nan, 7], max_tokens=3, temperature=0)
        async def both():
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
                good = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
                bad = client.completions.create(model=MODEL, prompt=[5, poison, 7], max_tokens=4, temperature=0)
                return await asyncio.gather(good, bad, return_exceptions=True)

        good, bad = asyncio.run(both())
    finally:
        handle.remove()
        logits_handle.remove()
    assert isinstance(bad, openai.InternalServerError)
    assert "generation failed: RuntimeError: the model refused this prompt" in str(bad)
    assert good.choices[0].text == server.tokenizer.decode(server.alone([5, 6, 7, 8], 4))
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_a_row_whose_logits_go_non_finite_in_a_batched_step_ends_its_request_alone(server):
    """Two greedy requests decoding in one batch; at the third decode step the first row's logits are NaN (as a
    failing kernel would leave them): its request ends with an error naming non-finite logits, the other keeps
    `generate()`'s tokens to its end, and the engine goes on serving."""
    from kimik3.engine import Engine

    prompts = [list(range(5, 17)), list(range(40, 61))]
    engine = Engine(server.model, server.tokenizer, max_requests=2, prefill_chunk=64, prefix_cache_bytes=0)
    emit_rows, steps = engine._emit_rows, []

    def poisoned(jobs, logits):
        steps.append(len(jobs))
        if len(steps) == 3:
            logits = logits.clone()
            logits[0] = float("nan")
        emit_rows(jobs, logits)

    engine._emit_rows = poisoned
    try:
        jobs, outcomes = _outcomes(engine, lambda loop: [Job(ids, Sampling(max_tokens=8, temperature=0.0), loop)
                                                         for ids in prompts])
        assert steps[:3] == [2, 2, 2]  # both rows were in the poisoned step
        failed, good = outcomes
        assert isinstance(failed[-1], ServeError) and failed[-1].status == 500
        assert "non-finite values after 3 tokens" in failed[-1].message and jobs[0].finish_reason == "error"
        assert good == server.alone(prompts[1], 8) and jobs[1].finish_reason == "length"
        [after] = _greedy_each(engine, [prompts[0]], 4)
        assert after.new_ids == server.alone(prompts[0], 4)  # the engine serves on
    finally:
        engine.stop()


def test_rows_come_and_go_through_pages_without_copying_the_others(server):
    """The paged batch (KimiK3PagedCache): a row coming writes its own latents into pages once, a row leaving frees its
    pages and copies nothing; every row decodes generate()'s greedy tokens (fp32) throughout, and the pages held are
    those its tokens fill (a new page each time one is full)."""
    code, model, size = server.engine.cache_code, server.model, 4
    prompts = [list(range(5, 8)), list(range(10, 30)), list(range(40, 49)), list(range(60, 73))]
    paged = code.KimiK3PagedCache(model.config, block_size=size)
    rows, tokens = [], []

    def come(ids):
        cache = code.KimiK3Cache(model.config)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
        copied = paged.latent_bytes_copied
        paged.add_rows([cache])
        assert paged.latent_bytes_copied - copied == cache.layers[1].latents.nbytes  # its own latents, once
        rows.append(ids)
        tokens.append([int(logits[0, -1].argmax())])

    def step():
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[t[-1]] for t in tokens]), attention_mask=paged.attention_mask(1),
                        past_key_values=paged, use_cache=True)
        for row, produced in enumerate(tokens):
            produced.append(int(out.logits[row, -1].argmax()))
        lengths = [len(ids) + len(produced) - 1 for ids, produced in zip(rows, tokens)]
        assert paged.pages_held == sum(-(-length // size) for length in lengths)

    for ids in prompts[:3]:
        come(ids)
    for _ in range(3):
        step()
    copied, free = paged.latent_bytes_copied, paged.free_pages
    held = len(paged.block_tables[1])
    paged.remove_rows([1])  # the longest leaves: nothing is copied, its pages are free again
    assert paged.latent_bytes_copied == copied and paged.free_pages == free + held
    done = [(rows.pop(1), tokens.pop(1))]
    come(prompts[3])  # into the pages it freed (the pool grows no more)
    assert paged.free_pages == free + held - -(-len(prompts[3]) // size) and paged.latent_bytes_copied == \
        copied + len(prompts[3]) * model.config.mla_cache_dim * 4
    for _ in range(4):
        step()
    for ids, produced in done + list(zip(rows, tokens)):
        assert produced == server.alone(ids, len(produced))


def test_twins_share_their_prompts_full_pages_and_each_copies_its_partial_page(server):
    """Rows holding the same prompt (the `n` sequences of one request) share its full pages, reference-counted: a
    twin writes only its partial last page into a page of its own (copy-on-write where the rows append), the pages
    held count a shared page once, a row leaving frees only the pages no other row holds, and every row decodes
    generate()'s greedy tokens after a first token of its own (a shared partial page would mix the rows' latents)."""
    code, model, size = server.engine.cache_code, server.model, 4
    ids, firsts = list(range(5, 19)), [30, 31, 32]  # 14 tokens: 3 full pages and 2 tokens of a fourth
    row_bytes = model.config.mla_cache_dim * 4  # one token's latents in the one MLA layer (fp32)
    source = code.KimiK3Cache(model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=source, use_cache=True)
    paged = code.KimiK3PagedCache(model.config, block_size=size)
    paged.add_rows([source, source.copy_prefix(14), source.copy_prefix(14)], twins=[None, 0, 0])
    assert paged.latent_bytes_copied == (14 + 2 * 2) * row_bytes  # the prompt once, then a partial page a twin
    tables = paged.block_tables
    assert tables[1][:3] == tables[2][:3] == tables[0][:3] and len({t[3] for t in tables}) == 3
    assert paged.pages_held == 4 + 1 + 1
    tokens, alone = [[first] for first in firsts], [source.copy_prefix(14) for _ in firsts]
    for _ in range(4):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[t[-1]] for t in tokens]), attention_mask=paged.attention_mask(1),
                        past_key_values=paged, use_cache=True).logits[:, -1]
            # each row on a cache of its own: the logits agree to rounding (1.5e-7 measured; 5e-3 off with the
            # partial page shared, though the tiny model's greedy tokens happen to survive that)
            own = torch.cat([model(input_ids=torch.tensor([[t[-1]]]), past_key_values=cache,
                                   use_cache=True).logits[:, -1] for t, cache in zip(tokens, alone)])
        torch.testing.assert_close(out, own, atol=1e-5, rtol=0)
        for row, produced in enumerate(tokens):
            produced.append(int(out[row].argmax()))
    # 18 tokens a row: 5 pages each, the first 3 shared
    assert paged.pages_held == 5 + 2 * 2 == len({page for table in paged.block_tables for page in table})
    shared, free = paged.block_tables[0][:3], paged.free_pages
    paged.remove_rows([0])  # the source leaves: its own 2 pages are free, the 3 its twins hold are not
    assert paged.free_pages == free + 2 and not set(shared) & set(paged.free) and paged.pages_held == 7
    paged.remove_rows([0, 1])
    assert paged.pages_held == 0 and sorted(paged.free) == list(range(1, paged._pool_pages))  # each page once
    for first, produced in zip(firsts, tokens):
        assert produced[1:] == server.alone(ids + [first], 4)


def _budget(server, pages: int, size: int, sequences: int) -> int:
    """A --max-cache-bytes that leaves `pages` pages of `size` tokens beside the KDA states of `sequences`."""
    code, config = server.engine.cache_code, server.model.config
    return sequences * code.snapshot_bytes(config, dtype_bytes=4) + (pages + 1) * code.paged_page_bytes(config, size, 4)


def test_a_byte_budget_preempts_the_sequence_that_arrived_last_and_its_tokens_do_not_change(server):
    """Under --max-cache-bytes the pool holds a fixed number of pages: sequences are admitted though their longest
    caches do not fit together, and when a decode step finds no free page the one that arrived last gives its pages
    up, is read again later (its prompt from the prefix store, then the tokens it had produced) and goes on; every
    client gets generate()'s greedy tokens. A sequence the pool could never hold is a 400 naming the budget."""
    from kimik3.engine import Engine

    size, pool = 4, 12
    engine = Engine(server.model, server.tokenizer, max_requests=3, prefill_chunk=16, block_size=size,
                    max_cache_bytes=_budget(server, pool, size, 3))
    preempted = []  # (the job's number, its tokens, the numbers of those holding pages, whether a page was short)
    preempt = engine._preempt

    def watched(job):
        holders = [other.key for other in (*engine.batch, *engine.reading) if other in engine.batch or other.pages]
        short = engine.paged.pages_needed(1) > engine.paged.free_pages - engine._pages_aside()
        preempted.append((job.key, len(job.new_ids), holders, short))
        preempt(job)

    engine._preempt = watched
    prompts = [list(range(5, 15)), list(range(20, 34)), list(range(40, 46))]  # 3 + 4 + 2 pages; 6 + 7 + 5 at the end

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, Sampling(max_tokens=12, temperature=0.0), loop) for ids in prompts]
        engine.submit(jobs)  # one step takes them in, in this order
        for job in jobs:
            while (item := await job.mailbox.get()) is not None:
                assert not isinstance(item, Exception), item
        return jobs

    try:
        assert engine.paged.num_pages == pool
        with pytest.raises(ServeError, match=r"the server's pool of [0-9,]+ \(12 pages; --max-cache-bytes\)"):
            engine.submit([Job(prompts[0], Sampling(max_tokens=40), None)])  # 50 tokens: 13 pages
        jobs = asyncio.run(run())
        for job, ids in zip(jobs, prompts):
            assert job.new_ids == server.alone(ids, 12)
        assert preempted and preempted[0][0] == jobs[2].key and engine.stats["preemptions"] == len(preempted)
        for key, _, holders, short in preempted:  # only when pages were short, the last to arrive of those holding
            assert short and key == max(holders)
        # each time from the stored prompt: only the tokens it had produced but its last are computed again
        assert engine.stats["tokens_recomputed"] == sum(produced - 1 for _, produced, _, _ in preempted)
        assert engine.paged.pages_held == 0 and engine.paged.free_pages == pool
        assert engine.paged.pool_bytes() + 3 * engine.cache_code.snapshot_bytes(server.model.config, dtype_bytes=4) \
            <= engine.max_cache_bytes
    finally:
        engine.stop()


@pytest.mark.parametrize("lengths, twins, named", [
    ((14, 9), [None, 0], "twins[1]=0 must be None or the position of an earlier cache of the same length (9 tokens; "
                         "the lengths are [14, 9])"),
    ((9, 9), [1, None], "twins[0]=1 must be None or the position of an earlier cache of the same length"),
    ((9, 9), [None], "1 twins for 2 caches"),
], ids=["paged-twins-of-another-length", "paged-twin-of-a-later-row", "paged-twins-not-one-a-cache"])
def test_rows_that_cannot_share_pages_are_refused_by_name(server, lengths, twins, named):
    paged = server.engine.cache_code.KimiK3PagedCache(server.model.config, block_size=4)
    with pytest.raises(ValueError, match=re.escape(named)):
        paged.add_rows([_filled(server, length) for length in lengths], twins=twins)
    assert paged.pages_held == 0 and paged.latent_bytes_copied == 0  # nothing taken


@pytest.mark.parametrize("shared, named", [
    ([(0, 3)], "shared[0]=(0, 3) must be None or (row, pages): a row here (0..0) and at most its full pages, within "
               "the cache's 9 tokens"),
    ([(1, 1)], "shared[0]=(1, 1) must be None or (row, pages): a row here (0..0)"),
    ([(0, 2), None], "2 shared entries for 1 caches"),
], ids=["paged-shared-beyond-the-rows-full-pages", "paged-shared-with-a-row-not-here", "paged-shared-not-one-a-cache"])
def test_a_row_that_cannot_hold_anothers_pages_is_refused_by_name(server, shared, named):
    """`add_rows(shared=)` (a prompt started from a running row's stored prompt) holds only full pages of a row
    already in the batch, within the joining cache's tokens; anything else is refused before a page is taken."""
    paged = server.engine.cache_code.KimiK3PagedCache(server.model.config, block_size=4)
    paged.add_rows([_filled(server, 10)])  # 2 full pages and 2 tokens of a third
    held, copied = paged.pages_held, paged.latent_bytes_copied
    with pytest.raises(ValueError, match=re.escape(named)):
        paged.add_rows([_filled(server, 9)], shared=shared)
    assert paged.pages_held == held and paged.latent_bytes_copied == copied and len(paged.lengths) == 1
    with pytest.raises(ValueError, match=re.escape("cache 1 is a twin and shares a row's pages too")):
        paged.add_rows([_filled(server, 9), _filled(server, 9)], twins=[None, 0], shared=[None, (0, 2)])
    paged.add_rows([_filled(server, 9)], shared=[(0, 2)])  # the row's 2 full pages: taken, one page of its own
    assert paged.block_tables[1][:2] == paged.block_tables[0][:2] and paged.pages_held == held + 1


def _run_jobs(jobs_of):
    """The jobs `jobs_of(loop)` gives, submitted in one call each list, until each has ended."""
    async def run():
        loop = asyncio.get_running_loop()
        groups = jobs_of(loop)
        for engine, jobs in groups:
            engine.submit(jobs)
        for _, jobs in groups:
            for job in jobs:
                while (item := await job.mailbox.get()) is not None:
                    assert not isinstance(item, Exception), item
        for engine, _ in groups:  # a job's stream ends as its row leaves the batch, in the engine's thread
            while engine.busy():
                await asyncio.sleep(0.005)
        return [jobs for _, jobs in groups]

    return asyncio.run(run())


def _outcomes(engine, jobs_of):
    """The jobs `jobs_of(loop)` gives, submitted together, and what each one's stream held (tokens, then an error
    where it ended with one), once each has ended and left the batch."""
    async def run():
        jobs = jobs_of(asyncio.get_running_loop())
        engine.submit(jobs)
        outcomes = []
        for job in jobs:
            items = []
            while (item := await job.mailbox.get()) is not None:
                items.append(item)
            outcomes.append(items)
        while engine.busy():  # a job's stream ends as its row leaves the batch, in the engine's thread
            await asyncio.sleep(0.005)
        return jobs, outcomes

    return asyncio.run(run())


def _greedy_each(engine, prompts, max_tokens):
    """One greedy request a prompt, submitted together, run until each has ended: their jobs, in order."""
    return [job for [job] in _run_jobs(lambda loop: [
        (engine, [Job(ids, Sampling(max_tokens=max_tokens, temperature=0.0), loop)]) for ids in prompts])]


def _request(ids, sampling, loop, n):
    """The jobs of one request of `n` sequences, as the HTTP side makes them (kimik3.serve.App.respond)."""
    jobs = [Job(ids, sampling, loop)]
    return jobs + [Job(ids, sampling, loop, index, twin=jobs[0]) for index in range(1, n)]


def test_the_n_sequences_of_a_request_share_the_prompts_pages_and_keep_their_tokens(server):
    """n=3 in the engine: the twins hold the first sequence's full prompt pages and write only the prompt's partial
    page each (exact bytes), pages held count the shared pages once at every decode step and all are free at the end;
    greedy twins give generate()'s tokens, seeded sampled twins (seed + index) the tokens of three n=1 requests with
    their seeds, which share nothing."""
    from kimik3.engine import Engine

    size, ids = 4, list(range(5, 19))  # 14 tokens: 3 full pages and 2 tokens of a fourth
    row_bytes = server.model.config.mla_cache_dim * 4  # a token's latents in the one MLA layer (fp32)
    engine = Engine(server.model, server.tokenizer, max_requests=3, prefill_chunk=16, block_size=size,
                    prefix_cache_bytes=None)  # (16: the n=1 prompts are read alone, as the first twin is)
    steps = []  # after each decode forward of three rows: pages held, and those its rows' tokens fill
    decode = engine._decode

    def watched():
        decode()
        if len(engine.batch) == 3:
            steps.append((engine.paged.pages_held, sum(-(-length // size) for length in engine.paged.lengths)))

    engine._decode = watched
    try:
        results = {}
        for name, sampling, n in (("greedy", Sampling(max_tokens=6, temperature=0.0), 3),
                                  ("sampled", Sampling(max_tokens=6, temperature=1.0, seed=7), 3),
                                  ("alone", None, 1)):
            copied, steps[:] = engine.stats["latent_bytes_copied"], []
            if n == 3:
                [jobs] = _run_jobs(lambda loop: [(engine, _request(ids, sampling, loop, 3))])
            else:  # three requests at once, each with one twin's seed: rows of their own
                jobs = [job for [job] in _run_jobs(lambda loop: [
                    (engine, [Job(ids, Sampling(max_tokens=6, temperature=1.0, seed=7 + i), loop)])
                    for i in range(3)])]
            results[name] = ([job.new_ids for job in jobs], engine.stats["latent_bytes_copied"] - copied, list(steps))
        greedy, sampled, alone = results["greedy"], results["sampled"], results["alone"]
        assert greedy[0] == [server.alone(ids, 6)] * 3
        assert sampled[0] == alone[0] and len({tuple(t) for t in sampled[0]}) > 1  # the twins' draws differ
        # bytes written into pages: the prompt once and a partial page a twin, against the prompt a row
        assert greedy[1] == sampled[1] == (14 + 2 * 2) * row_bytes and alone[1] == 3 * 14 * row_bytes
        for shared in (greedy[2], sampled[2]):
            assert shared and all(held == filled - 2 * 3 for held, filled in shared)  # 3 pages held once, not thrice
        assert alone[2] and all(held == filled for held, filled in alone[2])
        engine.stop()
        assert engine.paged.pages_held == 0 and sorted(engine.paged.free) == list(range(1, engine.paged._pool_pages))
    finally:
        engine.stop()


def test_a_prompt_that_starts_from_a_running_rows_stored_prompt_holds_its_full_pages(server):
    """Sessions sharing a long prefix while they run (an agent's system prompt and tools): B's prompt starts from A's
    stored prompt while A decodes, and B joins holding A's full pages of that prefix (a reference each) instead of
    writing them. The latents written into pages are B's own tokens after them, the pages held count the shared ones
    once at every step both run, B keeps them when A leaves first, both give generate()'s tokens, and every page is
    free at the end. C starts from the same stored prompt after A has left: nothing to share, written whole."""
    from kimik3.engine import Engine

    size, vocab = 4, server.model.config.vocab_size
    first = torch.randint(3, vocab - 300, (30,), generator=torch.Generator().manual_seed(9)).tolist()  # 7 pages + 2
    second, third = first + [40, 41, 42, 43, 44], first + [50, 51]  # B: 7 pages shared, 7 tokens of its own
    row_bytes = server.model.config.mla_cache_dim * 4  # a token's latents in the one MLA layer (fp32)
    engine = Engine(server.model, server.tokenizer, max_requests=4, prefill_chunk=16, block_size=size)
    steps, marks, later = [], {}, {}
    decode = engine._decode

    def watched():  # in the engine's thread: B comes at the step after A joined, C once A and B have left
        decode()
        a, b = later["a"], later["b"]
        if len(engine.batch) == 2:
            steps.append((engine.paged.pages_held, sum(-(-length // size) for length in engine.paged.lengths)))
        if a in engine.batch and "b" not in marks:
            marks["b"] = (engine.stats["latent_bytes_copied"], engine.stats["pages_shared"])
            engine.submit([b])
        if b.done and a.done and "c" not in marks:
            marks["c"] = (engine.stats["latent_bytes_copied"], engine.stats["pages_shared"])
            engine.submit([later["c"]])

    async def run():
        loop = asyncio.get_running_loop()
        later.update(a=Job(first, Sampling(max_tokens=12, temperature=0.0), loop),
                     b=Job(second, Sampling(max_tokens=16, temperature=0.0), loop),
                     c=Job(third, Sampling(max_tokens=3, temperature=0.0), loop))
        engine.submit([later["a"]])
        for name in "abc":
            while (item := await later[name].mailbox.get()) is not None:
                assert not isinstance(item, Exception), item
        while engine.busy():
            await asyncio.sleep(0.005)

    engine._decode = watched
    try:
        asyncio.run(run())
        a, b, c = later["a"], later["b"], later["c"]
        assert a.new_ids == server.alone(first, 12) and b.new_ids == server.alone(second, 16)
        assert c.new_ids == server.alone(third, 3)
        assert b.cached_tokens == c.cached_tokens == len(first)  # both started from A's stored prompt
        copied_before_b, shared_before_b = marks["b"]
        copied_before_c, shared_before_c = marks["c"]
        assert shared_before_c - shared_before_b == 7  # B held A's 7 full pages
        assert copied_before_c - copied_before_b == (35 - 28) * row_bytes  # B wrote only its tokens after them
        assert steps and all(held == filled - 7 for held, filled in steps)  # shared pages counted once
        assert engine.stats["pages_shared"] == shared_before_c  # C: A had left, nothing to share
        assert engine.stats["latent_bytes_copied"] - copied_before_c == len(third) * row_bytes
        assert engine.paged.pages_held == 0 and sorted(engine.paged.free) == list(range(1, engine.paged._pool_pages))
    finally:
        engine.stop()


def test_a_preempted_row_holds_no_stored_prompt_for_later_prompts(server):
    """A row that is preempted is read again, perhaps from another stored prompt's latents: it no longer stands for the
    prompt it stored, so a later prompt that starts from that prompt shares none of its pages."""
    from kimik3.engine import Engine

    engine = Engine(server.model, server.tokenizer, max_requests=2, prefill_chunk=16, block_size=4)
    engine.stop()  # its state driven here, not by its thread
    try:
        ids = list(range(5, 17))
        holder, other = Job(ids, Sampling(max_tokens=4), None), Job(ids + [20], Sampling(max_tokens=4), None)
        stored = server.engine.code.KimiK3Cache(server.model.config)
        engine.page_holders[stored] = weakref.ref(holder)
        other.stored_prefix = (stored, len(ids))
        engine.batch = [holder]
        engine.paged.add_rows([_filled(server, len(ids))])
        assert engine._shared_pages(other) == (0, 3)  # the holder's 3 full pages
        engine._preempt(holder)
        assert stored not in engine.page_holders and engine._shared_pages(other) is None
    finally:
        engine.stop()


def test_a_twin_preempted_under_a_byte_budget_frees_only_its_own_pages_and_keeps_its_tokens(server):
    """n=3 greedy under a pool that cannot hold the three sequences at their longest: the twin that arrived last is
    preempted while it shares the prompt's pages; it gives up only the pages no other row holds (none is freed twice
    or while held), is read again and rejoins, and every sequence ends with generate()'s tokens and every page
    free."""
    from kimik3.engine import Engine

    # 12 tokens: 3 whole pages shared (a twin sets no page aside while it reads); 23 at the end, 6 + 3 + 3 pages
    size, pool, ids = 4, 10, list(range(5, 17))
    engine = Engine(server.model, server.tokenizer, max_requests=3, prefill_chunk=16, block_size=size,
                    max_cache_bytes=_budget(server, pool, size, 3))
    seen = []  # per preemption: the job's `n` index, the pages it shared with the first row
    preempt = engine._preempt

    def watched(job):
        paged = engine.paged
        tables = {other: paged.block_tables[row] for row, other in enumerate(engine.batch)}
        held = set(tables.get(job, []))
        others = {page for other, table in tables.items() if other is not job for page in table}
        seen.append((job.index, len(held & others)))
        preempt(job)
        free = paged.free
        assert len(set(free)) == len(free) and not others & set(free)  # nothing freed twice, nor held by another
        assert set(free) == set(range(1, pool + 1)) - others and paged.pages_held == len(others)

    engine._preempt = watched
    try:
        [jobs] = _run_jobs(lambda loop: [(engine, _request(ids, Sampling(max_tokens=12, temperature=0.0), loop, 3))])
        assert [job.new_ids for job in jobs] == [server.alone(ids, 12)] * 3
        assert (2, 3) in seen  # the last twin, sharing the prompt's 3 pages
        engine.stop()
        assert engine.paged.pages_held == 0 and sorted(engine.paged.free) == list(range(1, pool + 1))
    finally:
        engine.stop()


def test_a_twin_that_cannot_join_beside_its_first_sequence_reads_the_prompt_into_pages_of_its_own(server):
    """Under a pool that holds one sequence, the twin (which would set aside only its partial page) cannot start
    beside its first sequence: it waits, then reads the prompt itself, setting its full pages aside anew; both get
    generate()'s tokens, each prompt is written into pages whole, and no page is left held."""
    from kimik3.engine import Engine

    size, pool, ids = 4, 4, list(range(5, 19))  # 14 tokens + 2: 4 pages, the whole pool
    engine = Engine(server.model, server.tokenizer, max_requests=2, prefill_chunk=16, block_size=size,
                    max_cache_bytes=_budget(server, pool, size, 2))
    reads, read = [], engine._read  # per chunk read: the job's `n` index, whether it reads for itself, pages aside

    def watched(job):
        reads.append((job.index, job.twin is None, job.pages))
        return read(job)

    engine._read = watched
    try:
        [jobs] = _run_jobs(lambda loop: [(engine, _request(ids, Sampling(max_tokens=2, temperature=0.0), loop, 2))])
        assert [job.new_ids for job in jobs] == [server.alone(ids, 2)] * 2
        assert (1, False, 1) in reads and reads[-1] == (1, True, 4)  # its partial page aside, then its own 4
        assert engine.stats["latent_bytes_copied"] == 2 * 14 * server.model.config.mla_cache_dim * 4
        assert engine.stats["preemptions"] == 0 and engine.paged.pages_held == 0 and engine.paged.free_pages == pool
    finally:
        engine.stop()


@pytest.mark.parametrize("options, named", [
    ({"block_size": 0}, "block_size=0 (--block-size) must be a whole number of tokens >= 1"),
    ({"max_cache_bytes": 1000}, "max_cache_bytes=1,000 (--max-cache-bytes) holds no page"),
    ({"decode_step": "graphs"}, "decode_step='graphs' (--decode-step) must be one of auto, plain, fixed, captured, "
                                "compiled"),
    ({"decode_step": "captured"}, "decode_step='captured' (--decode-step captured): a CUDA graph cannot hold the "
                                  "decode step the model is not on a CUDA device; use fixed or plain"),
    ({"speculative_tokens": -1}, "speculative_tokens=-1 (--speculative-tokens) must be a whole number from 0 (off) "
                                 "to 16"),
    ({"speculative_tokens": 17}, "speculative_tokens=17 (--speculative-tokens) must be a whole number from 0 (off) "
                                 "to 16"),
], ids=["serve-block-size-not-positive", "serve-cache-budget-below-a-page", "serve-decode-step-unknown",
        "serve-decode-step-captured-off-cuda", "serve-speculative-tokens-negative",
        "serve-speculative-tokens-too-many"])
def test_a_pool_that_cannot_work_is_refused_by_flag(server, options, named):
    from kimik3.engine import Engine

    with pytest.raises(ValueError, match=re.escape(named)):
        Engine(server.model, server.tokenizer, max_requests=2, **options)


def test_a_batch_that_cannot_be_joined_ends_its_requests_by_name(server, monkeypatch):
    def refuse(self, caches, twins=None, shared=None):
        raise RuntimeError("no room to join")

    monkeypatch.setattr(server.engine.cache_code.KimiK3PagedCache, "add_rows", refuse)
    with pytest.raises(openai.InternalServerError, match="generation failed: RuntimeError: no room to join"):
        server.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    monkeypatch.undo()
    deadline = time.time() + 20  # the error reaches the client as the engine clears the batch
    while server.engine.busy() and time.time() < deadline:
        time.sleep(0.02)
    assert server.engine.busy() == 0 and server.engine.paged.pages_held == 0
    reply = server.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert reply.choices[0].text == server.tokenizer.decode(server.alone([5, 6, 7], 3))


@pytest.mark.parametrize("url, named", [
    ("https://example.com/cat.png", "only data: URLs"),
    ("file:///etc/hostname", "only data: URLs"),
    ("/etc/hostname", "only data: URLs"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png;base64,aGVsbG8=", "not an image file"),
], ids=["serve-image-https-url", "serve-image-file-url", "serve-image-path", "serve-image-bad-base64",
        "serve-image-not-an-image"])
def test_bad_images_are_named_and_nothing_is_fetched(vision_app, url, named):
    app, _ = vision_app
    message = {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                           {"type": "image_url", "image_url": {"url": url}}]}
    answer = app.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 2})
    assert answer.status_code == 400
    error = answer.json()["error"]["message"]
    assert error.startswith("messages[0].content[1].image_url: ") and named in error, error


@pytest.fixture(scope="module")
def vision_app(tmp_path_factory):
    """A folder with a vision tower (kimik3 tiny --vision) served through FastAPI's test client: the composite model
    loads its multimodal class; the engine finds its cache and store through the text model's module of the same
    copy of the code, and the folder's processor reads the images."""
    from fastapi.testclient import TestClient

    folder = tmp_path_factory.mktemp("serve_vision") / "vision"
    write_tiny_folder(folder, num_hidden_layers=2, seed=4, vision=True)
    app, engine = make_app(folder, model_name=MODEL, prefill_chunk=16)
    try:
        with TestClient(app) as client:
            yield client, engine
    finally:
        engine.stop()


def test_a_folder_with_a_vision_tower_serves_text_and_images(vision_app):
    """Text as the text model's prompt; an image in a message (a data: URL) read by the folder's processor in the
    prefill's first forward, though the prompt is read 16 tokens a step: greedy tokens equal `generate()` of the
    processor's inputs, also for a request of n=2 (one prefill, the twin copying it) and streamed."""
    client, engine = vision_app
    assert type(engine.model).__name__ == "KimiK3ForConditionalGeneration"
    messages = [{"role": "user", "content": "Describe nothing."}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0,
                                                       "logprobs": True}).json()
    prompt = encode_chat(engine.tokenizer, messages, add_generation_prompt=True, reasoning_effort="max")
    with torch.no_grad():
        want = engine.model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
    tokens = [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]
    assert tokens == engine.tokenizer.convert_ids_to_tokens(want.tolist())

    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(engine.model.name_or_path, trust_remote_code=True)

    def generated(image):
        local = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                              {"type": "image", "image": image}]}]
        inputs = processor.apply_chat_template(local, add_generation_prompt=True, tokenize=True, return_dict=True,
                                               return_tensors="pt", reasoning_effort="max")
        with torch.no_grad():
            out = engine.model.generate(**inputs, max_new_tokens=4, do_sample=False)
            first = torch.log_softmax(engine.model(**inputs).logits[0, -1].float(), dim=-1)
        return out[0, inputs["input_ids"].shape[1]:].tolist(), inputs["input_ids"][0], first

    picture = noise_image(1)
    want, prompt, first = generated(picture)
    length = len(prompt)
    rows = (prompt == engine.model.config.media_placeholder_token_id).nonzero()[:, 0].tolist()
    assert rows[0] // 16 != rows[-1] // 16  # the image's rows cross a boundary of the prompt's 16-token chunks
    sent = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                         {"type": "image_url", "image_url": {"url": data_url(picture)}}]}]
    answer = client.post("/v1/chat/completions", json={"messages": sent, "max_tokens": 4, "temperature": 0, "n": 2,
                                                       "logprobs": True, "top_logprobs": 20}).json()
    assert answer["usage"]["prompt_tokens"] == length
    top = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    ids = engine.tokenizer.convert_tokens_to_ids([entry["token"] for entry in top])
    served = torch.tensor([entry["logprob"] for entry in top])
    # the first token's 20 likeliest log-probabilities are the model's with this picture, not with another
    mine, others = (served - first[ids]).abs().max(), (served - generated(noise_image(2))[2][ids]).abs().max()
    assert mine < 1e-5 and others > 1e-3  # measured 5e-7 and 1e-2
    for choice in answer["choices"]:  # n=2: one prefill, the twin copying its cache
        assert [e["token"] for e in choice["logprobs"]["content"]] == engine.tokenizer.convert_ids_to_tokens(want)
    with client.stream("POST", "/v1/chat/completions", json={"messages": sent, "max_tokens": 4, "temperature": 0,
                                                             "stream": True, "logprobs": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    streamed = [e["token"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == engine.tokenizer.convert_ids_to_tokens(want)


def test_an_offloaded_load_serves_the_same_tokens(folder, server):
    """`--experts-offload host` (the load option): the routed experts stay in host memory behind a small device
    cache, and the served greedy tokens are those of the model held whole."""
    from fastapi.testclient import TestClient

    app, engine = make_app(folder, model_name=MODEL, experts_offload="host", experts_cache_bytes=10 ** 5)
    try:
        with TestClient(app) as client:
            answer = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
                                                          "logprobs": 0}).json()
        assert engine.model.experts_cache.moves > 0
        assert answer["choices"][0]["logprobs"]["tokens"] == \
            server.tokenizer.convert_ids_to_tokens(server.alone([5, 6, 7, 8], 4))
    finally:
        engine.stop()


@pytest.mark.parametrize("argv, named", [
    (["--experts-offload", "host"], "experts_offload='host' needs experts_cache_bytes"),
    (["--experts-cache-bytes", "lots"], "argument --experts-cache-bytes: 'lots': give a whole number of bytes or auto"),
    (["--tp-plan", "auto"], "--tp-plan auto runs under torchrun and torchrun's 1 rank(s) need it"),
], ids=["serve-offload-without-a-cache", "serve-cache-bytes-not-a-number", "serve-tp-plan-without-torchrun"])
def test_the_command_refuses_load_options_by_name(folder, capsys, argv, named):
    from kimik3.cli import main

    assert main(["serve", str(folder), *argv]) in (1, 2)
    assert named in capsys.readouterr().err


def test_the_command_serves_from_a_process_of_its_own_and_stops_cleanly(folder, server, tmp_path):
    """`kimik3 serve DIR --port P` as a user starts it (the console entry's code, a fresh interpreter, outside the
    checkout): it answers the openai client with the tokens `generate()` gives, and an interrupt (Ctrl-C) stops it
    with exit code 0 and no traceback."""
    import signal
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "kimik3.cli", "serve", str(folder), "--host", "127.0.0.1",
                                "--port", str(port), "--log-level", "warning"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while process.poll() is None and time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert process.poll() is None, process.communicate()[1][-3000:]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [folder.name]  # the folder's name by default
            reply = client.completions.create(model=folder.name, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
        assert reply.choices[0].text == server.tokenizer.decode(server.alone([5, 6, 7, 8], 4))
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
    assert process.returncode == 0 and "Traceback" not in err, err[-3000:]


def test_an_engine_without_a_tokenizer_counts_tokens(server):
    """The engine driven directly, as benchmarks/bench_serve.py drives it on a random-weight model with no
    tokenizer: its jobs get generate()'s greedy tokens (there is no text to decode, no stop sequence to look for)."""
    from kimik3.engine import Engine

    engine = Engine(server.model, None, max_requests=2, prefill_chunk=16, prefix_cache_bytes=0)

    async def one():
        job = Job([5, 6, 7, 8, 9], Sampling(max_tokens=4, temperature=0.0), asyncio.get_running_loop())
        engine.submit([job])
        while (item := await job.mailbox.get()) is not None:
            assert not isinstance(item, Exception), item
        return job

    try:
        job = asyncio.run(one())
    finally:
        engine.stop()
    assert job.new_ids == server.alone([5, 6, 7, 8, 9], 4) and job.decoded is None


def test_the_prefix_store_knows_images_by_their_pixels(vision_app):
    """A prompt with images is stored under ids whose image rows stand for the images' pixels: a later prompt with
    the same images and text up to a 512-token block (an agent's next turn) starts from the stored state there, past
    the images; one whose first image differs reuses nothing, though every id but its image rows agrees. Every
    reply's first-token log-probabilities are one process's (within 1e-5)."""
    from transformers import AutoProcessor

    client, engine = vision_app
    processor = AutoProcessor.from_pretrained(engine.model.name_or_path, trust_remote_code=True)
    words = "The river bends twice before it reaches the sea, and the ferry waits where the water runs slow. " * 9

    def ask(first, second, question):
        sent = [{"type": "image_url", "image_url": {"url": data_url(first)}},
                {"type": "image_url", "image_url": {"url": data_url(second)}},
                {"type": "text", "text": words + question}]
        local = [{"type": "image", "image": first}, {"type": "image", "image": second},
                 {"type": "text", "text": words + question}]
        answer = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": sent}], "max_tokens": 1, "temperature": 0, "logprobs": True,
            "top_logprobs": 20}).json()
        inputs = processor.apply_chat_template([{"role": "user", "content": local}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True, return_tensors="pt",
                                               reasoning_effort="max")
        with torch.no_grad():
            first_token = torch.log_softmax(engine.model(**inputs).logits[0, -1].float(), dim=-1)
        assert "choices" in answer, answer
        top = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        ids = engine.tokenizer.convert_tokens_to_ids([entry["token"] for entry in top])
        served = torch.tensor([entry["logprob"] for entry in top])
        assert (served - first_token[ids]).abs().max() < 1e-5
        rows = (inputs["input_ids"][0] == engine.media_id).nonzero()[:, 0].tolist()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"], rows

    cached, rows = ask(noise_image(11), noise_image(12), "Which is brighter?")
    assert cached == 0 and len(rows) == 40 and rows[-1] < 512  # both images' rows before the first block's end
    assert ask(noise_image(11), noise_image(12), "Which is darker?")[0] == 512  # from the first block's stored state
    assert ask(noise_image(14), noise_image(12), "Which is darker?")[0] == 0  # another first image: nothing reused


def test_short_prompts_that_come_together_are_read_in_one_forward(server):
    """Fresh prompts that fit in a chunk, taken in at one step, are read in one left-padded forward and split into
    their own caches: each job's greedy tokens are generate()'s of it alone, and a later prompt extending one of them
    starts from that prompt stored whole."""
    from kimik3.engine import Engine

    engine = Engine(server.model, server.tokenizer, max_requests=8, prefill_chunk=64)
    prompts = [[5, 6, 7], list(range(10, 30)), list(range(40, 51))]  # padded to 20 tokens: 3 x 20 <= 64

    async def run(batch):
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, Sampling(max_tokens=4, temperature=0.0), loop) for ids in batch]
        engine.submit(jobs)  # one call: taken in at one step
        for job in jobs:
            while (item := await job.mailbox.get()) is not None:
                assert not isinstance(item, Exception), item
        return jobs

    try:
        jobs = asyncio.run(run(prompts))
        assert engine.stats["prefill_forwards"] == 1 and engine.stats["prompt_tokens_computed"] == 34
        for job, ids in zip(jobs, prompts):
            assert job.new_ids == server.alone(ids, 4)
        longer = prompts[1] + [7, 8, 9]
        (job,) = asyncio.run(run([longer]))
        assert job.cached_tokens == 20 and job.new_ids == server.alone(longer, 4)
    finally:
        engine.stop()


def test_long_prompts_that_start_together_are_read_in_lockstep(server):
    """Prompts longer than a chunk that start at the same step are read in one batch, every row at the same position:
    chunks of min(prefill_chunk, the shortest remainder), a row taken out when its prompt ends. Prompts of 100, 130 and
    130 tokens under a 48-token chunk take 4 forwards (48, 48, 4, 30) where alone they take 9, and each gets
    generate()'s tokens. A row whose client goes away leaves the batch and its request ends; a forward that fails sends
    its rows to read alone, so only the prompt that fails ends its request."""
    from kimik3.engine import Engine

    vocab = server.model.config.vocab_size
    generator = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, vocab - 300, (length,), generator=generator).tolist() for length in (100, 130, 130)]
    engine = Engine(server.model, server.tokenizer, max_requests=4, prefill_chunk=48)
    try:
        forwards = engine.stats["prefill_forwards"]
        jobs = _greedy_each(engine, prompts, 5)
        assert engine.stats["prefill_forwards"] - forwards == 4
        assert [job.new_ids for job in jobs] == [server.alone(ids, 5) for ids in prompts]

        step, gone = engine._lockstep_step, []

        def leaving(group):  # the second prompt's client goes away after the batch's first chunk
            if group.position == 48 and not gone:
                gone.append(group.jobs[1])
                group.jobs[1].cancel_asked = group.jobs[1].cancelled = True
            return step(group)

        engine._lockstep_step = leaving
        async def run():
            loop = asyncio.get_running_loop()
            jobs = [Job(ids, Sampling(max_tokens=5, temperature=0.0), loop) for ids in prompts]
            for job in jobs:
                engine.submit([job])
            for job in jobs:
                while (item := await job.mailbox.get()) is not None:
                    assert not isinstance(item, Exception), item
            return jobs

        first, second, third = asyncio.run(run())
        assert gone == [second] and second.new_ids == [] and second.cancelled
        assert first.new_ids == server.alone(prompts[0], 5) and third.new_ids == server.alone(prompts[2], 5)
        engine._lockstep_step = step

        poison = 761  # a prompt holding it makes the model raise, in whatever batch it is read

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids")
            if ids is not None and bool((ids == poison).any()):
                raise RuntimeError("the model refused this prompt")

        async def poisoned():
            loop = asyncio.get_running_loop()
            bad = prompts[1][:60] + [poison] + prompts[1][61:]  # in its second chunk: the batch's first went well
            jobs = [Job(ids, Sampling(max_tokens=5, temperature=0.0), loop) for ids in (prompts[0], bad, prompts[2])]
            for job in jobs:
                engine.submit([job])
            errors = []
            for job in jobs:
                while (item := await job.mailbox.get()) is not None:
                    if isinstance(item, Exception):
                        errors.append((job, str(item)))
            return jobs, errors

        handle = server.model.register_forward_pre_hook(hook, with_kwargs=True)
        forwards = engine.stats["prefill_forwards"]
        try:
            (good, bad, other), errors = asyncio.run(poisoned())
        finally:
            handle.remove()
        assert [job for job, _ in errors] == [bad] and "the model refused this prompt" in errors[0][1]
        assert good.new_ids == server.alone(prompts[0], 5) and other.new_ids == server.alone(prompts[2], 5)
        # the batch's first forward (its second failed), then each alone from the start: 3, the bad one's first chunk
        # (its second fails), 3
        assert engine.stats["prefill_forwards"] - forwards == 1 + 3 + 1 + 3
    finally:
        engine.stop()


def test_a_cache_refuses_to_select_rows_it_does_not_hold_or_with_tokens_pending(server):
    cache = _filled(server, 9)
    for rows in ([1], [], [-1]):
        with pytest.raises(ValueError, match=re.escape(f"KimiK3Cache.select_rows({rows}): the cache holds 1 rows")):
            cache.select_rows(rows)
    snapshots = server.engine.code.KimiK3Cache(server.model.config, snapshot_interval=4)
    with torch.no_grad():
        server.model(input_ids=torch.arange(3, 12)[None], past_key_values=snapshots, use_cache=True)
    snapshots.crop(6)  # back to the snapshot at 4: 2 tokens pending for the next forward
    with pytest.raises(ValueError, match=re.escape("KimiK3Cache.select_rows: 2 tokens are pending")):
        snapshots.select_rows([0])
    assert cache.select_rows([0]).get_seq_length() == 9 and cache.batch_size == 1  # the source unchanged
    with pytest.raises(NotImplementedError, match="KimiK3PagedCache.select_rows: not supported"):
        server.engine.cache_code.KimiK3PagedCache(server.model.config).select_rows([0])


def test_prompts_read_in_lockstep_leave_the_stores_block_snapshots_in_each_rows_cache(server):
    """Two 600-token prompts read in one batch under 256-token chunks (256, 256, 88: the KDA snapshot at the store's
    512-token block end written for both rows in the batch's second forward) are each stored with their own snapshot:
    a later prompt that shares the first 520 tokens of one starts from its block at 512 and gets generate()'s tokens."""
    from kimik3.engine import Engine

    vocab = server.model.config.vocab_size
    generator = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, vocab - 300, (600,), generator=generator).tolist() for _ in range(2)]
    engine = Engine(server.model, server.tokenizer, max_requests=4, prefill_chunk=256)
    try:
        forwards = engine.stats["prefill_forwards"]
        jobs = _greedy_each(engine, prompts, 3)
        assert engine.stats["prefill_forwards"] - forwards == 3
        assert [job.new_ids for job in jobs] == [server.alone(ids, 3) for ids in prompts]
        for ids in prompts:
            later = ids[:520] + [7, 8, 9]
            [job] = _greedy_each(engine, [later], 3)
            assert job.cached_tokens == 512 and job.new_ids == server.alone(later, 3)
    finally:
        engine.stop()


def test_a_group_of_short_prompts_posts_its_first_tokens_before_the_next_group_is_read(server):
    """Four fresh prompts of 20 tokens under a 40-token chunk are read in two groups of two: the first group's
    first tokens reach their mailboxes right after its forward, before the second group's forward runs (posting
    every first token after the last group's forward made a burst's mean time to first token that of all its
    groups), and every job gets generate()'s tokens of it alone."""
    from kimik3.engine import Engine

    engine = Engine(server.model, server.tokenizer, max_requests=8, prefill_chunk=40, prefix_cache_bytes=None)
    prompts = [list(range(10 + 20 * i, 30 + 20 * i)) for i in range(4)]
    events = []
    hook = server.model.register_forward_hook(lambda module, args, output: events.append(("forward", None)))

    async def run():
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, Sampling(max_tokens=3, temperature=0.0), loop) for ids in prompts]
        for index, job in enumerate(jobs):
            def post(item, index=index, post=job.post):
                events.append(("post", index))
                post(item)
            job.post = post
        engine.submit(jobs)
        for job in jobs:
            while (item := await job.mailbox.get()) is not None:
                assert not isinstance(item, Exception), item
        return jobs

    try:
        jobs = asyncio.run(run())
    finally:
        hook.remove()
        engine.stop()
    forwards = [at for at, (kind, _) in enumerate(events) if kind == "forward"]
    first_post = {index: events.index(("post", index)) for index in range(4)}
    assert engine.stats["prefill_forwards"] == 2
    assert first_post[0] < forwards[1] and first_post[1] < forwards[1]  # the first group's, before the second group
    assert forwards[1] < first_post[2] < forwards[2] and forwards[1] < first_post[3] < forwards[2]
    for job, ids in zip(jobs, prompts):
        assert job.new_ids == server.alone(ids, 3)


def _paged_rows(code, model, prompts, size):
    """A paged cache of a row a prompt (each read alone into a growing cache, then added) and each row's first
    greedy token."""
    paged = code.KimiK3PagedCache(model.config, block_size=size, max_rows=8)
    caches, firsts = [], []
    for ids in prompts:
        cache = code.KimiK3Cache(model.config)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
        caches.append(cache)
        firsts.append(int(logits[0, -1].argmax()))
    paged.add_rows(caches)
    return paged, firsts


def test_a_fixed_shape_decode_step_computes_the_plain_steps_logits_and_touches_only_its_rows(server):
    """`KimiK3PagedCache.fixed_step` (what a CUDA graph captures): three rows padded to four and their keys to a bucket
    of more pages than the longest row holds give, step after step, the plain paged step's logits (fp32), write the
    same latents into the rows' pages, leave page 0 zero and the rows' KDA slots as the plain step leaves them; the
    padding row writes nothing a real row reads."""
    from kimik3.engine import page_bucket

    code, model, size = server.engine.cache_code, server.model, 4
    prompts = [list(range(5, 8)), list(range(10, 31)), list(range(40, 49))]
    plain, tokens = _paged_rows(code, model, prompts, size)
    fixed, _ = _paged_rows(code, model, prompts, size)
    kda = code.KimiK3PagedCache(model.config).kda_layer_indices[0]
    slot_addresses = [slot.data_ptr() for slot in fixed.layers[kda].slots]
    for rows in (2, 5):  # fewer than the cache's rows; more than its slots (3 rows took 4)
        with pytest.raises(ValueError, match=rf"KimiK3PagedStep: {rows} rows for a cache of 3 rows in 4 slots"):
            fixed.fixed_step(rows, 8)
    with pytest.raises(ValueError, match=r"KimiK3PagedStep: keys of 5 pages a row; the longest row needs 6"):
        fixed.fixed_step(4, 5)  # 21 tokens + 1 at 4 a page
    step = fixed.fixed_step(4, 6)
    for tables, named in (([[1] * 7, [2], [3]], "3 rows of up to 7 pages"), ([[1]] * 5, "5 rows of up to 1 pages")):
        with pytest.raises(ValueError, match=rf"KimiK3PagedStep.load: {named} for a step of 4 rows of 6 pages"):
            step.load(tables, [1] * len(tables))
    for _ in range(5):
        ids = torch.tensor([[token] for token in tokens])
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=plain.attention_mask(1), past_key_values=plain,
                         use_cache=True).logits[:, -1]
            fixed.reserve_pages(1)
            pages = page_bucket(max(map(len, fixed.block_tables))) + 2  # more keys than the longest row's
            step = fixed.fixed_step(4, pages)
            step.load(fixed.block_tables, [length + 1 for length in fixed.lengths])
            padded = torch.cat([ids, torch.tensor([[77]])])  # the padding row's token: any id
            got = model(input_ids=padded, past_key_values=step, use_cache=True).logits[:, -1]
            fixed.advance(1)
        torch.testing.assert_close(got[:3], want, rtol=0, atol=2e-5)
        assert fixed.block_tables == plain.block_tables and fixed.lengths == plain.lengths
        for ours, theirs in zip(fixed.mla_layers, plain.mla_layers):
            assert not ours.pages[0].any()  # the padding row's latents went nowhere
            held = torch.tensor(sorted(fixed.refs))
            torch.testing.assert_close(ours.pages[held], theirs.pages[held], rtol=0, atol=2e-5)
        for index in fixed.kda_layer_indices:
            ours, theirs = fixed.layers[index], plain.layers[index]
            for a, b in zip((*ours.conv_states, ours.recurrent_state), (*theirs.conv_states, theirs.recurrent_state)):
                torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
        tokens = [int(row.argmax()) for row in want]
    assert [slot.data_ptr() for slot in fixed.layers[kda].slots] == slot_addresses  # the same tensors throughout


def test_the_paged_batchs_kda_slots_keep_their_addresses_as_rows_come_and_go(server):
    """`KimiK3SlotKDAStateLayer`: a row leaving moves the later rows' states down a slot (their values, in order), a
    row coming takes the next slot, and the buffers are the same tensors until rows outgrow them (then the next power
    of two of slots, at most max_rows=8 unless the rows need more)."""
    code, model = server.engine.cache_code, server.model
    prompts = [list(range(5 + 10 * i, 12 + 10 * i)) for i in range(3)]
    paged, _ = _paged_rows(code, model, prompts, 4)
    index = paged.kda_layer_indices[0]
    layer = paged.layers[index]
    states = [layer.recurrent_state[row].clone() for row in range(3)]
    addresses = [slot.data_ptr() for slot in layer.slots]
    paged.remove_rows([0])
    assert layer.rows == 2 and [slot.data_ptr() for slot in layer.slots] == addresses
    torch.testing.assert_close(layer.recurrent_state, torch.stack(states[1:]), rtol=0, atol=0)
    more, _ = _paged_rows(code, model, [list(range(90, 97))] * 7, 4)  # 9 rows: past the 8 slots
    paged.add_rows([_one_row(code, model, list(range(90, 97)))])
    assert layer.rows == 3 and [slot.data_ptr() for slot in layer.slots] == addresses
    torch.testing.assert_close(layer.recurrent_state[2], more.layers[index].recurrent_state[0], rtol=0, atol=0)
    assert layer.slots[-1].shape[0] == 4  # 3 rows came first: 4 slots
    paged.add_rows([_one_row(code, model, list(range(90, 97)))])
    assert layer.rows == 4 and [slot.data_ptr() for slot in layer.slots] == addresses
    paged.add_rows([_one_row(code, model, list(range(90, 97))) for _ in range(2)])
    assert layer.rows == 6 and layer.slots[-1].shape[0] == 8 and layer.slots[-1].data_ptr() != addresses[-1]
    torch.testing.assert_close(layer.recurrent_state[:2], torch.stack(states[1:]), rtol=0, atol=0)
    paged.add_rows([_one_row(code, model, list(range(90, 97))) for _ in range(3)])
    assert layer.rows == 9 and paged.slots_held() == 9  # past max_rows: what the rows need


def _one_row(code, model, ids):
    cache = code.KimiK3Cache(model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def test_the_engines_fixed_shape_steps_give_each_requests_greedy_tokens(server):
    """The engine's decode forward at fixed shapes (`decode_step="fixed"`, what `captured` replays on CUDA): five
    requests of different lengths and max_tokens, two joining a running batch, each with `generate()`'s greedy
    tokens alone (fp32); rows were padded to the buckets; and a request whose client goes away leaves the others'
    tokens as they were."""
    from kimik3.engine import Engine

    vocab = server.model.config.vocab_size
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, vocab - 300, (n,), generator=generator).tolist() for n in (7, 40, 90, 19, 61)]
    new_tokens = [14, 5, 11, 9, 12]
    engine = Engine(server.model, server.tokenizer, max_requests=6, prefill_chunk=32, block_size=4,
                    prefix_cache_bytes=0, decode_step="fixed")
    try:
        async def run():
            loop = asyncio.get_running_loop()
            jobs = [Job(ids, Sampling(max_tokens=n, temperature=0.0), loop) for ids, n in zip(prompts, new_tokens)]
            gone = Job(prompts[2], Sampling(max_tokens=40, temperature=0.0), loop)
            for position, job in enumerate([*jobs[:3], gone, *jobs[3:]]):
                if position == 4:  # the last two join a running batch
                    while len(engine.batch) < 3:
                        await asyncio.sleep(0.002)
                    gone.cancel()
                engine.submit([job])
            for job in jobs:
                while (item := await job.mailbox.get()) is not None:
                    assert not isinstance(item, Exception), item
            while engine.busy():
                await asyncio.sleep(0.005)
            return jobs

        jobs = asyncio.run(run())
        for job, ids, n in zip(jobs, prompts, new_tokens):
            assert job.new_ids == server.alone(ids, n)
        assert engine.stats["decode_padding_rows"] > 0 and engine.stats["decode_graphs"] == 0
        assert engine.paged.pages_held == 0
        # the pool grew while rows ran (a new tensor): the steps were made again on it (a graph would read the old)
        assert engine.paged.pool_bytes_copied > 0
        assert engine.steps.addresses == tuple(tensor.data_ptr() for tensor in engine.paged.buffers())
    finally:
        engine.stop()


def test_the_decode_steps_buckets_bound_the_padding():
    """Rows padded to the next power of two (at most the slots held); keys to at most a quarter more pages than the
    longest row needs, in at most four buckets per doubling past eight pages."""
    from kimik3.engine import page_bucket, row_bucket

    assert [row_bucket(rows, 6) for rows in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    buckets = [page_bucket(pages) for pages in range(1, 5000)]
    assert all(pages <= bucket <= max(8, 1.25 * pages) for pages, bucket in zip(range(1, 5000), buckets))
    for low in (16, 64, 1024):  # (low, 2 low]: four buckets
        assert len({page_bucket(pages) for pages in range(low + 1, 2 * low + 1)}) == 4


def test_a_verify_forward_keeps_each_rows_own_tokens_as_if_only_those_were_read(server):
    """`KimiK3PagedCache.begin_verify` / `keep_verified`: three rows verify 4 tokens each in one forward and keep 1, 3
    and 4 of them; the next step's logits equal (fp32, within 2e-5) those of each row read alone in a growing cache,
    its prompt and then only its kept tokens; a row holds only the pages its kept tokens fill."""
    code, model, size = server.engine.cache_code, server.model, 4
    prompts = [list(range(5, 12)), list(range(20, 33)), list(range(40, 48))]
    verified, _ = _paged_rows(code, model, prompts, size)
    tokens = [[101, 102, 103, 104], [201, 202, 203, 204], [301, 302, 303, 304]]
    kept, follow = [1, 3, 4], [7, 8, 9]
    with pytest.raises(ValueError, match=r"keep_verified: no verify forward was begun \(begin_verify\)"):
        verified.keep_verified(kept)
    with torch.no_grad():
        verified.begin_verify()
        model(input_ids=torch.tensor(tokens), attention_mask=verified.attention_mask(4), past_key_values=verified,
              use_cache=True)
    with pytest.raises(ValueError, match=r"keep_verified\(\[1, 5, 4\]\): one count a row \(3 rows\), each in 1..4"):
        verified.keep_verified([1, 5, 4])
    verified.keep_verified(kept)
    assert verified.lengths == [len(ids) + n for ids, n in zip(prompts, kept)]
    assert [len(table) for table in verified.block_tables] == [-(-length // size) for length in verified.lengths]
    assert verified.pages_held == sum(len(table) for table in verified.block_tables)
    with torch.no_grad():
        got = model(input_ids=torch.tensor([[t] for t in follow]), attention_mask=verified.attention_mask(1),
                    past_key_values=verified, use_cache=True).logits[:, -1]
        want = []
        for ids, row, n, token in zip(prompts, tokens, kept, follow):
            cache = code.KimiK3Cache(model.config)
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
            for earlier in row[:n]:
                model(input_ids=torch.tensor([[earlier]]), past_key_values=cache, use_cache=True)
            want.append(model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1])
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=2e-5)


CYCLE = [501, 502, 503, 504, 505, 506, 507]
CYCLE_NEXT = {token: CYCLE[(i + 1) % len(CYCLE)] for i, token in enumerate(CYCLE)}


def _steer_to_cycle(module, args, kwargs, output):
    """A forward hook (with_kwargs) steering the model's logits at every position: after a token of CYCLE, all on its
    next one; elsewhere the model's own choice (which reads the cache)."""
    ids = kwargs["input_ids"][:, -output.logits.shape[1]:]  # (a prefill keeps the last position's logits)
    for row, position in (ids.unsqueeze(-1) == torch.tensor(CYCLE)).any(-1).nonzero().tolist():
        output.logits[row, position] = -1e4
        output.logits[row, position, CYCLE_NEXT[int(ids[row, position])]] = 0.0
    return output


@pytest.mark.parametrize("speculative_tokens,decode_step", [(0, "plain"), (4, "plain"), (4, "fixed")])
def test_speculative_rounds_give_each_greedy_requests_tokens_in_fewer_forwards(server, speculative_tokens,
                                                                               decode_step):
    """`speculative_tokens`: the model steered (a hook on its logits, every position) to continue a 7-token cycle
    after any token of it, so prompt lookup's proposals there are the model's own tokens; three greedy requests with
    different max_tokens, two in the cycle and one outside it (the model's own tokens, which read the cache: each
    round it keeps one of the verified tokens and goes back over the rest): each gets the tokens of `generate()`
    alone under the same steering, and with speculation on in fewer decode forwards than tokens; off, one a token. The
    fixed-shape steps (the captured steps' forward, run eagerly here) read the KDA slots a round rewrote."""
    from kimik3.engine import Engine

    prompts = [[5, 6] + CYCLE * 2 + [501, 502], [9] + CYCLE + [503], [11, 12, 13]]
    max_tokens = [23, 10, 17]
    handle = server.model.register_forward_hook(_steer_to_cycle, with_kwargs=True)
    engine = Engine(server.model, server.tokenizer, max_requests=4, prefill_chunk=64, block_size=4,
                    prefix_cache_bytes=0, speculative_tokens=speculative_tokens, decode_step=decode_step)
    try:
        jobs = _run_jobs(lambda loop: [(engine, [Job(ids, Sampling(max_tokens=n, temperature=0.0), loop)
                                                 for ids, n in zip(prompts, max_tokens)])])[0]
        stats = dict(engine.stats)
        for job, ids, n in zip(jobs, prompts, max_tokens):
            assert job.new_ids == server.alone(ids, n)
        assert engine.paged.pages_held == 0
    finally:
        engine.stop()
        handle.remove()
    if speculative_tokens:
        assert stats["speculative_rounds"] > 0 and stats["tokens_accepted"] > 0
        assert stats["decode_forwards"] < max(max_tokens) - 1  # several tokens a forward
    else:
        assert stats["speculative_rounds"] == 0 and stats["decode_forwards"] == max(max_tokens) - 1


def test_speculative_draws_keep_each_tokens_distribution():
    """`speculative_draws` (a sampling row's tokens in a round): over 20,000 rounds with fixed distributions p0, p1,
    p2 on 6 tokens and proposals [2, 4], the first token's frequencies are p0's, the second's (after the first
    proposal was kept) p1's, the third's (both kept) p2's, within four standard deviations; a rejected
    proposal never comes back as the replacement, and the round ends at it. Fails if a proposal were kept whenever it
    is likely (greedy-style), or the replacement drawn from p0 itself (the proposal twice as likely)."""
    from kimik3.engine import speculative_draws

    probs = [torch.tensor([0.1, 0.2, 0.3, 0.05, 0.25, 0.1]), torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2]),
             torch.tensor([0.4, 0.1, 0.1, 0.2, 0.1, 0.1])]
    probs[1] = probs[1] * 3  # weights, as top_p leaves them: taken relative to their sum
    generator = torch.Generator().manual_seed(0)
    counts = [torch.zeros(6) for _ in range(3)]
    for _ in range(20_000):
        tokens = list(speculative_draws(lambda i: probs[i], [2, 4], generator))
        for position, token in enumerate(tokens):
            counts[position][token] += 1
        assert len(tokens) == 3 or tokens[-1] != [2, 4][len(tokens) - 1]  # a round ends at its replacement
        assert tokens[:-1] == [2, 4][:len(tokens) - 1]
    for position in range(3):
        drawn = counts[position].sum()
        frequencies, target = counts[position] / drawn, probs[position] / probs[position].sum()
        # four standard deviations of a frequency at p = 1/2 over this position's draws (6,000 and 1,200 after it)
        assert (frequencies - target).abs().max() < 4 * (0.25 / drawn) ** 0.5, (position, frequencies, target)
    assert counts[1].sum() == pytest.approx(20_000 * 0.3, rel=0.05)  # the first proposal kept at p0's 0.3


def test_speculative_rounds_run_for_sampling_rows_beside_greedy_ones(server):
    """Sampling and greedy requests in one batch with `speculative_tokens=4`, the model steered to a 7-token cycle
    after any token of it (there its distribution is one token: every proposal kept): two sampling requests (one
    seeded) inside the cycle get the cycle's tokens in fewer forwards than tokens; a greedy request beside them gets
    `generate()`'s tokens; a sampling request outside the cycle gets tokens of the vocabulary with a seed's
    repeatability (the same run twice gives the same tokens). Off, the rounds never run."""
    from kimik3.engine import Engine

    prompts = [[5, 6] + CYCLE + [501], [9] + CYCLE + [503], [11, 12] + CYCLE + [505], [20, 21, 22]]
    samplings = [Sampling(max_tokens=20, temperature=0.8, seed=7), Sampling(max_tokens=15, temperature=1.0),
                 Sampling(max_tokens=12, temperature=0.0), Sampling(max_tokens=10, temperature=1.0, seed=3)]
    handle = server.model.register_forward_hook(_steer_to_cycle, with_kwargs=True)
    runs = []
    try:
        for speculative_tokens in (4, 4, 0):
            engine = Engine(server.model, server.tokenizer, max_requests=6, prefill_chunk=64, block_size=4,
                            prefix_cache_bytes=0, speculative_tokens=speculative_tokens)
            try:
                jobs = _run_jobs(lambda loop: [(engine, [Job(ids, sampling, loop)
                                                         for ids, sampling in zip(prompts, samplings)])])[0]
                runs.append(([job.new_ids for job in jobs], dict(engine.stats)))
                assert engine.paged.pages_held == 0
            finally:
                engine.stop()
        greedy_alone = server.alone(prompts[2], 12)
    finally:
        handle.remove()
    (tokens, stats), (again, _), (_, off) = runs

    def continuing(token, n):  # the cycle's next n tokens after `token`
        out = []
        for _ in range(n):
            token = CYCLE_NEXT[token]
            out.append(token)
        return out

    assert tokens[0] == continuing(501, 20) and tokens[1] == continuing(503, 15)
    assert tokens[2] == greedy_alone
    assert len(tokens[3]) == 10 and all(0 <= t < server.model.config.vocab_size for t in tokens[3])
    assert again[3] == tokens[3] and again[0] == tokens[0]  # seeded: the same tokens again
    assert stats["speculative_rounds"] > 0 and stats["tokens_accepted"] >= 20
    assert stats["decode_forwards"] < 20 - 1  # the longest request's 19 decoded tokens in fewer forwards
    assert off["speculative_rounds"] == 0


def test_a_sampling_row_whose_logits_go_non_finite_inside_a_round_ends_its_request_alone(server):
    """Inside a speculative round, a sampling row's logits go NaN at the position after token 505 (the model steered
    to the cycle, then poisoned there): it keeps the three proposals before that position, then its request ends
    with an error naming non-finite logits after 4 tokens, with no token drawn from the NaN; a greedy row in the same
    round keeps the cycle's tokens to its end, and the engine serves on."""
    from kimik3.engine import Engine

    def steer_then_poison(module, args, kwargs, output):
        output = _steer_to_cycle(module, args, kwargs, output)
        ids = kwargs["input_ids"][:, -output.logits.shape[1]:]
        output.logits[ids == 505] = float("nan")
        return output

    prompts = [[5, 6] + CYCLE + [501], [9] + CYCLE + [501]]
    samplings = [Sampling(max_tokens=10, temperature=0.9, seed=1), Sampling(max_tokens=3, temperature=0.0)]
    handle = server.model.register_forward_hook(steer_then_poison, with_kwargs=True)
    engine = Engine(server.model, server.tokenizer, max_requests=2, prefill_chunk=64, block_size=4,
                    prefix_cache_bytes=0, speculative_tokens=4)
    try:
        jobs, outcomes = _outcomes(engine, lambda loop: [Job(ids, sampling, loop)
                                                         for ids, sampling in zip(prompts, samplings)])
        failed, good = outcomes
        assert failed[:-1] == [502, 503, 504, 505] and isinstance(failed[-1], ServeError)
        assert "non-finite values after 4 tokens" in failed[-1].message and jobs[0].finish_reason == "error"
        assert good == [502, 503, 504] and jobs[1].finish_reason == "length"
        assert engine.stats["speculative_rounds"] >= 1
    finally:
        handle.remove()
    try:
        [after] = _greedy_each(engine, [prompts[0][:4]], 4)
        assert after.new_ids == server.alone(prompts[0][:4], 4)  # the engine serves on
    finally:
        engine.stop()
