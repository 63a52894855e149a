"""`kimik3 serve DIR` (and `python -m kimik3.serve DIR`): an OpenAI-compatible HTTP server for any folder this project
loads (docs/design.md, Serving). FastAPI and uvicorn, the web stack `transformers serve` uses; the routes
`/v1/chat/completions` (streaming and not), `/v1/completions`, `/v1/models` and `/health`. A request is checked here
and handed to the engine (kimik3/engine.py: continuous batching on the paged hybrid cache) as jobs, one per `n`,
whose tokens come back through their mailboxes. The K3 chat format (kimik3.chat_format) renders messages, tools,
`tool_choice` and `reasoning_effort` to ids (message text never becomes a control token), and the reply is split
into `reasoning_content`, `content` and `tool_calls` (`Reply`)."""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from kimik3.engine import Engine, Job, Sampling, ServeError

MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_N = 8
MAX_TOP_LOGPROBS = 20


def _number(body: dict, name: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ServeError(400, f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}", name)
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
        raise ServeError(400, f"{name}={value} is outside {bounds}", name)
    return kind(value)


def parse_sampling(body: dict, default_max_tokens: int, chat: bool) -> tuple[Sampling, int]:
    temperature = _number(body, "temperature", 1.0, float, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, float, 0.0, 1.0, low_open=True)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, int, 1)
    seed = _number(body, "seed", None, int)
    n = _number(body, "n", 1, int, 1, MAX_N)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str) and stop:
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4):
        raise ServeError(400, "stop must be a non-empty string or a list of at most 4 non-empty strings", "stop")
    if chat:  # chat: logprobs true/false, top_logprobs 0..20
        if not isinstance(body.get("logprobs", False), bool):
            raise ServeError(400, f"logprobs must be true or false, got {body['logprobs']!r}", "logprobs")
        top = _number(body, "top_logprobs", 0, int, 0, MAX_TOP_LOGPROBS)
        if top and not body.get("logprobs"):
            raise ServeError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = top if body.get("logprobs") else None
    else:  # completions: logprobs an integer 0..5, the most likely tokens at each position
        logprobs = _number(body, "logprobs", None, int, 0, 5)
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                    logprobs=logprobs), n


