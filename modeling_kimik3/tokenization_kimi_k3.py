"""The Kimi K3 tokenizer: byte-level BPE over the release's `tiktoken.model` ranks, with 256 reserved special ids
after the ranks (163,584 ranks + 256 = 163,840 for the release).

Two classes read the same files:
  * `KimiK3Tokenizer` (slow, pure Python): the `regex` package (V1 semantics, for the `&&` class intersections of
    the Kimi pre-tokenizer) and tiktoken's merge rule (merge the adjacent pair whose concatenation has the lowest
    rank; a piece that is itself a rank is one token). `tiktoken` is not needed.
  * `KimiK3TokenizerFast`: a `tokenizers` byte-level BPE (`tokenizer.json`), built from the ranks when the folder has
    no `tokenizer.json` yet; Oniguruma, which `tokenizers` uses, understands the same `&&` intersections.

Specials come from `tokenizer_config.json`'s `added_tokens_decoder` when present, otherwise from the release's
convention relative to the number of ranks N (`SPECIAL_OFFSETS`, the rest `<|reserved_token_{id}|>`).
The generation stop of a chat turn is `<|end_of_msg|>` (N + 2), not `[EOS]` (N + 1, end of a document).

This file runs as remote code copied flat into a model folder: no imports of `kimik3`, no network.
"""

import base64
import heapq
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

from transformers import AddedToken, PreTrainedTokenizer, PreTrainedTokenizerFast
from transformers.dynamic_module_utils import get_relative_import_files

from .files_kimi_k3 import check_inside

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
# tokenizer_config.json's `auto_map` entry for these classes (slow, fast), named after this file: what save_pretrained
# writes, and `kimik3 convert` for a converted folder's tokenizer.
AUTO_TOKENIZER = (f"{Path(__file__).stem}.KimiK3Tokenizer", f"{Path(__file__).stem}.KimiK3TokenizerFast")
NUM_RESERVED_SPECIAL = 256

# The Kimi pre-tokenizer: Han runs alone; letter runs exclude Han through class intersections (`&&`).
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Named specials by offset from the number of ranks N (the release: N = 163584).
SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
BOS_TOKEN, DOCUMENT_EOS_TOKEN, END_OF_MSG_TOKEN, PAD_TOKEN, UNK_TOKEN = (
    "[BOS]", "[EOS]", "<|end_of_msg|>", "[PAD]", "[UNK]")


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be read as the K3 format; the message names the file and line or key."""


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------


def load_ranks(path) -> dict[bytes, int]:
    """Reads a tiktoken ranks file (`base64-token rank` per line). Ranks must be exactly 0..N-1, each once, each
    token once, and every single byte must be a rank (byte-level BPE can then encode any input)."""
    if not os.path.isfile(path):
        raise TokenizerFileError(f"{path}: the ranks file (tiktoken.model) is missing")
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    with open(path, "rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 2:
                raise TokenizerFileError(f"{path}:{lineno}: expected `<base64 token> <rank>`, got {line[:80]!r}")
            try:
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
            except ValueError as exc:
                raise TokenizerFileError(f"{path}:{lineno}: not `<base64 token> <rank>` ({exc})") from None
            if not token or rank < 0:
                raise TokenizerFileError(f"{path}:{lineno}: empty token or negative rank {rank}")
            if rank in line_of_rank:
                raise TokenizerFileError(f"{path}:{lineno}: rank {rank} is repeated (first on line "
                                         f"{line_of_rank[rank]})")
            if token in ranks:
                raise TokenizerFileError(f"{path}:{lineno}: token {token!r} is repeated (rank {ranks[token]} before)")
            ranks[token] = rank
            line_of_rank[rank] = lineno
    if not ranks:
        raise TokenizerFileError(f"{path}: holds no ranks")
    if max(line_of_rank) != len(ranks) - 1:
        missing = next(r for r in range(len(ranks)) if r not in line_of_rank)
        raise TokenizerFileError(f"{path}: ranks are not 0..{len(ranks) - 1}: rank {missing} is missing")
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise TokenizerFileError(f"{path}: byte-level BPE needs every single byte as a rank; missing "
                                 f"{len(missing_bytes)} (first: {missing_bytes[0]:#04x})")
    return ranks


def default_specials(num_ranks: int) -> dict[int, str]:
    """The release's special ids relative to N: the named ones, the others `<|reserved_token_{id}|>`."""
    return {num_ranks + i: SPECIAL_OFFSETS.get(i, f"<|reserved_token_{num_ranks + i}|>")
            for i in range(NUM_RESERVED_SPECIAL)}


