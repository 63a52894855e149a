"""The K3 chat format (XTML) in Python: a renderer that produces the same text as `configuration/chat_template.jinja`
as a list of segments, encoded segment by segment (the renderer's own control tokens as special tokens, everything
else, message text and attribute values included, as ordinary text: marker text typed by a user stays text), and a
parser of model output (reasoning, response, tool calls with typed arguments). The tokenizer's
`apply_chat_template(tokenize=True)` gives the same ids (docs/bad_inputs.md, "Chat and tokenizer")."""

import json
import re
from dataclasses import dataclass, field

from kimik3.modeling.tokenization_kimi_k3 import normalize_conversation

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
# The efforts the release's encoder accepts: its note names `medium` too, but the encoder asserts low, high or max
REASONING_EFFORTS = ("low", "high", "max")
CONTROL_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)  # the only special tokens the renderer writes
TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
# A system message carrying `tools` extends the tool set mid-conversation (the release's dynamic declaration)
DYNAMIC_TOOL_DECLARE_HEAD = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                             "You have access to all existing and extended tools.\nHere are the specs for the "
                             "extended tools.\n\n```json\n")
EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
               "with `thinking_effort={}`.")
TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."


DECLARING_SYSTEM_WITH_TEXT = ("a system message carrying `tools` is the release's declaration of more tools and "
                              "renders no text (its encoder drops it): put the text in a system message of its own")


class ChatFormatError(ValueError):
    pass


@dataclass
class Segment:
    text: str
    markup: bool  # markup: the renderer's own text, its control tokens special; content: ordinary text throughout