class App:
    """The HTTP side: the routes, each request checked, turned into jobs, and its jobs' tokens into OpenAI's
    responses (streamed as server-sent events with `"stream": true`)."""

    def __init__(self, engine: Engine, model_name: str, default_max_tokens: int = 256, processor=None,
                 no_images: str = "this model has no vision tower"):
        self.engine, self.model_name, self.default_max_tokens = engine, model_name, default_max_tokens
        self.tokenizer = engine.tokenizer
        self.processor, self.no_images = processor, no_images  # images in messages, or why not

    def build(self):
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, StreamingResponse

        api = FastAPI(title="kimik3 serve")

        @api.exception_handler(ServeError)
        async def serve_error(request, error: ServeError):
            return JSONResponse(error.body(), status_code=error.status)

        @api.exception_handler(RequestValidationError)
        async def validation_error(request, error):
            return JSONResponse(ServeError(400, f"the request is malformed: {error}").body(), status_code=400)

        @api.get("/health")
        async def health():
            alive = self.engine.thread.is_alive()
            steps = self.engine.steps
            errors = {"capture_error": None, "compile_error": None} if steps is None else \
                {"capture_error": steps.capture_error, "compile_error": steps.compile_error}
            # what the decode steps run as now: a capture or a compile that failed fell back by a step
            running = "fixed" if errors["capture_error"] else "captured" if errors["compile_error"] else \
                self.engine.decode_step
            return JSONResponse({"status": "ok" if alive else "engine stopped", "model": self.model_name,
                                 "busy": self.engine.busy(), "stats": dict(self.engine.stats),
                                 "decode_step": running, **errors}, status_code=200 if alive else 503)

        @api.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "kimik3",
                                                "created": int(time.time())}]}

        async def body_of(request: Request) -> dict:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ServeError(400, f"the request body is not valid JSON: {error}") from None
            if not isinstance(body, dict):
                raise ServeError(400, f"the request body must be a JSON object, got {type(body).__name__}")
            model = body.get("model")
            if model is not None and model != self.model_name:
                raise ServeError(404, f"model {model!r} not found: this server serves {self.model_name!r}", "model",
                                 kind="model_not_found")
            return body

        @api.post("/v1/completions")
        async def completions(request: Request):
            body = await body_of(request)
            return await self.respond(request, body, self.prompt_ids(body), False, StreamingResponse)

        @api.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            body = await body_of(request)
            ids, images = self.chat_ids(body)
            return await self.respond(request, body, ids, True, StreamingResponse, images)

        return api

    def prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list, as the openai client may send it
        if isinstance(prompt, str) and prompt:
            # plain text: markup in it stays text, never a control token
            return self.tokenizer.encode(prompt, add_special_tokens=False, split_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            vocab = self.engine.text_config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ServeError(400, f"prompt holds the token id {bad}, outside [0, {vocab})", "prompt")
            return list(prompt)
        raise ServeError(400, "prompt must be one non-empty string or one non-empty list of token ids", "prompt")

    def chat_ids(self, body: dict) -> tuple[list[int], dict | None]:
        """The chat prompt's ids, and its images (pixel_values, grid_thws; None without): messages rendered by the K3
        chat format, with images by the folder's processor (the same template; each image's placeholder rows
        expanded)."""
        from kimik3.chat_format import encode_chat

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ServeError(400, "messages must be a non-empty list of message objects", "messages")
        messages, images = self.read_images(messages)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ServeError(400, "tools must be a list of tool objects", "tools")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none", "required"):
            raise ServeError(400, f"tool_choice must be 'auto', 'none' or 'required', got {tool_choice!r}",
                             "tool_choice")
        options = dict(tools=[t.get("function", t) for t in tools or []] or None, add_generation_prompt=True,
                       reasoning_effort=body.get("reasoning_effort", "max"),
                       tool_choice=None if tool_choice in (None, "auto") else tool_choice,
                       response_format=body.get("response_format"))
        try:
            if not images:
                return encode_chat(self.tokenizer, messages, **options), None
            inputs = self.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                        return_tensors="pt", **options)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ServeError(400, f"messages: {error}", "messages") from None
        return inputs["input_ids"][0].tolist(), {key: inputs[key] for key in ("pixel_values", "grid_thws")}

    def read_images(self, messages: list[dict]) -> tuple[list[dict], int]:
        """The messages with each `image_url` part as the processor's image part (the picture decoded), and how
        many there were. Only `data:` URLs are read: the server fetches nothing and opens no file a client names."""
        from kimik3.modeling.image_processing_kimi_k3 import load_image_source

        count, out = 0, []
        for position, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, list):
                out.append(message)
                continue
            parts = []
            for index, part in enumerate(content):
                where = f"messages[{position}].content[{index}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in (None, "text"):
                    parts.append(part)
                    continue
                if kind != "image_url":
                    raise ServeError(400, f"{where}: parts of type {kind!r} are not served (text and image_url are)",
                                     "messages")
                if self.processor is None:
                    raise ServeError(400, f"{where}: an image, but {self.no_images}", "messages")
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url[:5].lower() == "data:":
                    raise ServeError(400, f"{where}.image_url: only data: URLs (base64) are read; the server fetches "
                                          "no URL and opens no file a request names", "messages")
                try:
                    picture = load_image_source(url)
                except ValueError as error:
                    raise ServeError(400, f"{where}.image_url: {str(error).removeprefix('Kimi K3 image processor: ')}",
                                     "messages") from None
                parts.append({"type": "image", "image": picture})
                count += 1
            out.append({**message, "content": parts})
        return out, count

    async def respond(self, request, body: dict, ids: list[int], chat: bool, stream_response, images=None):
        sampling, n = parse_sampling(body, self.default_max_tokens, chat)
        if len(ids) + sampling.max_tokens > self.engine.max_context:
            raise ServeError(400, f"the prompt's {len(ids):,} tokens and max_tokens {sampling.max_tokens:,} exceed "
                                  f"the context of {self.engine.max_context:,} tokens (--max-model-len)", "max_tokens",
                             kind="context_length_exceeded")
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, sampling, loop)]
        jobs += [Job(ids, sampling, loop, index, twin=jobs[0]) for index in range(1, n)]
        jobs[0].images = images  # the twins copy the first job's cache after the prompt: the images run once
        self.engine.submit(jobs)
        reply = Reply(self, jobs, chat, len(ids))
        if body.get("stream"):
            return stream_response(reply.events(request, bool((body.get("stream_options") or {}).get(
                "include_usage"))), media_type="text/event-stream")
        try:
            for job in jobs:
                await reply.drain(request, job)
        finally:
            reply.let_go()
        return reply.whole()


