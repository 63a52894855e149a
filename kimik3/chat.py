"""`kimik3 chat DIR`: a prompt -> the chat template -> `generate` (stopping at `<|end_of_msg|>`) -> text streamed
through `TextStreamer`, then the reply parsed into reasoning / response / tool calls."""

from dataclasses import dataclass
from pathlib import Path

from kimik3.chat_format import ParsedReply, parse_reply

END_OF_MSG = "<|end_of_msg|>"


class ChatFolderError(ValueError):
    pass


@dataclass
class ChatResult:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str  # the generated ids decoded, special tokens kept (what was streamed)
    reply: ParsedReply | None  # None when the text is not well-formed XTML (a random model, a cut-off reply)


def load_chat(directory):
    """Tokenizer and model of a folder (trust_remote_code: the folder's own code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ChatFolderError(f"{directory}: no config.json (not a model folder)")
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tiktoken.model")):
        raise ChatFolderError(f"{directory}: no tokenizer (tiktoken.model or tokenizer.json); `kimik3 tiny` writes "
                              "one, `kimik3 convert` copies the release's")
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    return tokenizer, model


def chat(tokenizer, model, prompt: str, max_new_tokens: int = 64, reasoning_effort: str = "max",
         do_sample: bool = False, streamer=None, **generate_kwargs) -> ChatResult:
    """One user turn. Generation stops at `<|end_of_msg|>` (the end of an assistant message; `[EOS]` ends a
    document and is not what a chat turn emits)."""
    import torch

    from kimik3.chat_format import ChatFormatError

    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               reasoning_effort=reasoning_effort, tokenize=True,
                                               return_dict=True)["input_ids"]
    input_ids = torch.tensor([prompt_ids])
    stop = tokenizer.convert_tokens_to_ids(END_OF_MSG)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=do_sample, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id,
                             streamer=streamer, **generate_kwargs)
    new_ids = out[0, input_ids.shape[1]:].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=False)
    try:
        reply = parse_reply(text)
    except ChatFormatError:
        reply = None
    return ChatResult(list(prompt_ids), new_ids, text, reply)


def run_chat(directory, prompt: str, max_new_tokens: int = 64, reasoning_effort: str = "max", say=print):
    from transformers import TextStreamer

    tokenizer, model = load_chat(directory)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=False)
    result = chat(tokenizer, model, prompt, max_new_tokens, reasoning_effort, streamer=streamer)
    if result.reply is not None and result.reply.complete:
        say(f"\n[response] {result.reply.response}")
    return result