def resolve_specials(num_ranks: int, added_tokens_decoder: dict | None, source: str) -> dict[int, str]:
    """The special tokens by id: the convention, overridden by `added_tokens_decoder` (id -> token) when given.
    An id outside N..N+255 or a token named at two ids is an error naming the key."""
    specials = default_specials(num_ranks)
    for key, token in (added_tokens_decoder or {}).items():
        content = token.content if isinstance(token, AddedToken) else (
            token.get("content") if isinstance(token, dict) else token)
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise TokenizerFileError(f"{source}: added_tokens_decoder key {key!r} is not a token id") from None
        if not num_ranks <= token_id < num_ranks + NUM_RESERVED_SPECIAL:
            raise TokenizerFileError(
                f"{source}: added_tokens_decoder[{token_id}] = {content!r}: special ids of this vocabulary are "
                f"{num_ranks}..{num_ranks + NUM_RESERVED_SPECIAL - 1} ({num_ranks} ranks in tiktoken.model)")
        if not isinstance(content, str) or not content:
            raise TokenizerFileError(f"{source}: added_tokens_decoder[{token_id}] has no token text")
        specials[token_id] = content
    seen: dict[str, int] = {}
    for token_id, content in sorted(specials.items()):
        if content in seen:
            raise TokenizerFileError(f"{source}: added_tokens_decoder names {content!r} at ids {seen[content]} and "
                                     f"{token_id}")
        seen[content] = token_id
    return specials


def check_token_ids(ids, vocab_size: int) -> list[int]:
    """Ids to decode as ints, each in 0..vocab_size-1: an id outside the vocabulary is an error naming it (the fast
    backend would drop it silently, or overflow on a negative one). An id must be a whole number: int() would read 1.5
    or True as an id."""
    for i in ids:
        if isinstance(i, bool) or not hasattr(type(i), "__index__"):
            raise ValueError(f"token ids must be whole numbers, got {i!r} ({type(i).__name__})")
    ids = [int(i) for i in ids]
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary: ids are 0..{vocab_size - 1} (vocabulary size "
                             f"{vocab_size})")
    return ids


def check_named_special(source: str, key: str, value, specials_by_token: dict[str, int]) -> None:
    """A `bos_token`/`eos_token`/... value must be one of the special tokens (a clear error, not a silent new id)."""
    content = value.content if isinstance(value, AddedToken) else value
    if content is not None and content not in specials_by_token:
        raise TokenizerFileError(f"{source}: {key} = {content!r} is not one of the special tokens "
                                 f"(added_tokens_decoder / the reserved ids)")