class Reply:
    """One request's jobs turned into OpenAI's response objects: whole, or as server-sent events."""

    def __init__(self, app: App, jobs: list[Job], chat: bool, prompt_tokens: int):
        self.app, self.jobs, self.chat, self.prompt_tokens = app, jobs, chat, prompt_tokens
        self.tokenizer = app.tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + jobs[0].id
        self.created = int(time.time())

    def let_go(self) -> None:
        """The response is done with its jobs (sent, failed, or its client gone): the unfinished ones are cancelled,
        and the engine frees their rows at its next step."""
        for job in self.jobs:
            if job.finish_reason is None:
                job.cancel()

    def text(self, job: Job) -> str:
        """What the job generated, up to its first stop sequence."""
        return job.visible(ended=True)

    def fields(self, job: Job, parser=None) -> dict:
        """The reply as OpenAI's assistant message fields: in the K3 format the generation prompt opens the think
        section, so the text is `reasoning_content` until the model opens its response (`content`); its tool calls
        are `tool_calls` (arguments as JSON text). Markup the parser cannot follow (a malformed tool block) leaves
        the raw text as `content`. `parser`: a `ReplyParser` the stream has fed the text so far (else the whole
        text is parsed)."""
        from kimik3.chat_format import ChatFormatError, parse_reply

        text = parser.text if parser is not None else self.text(job)
        try:
            reply = parser.reply() if parser is not None else parse_reply(text)
        except ChatFormatError:
            return {"content": text}
        out = {"content": reply.response, "reasoning_content": reply.reasoning}
        if reply.tool_calls:
            out["tool_calls"] = [
                {"id": f"call_{job.id}_{call.index}", "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments if isinstance(call.arguments, str)
                              else json.dumps(call.arguments, ensure_ascii=False)}}
                for call in reply.tool_calls]
        return out

    def finish(self, job: Job) -> str:
        if job.finish_reason == "stop" and self.chat and self.fields(job).get("tool_calls"):
            return "tool_calls"
        return job.finish_reason if job.finish_reason in ("stop", "length") else "stop"

    def logprobs(self, job: Job, start: int = 0, end: int | None = None):
        if job.sampling.logprobs is None:
            return None
        ids, entries = job.new_ids[start:end], job.logprobs[start:end]
        piece = self.tokenizer.convert_ids_to_tokens
        if self.chat:
            return {"content": [{"token": piece(token), "logprob": logprob, "bytes": None,
                                 "top_logprobs": [{"token": piece(t), "logprob": lp, "bytes": None} for t, lp in top]}
                                for token, (logprob, top) in zip(ids, entries)]}
        return {"tokens": [piece(t) for t in ids], "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [{piece(t): lp for t, lp in top} for _, top in entries], "text_offset": None}

    def usage(self) -> dict:
        completion = sum(len(job.new_ids) for job in self.jobs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.jobs[0].cached_tokens}}

    def whole(self) -> dict:
        choices = []
        for job in self.jobs:
            choice = {"index": job.index, "finish_reason": self.finish(job), "logprobs": self.logprobs(job)}
            if self.chat:
                fields = self.fields(job)
                choice["message"] = {"role": "assistant", **{k: v for k, v in fields.items() if v}}
                choice["message"].setdefault("content", None if fields.get("tool_calls") else "")
            else:
                choice["text"] = self.text(job)
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.app.model_name, "choices": choices, "usage": self.usage()}

    async def drain(self, request, job: Job) -> None:
        """Waits for the job's end; a client gone away cancels it (the engine frees its slot at its next step)."""
        while True:
            try:
                item = await asyncio.wait_for(job.mailbox.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    raise asyncio.CancelledError from None
                continue
            if isinstance(item, ServeError):
                raise item
            if item is None:
                return

    def _chunk(self, job: Job | None, delta: dict | None = None, finish: str | None = None, logprobs=None,
               usage: dict | None = None) -> str:
        choices = []
        if job is not None:
            if self.chat:
                choice = {"index": job.index, "delta": delta or {}, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": job.index, "text": (delta or {}).get("content", ""), "finish_reason": finish,
                          "logprobs": logprobs}
            choices.append(choice)
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.app.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"

    async def events(self, request, include_usage: bool = False):
        """Server-sent events: each job's deltas as its tokens come (chat: reasoning and response text as
        `reasoning_content` and `content`, each tool call once whole), its finish, then [DONE]. A client that goes
        away cancels every job of the request: the engine frees their slots at its next step."""
        from kimik3.chat_format import ChatFormatError, ReplyParser

        try:
            for job in self.jobs:
                if self.chat:
                    yield self._chunk(job, {"role": "assistant", "content": ""})
                sent = {"content": "", "reasoning_content": ""}
                calls_sent, tokens_sent = 0, 0
                parser = ReplyParser() if self.chat else None  # fed what becomes visible, once
                while True:
                    item = await job.mailbox.get()
                    if isinstance(item, ServeError):
                        yield "data: " + json.dumps(item.body()) + "\n\n"
                        return
                    end = item is None
                    text = job.visible(end)
                    if parser is None:
                        fields = {"content": text}
                    else:
                        try:
                            parser.feed(text[len(parser.text):])
                        except ChatFormatError:
                            pass  # malformed markup: `fields` gives the raw text, as for the whole reply
                        fields = self.fields(job, parser)
                    delta = {}
                    for key in sent:
                        now = fields.get(key) or ""
                        # a partial character or tag at the end waits for the next token
                        if now.startswith(sent[key]) and len(now) > len(sent[key]) and \
                                (end or not now.endswith("\ufffd")):
                            delta[key], sent[key] = now[len(sent[key]):], now
                    calls = fields.get("tool_calls") or []
                    if len(calls) > calls_sent:
                        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)][calls_sent:]
                        calls_sent = len(calls)
                    logprobs = None
                    if job.sampling.logprobs is not None and (delta or end) and len(job.new_ids) > tokens_sent:
                        logprobs = self.logprobs(job, tokens_sent)
                        tokens_sent = len(job.new_ids)
                    if delta or logprobs:
                        yield self._chunk(job, delta, logprobs=logprobs)
                    if end:
                        break
                yield self._chunk(job, finish=self.finish(job))
            if include_usage:
                yield self._chunk(None, usage=self.usage())
            yield "data: [DONE]\n\n"
        finally:
            self.let_go()


