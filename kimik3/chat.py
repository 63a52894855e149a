"""`kimik3 chat DIR`: a conversation -> the chat template -> `generate` (stopping at `<|end_of_msg|>`) -> text streamed
through `TextStreamer`, then the reply parsed into reasoning / response / tool calls and echoed back into the
conversation as the template renders an earlier assistant turn (its reasoning kept: kimik3/chat_format.py).

A long prompt is prefilled through the cache in chunks (`prefill_chunk_size` tokens). In one forward the MLA layers'
expanded attention runs over the whole prompt: on CPU, SDPA's math kernel materialises f32 [heads, T, T] scores and
their softmax, memory that grows with the square of the prompt (the tiny model: 0.7 GB at 4K tokens, 2.6 GB at 8K,
so tens of GB at a 100 KB prompt). A chunk continuing a cache instead attends to the cached latents expanded block
by block (`mla_prefill_block_size`, merged by log-sum-exp: docs/architecture.md, Gated NoPE MLA), so the workspace is
bounded by chunk x block whatever the prompt's length."""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kimik3.chat_format import ParsedReply, parse_reply

END_OF_MSG = "<|end_of_msg|>"
PREFILL_CHUNK_SIZE = 2048
EXIT_COMMANDS = ("/exit", "/quit")


class ChatFolderError(ValueError):
    pass


class ChatInputError(ValueError):
    """A user input kimik3 chat cannot use (prompt, tools file, image, length); the message names it."""


@dataclass
class ChatResult:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str  # the generated ids decoded, special tokens kept (what was streamed)
    reply: ParsedReply | None  # None when the text is not well-formed XTML (a random model, a cut-off reply)
    message: dict = field(default_factory=dict)  # the reply as the assistant message the next turn's prompt holds
    prefill_chunks: list[int] = field(default_factory=list)  # tokens of each chunk prefilled before generate()


def load_chat(directory, vision: bool = False, **load_options):
    """Tokenizer and model of a folder (trust_remote_code: the folder's own code; `load_options` go to
    `from_pretrained`, e.g. dtype, experts_offload); with `vision`, also its processor (a model with a vision tower is
    required)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ChatFolderError(f"{directory}: no config.json (not a model folder)")
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tiktoken.model")):
        raise ChatFolderError(f"{directory}: no tokenizer (tiktoken.model or tokenizer.json); `kimik3 tiny` writes "
                              "one, `kimik3 convert` copies the release's")
    from kimik3.modeling.files_kimi_k3 import read_json

    # transformers reads it first, and a file it cannot parse (100,000 nested arrays) failed there in a RecursionError
    read_json(directory / "config.json", error=lambda where, message: ChatFolderError(f"{where}: {message}"))
    _check_our_code(directory)
    if vision:
        check_vision_folder(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **load_options).eval()
    if not vision:
        return tokenizer, model
    if getattr(model, "vision_tower", None) is None:
        raise ChatFolderError(f"{directory}: --image needs a model with a vision tower; this checkpoint holds no "
                              "vision_tower.* tensors")
    from transformers import AutoProcessor

    return tokenizer, model, AutoProcessor.from_pretrained(directory, trust_remote_code=True)


def _check_our_code(directory: Path):
    """The chat loads the folder's own code (trust_remote_code). A release folder carries Moonshot's code under our
    files' names, written for transformers 4.57 on Hopper GPUs; its failure would name neither the folder nor the way
    out. A folder of ours carries the modules a save writes (saving_kimi_k3.CARRIED_MODULES)."""
    from kimik3.modeling.saving_kimi_k3 import CARRIED_MODULES

    if any((directory / name).is_file() for name in ("modeling_kimi_linear.py", "configuration_kimi_k3.py")) and \
            not all((directory / name).is_file() for name in CARRIED_MODULES):
        raise ChatFolderError(
            f"{directory}: this is the release's folder, with the release's own code (for transformers 4.57 on "
            f"Hopper GPUs), which `kimik3 chat` would run; make a folder this project loads: `kimik3 adopt "
            f"{directory} K3_DIR` (kilobytes: our code and links to the release's shards) or `kimik3 convert "
            f"{directory} K3_DIR` (a copy in our layout), then `kimik3 chat K3_DIR`")


def check_vision_folder(directory: Path):
    """Before any weight is read: the config must describe a vision tower and the folder hold a processor."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatFolderError(f"{directory / 'config.json'}: cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        raise ChatFolderError(f"{directory}: --image needs a model with a vision tower; its config.json describes "
                              "none (a text-only model: no vision_config)")
    if not (directory / "processor_config.json").is_file() and not (directory / "preprocessor_config.json").is_file():
        raise ChatFolderError(f"{directory}: --image needs the folder's image processor settings "
                              "(processor_config.json or preprocessor_config.json), and there are none")