# ---------------------------------------------------------------------------------------------------------------
# Byte-level BPE
# ---------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's): printable bytes stand for themselves, the others get unused code points,
    so every byte string has a reversible text form (that is what `tokenizers`' ByteLevel uses too)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def token_text(token: bytes) -> str:
    alphabet = bytes_to_unicode()
    return "".join(alphabet[b] for b in token)


def bpe_parts(ranks: dict[bytes, int], piece: bytes, max_rank: int | None = None) -> list[bytes]:
    """tiktoken's merge rule: repeatedly merge the adjacent pair whose concatenation has the lowest rank (leftmost
    on a tie), considering only ranks below `max_rank` when given.

    The pairs wait in a heap ordered by (rank, start offset), so the pair taken is the one the rule names; a merge
    adds at most two new pairs, and an entry whose parts have changed since it was pushed is skipped. That is
    O(n log n) for a piece of n bytes: rescanning every pair after each merge was O(n^2) on one long word (a page
    of text without spaces took minutes)."""
    n = len(piece)
    if n < 2:
        return [piece]
    limit = max_rank

    def rank_of(start: int, end: int):
        rank = ranks.get(piece[start:end])
        return rank if rank is not None and (limit is None or rank < limit) else None

    # parts as a linked list of start offsets: part `i` is piece[i:end[i]], `prev[i]` the part before it
    end = list(range(1, n + 1))
    prev = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        rank = rank_of(i, i + 2)
        if rank is not None:
            heap.append((rank, i, i + 2))
    heapq.heapify(heap)
    while heap:
        _, i, stop = heapq.heappop(heap)
        if not alive[i] or end[i] >= n or end[end[i]] != stop:
            continue  # one of the two parts was merged into another since this pair was pushed
        alive[end[i]] = False
        end[i] = stop
        if stop < n:
            prev[stop] = i
            rank = rank_of(i, end[stop])
            if rank is not None:
                heapq.heappush(heap, (rank, i, end[stop]))
        if prev[i] >= 0:
            rank = rank_of(prev[i], stop)
            if rank is not None:
                heapq.heappush(heap, (rank, prev[i], stop))
    parts, i = [], 0
    while i < n:
        parts.append(piece[i:end[i]])
        i = end[i]
    return parts


def ranks_to_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list equivalent to the ranks: each multi-byte token is the merge of the two parts that the ranks
    below it produce (a token the lower ranks cannot reach in two parts gets no merge; a whole piece equal to it is
    still one token, as `ignore_merges` does)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = bpe_parts(ranks, token, max_rank=rank)
            if len(parts) == 2:
                merges.append((parts[0], parts[1]))
    return merges


def build_fast_backend(ranks: dict[bytes, int], specials: dict[int, str]):
    """A `tokenizers.Tokenizer` equal to the slow tokenizer: the same pre-tokenizer regex, byte-level BPE with the
    whole-piece lookup first (`ignore_merges`, as tiktoken does), the specials as added tokens at their ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token_text(token): rank for token, rank in ranks.items()}
    merges = [(token_text(a), token_text(b)) for a, b in ranks_to_merges(ranks)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    ordered = [specials[i] for i in sorted(specials)]
    if sorted(specials) != list(range(len(ranks), len(ranks) + len(specials))):
        raise TokenizerFileError("the special ids must follow the ranks without gaps")
    from tokenizers import AddedToken as BackendAddedToken

    backend.add_special_tokens([BackendAddedToken(t, special=True, normalized=False) for t in ordered])
    return backend


# ---------------------------------------------------------------------------------------------------------------
# Chat helpers shared by the template path and kimik3.chat_format (one home for the normalisation)
# ---------------------------------------------------------------------------------------------------------------


def deep_sorted(value):
    """Mappings with their keys sorted at every level (lists keep their order), as the encoder normalises tool
    schemas and call arguments."""
    if isinstance(value, dict):
        return {key: deep_sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sorted(item) for item in value]
    return value


class ChatMessageError(ValueError):
    """A conversation the chat format cannot render; the message names the message index and the field."""


MESSAGE_ROLES = ("user", "system", "developer", "assistant", "tool")
PART_TYPES = ("text", "image", "image_url")


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def normalize_tool_call(call, where: str = "tool_calls[0]") -> dict:
    """An OpenAI-style call with its `arguments` as typed values: a JSON-object string is parsed (as the encoder does;
    a Jinja template cannot parse JSON), keys deep-sorted. A string that is not a JSON object stays a string and is
    rendered as a `json` block. A call without a name, or with arguments that are neither a mapping nor a string, is
    a ChatMessageError naming `where`."""
    if not isinstance(call, dict):
        raise ChatMessageError(f"{where} must be a mapping with a `function` (`name`, `arguments`), not "
                               f"{type(call).__name__}")
    call = dict(call)
    nested = "function" in call
    if nested and not isinstance(call["function"], dict):
        raise ChatMessageError(f"{where}.function must be a mapping with `name` and `arguments`, not "
                               f"{type(call['function']).__name__}")
    function = dict(call["function"] if nested else {k: call[k] for k in ("name", "arguments") if k in call})
    field = f"{where}.function" if nested else where
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ChatMessageError(f"{field}.name: a tool call needs the tool's name (a non-empty string), got {name!r}")
    check_text(name, f"{field}.name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:  # NaN / Infinity are not JSON: such a string stays a string
            parsed = json.loads(arguments, parse_constant=_not_json) if arguments.strip() else {}
        except ValueError:
            parsed = None
        except RecursionError:
            raise ChatMessageError(f"{field}.arguments: the JSON string is nested too deeply to parse (a real call "
                                   "nests a few levels)") from None
        if isinstance(parsed, dict):
            arguments = parsed
    elif arguments is not None and not isinstance(arguments, dict):
        raise ChatMessageError(f"{field}.arguments must be a mapping or a JSON string, not "
                               f"{type(arguments).__name__} ({arguments!r:.80})")
    if arguments is not None:
        check_arguments(arguments, field)
    if isinstance(arguments, dict):
        try:
            arguments = deep_sorted(arguments)
        except RecursionError:
            raise ChatMessageError(f"{field}.arguments are nested too deeply (a real call nests a few levels)") from None
    function["arguments"] = arguments if arguments is not None else {}
    call["function"] = function
    return call


def check_text(text: str, where: str) -> None:
    """Text the encoder can encode: a lone surrogate (`"\ud800"`, what a bad decode leaves) has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ChatMessageError(f"{where} is not valid Unicode text: {exc.reason} ({text[exc.start]!r} at offset "
                               f"{exc.start})") from None


def check_arguments(arguments, field: str) -> None:
    """Typed tool-call arguments must be JSON values, as the encoder writes them: no NaN or infinity, no sets or
    other objects, no nesting beyond the parser (a RecursionError), no text without a UTF-8 form."""
    try:
        check_text(json.dumps(arguments, allow_nan=False, ensure_ascii=False), f"{field}.arguments")
    except RecursionError:
        raise ChatMessageError(f"{field}.arguments are nested too deeply (a real call nests a few levels)") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ChatMessageError):
            raise
        raise ChatMessageError(f"{field}.arguments must be JSON values (strings, numbers, booleans, null, lists, "
                               f"mappings with string keys): {exc}") from None


def check_content(content, where: str, optional: bool) -> None:
    """Message content is a string or a list of parts (`{"type": "text", "text": ...}`, `{"type": "image", ...}`,
    `{"type": "image_url", ...}`); None only where `optional` (an assistant turn, a system message declaring tools)."""
    if content is None:
        if not optional:
            raise ChatMessageError(f"{where} is missing: this message needs content (a string or a list of parts)")
        return
    if isinstance(content, str):
        check_text(content, where)
        return
    if not isinstance(content, (list, tuple)):
        raise ChatMessageError(f"{where} must be a string or a list of parts, not {type(content).__name__} "
                               f"({content!r:.80})")
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatMessageError(f"{where}[{index}] must be a part mapping with a `type`, not {type(part).__name__}")
        kind = part.get("type")
        if kind not in PART_TYPES:
            raise ChatMessageError(f"{where}[{index}].type is {kind!r}: a part is one of {', '.join(PART_TYPES)}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ChatMessageError(f"{where}[{index}].text: a text part needs a string `text`, got "
                                   f"{type(part.get('text')).__name__}")
        if kind == "text":
            check_text(part["text"], f"{where}[{index}].text")