def tensor_parallel_options(plan: str) -> dict:
    """`from_pretrained`'s options for the tensor-parallel `plan` over this process group: a `DistributedConfig`
    where the installed transformers takes the plan there (a bare `tp_plan=` is deprecated from 5.18 on), else
    `tp_plan`."""
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    if "tp_plan" in getattr(DistributedConfig, "__dataclass_fields__", {}):
        return {"distributed_config": DistributedConfig(tp_size=dist.get_world_size(), tp_plan=plan)}
    return {"tp_plan": plan}


def make_app(directory, model_name: str | None = None, max_requests: int = 16, prefill_chunk: int = 512,
             max_context: int | None = None, default_max_tokens: int = 256, prefix_cache_bytes: int | None = 1 << 30,
             max_cache_bytes: int | None = None, device: str | None = None, block_size: int = 64,
             decode_step: str = "auto", speculative_tokens: int = 0, **load_options):
    """(the FastAPI app, its engine) serving the folder `directory`, loaded as `kimik3 chat` loads it (the Auto
    classes with the folder's own code; `load_options` to `from_pretrained`)."""
    from kimik3.chat import load_chat

    load_options = {k: v for k, v in load_options.items() if v is not None}
    if "tp_plan" in load_options:
        load_options.update(tensor_parallel_options(load_options.pop("tp_plan")))
    tokenizer, model = load_chat(directory, **load_options)
    if device:
        model.to(device)
    engine = Engine(model, tokenizer, max_requests=max_requests, prefill_chunk=prefill_chunk, max_context=max_context,
                    prefix_cache_bytes=prefix_cache_bytes, max_cache_bytes=max_cache_bytes, block_size=block_size,
                    decode_step=decode_step, speculative_tokens=speculative_tokens)
    processor, no_images = None, "this model has no vision tower"
    if getattr(model, "vision_tower", None) is not None:
        from kimik3.chat import ChatFolderError, check_vision_folder

        try:
            check_vision_folder(Path(directory))
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(directory, trust_remote_code=True)
        except (ChatFolderError, OSError, ValueError) as error:  # text is still served; images say why not
            no_images = f"the folder's processor did not load ({error})"
    name = model_name or Path(directory).resolve().name
    return App(engine, name, default_max_tokens, processor, no_images).build(), engine