def load_tools(path) -> list[dict]:
    """A JSON file of tool declarations: a list of `{"type": "function", "function": {"name": ..., "description": ...,
    "parameters": {...}}}` (OpenAI's form, what the template declares), or of bare `{"name": ..., ...}` functions."""
    path = Path(path)
    if not path.is_file():
        kind = "is a folder" if path.is_dir() else "no such file" if not path.exists() else "is not a regular file"
        raise ChatInputError(f"--tools {path}: {kind}")
    try:
        tools = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ChatInputError(f"--tools {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                             f"{exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ChatInputError(f"--tools {path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ChatInputError(f"--tools {path}: nested too deeply to parse (JSON arrays or objects inside each other "
                             "beyond Python's recursion limit; a tool declaration nests a few levels)") from None
    example = '{"type": "function", "function": {"name": "...", "parameters": {...}}}'
    if not isinstance(tools, list) or not tools:
        found = "an empty list" if tools == [] else f"a JSON {type(tools).__name__}"
        raise ChatInputError(f"--tools {path}: must hold a non-empty JSON list of tool declarations like {example}, "
                             f"not {found}")
    for index, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatInputError(f"--tools {path}: tool {index} is not a declaration with a name (expected "
                                 f"{example}); found {json.dumps(tool)[:120]}")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise ChatInputError(f"--tools {path}: tool {index} ({function['name']}): `parameters` must be a JSON "
                                 "Schema object")
    return tools


def read_prompt_file(path) -> str:
    path = Path(path)
    if not path.is_file():
        raise ChatInputError(f"--prompt-file {path}: {'is a folder' if path.is_dir() else 'no such file'}")
    return utf8_text(path.read_bytes(), f"--prompt-file {path}")


def utf8_text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatInputError(f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); kimik3 "
                             "chat reads UTF-8") from None


def checked_text(text: str, where: str) -> str:
    """Text that came through the OS as str (command-line arguments, a terminal): bytes that were not UTF-8 arrive
    as lone surrogates (surrogateescape), which the tokenizer cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = text.encode("utf-8", "surrogateescape")
        offset = len(text[:exc.start].encode("utf-8", "surrogateescape"))
        raise ChatInputError(f"{where}: not UTF-8 text (byte 0x{raw[offset]:02x} at offset {offset}); kimik3 chat "
                             "reads UTF-8") from None
    return text


def user_message(text: str, image=None) -> dict:
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def assistant_message(reply: ParsedReply | None, text: str, tokenizer) -> dict:
    """The reply as the assistant message of the history: reasoning (the template keeps it for earlier turns),
    response and tool calls. A reply that is not well-formed XTML becomes its text without markup."""
    if reply is None:
        return {"role": "assistant", "content": tokenizer.decode(tokenizer.encode(text, add_special_tokens=False),
                                                                 skip_special_tokens=True)}
    message = {"role": "assistant", "content": reply.response, "reasoning_content": reply.reasoning}
    if reply.tool_calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in reply.tool_calls]
    return message


def _has_images(messages) -> bool:
    return any(isinstance(m.get("content"), list) and any(part.get("type") == "image" for part in m["content"])
               for m in messages)


def _model_code(model, module: str):
    """A module of the model's own code (`cache_kimi_k3`, `compat_kimi_k3`), next to its class's module: the installed
    package's, or a model folder's copy loaded with trust_remote_code (whose cache and cache field it must use)."""
    package = type(model).__module__.rpartition(".")[0]
    return sys.modules[f"{package}.{module}"]


def prefill_in_chunks(model, input_ids, chunk_size: int, image_inputs: dict | None = None, first_chunk_end: int = 0):
    """Run all but the last prompt token through a new cache, `chunk_size` tokens a forward (the first chunk reaches
    at least `first_chunk_end`: images are read in the prefill's first forward). Returns (cache, chunk lengths)."""
    import torch

    cache = _model_code(model, "cache_kimi_k3").KimiK3Cache(model.config.get_text_config())
    total = input_ids.shape[1] - 1  # generate() runs the last token, and returns the first new one from it
    chunks, start = [], 0
    with torch.no_grad():
        while start < total:
            end = min(total, max(start + chunk_size, first_chunk_end if start == 0 else 0))
            extra = image_inputs if start == 0 and image_inputs else {}
            model(input_ids=input_ids[:, start:end], cache=cache, use_cache=True, logits_to_keep=1, **extra)
            chunks.append(end - start)
            start = end
    return cache, chunks


def chat(tokenizer, model, prompt, max_new_tokens: int = 64, reasoning_effort: str = "max",
         do_sample: bool = False, streamer=None, tools: list | None = None, processor=None,
         prefill_chunk_size: int = PREFILL_CHUNK_SIZE, note=None, **generate_kwargs) -> ChatResult:
    """One assistant turn: `prompt` is the user's text (a one-turn conversation) or the whole conversation (a list
    of messages; image parts need `processor`). Generation stops at `<|end_of_msg|>` (the end of an assistant
    message; `[EOS]` ends a document and is not what a chat turn emits). A prompt longer than `prefill_chunk_size`
    tokens is prefilled in chunks through the cache; `note` (a callable) hears when the reply is shortened to fit
    `max_position_embeddings`."""
    import torch

    messages = [user_message(prompt)] if isinstance(prompt, str) else list(prompt)
    template_kwargs = dict(add_generation_prompt=True, reasoning_effort=reasoning_effort, tools=tools or None,
                           tokenize=True, return_dict=True)
    image_inputs = {}
    if _has_images(messages):
        if processor is None:
            raise ChatInputError("the conversation has image parts: pass the folder's processor (load_chat(..., "
                                 "vision=True))")
        inputs = processor.apply_chat_template(messages, return_tensors="pt", **template_kwargs)
        input_ids = inputs["input_ids"]
        image_inputs = {key: inputs[key] for key in ("pixel_values", "grid_thws") if key in inputs}
    else:
        input_ids = torch.tensor([tokenizer.apply_chat_template(messages, **template_kwargs)["input_ids"]])
    prompt_length = input_ids.shape[1]
    limit = model.config.get_text_config().max_position_embeddings
    if prompt_length >= limit:
        raise ChatInputError(f"the prompt is {prompt_length:,} tokens, but the model's max_position_embeddings is "
                             f"{limit:,}: no room for a reply; shorten the prompt" +
                             (" (or start a new conversation)" if len(messages) > 1 else ""))
    if prompt_length + max_new_tokens > limit:
        max_new_tokens = limit - prompt_length
        if note is not None:
            note(f"the reply is limited to {max_new_tokens:,} tokens: the prompt is {prompt_length:,} tokens of the "
                 f"model's max_position_embeddings {limit:,}")

    chunks = []
    kwargs = dict(image_inputs)
    if prompt_length - 1 > prefill_chunk_size:
        media_id = getattr(model.config, "media_placeholder_token_id", None)
        last_image_token = 0
        if image_inputs and media_id is not None:
            positions = (input_ids[0] == media_id).nonzero()
            last_image_token = int(positions[-1]) + 1 if len(positions) else 0
        cache, chunks = prefill_in_chunks(model, input_ids, prefill_chunk_size, image_inputs, last_image_token)
        kwargs = {_model_code(model, "compat_kimi_k3").CACHE_FIELD: cache}
    stop = tokenizer.convert_tokens_to_ids(END_OF_MSG)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=do_sample, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id,
                             streamer=streamer, **kwargs, **generate_kwargs)
    new_ids = out[0, prompt_length:].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=False)
    from kimik3.chat_format import ChatFormatError

    try:
        reply = parse_reply(text)
    except ChatFormatError:
        reply = None
    return ChatResult(input_ids[0].tolist(), new_ids, text, reply, assistant_message(reply, text, tokenizer), chunks)


def user_turns(stdin, interactive: bool, ask=None):
    """User messages from stdin, one a line (blank lines skipped), until end of input or /exit. Raw bytes are decoded
    as UTF-8, and a line that is not names its number."""
    number = 0
    while True:
        number += 1
        if interactive:
            try:
                line = checked_text(input(ask or "> "), f"stdin, line {number}")
            except EOFError:
                return
            except UnicodeDecodeError as exc:
                raise ChatInputError(f"stdin, line {number}: not UTF-8 text ({exc.reason}); kimik3 chat reads "
                                     "UTF-8") from None
        else:
            buffer = getattr(stdin, "buffer", None)
            raw = buffer.readline() if buffer is not None else stdin.readline()
            if not raw:
                return
            line = utf8_text(raw, f"stdin, line {number}") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if line.strip() in EXIT_COMMANDS:
            return
        if line.strip():
            yield line


class Conversation:
    """The messages of a chat session: an optional system prompt, then user and assistant turns."""

    def __init__(self, system: str | None = None):
        self.messages = [{"role": "system", "content": system}] if system else []

    def turn(self, tokenizer, model, text: str, image=None, **chat_kwargs) -> ChatResult:
        pending = self.messages + [user_message(text, image)]
        result = chat(tokenizer, model, pending, **chat_kwargs)
        self.messages = pending + [result.message]
        return result


def run_chat(directory, prompt: str | None = None, max_new_tokens: int = 64, reasoning_effort: str = "max",
             say=print, system: str | None = None, tools_file=None, image=None, stdin=None,
             prefill_chunk_size: int = PREFILL_CHUNK_SIZE, warn=None):
    """The chat program: one turn for `prompt`, else a loop over the user turns read from `stdin` (interactive on a
    terminal). `image` (a path or URL) is attached to the first turn. Bad input raises ChatInputError /
    ChatFolderError before the model is loaded where it can be checked then. Returns the turns' results."""
    from transformers import TextStreamer

    warn = warn or (lambda message: print(f"kimik3 chat: note: {message}", file=sys.stderr))
    stdin = sys.stdin if stdin is None else stdin
    if prompt is not None:
        checked_text(prompt, "argument --prompt")
    if system is not None:
        checked_text(system, "argument --system")
    tools = load_tools(tools_file) if tools_file is not None else None
    picture = None
    if image is not None:
        from kimik3.modeling.image_processing_kimi_k3 import load_image_source

        try:
            picture = load_image_source(image)
        except ValueError as exc:
            raise ChatInputError(f"--image: {str(exc).removeprefix('Kimi K3 image processor: ')}") from None
    from kimik3.demo import progress_bars_off

    with progress_bars_off():
        loaded = load_chat(directory, vision=picture is not None)
    tokenizer, model = loaded[:2]
    processor = loaded[2] if len(loaded) > 2 else None
    interactive = prompt is None and stdin.isatty()
    if interactive:
        warn(f"{directory} loaded; type a message (one line a turn), /exit or Ctrl-D to end")
    conversation = Conversation(system)
    results = []
    for text in [prompt] if prompt is not None else user_turns(stdin, interactive):
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=False)
        result = conversation.turn(tokenizer, model, text, picture if not results else None,
                                   max_new_tokens=max_new_tokens, reasoning_effort=reasoning_effort, tools=tools,
                                   processor=processor, prefill_chunk_size=prefill_chunk_size, streamer=streamer,
                                   note=warn)
        if result.reply is not None and result.reply.complete:
            say(f"\n[response] {result.reply.response}")
            for call in result.reply.tool_calls:
                say(f"[tool call] {call.name} {json.dumps(call.arguments, ensure_ascii=False)} (kimik3 chat does "
                    "not run tools)")
        results.append(result)
    return results
