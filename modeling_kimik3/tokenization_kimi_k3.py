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
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

from transformers import AddedToken, PreTrainedTokenizer, PreTrainedTokenizerFast

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
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
    on a tie), considering only ranks below `max_rank` when given."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_index, best_rank = -1, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (max_rank is None or rank < max_rank) and (best_rank is None or rank < best_rank):
                best_index, best_rank = i, rank
        if best_rank is None:
            break
        parts[best_index:best_index + 2] = [parts[best_index] + parts[best_index + 1]]
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


def normalize_tool_call(call: dict) -> dict:
    """An OpenAI-style call with its `arguments` as typed values: a JSON-object string is parsed (as the encoder does;
    a Jinja template cannot parse JSON), keys deep-sorted. A string that is not a JSON object stays a string and is
    rendered as a `json` block."""
    call = dict(call)
    function = dict(call.get("function") or {k: call[k] for k in ("name", "arguments") if k in call})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    if isinstance(arguments, dict):
        arguments = deep_sorted(arguments)
    function["arguments"] = arguments if arguments is not None else {}
    call["function"] = function
    return call


def normalize_conversation(messages: list[dict]) -> list[dict]:
    """What the encoder does before rendering and a Jinja template cannot: tool-call arguments given as JSON strings
    become typed values (keys deep-sorted). The template itself orders tool results by call."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [normalize_tool_call(call) for call in message["tool_calls"]]
        out.append(message)
    return out


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


class ChatNormalizingMixin:
    """`apply_chat_template` normalises the conversation first (tool arguments parsed from JSON strings), so the Jinja
    template renders what the encoder renders. `save_pretrained` (and so `push_to_hub`) writes this file and the
    `auto_map` naming it, so the folder loads with trust_remote_code whether the tokenizer came from the installed
    package or from a folder."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        saved = super().save_pretrained(save_directory, *args, **kwargs)
        directory, here = Path(save_directory), Path(__file__).resolve()
        # transformers 5 saves a fast tokenizer as tokenizer.json only; the ranks file keeps the slow class loadable
        saved = tuple(saved) + tuple(p for p in self.save_vocabulary(str(directory)) if p not in saved)
        if here != (directory / here.name).resolve():
            shutil.copyfile(here, directory / here.name)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["auto_map"] = {**config.get("auto_map", {}),
                              "AutoTokenizer": [f"{here.stem}.KimiK3Tokenizer", f"{here.stem}.KimiK3TokenizerFast"]}
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return tuple(saved) + (str(directory / here.name),)

    def apply_chat_template(self, conversation, *args, **kwargs):
        if conversation and isinstance(conversation[0], dict):
            conversation = normalize_conversation(list(conversation))
        elif conversation and isinstance(conversation[0], (list, tuple)):
            conversation = [normalize_conversation(list(c)) for c in conversation]
        return super().apply_chat_template(conversation, *args, **kwargs)


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
            cached = tuple(token_text(p) for p in parts)
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
        ids = [int(i) for i in token_ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
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

    def save_vocabulary(self, save_directory, filename_prefix=None):
        import shutil

        if self.vocab_file is None or not os.path.isfile(self.vocab_file):
            return ()
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