def main(argv=None) -> int:
    from kimik3.arguments import add_serve_arguments

    parser = argparse.ArgumentParser(prog="kimik3 serve", description=__doc__.split("\n\n")[0])
    add_serve_arguments(parser)
    return run(parser.parse_args(argv))


def run(args) -> int:
    import os

    import uvicorn

    from kimik3.chat import ChatFolderError

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if (args.tp_plan is None) != (ranks == 1):
        print(f"kimik3 serve: error: --tp-plan auto runs under torchrun and torchrun's {ranks} rank(s) need it: "
              "torchrun --nproc-per-node N -m kimik3.serve DIR --tp-plan auto", file=sys.stderr)
        return 2
    if args.tp_plan is not None and args.device is not None:
        print("kimik3 serve: error: --device with --tp-plan: each rank takes its own GPU (LOCAL_RANK)",
              file=sys.stderr)
        return 2
    if ranks > 1:
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        app, engine = make_app(args.directory, model_name=args.model_name, max_requests=args.max_requests,
                               prefill_chunk=args.prefill_chunk, max_context=args.max_model_len,
                               default_max_tokens=args.max_tokens, prefix_cache_bytes=args.prefix_cache_bytes,
                               max_cache_bytes=args.max_cache_bytes, block_size=args.block_size,
                               decode_step=args.decode_step, speculative_tokens=args.speculative_tokens,
                               experts_cache_bytes=args.experts_cache_bytes,
                               device=args.device, dtype=args.dtype, experts_offload=args.experts_offload,
                               experts_compute=args.experts_compute, tp_plan=args.tp_plan)
    except (ChatFolderError, ValueError, OSError) as error:  # a folder or load option refused by name
        print(f"kimik3 serve: error: {error}", file=sys.stderr)
        return 1
    if not engine.leader:  # a rank that computes: it follows rank 0's steps until rank 0 stops
        import signal

        # torchrun hands Ctrl-C to every rank: rank 0 stops the engine, which tells this one to end
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.thread.join()
        return 0
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