def normalize_conversation(messages, where: str = "messages") -> list[dict]:
    """What the encoder does before rendering and a Jinja template cannot: tool-call arguments given as JSON strings
    become typed values (keys deep-sorted). The template itself orders tool results by call. Every field a renderer
    reads is checked first, so a bad message is a ChatMessageError naming `messages[i].field` on every path (the
    template, the processor, kimik3.chat_format) instead of a Jinja error or a silently empty turn."""
    out = []
    for index, message in enumerate(messages):
        here = f"{where}[{index}]"
        if not isinstance(message, dict):
            raise ChatMessageError(f"{here} must be a mapping with `role` and `content`, not {type(message).__name__}")
        message = dict(message)
        role = message.get("role")
        if "role" not in message:
            raise ChatMessageError(f"{here} has no `role` (keys: {sorted(map(str, message))}): a message says who "
                                   f"speaks, one of {', '.join(MESSAGE_ROLES)}")
        if role not in MESSAGE_ROLES:
            raise ChatMessageError(f"{here}.role is {role!r}: a message role is one of {', '.join(MESSAGE_ROLES)}")
        check_content(message.get("content"), f"{here}.content",
                      optional=role == "assistant" or role in ("system", "developer") and bool(message.get("tools")))
        for key in ("reasoning_content", "reasoning", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise ChatMessageError(f"{here}.{key} must be a string, not {type(message[key]).__name__}")
            if message.get(key) is not None:
                check_text(message[key], f"{here}.{key}")
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, (list, tuple)):
                raise ChatMessageError(f"{here}.tool_calls must be a list of calls, not {type(calls).__name__}")
            message["tool_calls"] = [normalize_tool_call(call, f"{here}.tool_calls[{i}]")
                                     for i, call in enumerate(calls)]
        out.append(message)
    return out


def normalize_conversations(conversation):
    """`normalize_conversation` for one conversation or a batch of them (anything else passes as it is)."""
    if isinstance(conversation, (list, tuple)) and (not conversation or any(
            isinstance(c, (list, tuple)) and not c for c in conversation)):
        raise ChatMessageError("the conversation is empty: give at least one message")
    if isinstance(conversation, (list, tuple)) and conversation and isinstance(conversation[0], (list, tuple)):
        return [normalize_conversation(list(c), f"conversation {i}: messages") for i, c in enumerate(conversation)]
    if isinstance(conversation, (list, tuple)) and conversation and not hasattr(conversation[0], "messages"):
        return normalize_conversation(list(conversation))
    return conversation


# Template markers vs message text. The chat paths render the template twice: as it is (the text
# `tokenize=False` returns) and with every control-token spelling in the template's own source wrapped in tags that
# hold a random per-tokenizer nonce. In the tagged rendering a control token with tags around it was written by
# the template; any other spelling of one came from the conversation (content, names, arguments, tool schemas,
# parts that join into one, ...) and is encoded as ordinary text. The text between two of the template's control
# tokens is encoded as one piece, as the release's segment-wise encoder encodes a content segment, so ordinary
# conversations get the same ids as before. The tagged rendering with its tags removed must equal the plain one, or
# the template inspects its own markers (or a message carries the tags) and the encoding is refused.
_TAG_OPEN, _TAG_CLOSE = "\ue000", "\ue001"


# Tokenizer options that change what an encoding returns and that the chat path's piece-wise encoding cannot honour.
UNSUPPORTED_CHAT_ENCODING_OPTIONS = frozenset({
    "stride", "return_overflowing_tokens", "return_offsets_mapping", "return_special_tokens_mask", "return_length",
    "return_token_type_ids", "is_split_into_words", "split_special_tokens", "text_pair", "text_target",
    "text_pair_target", "add_prefix_space",
})


