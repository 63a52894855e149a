"""The K3 tokenizer on a synthetic ranks file in the release's format: slow and fast give the same ids, text round-trips
exactly, the specials sit at their ids, and bad files get errors naming the file and line or key."""

import json
import random
import shutil

import pytest
import regex

from kimik3.modeling.tokenization_kimi_k3 import (
    PAT_STR,
    KimiK3Tokenizer,
    KimiK3TokenizerFast,
    TokenizerFileError,
    load_ranks,
    ranks_to_merges,
)
from kimik3.tokenizer_files import write_tokenizer_folder

N = 512

CORPUS = [
    "Hello world! What's up? I'LL say we'Ve DON'T",
    "你好，世界！今天天气很好。Hello世界abc",
    "emoji 👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "e\u0301 a\u0308\u0301 Zalgo: Z\u0335\u0321\u031b a\u0336",
    " " * 40 + "x\n\n\n  \t y\r\n\r\n   \n",
    "def f(x):\n    return x**2  # ok\n\tTabbed\u00a0nbsp\u2028line sep\u3000ideographic space",
    "1234567890 3.14159 ٣٤٥ ⅷ ½",
    "Ünïcödé ΕΛΛΗΝΙΚΆ русский Ǆǅǆ ǅungla",
    "こんにちは カタカナ 안녕하세요 ภาษาไทย हिन्दी",
    "x\x00\x1c\x1d\x85 control ſ K",
    "",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer_folder(directory, N)
    return directory


@pytest.fixture(scope="module")
def slow(folder):
    return KimiK3Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def fast(folder):
    return KimiK3TokenizerFast.from_pretrained(folder)


def random_texts(count, seed=0):
    rng = random.Random(seed)
    pools = [range(0x20, 0x7F), range(0x00, 0x20), range(0x80, 0x250), range(0x300, 0x370), range(0x4E00, 0x4F00),
             range(0x3040, 0x30FF), range(0xAC00, 0xAC80), range(0x1F300, 0x1F700), range(0x2000, 0x2070),
             range(0x600, 0x6FF), range(0x900, 0x97F), range(0x20000, 0x20100), range(0x1D400, 0x1D500)]
    return ["".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_slow_and_fast_give_identical_ids_and_exact_round_trips(slow, fast):
    for text in CORPUS + random_texts(400):
        ids = slow.encode(text, add_special_tokens=False)
        assert fast.encode(text, add_special_tokens=False) == ids, repr(text)
        assert slow.decode(ids) == text and fast.decode(ids) == text, repr(text)
        assert all(i < N for i in ids)  # ordinary text never becomes a special id


def test_the_merges_are_real_bpe_and_whole_pieces_are_one_token(folder, slow):
    ranks = load_ranks(folder / "tiktoken.model")
    assert len(ranks) == N and len(ranks_to_merges(ranks)) == N - 256
    assert max(len(t) for t in ranks) >= 4  # merges of merges
    # a long learnt token that is one whole pre-token piece encodes to its own rank
    words = [t for t in ranks if len(t) >= 4 and t.isascii() and t.decode().strip().isalpha()]
    assert words
    for word in words:
        assert slow.encode(word.decode(), add_special_tokens=False) == [ranks[word]]


def test_pre_tokenizer_needs_set_intersection_semantics():
    pieces = regex.findall("(?V1)" + PAT_STR, "Hello世界abc 你好World's 12345")
    assert pieces == ["Hello", "世界", "abc", " ", "你好", "World's", " ", "123", "45"]
    # without V1, `&&` is two literal characters and Han is not excluded from the letter classes
    assert regex.findall("(?V0)" + PAT_STR, "Hello世界abc") != ["Hello", "世界", "abc"]


def test_special_tokens_sit_at_the_release_offsets(slow, fast):
    expected = {"[BOS]": N, "[EOS]": N + 1, "<|end_of_msg|>": N + 2, "<|open|>": N + 3, "<|close|>": N + 4,
                "<|sep|>": N + 5, "<|media_begin|>": N + 18, "<|media_content|>": N + 19, "<|media_end|>": N + 20,
                "<|media_pad|>": N + 21, "[UNK]": N + 254, "[PAD]": N + 255, f"<|reserved_token_{N + 6}|>": N + 6}
    for tok in (slow, fast):
        assert len(tok) == N + 256
        assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
        # the chat turn's end is the EOS generation stops at, not the document end [EOS]
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (N, N + 2, N + 255)
        ids = tok.encode("<|open|>hi<|sep|>", add_special_tokens=False)
        assert (ids[0], ids[-1]) == (N + 3, N + 5) and all(i < N for i in ids[1:-1])
        assert tok.decode([N + 2]) == "<|end_of_msg|>" and tok.decode([N + 2, 72], skip_special_tokens=True) == "H"


def test_partial_utf8_decodes_to_replacement_not_an_error(slow, fast):
    ids = slow.encode("👍", add_special_tokens=False)
    assert len(ids) > 1  # a 4-byte character over several byte tokens
    for tok in (slow, fast):
        assert tok.decode(ids[:1]) == "\ufffd"
        assert tok.decode(ids) == "👍"


def test_added_tokens_decoder_overrides_the_convention(folder, tmp_path):
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"][str(N + 7)]["content"] = "<|custom|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").unlink()  # the fast one is rebuilt from tiktoken.model with these specials
    for cls in (KimiK3Tokenizer, KimiK3TokenizerFast):
        tok = cls.from_pretrained(tmp_path)
        assert tok.convert_tokens_to_ids("<|custom|>") == N + 7
        assert tok.encode("a<|custom|>", add_special_tokens=False)[-1] == N + 7


def test_fast_is_built_from_the_ranks_when_there_is_no_tokenizer_json(folder, tmp_path, slow):
    """A converted release folder has tiktoken.model and no tokenizer.json; AutoTokenizer still works."""
    from transformers import AutoTokenizer

    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer.json").unlink()
    tok = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    assert tok.is_fast
    for text in CORPUS:
        assert tok.encode(text, add_special_tokens=False) == slow.encode(text, add_special_tokens=False)


def _write(folder, tmp_path, ranks_text=None, config_edit=None):
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer.json").unlink()
    if ranks_text is not None:
        (tmp_path / "tiktoken.model").write_text(ranks_text)
    if config_edit is not None:
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        config_edit(config)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def _ranks_lines(folder):
    return (folder / "tiktoken.model").read_text().splitlines(keepends=True)


@pytest.mark.parametrize("case, fragment", [
    ("malformed-line", r"tiktoken.model:3: expected `<base64 token> <rank>`"),
    ("bad-base64", r"tiktoken.model:3: not `<base64 token> <rank>`"),
    ("duplicate-rank", r"tiktoken.model:300: rank 3 is repeated \(first on line 4\)"),
    ("missing-byte", r"tiktoken.model: byte-level BPE needs every single byte"),
    ("missing-file", r"tiktoken.model\) is missing"),
    ("bos-not-special", r"tokenizer_config.json: bos_token = '<s>' is not one of the special tokens"),
    ("special-out-of-range", r"tokenizer_config.json: added_tokens_decoder\[5\] = 'x': special ids of this "
                             r"vocabulary are 512..767"),
    ("special-twice", r"tokenizer_config.json: added_tokens_decoder names '\[BOS\]' at ids 512 and 600"),
])
@pytest.mark.parametrize("cls", [KimiK3Tokenizer, KimiK3TokenizerFast], ids=["slow", "fast"])
def test_bad_tokenizer_files_name_the_file_and_line_or_key(folder, tmp_path, case, fragment, cls):
    lines = _ranks_lines(folder)
    edits = {
        "malformed-line": dict(ranks_text="".join(lines[:2] + ["QUJD\n"] + lines[3:])),
        "bad-base64": dict(ranks_text="".join(lines[:2] + ["@@@ 2\n"] + lines[3:])),
        "duplicate-rank": dict(ranks_text="".join(lines[:299] + [lines[299].split()[0] + " 3\n"] + lines[300:])),
        "missing-byte": dict(ranks_text="".join(lines[1:] + ["QUJDRA== 0\n"])),
        "missing-file": dict(ranks_text=""),
        "bos-not-special": dict(config_edit=lambda c: c.update(bos_token="<s>")),
        "special-out-of-range": dict(config_edit=lambda c: c["added_tokens_decoder"].update(
            {"5": {"content": "x", "special": True}})),
        "special-twice": dict(config_edit=lambda c: c["added_tokens_decoder"][str(N + 88)].update(content="[BOS]")),
    }
    directory = _write(folder, tmp_path, **edits[case])
    if case == "missing-file":
        (directory / "tiktoken.model").unlink()
    with pytest.raises((TokenizerFileError, OSError, ValueError), match=fragment):
        cls.from_pretrained(directory)