def compact_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def escape_attribute(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _jinja_str(value) -> str:
    # what Jinja's `|string` writes for the values attributes take (bools and None as Python spells them)
    return str(value)


class Renderer:
    def __init__(self):
        self.segments: list[Segment] = []

    def markup(self, text: str):
        if self.segments and self.segments[-1].markup:
            self.segments[-1].text += text
        else:
            self.segments.append(Segment(text, True))

    def content(self, text: str):
        if text:
            self.segments.append(Segment(text, False))

    def open(self, tag: str, *attrs):
        self.markup(OPEN + tag)
        for key, value in attrs:  # a value (a name, a tool, an argument key) is message data: content
            self.markup(f' {key}="')
            self.content(escape_attribute(_jinja_str(value)))
            self.markup('"')
        self.markup(SEP)

    def close(self, tag: str):
        self.markup(CLOSE + tag + SEP)

    def end_message(self):
        self.close("message")
        self.markup(END_OF_MSG)

    def system_note(self, kind: str, body: str):
        self.open("message", ("role", "system"), ("type", kind))
        self.content(body.strip())
        self.end_message()


def content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") in ("image", "image_url"):
            parts.append(IMAGE_PLACEHOLDER)
        elif part.get("text") is not None:
            parts.append(part["text"])
    return "".join(parts)


def value_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def _function(call: dict) -> dict:
    return call["function"] if isinstance(call.get("function"), dict) else call


def _render_assistant(r: Renderer, message: dict, thinking: bool = True):
    attrs = [("role", "assistant")] + ([("name", message["name"])] if message.get("name") else [])
    r.open("message", *attrs)
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if thinking:
        r.open("think")
        if reasoning and reasoning.strip():
            r.content(reasoning)
        r.close("think")
    r.open("response")
    r.content(content_text(message.get("content")))
    r.close("response")
    calls = message.get("tool_calls") or []
    if calls:
        r.open("tools")
        for index, call in enumerate(calls, start=1):
            fn = _function(call)
            r.open("call", ("tool", fn.get("name")), ("index", index))
            arguments = fn.get("arguments", {})
            if isinstance(arguments, dict):
                for key, value in arguments.items():
                    r.open("argument", ("key", key), ("type", value_type(value)))
                    r.content(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                    r.close("argument")
            elif isinstance(arguments, str) and arguments.strip():
                r.open("json", ("type", "object"))
                r.content(arguments)
                r.close("json")
            r.close("call")
        r.close("tools")
    r.end_message()


def _render_tool_run(r: Renderer, run: list[dict], calls: list[dict]):
    """One run of tool results: in call order (matched by tool_call_id), the unmatched ones after in their order."""
    done, index = set(), 0

    def emit(result, name):
        nonlocal index
        index += 1
        r.open("message", ("role", "tool"), ("tool", name), ("index", index))
        r.content(content_text(result.get("content")))
        r.end_message()

    for call in calls:
        fn = _function(call)
        for position, result in enumerate(run):
            if call.get("id") is not None and result.get("tool_call_id") == call.get("id") and position not in done:
                done.add(position)
                emit(result, result.get("name") or fn.get("name"))
    for position, result in enumerate(run):
        if position in done:
            continue
        name = result.get("name") or result.get("tool")
        if not name and index + 1 <= len(calls):
            name = _function(calls[index]).get("name")
        if not name:
            raise ChatFormatError("a tool message needs a tool name: `name`, or a `tool_call_id` of a call")
        emit(result, name)


def _declare_tools(r: Renderer, tools, dynamic: bool = False):
    r.open("message", ("role", "system"), ("type", "tool-declare"))
    r.content((DYNAMIC_TOOL_DECLARE_HEAD if dynamic else TOOL_DECLARE_HEAD) + compact_json(tools) + "\n```")
    r.end_message()


def render_segments(messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False,
                    reasoning_effort: str | None = "max", tool_choice=None, response_format=None,
                    thinking: bool = True) -> list[Segment]:
    """The conversation as XTML segments, block order: tool declarations, effort, messages, tool_choice,
    response_format, generation prompt. As the release's encoder: `thinking=False` drops the effort message and the
    think sections and opens the response in the generation prompt; a system message carrying `tools` declares
    them where it stands, as new tools (with text too it is refused: the encoder would drop the text); `developer`
    messages are dropped."""
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError(f"reasoning_effort must be low, high or max, as the release's encoder accepts (got "
                              f"{reasoning_effort})")
    thinking = True if thinking is None else thinking
    messages = normalize_conversation(list(messages))
    r = Renderer()
    if tools:
        _declare_tools(r, tools)
    if reasoning_effort is not None and thinking:
        r.system_note("thinking-effort", EFFORT_BODY.format(reasoning_effort))
    calls: list[dict] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        role = message.get("role")
        if role == "developer":
            pass
        elif role in ("user", "system"):
            body = content_text(message.get("content"))
            if role == "system" and message.get("tools"):
                if body:
                    raise ChatFormatError(DECLARING_SYSTEM_WITH_TEXT)
                _declare_tools(r, message["tools"], dynamic=True)
            else:
                r.open("message", ("role", role), *([("name", message["name"])] if message.get("name") else []))
                r.content(body)
                r.end_message()
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            _render_assistant(r, message, thinking)
        elif role == "tool":
            run = []
            while i < len(messages) and messages[i].get("role") == "tool":
                run.append(messages[i])
                i += 1
            _render_tool_run(r, run, calls)
            continue
        else:
            raise ChatFormatError(f"unknown message role {role}")
        i += 1
    if tool_choice in TOOL_CHOICE_BODY:
        r.system_note("tool-choice", TOOL_CHOICE_BODY[tool_choice])
    format_type = response_format.get("type") if isinstance(response_format, dict) else response_format
    if format_type == "json_object":
        r.system_note("response-format", f"The system is invoked with `response_format=json_object`.\n{RAW_JSON}")
    elif format_type == "json_schema":
        wrapper = response_format.get("json_schema")
        schema = wrapper["schema"] if isinstance(wrapper, dict) and "schema" in wrapper else wrapper
        r.system_note("response-format", "The system is invoked with `response_format=json_schema`.\n" + RAW_JSON +
                      "\nThe JSON data must match the following schema:\n```json\n" + compact_json(schema) + "\n```")
    if add_generation_prompt:
        r.open("message", ("role", "assistant"))
        r.open("think" if thinking else "response")
    return r.segments


def render_text(messages, **kwargs) -> str:
    """The flat prompt text (what the Jinja template renders)."""
    return "".join(s.text for s in render_segments(messages, **kwargs))


_CONTROL_RE = re.compile("(" + "|".join(re.escape(t) for t in CONTROL_TOKENS) + ")")


def encode_segments(tokenizer, segments: list[Segment]) -> list[int]:
    """Token ids: the control tokens of markup segments as special tokens, the text between two of them (markup
    words, attribute values, content) as one piece of ordinary text, so control-token spellings in message data stay
    text. That piece is what the release's encoder encodes as a content segment (BPE is not associative: pieces
    are not merged across control tokens)."""
    ids: list[int] = []
    text: list[str] = []

    def flush():
        if text:
            ids.extend(tokenizer.encode("".join(text), add_special_tokens=False, split_special_tokens=True))
            text.clear()

    for segment in segments:
        if not segment.markup:
            text.append(segment.text)
            continue
        for index, piece in enumerate(_CONTROL_RE.split(segment.text)):
            if index % 2:
                flush()
                ids.append(tokenizer.convert_tokens_to_ids(piece))
            elif piece:
                text.append(piece)
    flush()
    return ids


def encode_chat(tokenizer, messages, **kwargs) -> list[int]:
    return encode_segments(tokenizer, render_segments(messages, **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# Model output
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: dict | str  # typed values; the raw text of a `json` block that does not parse
    index: int


@dataclass
class ParsedReply:
    reasoning: str = ""
    response: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    complete: bool = False  # the message was closed (generation did not stop mid-way)


def _parse_attributes(text: str) -> tuple[str, dict]:
    import re

    tag, _, rest = text.partition(" ")
    attrs = {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return tag, attrs


def _typed(value: str, kind: str):
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise ChatFormatError(f"argument of type {kind} is not valid JSON: {value[:80]!r}") from None


def parse_reply(text: str) -> ParsedReply:
    """Parses the decoded text of an assistant turn (what follows the generation prompt, special tokens kept), e.g.
    `...reasoning<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|>`.
    The leading `<|open|>message ...<|sep|><|open|>think<|sep|>` may be present or not. A malformed tool block raises
    ChatFormatError (the caller can retry the generation)."""
    return ReplyParser().feed(text).reply()


class ReplyParser:
    """`parse_reply` fed piece by piece, as a reply streams: `feed(more)` goes over what it has not settled (the text
    after the last whole tag; plain text already searched for tags is not searched again) and `reply()` is
    `parse_reply` of everything fed so far, so a streamed reply costs its length once, not once a token. A malformed
    tag raises ChatFormatError from `feed`, as it would from `parse_reply` of every longer text."""

    HEAD = OPEN + "message"

    def __init__(self):
        self.text = ""
        self._reply = ParsedReply()
        self._stack: list[str] | None = None  # decided once the text shows whether it opens with HEAD
        self._position = 0  # the unsettled text begins here, after the last whole tag
        self._clear = 0  # text[_position:_clear] holds no tag's start
        self._cut: int | None = None  # a tag begins here whose <|sep|> has not come yet
        self._pending_call: ToolCall | None = None
        self._pending_arg: tuple[str, str] | None = None

    def feed(self, more: str) -> "ReplyParser":
        self.text += more
        if self._stack is None:
            if len(self.text) < len(self.HEAD) and self.HEAD.startswith(self.text):
                return self  # too short to tell
            # without the head the text continues the generation prompt, inside <|open|>think<|sep|>
            self._stack = [] if self.text.startswith(self.HEAD) else ["message", "think"]
        self._advance()
        return self

    def _advance(self) -> None:
        text, reply, stack = self.text, self._reply, self._stack
        longest = max(len(OPEN), len(CLOSE))
        while True:
            start = max(self._position, self._clear)
            o, c = text.find(OPEN, start), text.find(CLOSE, start)
            if o < 0 and c < 0:
                self._clear, self._cut = max(self._position, len(text) - longest + 1), None
                return
            nxt = min(x for x in (o, c) if x >= 0)
            sep = text.find(SEP, nxt)
            if sep < 0:  # cut mid-tag: what came before stays
                self._clear, self._cut = nxt, nxt
                return
            inner = text[nxt + len(OPEN if nxt == o else CLOSE):sep]
            chunk = text[self._position:nxt]
            current = stack[-1] if stack else None
            if nxt == o:
                tag, attrs = _parse_attributes(inner)
                if current in ("think", "response") and chunk:
                    _append(reply, current, chunk)
                stack.append(tag)
                if tag == "call":
                    self._pending_call = ToolCall(attrs.get("tool", ""), {},
                                                  int(attrs.get("index", len(reply.tool_calls) + 1)))
                elif tag == "argument":
                    self._pending_arg = (attrs.get("key", ""), attrs.get("type", "string"))
            else:
                tag = inner.strip()
                if tag != current:
                    raise ChatFormatError(f"</{tag}> closes <{current}>: the reply's markup is not well nested")
                call = self._pending_call
                if tag in ("think", "response"):
                    _append(reply, tag, chunk)
                elif tag == "argument" and call is not None and self._pending_arg is not None:
                    key, kind = self._pending_arg
                    call.arguments[key] = _typed(chunk, kind)
                    self._pending_arg = None
                elif tag == "json" and call is not None:
                    try:
                        call.arguments = json.loads(chunk)
                    except json.JSONDecodeError:
                        call.arguments = chunk
                elif tag == "call" and call is not None:
                    reply.tool_calls.append(call)
                    self._pending_call = None
                elif tag == "message":
                    reply.complete = True
                stack.pop()
            self._position = self._clear = sep + len(SEP)

    def reply(self) -> ParsedReply:
        """What the text fed so far says: the settled sections, plus the unsettled text of an open think or
        response section (up to a tag still being written)."""
        if self._stack is None:
            return ReplyParser._whole(self.text)
        reply = ParsedReply(self._reply.reasoning, self._reply.response, list(self._reply.tool_calls),
                            self._reply.complete)
        rest = self.text[self._position:self._cut].replace(END_OF_MSG, "")
        if self._stack and self._stack[-1] in ("think", "response") and rest:
            _append(reply, self._stack[-1], rest)
        return reply

    @staticmethod
    def _whole(text: str) -> ParsedReply:
        """A text too short to tell whether it opens with the head, parsed as if it were all there is."""
        parser = ReplyParser()
        parser.text, parser._stack = text, [] if text.startswith(ReplyParser.HEAD) else ["message", "think"]
        parser._advance()
        return parser.reply()


def _append(reply: ParsedReply, section: str, text: str):
    if section == "think":
        reply.reasoning += text
    else:
        reply.response += text