class ChatTagging:
    def __init__(self, markers, extra_markers=()):
        import re
        import secrets

        self.markers = tuple(sorted(set(markers) | set(extra_markers), key=lambda m: (-len(m), m)))
        nonce = secrets.token_hex(8)
        self.start, self.end = f"{_TAG_OPEN}{nonce}{_TAG_OPEN}", f"{_TAG_CLOSE}{nonce}{_TAG_CLOSE}"
        self._marker_re = re.compile("|".join(re.escape(m) for m in self.markers)) if self.markers else None
        self._tagged_re = re.compile(re.escape(self.start) + "(.*?)" + re.escape(self.end), re.S)
        self._templates: dict[str, str] = {}
        self._variables: dict[tuple, list[str]] = {}

    def tag(self, text: str) -> str:
        if self._marker_re is None:
            return text
        return self._marker_re.sub(lambda m: self.start + m.group(0) + self.end, text)

    def template(self, template: str) -> str:
        if template not in self._templates:
            self._templates[template] = self.tag(template)
        return self._templates[template]

    def template_kwargs(self, template: str, special_tokens_map: dict, given: dict) -> dict:
        """The named special tokens a template reads as variables (`{{ bos_token }}`), tagged: written by the
        template. Values the caller passes are conversation data and stay as they are."""
        import re

        names = tuple(key for key, value in special_tokens_map.items() if isinstance(value, str))
        if (template, names) not in self._variables:
            self._variables[template, names] = [key for key in names if re.search(rf"\b{key}\b", template)]
        return {key: self.tag(special_tokens_map[key]) for key in self._variables[template, names] if key not in given}

    def split(self, tagged: str, plain: str) -> list[tuple[str, bool]]:
        """(text, is_template_marker) pieces of a tagged rendering, checked against the plain one."""
        pieces, position = [], 0
        for match in self._tagged_re.finditer(tagged):
            pieces.append((tagged[position:match.start()], False))
            pieces.append((match.group(1), True))
            position = match.end()
        pieces.append((tagged[position:], False))
        stray = any(self.start in t or self.end in t for t, m in pieces if not m)
        if stray or any(m and t not in self.markers for t, m in pieces) or "".join(t for t, _ in pieces) != plain:
            raise ChatMessageError(
                "the chat template's own control tokens cannot be told apart from the conversation's text: the "
                "template compares or transforms its control tokens (or a message carries the tokenizer's private "
                "tags); render with tokenize=False and encode the parts yourself")
        return [(t, m) for t, m in pieces if t]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------


def _config_source(kwargs) -> str:
    folder = kwargs.get("name_or_path") or ""
    return os.path.join(folder, "tokenizer_config.json") if folder else "tokenizer_config.json"


def _named_defaults(kwargs, specials_by_token, source):
    for key, default in (("bos_token", BOS_TOKEN), ("eos_token", END_OF_MSG_TOKEN), ("pad_token", PAD_TOKEN),
                         ("unk_token", UNK_TOKEN)):
        kwargs.setdefault(key, default)
        check_named_special(source, key, kwargs[key], specials_by_token)


# the files a tokenizer folder may hold besides `vocab_files_names` (transformers reads each when it is there)
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
                        "chat_template.jinja", "chat_template.json")


def tokenizer_code_files() -> list[Path]:
    """This file and the files it imports: what a tokenizer folder carries (AutoTokenizer imports them from it)."""
    here = Path(__file__).resolve()
    return [here, *map(Path, get_relative_import_files(str(here)))]


def check_tokenizer_files(folder, subfolder, vocab_files_names: dict) -> None:
    """A local folder's tokenizer files must resolve inside it (the rule of docs/bad_inputs.md, "Loading a folder",
    `files_kimi_k3.check_inside`): a symlink out of the folder would read another file's text as the vocabulary or
    the chat template. Repo ids and files are left to transformers."""
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        return
    root = os.path.join(folder, subfolder or "")
    for name in (*vocab_files_names.values(), *TOKENIZER_SIDE_FILES):
        path = os.path.join(root, name)
        if os.path.lexists(path):
            check_inside(root, path, error=_tokenizer_file_error)


def _tokenizer_file_error(path, message: str) -> TokenizerFileError:
    return TokenizerFileError(f"{path}: {message}")


class KimiK3ChatText(str):
    """The text `apply_chat_template(..., tokenize=False)` returns. It is the template's text, and it remembers which
    control-token spellings in it the template wrote (`kimik3_chat_pieces`: (text, is_template_marker) pieces), so the
    common two-step `tokenizer(text)` / `tokenizer.encode(text)` encodes the conversation's text as ordinary text,
    giving the ids of `tokenize=True`. A new string made from it (concatenated, sliced, formatted, saved and read
    back) is a plain str, encoded as any text is: control-token spellings in it become control tokens."""

    kimik3_chat_pieces: tuple = ()


def chat_text_pieces(text) -> list | None:
    """The pieces of a chat text, or of each in a non-empty list of them; None for anything else."""
    texts = text if isinstance(text, (list, tuple)) and text else [text]
    pieces = [getattr(t, "kimik3_chat_pieces", None) if isinstance(t, str) else None for t in texts]
    return pieces if all(p is not None for p in pieces) else None


