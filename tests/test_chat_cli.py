"""`kimik3 chat` as a chat program: the loop over stdin keeps the history and echoes each reply back as the template
renders an earlier assistant turn, `--prompt` is one turn, a system prompt and tool declarations go into the prompt,
the reasoning efforts are the chat format's own list, long prompts are prefilled in chunks with the same result, and
images are read from a path or file:// URL (never from the network). Bad inputs: docs/bad_inputs.md, "kimik3 chat and
images by path". The CLI runs in-process on one tiny folder; the loop tests script the model's replies."""

import io
import json
import os
import re
import socket
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import kimik3.chat
import kimik3.chat_format
from kimik3.chat import Conversation, assistant_message, chat, load_chat
from kimik3.chat_format import REASONING_EFFORTS, encode_chat, parse_reply, render_text
from kimik3.cli import main
from kimik3.tiny import write_tiny_folder

REPLY = ("Hmm.<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|>"
         "<|end_of_msg|>")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_chat_cli")
    write_tiny_folder(directory, num_hidden_layers=4, seed=0)
    return directory


@pytest.fixture(scope="module")
def loaded(folder):
    return load_chat(folder)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat_inputs")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(directory / "photo.png")
    data = (directory / "photo.png").read_bytes()
    (directory / "cut.png").write_bytes(data[: len(data) // 2])
    (directory / "notes.txt").write_text("not an image\n")
    (directory / "tools.json").write_text(json.dumps(TOOLS))
    (directory / "bad.json").write_text('[{"type": "function", "function": {"name": "f"}')
    (directory / "object.json").write_text('{"name": "f"}')
    (directory / "noname.json").write_text('[{"type": "function", "function": {"description": "no name"}}]')
    (directory / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (directory / "long.txt").write_text(" ".join(f"w{i}" for i in range(3000)))
    (directory / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    os.mkfifo(directory / "tools-fifo")
    return directory


@pytest.fixture
def session(loaded, monkeypatch):
    """`kimik3 chat` on the module's loaded folder with generate() replaced by a scripted reply (the loop is under
    test, not the model): every call's prompt ids are recorded."""
    tokenizer, model = loaded
    calls, replies = [], []

    def generate(input_ids, **kwargs):
        calls.append({"ids": input_ids[0].tolist(), **kwargs})
        reply = tokenizer.encode(replies.pop(0) if replies else REPLY, add_special_tokens=False)
        return torch.cat([input_ids, torch.tensor([reply])], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    monkeypatch.setattr(kimik3.chat, "load_chat", lambda directory, vision=False: (tokenizer, model))
    return SimpleNamespace(calls=calls, replies=replies, tokenizer=tokenizer)


def _stdin(monkeypatch, data: bytes):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_stdin_loop_keeps_the_history_and_echoes_each_reply_as_the_template_expects(session, folder, monkeypatch,
                                                                                    capsys):
    _stdin(monkeypatch, b"hi\n\nagain\n/exit\nnever read\n")
    assert main(["chat", str(folder), "--system", "Be brief."]) == 0
    assert len(session.calls) == 2  # the blank line is skipped, /exit ends the loop
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    echoed = {"role": "assistant", "content": "Hi", "reasoning_content": "Hmm."}
    tokenizer = session.tokenizer
    assert session.calls[0]["ids"] == encode_chat(tokenizer, first, add_generation_prompt=True)
    assert session.calls[1]["ids"] == encode_chat(tokenizer, first + [echoed, {"role": "user", "content": "again"}],
                                                  add_generation_prompt=True)
    assert "<|open|>think<|sep|>Hmm.<|close|>think<|sep|>" in tokenizer.decode(session.calls[1]["ids"])
    assert capsys.readouterr().out.count("[response] Hi") == 2


def test_terminal_session_reads_turns_with_input_until_eof(session, folder, monkeypatch, capsys):
    turns = iter(["hello", "  ", "bye"])

    def typed(prompt):
        print(prompt, end="")
        try:
            return next(turns)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", typed)
    assert main(["chat", str(folder)]) == 0
    assert len(session.calls) == 2
    captured = capsys.readouterr()
    assert "type a message (one line a turn), /exit or Ctrl-D to end" in captured.err
    assert captured.out.count("> ") == 4 and captured.out.count("[response] Hi") == 2


def test_prompt_is_one_turn_with_the_tools_and_effort_in_its_prompt(session, folder, files, monkeypatch):
    _stdin(monkeypatch, b"must not be read\n")
    assert main(["chat", str(folder), "--prompt", "Weather in Paris?", "--tools", str(files / "tools.json"),
                 "--reasoning-effort", "low", "--max-new-tokens", "7"]) == 0
    (call,) = session.calls
    assert call["ids"] == encode_chat(session.tokenizer, [{"role": "user", "content": "Weather in Paris?"}],
                                      tools=TOOLS, reasoning_effort="low", add_generation_prompt=True)
    assert call["max_new_tokens"] == 7


def test_reasoning_efforts_are_read_from_the_chat_format(monkeypatch):
    """No copy of the list in the CLI: what chat_format accepts is what `--reasoning-effort` accepts."""
    seen = []
    monkeypatch.setattr(kimik3.chat, "run_chat", lambda directory, prompt, tokens, effort, **kw: seen.append(effort))
    for effort in REASONING_EFFORTS:
        assert main(["chat", "DIR", "--prompt", "x", "--reasoning-effort", effort]) == 0
    assert seen == list(REASONING_EFFORTS)
    assert main(["chat", "DIR", "--prompt", "x", "--reasoning-effort", "pondering"]) == 2
    monkeypatch.setattr(kimik3.chat_format, "REASONING_EFFORTS", REASONING_EFFORTS + ("pondering",))
    assert main(["chat", "DIR", "--prompt", "x", "--reasoning-effort", "pondering"]) == 0 and seen[-1] == "pondering"


def test_tool_calls_are_echoed_into_the_history_as_typed_calls():
    call = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
            '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    message = assistant_message(parse_reply(call), call, tokenizer=None)
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Paris"}}}]
    # rendered back, the earlier turn is the text the model produced (after the generation prompt)
    prompt = render_text([{"role": "user", "content": "x"}], add_generation_prompt=True)
    assert render_text([{"role": "user", "content": "x"}, message]) == prompt + call


def test_long_prompt_is_prefilled_in_chunks_with_the_unchunked_result(loaded):
    tokenizer, model = loaded
    lengths, logits = [], []
    hooks = [model.model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]),
                                                   with_kwargs=True),
             model.register_forward_hook(lambda m, a, out: logits.append(out.logits[0, -1]))]
    try:
        whole = chat(tokenizer, model, "The quick brown fox.", max_new_tokens=2)
        n = len(whole.prompt_ids)
        assert whole.prefill_chunks == [] and lengths == [n, 1]  # short of a chunk: generate() prefills it whole
        chunk = (n - 1) // 2 - 1  # two whole chunks and a part
        chunked = chat(tokenizer, model, "The quick brown fox.", max_new_tokens=2, prefill_chunk_size=chunk)
    finally:
        for hook in hooks:
            hook.remove()
    assert chunked.prefill_chunks == [chunk, chunk, n - 1 - 2 * chunk]
    assert lengths[2:] == chunked.prefill_chunks + [1, 1]  # then generate() runs only the last prompt token
    assert chunked.new_ids == whole.new_ids
    # the first new token's logits: the whole prompt at once against the chunks through the cache
    torch.testing.assert_close(logits[5], logits[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def vision_chat(loaded):
    """A tiny composite model on the tiny folder's vocabulary and the K3 processor over its tokenizer."""
    from kimik3.convert import testing
    from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
    from kimik3.modeling.multimodal_kimi_k3 import KimiK3ForConditionalGeneration
    from kimik3.modeling.processing_kimi_k3 import KimiK3Processor
    from kimik3.tiny import TINY_NUM_RANKS
    from kimik3.tokenizer_files import special_token_ids

    tokenizer, _ = loaded
    ids = special_token_ids(TINY_NUM_RANKS)
    raw = testing.tiny_release_config(num_layers=2, num_experts=4, vision_overrides={"patch_size": 14},
                                      config_overrides={"vocab_size": TINY_NUM_RANKS + 256, **ids})
    raw.update(ids, media_placeholder_token_id=tokenizer.convert_tokens_to_ids("<|media_pad|>"))
    torch.manual_seed(1)
    model = KimiK3ForConditionalGeneration(KimiK3Config(**raw)).eval()
    return tokenizer, model, KimiK3Processor(tokenizer=tokenizer)


def test_image_by_path_goes_through_the_chat_and_its_chunked_prefill(vision_chat, files, monkeypatch, capsys):
    tokenizer, model, processor = vision_chat
    conversation = Conversation()
    whole = conversation.turn(tokenizer, model, "What is it?", files / "photo.png", max_new_tokens=2,
                              processor=processor)
    media = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert whole.prompt_ids.count(media) == 2 * 3  # 60x40 -> 84x56: 4x6 patches, 2x3 merged rows
    chunked = chat(tokenizer, model, conversation.messages[:1], max_new_tokens=2, processor=processor,
                   prefill_chunk_size=4)
    assert chunked.prefill_chunks[0] > 4 and chunked.new_ids == whole.new_ids  # the first chunk holds the image
    # the CLI: --image attaches it to the first turn of the folder's model
    monkeypatch.setattr(kimik3.chat, "load_chat", lambda directory, vision=False: vision_chat)
    assert main(["chat", "DIR", "--image", (files / "photo.png").as_uri(), "--prompt", "And now?",
                 "--max-new-tokens", "1"]) == 0, capsys.readouterr().err


def test_processor_chat_template_reads_images_by_path_url_and_key(vision_chat, files):
    _, _, processor = vision_chat
    photo = files / "photo.png"
    expected = processor.image_processor.preprocess([Image.open(photo)])["pixel_values"]
    for part in ({"type": "image", "url": str(photo)}, {"type": "image", "path": str(photo)},
                 {"type": "image", "image": str(photo)}, {"type": "image", "url": photo.as_uri()}):
        inputs = processor.apply_chat_template([{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
                                               tokenize=True, return_dict=True, add_generation_prompt=True)
        assert torch.equal(inputs["pixel_values"], expected), part


def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("source, message", [
    pytest.param("https://example.com/cat.png", "https://example.com/cat.png: remote image URLs are not fetched",
                 id="image-source-remote-url"),
    pytest.param("missing.png", "missing.png: no such image file", id="image-source-missing-file"),
    pytest.param("notes.txt", "notes.txt: not an image file", id="image-source-not-an-image"),
    pytest.param("cut.png", "cut.png: cannot read the image", id="image-source-truncated"),
    pytest.param(".", "is a folder, not an image file", id="image-source-folder"),
    pytest.param("file://server/share/cat.png", "a file:// URL on host 'server'",
                 id="image-source-file-url-other-host"),
    pytest.param("fifo", "fifo: is not a regular file", id="image-source-fifo"),
    pytest.param("data:image/png,rawbytes", "data URL 'data:image/png': only base64 data URLs are read",
                 id="image-source-data-url-not-base64"),
])
def test_bad_image_sources_are_named_and_never_fetched(vision_chat, files, monkeypatch, source, message):
    _no_network(monkeypatch)
    _, _, processor = vision_chat
    if source == "fifo" and not (files / "fifo").exists():
        os.mkfifo(files / "fifo")  # opening it would block until a writer comes: it must be refused unopened
    source = source if ":" in source else str(files / source)
    conversation = [{"role": "user", "content": [{"type": "image", "url": source}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        processor.apply_chat_template(conversation, tokenize=True, return_dict=True, add_generation_prompt=True)


@pytest.mark.parametrize("args, stdin, message", [
    pytest.param(["--bogus"], b"", "kimik3 chat: error: unrecognized arguments: --bogus", id="chat-unknown-option"),
    pytest.param(["--reasoning-effort", "extreme"], b"", "argument --reasoning-effort: invalid choice: 'extreme' "
                 rf"\(choose from {', '.join(map(repr, REASONING_EFFORTS))}\)", id="chat-effort-not-in-template"),
    pytest.param(["--prompt", "x", "--prompt-file", "long.txt"], b"", "argument --prompt-file: not allowed with "
                 "argument --prompt", id="chat-prompt-and-prompt-file"),
    pytest.param([], b"hi\n\xff\xfeoops\n", r"stdin, line 2: not UTF-8 text \(byte 0xff at offset 0\)",
                 id="chat-stdin-not-utf8"),
    pytest.param(["--prompt", "caf\udce9"], b"", r"argument --prompt: not UTF-8 text \(byte 0xe9 at offset 3\)",
                 id="chat-prompt-not-utf8"),
    pytest.param(["--prompt-file", "latin1.txt"], b"", r"latin1.txt: not UTF-8 text \(byte 0xe9 at offset 3\)",
                 id="chat-prompt-file-not-utf8"),
    pytest.param(["--prompt-file", "nothing.txt"], b"", "--prompt-file .*nothing.txt: no such file",
                 id="chat-prompt-file-missing"),
    pytest.param(["--prompt-file", "long.txt"], b"", "the prompt is [0-9,]+ tokens, but the model's "
                 "max_position_embeddings is 4,096: no room for a reply", id="chat-prompt-too-long"),
    pytest.param(["--tools", "bad.json"], b"", r"--tools .*bad.json: not valid JSON \(Expecting",
                 id="chat-tools-not-json"),
    pytest.param(["--tools", "object.json"], b"", "object.json: must hold a non-empty JSON list of tool declarations",
                 id="chat-tools-not-a-list"),
    pytest.param(["--tools", "noname.json"], b"", "noname.json: tool 0 is not a declaration with a name",
                 id="chat-tools-no-name"),
    pytest.param(["--tools", "absent.json"], b"", "--tools .*absent.json: no such file", id="chat-tools-missing"),
    pytest.param(["--tools", "deep.json"], b"", "--tools .*deep.json: nested too deeply to parse",
                 id="chat-tools-nested-100k-deep"),
    pytest.param(["--tools", "tools-fifo"], b"", "--tools .*tools-fifo: is not a regular file",
                 id="chat-tools-fifo"),
    pytest.param(["--image", "https://example.com/cat.png"], b"", "--image: https://example.com/cat.png: remote "
                 "image URLs are not fetched", id="chat-image-remote-url"),
    pytest.param(["--image", "missing.png"], b"", "--image: .*missing.png: no such image file",
                 id="chat-image-missing"),
])
def test_bad_chat_inputs_exit_2_naming_the_input(session, folder, files, monkeypatch, capsys, args, stdin, message):
    _no_network(monkeypatch)
    monkeypatch.chdir(files)
    _stdin(monkeypatch, stdin)
    assert main(["chat", str(folder), *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err
    if args == ["--bogus"]:
        assert err.startswith("usage: kimik3 chat ")


@pytest.mark.parametrize("turns", [pytest.param(b"hi\nagain\nnever\n", id="chat-history-too-long")])
def test_conversation_outgrowing_the_model_ends_with_exit_2(session, folder, monkeypatch, capsys, turns):
    """The second turn's prompt (the history with it) is past max_position_embeddings: error naming both numbers."""
    tokenizer = session.tokenizer
    original = tokenizer.apply_chat_template

    def longer_from_the_second_turn(messages, **kwargs):
        result = original(messages, **kwargs)
        if len(messages) > 1:
            result["input_ids"] = [tokenizer.pad_token_id] * 5000
        return result

    monkeypatch.setattr(tokenizer, "apply_chat_template", longer_from_the_second_turn)
    _stdin(monkeypatch, turns)
    assert main(["chat", str(folder)]) == 2
    assert len(session.calls) == 1
    assert ("kimik3 chat: error: the prompt is 5,000 tokens, but the model's max_position_embeddings is 4,096: no "
            "room for a reply; shorten the prompt (or start a new conversation)") in capsys.readouterr().err


@pytest.mark.parametrize("room", [pytest.param(3, id="chat-reply-shortened-to-fit")])
def test_reply_is_shortened_to_fit_max_position_embeddings_with_a_note(session, loaded, folder, monkeypatch, capsys,
                                                                      room):
    _, model = loaded
    prompt = encode_chat(session.tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    monkeypatch.setattr(model.config, "max_position_embeddings", len(prompt) + room)
    assert main(["chat", str(folder), "--prompt", "hi", "--max-new-tokens", "10"]) == 0
    assert session.calls[0]["max_new_tokens"] == room
    assert (f"kimik3 chat: note: the reply is limited to {room} tokens: the prompt is {len(prompt)} tokens of the "
            f"model's max_position_embeddings {len(prompt) + room}") in capsys.readouterr().err


@pytest.mark.parametrize("make, message", [
    pytest.param(lambda root: root / "empty", "{}: no config.json", id="chat-folder-without-config"),
    pytest.param(None, "{}: --image needs a model with a vision tower; its config.json describes none",
                 id="chat-image-text-only-model"),
])
def test_chat_folder_errors(folder, files, tmp_path, capsys, make, message):
    directory = make(tmp_path) if make else folder
    directory.mkdir(exist_ok=True)
    args = ["--image", str(files / "photo.png")] if make is None else []
    assert main(["chat", str(directory), "--prompt", "Hello", *args]) == 2
    assert f"kimik3 chat: error: {message.format(directory)}" in capsys.readouterr().err


def test_chat_cli_generates_from_the_folder(folder, capsys):
    assert main(["chat", str(folder), "--prompt", "Hello", "--max-new-tokens", "3"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", [pytest.param("deep", id="chat-config-nested-100k-deep")])
def test_chat_on_a_folder_whose_config_cannot_be_parsed_names_it(tmp_path, monkeypatch, capsys, kind):
    folder = tmp_path / "k3"
    write_tiny_folder(folder, num_hidden_layers=2)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["chat", str(folder), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{folder / 'config.json'}: nested too deeply to parse" in err, err


@pytest.mark.parametrize("kind", [pytest.param("release", id="chat-release-folder")])
def test_chat_on_a_release_folder_points_to_adopt_and_convert(tmp_path, monkeypatch, capsys, kind):
    """A release folder carries the release's own code under our files' names; the chat would run it."""
    from kimik3.convert import testing

    _no_network(monkeypatch)
    release = testing.write_release_checkpoint(tmp_path / "rel", num_layers=2, num_experts=2, vision=False,
                                               return_dense=False).path
    assert main(["chat", str(release), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "the release's folder, with the release's own code" in err
    assert f"kimik3 adopt {release} K3_DIR" in err and f"kimik3 convert {release} K3_DIR" in err

