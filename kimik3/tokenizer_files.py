"""A K3 tokenizer folder without the release: a synthetic BPE ranks file in the tiktoken format (trained here on a
small built-in corpus with the Kimi pre-tokenizer), `tokenizer_config.json` with the 256 reserved specials, the chat
template and `tokenizer.json`. `kimik3 tiny` and the tests use it; the files have the release's layout, so the same
code reads them and the real ones."""

import base64
import json
from collections import Counter
from pathlib import Path

from kimik3.configuration import CHAT_TEMPLATE_PATH
from kimik3.modeling.tokenization_kimi_k3 import (
    PAT_STR,
    build_fast_backend,
    default_specials,
    load_ranks,
    tokenizer_code_files,
)

TOKENIZER_FILE_NAMES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja")
from kimik3.convert.files import OUR_AUTO_TOKENIZER as AUTO_TOKENIZER  # noqa: E402  (one home of the auto_map)

# Text the synthetic merges are learnt from: the chat markup words, English, code, digits, CJK; enough that the
# merges are real multi-level BPE (merges of merges), not only pairs of bytes.
TRAINING_TEXT = """\
message role="user" role="assistant" role="system" role="tool" type="tool-declare" type="thinking-effort"
think response tools call tool="get_weather" index="1" argument key="city" type="string" type="number" json
The quick brown fox jumps over the lazy dog. What's the weather in Paris today? It's sunny and 21 degrees.
def main(argv):\n    return sum(int(x) for x in argv)  # the answer is 42\n
你好，世界！今天天气很好。我们去公园散步吧。 Hello, world! こんにちは 안녕하세요 Привет мир
The system is invoked with `thinking_effort=max`. Here are the available tools, described in JSONSchema.
{"location": "San Francisco", "unit": "celsius", "days": 3, "verbose": true}
1234567890 3.14159 2026-11-30 https://example.com/path?query=value&other=1
"""


def pretokenize(text: str) -> list[bytes]:
    import regex

    return [piece.encode("utf-8") for piece in regex.findall("(?V1)" + PAT_STR, text)]


def train_ranks(num_ranks: int, text: str = TRAINING_TEXT) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 single bytes, then the most frequent adjacent pair of the pre-tokenized text
    merged at each step (ties broken by the pair's bytes, so the result is deterministic)."""
    if num_ranks < 256:
        raise ValueError(f"num_ranks={num_ranks}: byte-level BPE needs at least the 256 single bytes")
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(piece[i:i + 1] for i in range(len(piece))) for piece in pretokenize(text))
    while len(ranks) < num_ranks:
        pairs = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                if a + b not in ranks:
                    pairs[a, b] += count
        if not pairs:
            raise ValueError(f"num_ranks={num_ranks}: the training text supports only {len(ranks)} ranks")
        (a, b), _ = min(pairs.items(), key=lambda item: (-item[1], item[0]))
        ranks[a + b] = len(ranks)
        words = Counter({_merge_word(word, a, b): count for word, count in words.items()})
    return ranks


def _merge_word(word: tuple, a: bytes, b: bytes) -> tuple:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def ranks_file_text(ranks: dict[bytes, int]) -> str:
    return "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                   for token, rank in sorted(ranks.items(), key=lambda item: item[1]))


def tokenizer_config(num_ranks: int) -> dict:
    """`tokenizer_config.json` in the release's layout, pointing at our tokenizer classes; `eos_token` is the chat
    turn's end `<|end_of_msg|>` (what generation stops at), not the document end `[EOS]`."""
    specials = default_specials(num_ranks)
    return {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for i, t in sorted(specials.items())},
        "auto_map": {"AutoTokenizer": list(AUTO_TOKENIZER)},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|end_of_msg|>",
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "KimiK3Tokenizer",
        "unk_token": "[UNK]",
    }


def special_token_ids(num_ranks: int) -> dict:
    """The model config's token ids for a vocabulary of `num_ranks` ranks (BOS, chat EOS, PAD)."""
    return {"bos_token_id": num_ranks, "eos_token_id": num_ranks + 2, "pad_token_id": num_ranks + 255}


def write_tokenizer_folder(directory, num_ranks: int) -> list[Path]:
    """Writes the synthetic ranks, `tokenizer_config.json`, `chat_template.jinja` and `tokenizer.json` (vocabulary:
    num_ranks + 256) and the tokenizer's remote code. Returns the paths written."""
    import shutil

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks(num_ranks)
    written = []
    ranks_path = directory / "tiktoken.model"
    ranks_path.write_text(ranks_file_text(ranks))
    written.append(ranks_path)
    config_path = directory / "tokenizer_config.json"
    config_path.write_text(json.dumps(tokenizer_config(num_ranks), indent=2, sort_keys=True) + "\n")
    written.append(config_path)
    template_path = directory / "chat_template.jinja"
    shutil.copyfile(CHAT_TEMPLATE_PATH, template_path)
    written.append(template_path)
    backend = build_fast_backend(load_ranks(ranks_path), default_specials(num_ranks))
    fast_path = directory / "tokenizer.json"
    backend.save(str(fast_path))
    written.append(fast_path)
    for source in tokenizer_code_files():
        shutil.copyfile(source, directory / source.name)
        written.append(directory / source.name)
    return written