class ChatNormalizingMixin:
    """`apply_chat_template` checks and normalises the conversation first (tool arguments parsed from JSON strings),
    so the Jinja template renders what the encoder renders, and encodes message text as ordinary text.
    `save_pretrained` (and so `push_to_hub`) writes this file and the `auto_map` naming it, so the folder loads with
    trust_remote_code whether the tokenizer came from the installed package or from a folder."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        check_tokenizer_files(pretrained_model_name_or_path, kwargs.get("subfolder"), cls.vocab_files_names)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        """As transformers', with each id checked as `decode` checks it (the fast backend gave None for an id past
        the vocabulary and an OverflowError for a negative one, the slow class '[UNK]')."""
        if isinstance(ids, (list, tuple, int)):
            check_token_ids([ids] if isinstance(ids, int) else ids, len(self))
        return super().convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, save_directory, *args, **kwargs):
        saved = super().save_pretrained(save_directory, *args, **kwargs)
        directory, here = Path(save_directory), Path(__file__).resolve()
        # transformers 5 saves a fast tokenizer as tokenizer.json only; the ranks file keeps the slow class loadable
        saved = tuple(saved) + tuple(p for p in self.save_vocabulary(str(directory)) if p not in saved)
        for path in tokenizer_code_files():
            if path.resolve() != (directory / path.name).resolve():
                shutil.copyfile(path, directory / path.name)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["auto_map"] = {**config.get("auto_map", {}), "AutoTokenizer": list(AUTO_TOKENIZER)}
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return tuple(saved) + (str(directory / here.name),)

    def __call__(self, text=None, *args, **kwargs):
        """As transformers', and a chat text (`apply_chat_template(..., tokenize=False)`, or a list of them) passed on
        unchanged is encoded piece by piece, as `tokenize=True` encodes it."""
        pieces = chat_text_pieces(text)
        if pieces is None:
            return super().__call__(text, *args, **kwargs)
        if args:
            raise ValueError("a chat text (apply_chat_template(..., tokenize=False)) is encoded alone: pass the "
                             "encoding options by keyword, no text pair")
        options = {key: kwargs.pop(key) for key in ("padding", "truncation", "max_length", "return_tensors")
                   if key in kwargs}
        ids = [self.encode_chat_pieces(p) for p in pieces]
        return self.chat_batch_encoding(ids, isinstance(text, (list, tuple)), tokenizer_kwargs=kwargs, **options)

    def encode(self, text, *args, **kwargs):
        pieces = chat_text_pieces(text)
        if pieces is None or args or isinstance(text, (list, tuple)):
            return super().encode(text, *args, **kwargs)
        return self(text, **kwargs)["input_ids"]

    def chat_tagging(self, extra_markers=()) -> ChatTagging:
        """The tagging of this tokenizer's control tokens (every added token), one per set of extra markers."""
        cache = self.__dict__.setdefault("_kimik3_chat_tagging", {})
        key = tuple(extra_markers)
        if key not in cache:
            cache[key] = ChatTagging([t.content for t in self.added_tokens_decoder.values()], key)
        return cache[key]

    def encode_chat_pieces(self, pieces, spans=None):
        """Ids of (text, is_template_marker) pieces: a template marker that is a token is that token; the text
        between two of them is one piece of ordinary text (control-token spellings in it stay text). With `spans`
        (character ranges of the rendering, its `{% generation %}` blocks) also the mask of the tokens inside them:
        (ids, mask). A span must start and end at a marker, so that no token straddles its edge."""
        vocab = self.added_tokens_encoder
        layout, texts, text = [], [], []  # layout: (a token id or None for the next encoded text, start, end)
        position = start = 0
        for piece, is_marker in pieces:
            if is_marker and piece in vocab:
                if text:
                    layout.append((None, start, position))
                    texts.append("".join(text))
                    text = []
                layout.append((vocab[piece], position, position + len(piece)))
                start = position + len(piece)
            else:
                if not text:
                    start = position
                text.append(piece)
            position += len(piece)
        if text:
            layout.append((None, start, position))
            texts.append("".join(text))
        encoded = iter(self(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"] if texts else [])
        ids, mask = [], []
        for item, first, end in layout:
            part = next(encoded) if item is None else [item]
            ids.extend(part)
            if spans is not None:
                inside = any(first < b and a < end for a, b in spans)
                if inside and not any(a <= first and end <= b for a, b in spans):
                    raise ValueError("the chat template's {% generation %} block starts or ends inside the text "
                                     f"between two of its control tokens (characters {first}..{end}): it must start "
                                     "and end at a control token")
                mask.extend([int(inside)] * len(part))
        return ids if spans is None else (ids, mask)

    def chat_batch_encoding(self, ids, is_batched, padding=False, truncation=False, max_length=None,
                            return_tensors=None, tokenizer_kwargs=None):
        """What `self(rendered, add_special_tokens=False, ...)` returns, for ids encoded piece by piece."""
        options = dict(tokenizer_kwargs or {})
        side = options.pop("truncation_side", self.truncation_side)
        pad_options = {k: options.pop(k) for k in ("pad_to_multiple_of", "padding_side", "return_attention_mask")
                       if k in options}
        options.pop("add_special_tokens", None)  # a chat never gets BOS/EOS added around the template's own
        # Encoding options this piece-wise encoding does not implement are refused rather than silently not applied;
        # any other key is dropped, as `tokenizer(text, **kwargs)` drops keys it does not know (pipelines of some
        # transformers versions hand generation options such as `do_sample` to the processor along this path).
        unsupported = sorted(set(options) & UNSUPPORTED_CHAT_ENCODING_OPTIONS)
        if unsupported:
            raise ValueError(f"tokenizer_kwargs {unsupported}: not supported by the K3 chat encoding (it takes "
                             "truncation_side, padding_side, pad_to_multiple_of, return_attention_mask)")
        if truncation not in (False, None, "do_not_truncate"):
            limit = max_length if max_length is not None else self.model_max_length
            ids = [seq[:limit] if side == "right" else seq[max(len(seq) - limit, 0):] for seq in ids]
        batch = ids if is_batched or return_tensors else ids[0]
        return self.pad({"input_ids": batch}, padding=padding, max_length=max_length, return_tensors=return_tensors,
                        **pad_options)

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt=False, continue_final_message=False, tokenize=True, padding=False,
                            truncation=False, max_length=None, return_tensors=None, return_dict=True,
                            return_assistant_tokens_mask=False, tokenizer_kwargs=None, **kwargs):
        """As transformers' (same arguments and return values), with the conversation checked and normalised
        first, and with `tokenize=True` encoding message text as ordinary text wherever it spells a control token
        (see `ChatTagging`); `tokenize=False` returns the template's text unchanged. transformers 5.24's
        `sanitize_control_tokens` is accepted and changes nothing: this encoding always does it."""
        conversation = normalize_conversations(conversation)
        kwargs.pop("sanitize_control_tokens", None)
        render = dict(tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, **kwargs)
        plain = super().apply_chat_template(conversation, chat_template=chat_template, tokenize=False, **render)
        if not tokenize:
            try:
                pieces = self.chat_pieces(conversation, plain, chat_template, tools, kwargs, render)
            except ChatMessageError:  # a template that inspects its own markers: its text, as it is
                return plain
            texts = []
            for text, parts in zip(plain if isinstance(plain, list) else [plain], pieces):
                texts.append(KimiK3ChatText(text))
                texts[-1].kimik3_chat_pieces = tuple(parts)
            return texts if isinstance(plain, list) else texts[0]
        is_batched = isinstance(plain, list)
        pieces = self.chat_pieces(conversation, plain, chat_template, tools, kwargs, render)
        if not return_assistant_tokens_mask:
            ids = [self.encode_chat_pieces(p) for p in pieces]
            out = self.chat_batch_encoding(ids, is_batched, padding, truncation, max_length, return_tensors,
                                           tokenizer_kwargs)
            return out if return_dict else out["input_ids"]
        if not return_dict or continue_final_message:
            raise ValueError("return_assistant_tokens_mask needs return_dict=True and no continue_final_message "
                             "(as transformers')")
        spans = self.generation_spans(conversation, plain, chat_template, tools, documents, add_generation_prompt,
                                      kwargs)
        encoded = [self.encode_chat_pieces(p, s) for p, s in zip(pieces, spans)]
        out = self.chat_batch_encoding([ids for ids, _ in encoded], is_batched, padding, truncation, max_length,
                                       None, tokenizer_kwargs)
        # the mask padded and truncated as the ids were: the same call on the mask rows, whose padded places (the
        # pad id) the padding's own attention mask then zeroes
        masks = self.chat_batch_encoding([mask for _, mask in encoded], True, padding, truncation, max_length, None,
                                         {**(tokenizer_kwargs or {}), "return_attention_mask": True})
        masks = [[m * a for m, a in zip(row, attention)]
                 for row, attention in zip(masks["input_ids"], masks["attention_mask"])]
        out["assistant_masks"] = masks if is_batched else masks[0]
        if return_tensors:
            out.convert_to_tensors(tensor_type=return_tensors)
        return out

    def generation_spans(self, conversation, plain, chat_template, tools, documents, add_generation_prompt, kwargs):
        """The character ranges of each rendered conversation's `{% generation %}` blocks (transformers' renderer:
        what the model writes in an assistant turn, as the template marks it), in the text `plain` the ids encode."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = self.get_chat_template(chat_template, tools)
        conversations = conversation if isinstance(conversation[0], (list, tuple)) else [conversation]
        rendered, spans = render_jinja_template(
            conversations=[list(c) for c in conversations], tools=tools, documents=documents,
            chat_template=template, return_assistant_tokens_mask=True, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})
        if list(rendered) != (plain if isinstance(plain, list) else [plain]):
            raise ValueError("return_assistant_tokens_mask: the template rendered another text when asked for its "
                             "{% generation %} blocks, so their places cannot be read off the encoded text")
        return spans

    def chat_pieces(self, conversation, plain, chat_template, tools, kwargs, render) -> list:
        """(text, is_template_marker) pieces of each rendered conversation, from the tagged rendering (ChatTagging)
        checked against the plain one `plain`."""
        template = self.get_chat_template(chat_template, tools)
        tagging = self.chat_tagging()
        tagged = super().apply_chat_template(
            conversation, chat_template=tagging.template(template), tokenize=False,
            **tagging.template_kwargs(template, self.special_tokens_map, kwargs), **render)
        pairs = zip(tagged, plain) if isinstance(plain, list) else [(tagged, plain)]
        return [tagging.split(t, p) for t, p in pairs]


class KimiK3Tokenizer(ChatNormalizingMixin, PreTrainedTokenizer):
    """The slow K3 tokenizer (pure Python; see the module docstring)."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, added_tokens_decoder=None, **kwargs):
        import regex

        source = _config_source(kwargs)
        self.vocab_file = vocab_file or os.path.join(os.path.dirname(source), VOCAB_FILES_NAMES["vocab_file"])
        self.ranks = load_ranks(self.vocab_file)
        self.num_ranks = len(self.ranks)
        self.specials = resolve_specials(self.num_ranks, added_tokens_decoder, source)
        specials_by_token = {t: i for i, t in self.specials.items()}
        _named_defaults(kwargs, specials_by_token, source)
        # (?V1): set operations such as `[...&&[^\p{Han}]]`; V0 would read `&&` as two literal characters
        self.pattern = regex.compile("(?V1)" + PAT_STR)
        self.id_to_bytes = [b""] * (self.num_ranks + NUM_RESERVED_SPECIAL)
        for token, rank in self.ranks.items():
            self.id_to_bytes[rank] = token
        for token_id, content in self.specials.items():
            self.id_to_bytes[token_id] = content.encode("utf-8")
        self.text_to_id = {token_text(token): rank for token, rank in self.ranks.items()}
        self.id_to_text = {rank: text for text, rank in self.text_to_id.items()}
        self._piece_cache: dict[bytes, tuple[str, ...]] = {}
        self._added_tokens_decoder = {
            i: AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False)
            for i, t in self.specials.items()}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.num_ranks + NUM_RESERVED_SPECIAL

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(self.text_to_id)
        vocab.update({t: i for i, t in self.specials.items()})
        return vocab

    def _piece_tokens(self, piece: bytes) -> tuple[str, ...]:
        cached = self._piece_cache.get(piece)
        if cached is None:
            parts = [piece] if piece in self.ranks else bpe_parts(self.ranks, piece)
            cached = tuple(self.id_to_text[self.ranks[p]] for p in parts)
            if len(self._piece_cache) < 100_000:
                self._piece_cache[piece] = cached
        return cached

    def _tokenize(self, text, **kwargs):
        tokens = []
        for piece in self.pattern.findall(text):
            tokens.extend(self._piece_tokens(piece.encode("utf-8")))
        return tokens

    def _convert_token_to_id(self, token):
        if token in self.text_to_id:
            return self.text_to_id[token]
        return self.convert_tokens_to_ids(self.unk_token)

    def _convert_id_to_token(self, index):
        if index in self.id_to_text:
            return self.id_to_text[index]
        return self.specials.get(index, self.unk_token)

    def convert_tokens_to_string(self, tokens):
        specials_by_token = {t: i for i, t in self.specials.items()}
        return self._bytes_of_ids([specials_by_token.get(t, self.text_to_id.get(t)) for t in tokens])

    def _bytes_of_ids(self, ids) -> str:
        # bytes first, text once: a character split over two tokens decodes whole; an incomplete sequence (the end
        # of a partial generation) becomes U+FFFD instead of an exception
        return b"".join(self.id_to_bytes[i] for i in ids if i is not None).decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        ids = check_token_ids(token_ids, self.vocab_size)
        if skip_special_tokens:
            ids = [i for i in ids if i < self.num_ranks]
        return self._bytes_of_ids(ids)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        import shutil

        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)


class KimiK3TokenizerFast(ChatNormalizingMixin, PreTrainedTokenizerFast):
    """The fast K3 tokenizer (`tokenizers`); without a `tokenizer.json` it is built from `tiktoken.model`."""

    vocab_files_names = {**VOCAB_FILES_NAMES, "tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]
    slow_tokenizer_class = KimiK3Tokenizer

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        # our __init__ reads tokenizer.json, or builds the backend from tiktoken.model (transformers' own tiktoken
        # path would need the `tiktoken` package and would not know the Kimi pre-tokenizer)
        return kwargs

    def __init__(self, vocab_file=None, tokenizer_file=None, added_tokens_decoder=None, **kwargs):
        source = _config_source(kwargs)
        self.vocab_file = vocab_file
        if tokenizer_file is None or not os.path.isfile(tokenizer_file):
            ranks = load_ranks(vocab_file or os.path.join(os.path.dirname(source), VOCAB_FILES_NAMES["vocab_file"]))
            num_ranks = len(ranks)
            specials = resolve_specials(num_ranks, added_tokens_decoder, source)
            kwargs["tokenizer_object"] = build_fast_backend(ranks, specials)
        else:
            kwargs["tokenizer_file"] = tokenizer_file
            from tokenizers import Tokenizer

            backend_vocab = Tokenizer.from_file(tokenizer_file).get_vocab_size(with_added_tokens=False)
            specials = resolve_specials(backend_vocab, added_tokens_decoder, source)
        _named_defaults(kwargs, {t: i for i, t in specials.items()}, source)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)
        for token_id, content in specials.items():
            if self.convert_tokens_to_ids(content) != token_id:
                raise TokenizerFileError(f"{source}: {content!r} is id {self.convert_tokens_to_ids(content)} in "
                                         f"tokenizer.json but {token_id} in tokenizer_config.json")

    def _decode(self, token_ids, *args, **kwargs):
        ids = [token_ids] if isinstance(token_ids, int) else (
            token_ids["input_ids"] if isinstance(token_ids, dict) else token_ids)
        return super()._decode(check_token_ids(ids, len(self)), *args, **kwargs)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        import shutil

        if self.vocab_file is None or not os.path.isfile(self.vocab_file):
            return ()
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
