"""The XTML chat format: the Jinja template and the Python renderer give the same text and token ids on a broad set of
conversations; the reply parser recovers reasoning, response and typed tool calls; `chat()` goes from a prompt to
streamed text on a tiny folder (the `kimik3 chat` program: tests/test_chat_cli.py)."""

import json
import random

import pytest
from transformers import TextStreamer

from kimik3.chat import chat, load_chat
from kimik3.chat_format import ChatFormatError, ReplyParser, encode_chat, parse_reply, render_segments, render_text
from kimik3.modeling.tokenization_kimi_k3 import KimiK3Tokenizer
from kimik3.tiny import TINY_NUM_RANKS, write_tiny_folder

N = TINY_NUM_RANKS
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": '{"city": "Paris", "days": 2, "flag": true, '
                                                                    '"none": null, "opts": {"b": 1, "a": [1.5, "x"]}}'}},
         {"id": "c2", "type": "function", "function": {"name": "search", "arguments": {"q": "Rome & \"more\""}}}]
CONVERSATIONS = {
    "single-user": ([{"role": "user", "content": "Hello!"}], {}),
    "system-named": ([{"role": "system", "content": "Be brief.", "name": "ops"},
                      {"role": "user", "content": "Hi", "name": "ann"}], {}),
    "developer-dropped": ([{"role": "developer", "content": "Rules."}, {"role": "user", "content": "x"}], {}),
    "developer-with-tools-dropped": ([{"role": "developer", "content": "Rules.", "tools": TOOLS[:1]},
                                      {"role": "user", "content": "x"}], {}),
    "system-declares-tools": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"},
                               {"role": "system", "tools": TOOLS[1:]},
                               {"role": "system", "content": "Now search."},
                               {"role": "system", "tools": TOOLS[:1], "name": "ignored"},
                               {"role": "user", "content": "y"}], {"tools": TOOLS[1:]}),
    "thinking-off": ([{"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                      {"role": "user", "content": "And 3+3?"}], {"thinking": False, "reasoning_effort": "high"}),
    "effort-low": ([{"role": "user", "content": "Hi"}], {"reasoning_effort": "low"}),
    "multi-turn-reasoning-echoed": ([{"role": "user", "content": "2+2?"},
                                     {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                                     {"role": "user", "content": "And 3+3?"},
                                     {"role": "assistant", "content": "6"},  # no reasoning: empty think section
                                     {"role": "user", "content": "Thanks"}], {}),
    "tools-and-results-reordered": ([{"role": "user", "content": "Weather in Paris, news of Rome?"},
                                     {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
                                      "tool_calls": CALLS},
                                     {"role": "tool", "tool_call_id": "c2", "content": "news"},
                                     {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                                     {"role": "assistant", "content": "Rain; news."}],
                                    {"tools": TOOLS, "tool_choice": "required"}),
    "tool-result-by-position": ([{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
                                 {"role": "tool", "content": "{\"t\": 20}"}], {}),
    "unparseable-arguments-json-block": ([{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "",
                                           "tool_calls": [{"id": "z", "function": {"name": "search",
                                                                                  "arguments": "not json {"}}]}],
                                         {}),
    "images": ([{"role": "user", "content": [{"type": "text", "text": "What is in "}, {"type": "image"},
                                            {"type": "text", "text": " and "}, {"type": "image_url"}]}], {}),
    "effort-low-json-schema": ([{"role": "user", "content": "JSON please"}],
                               {"reasoning_effort": "low", "response_format": {
                                   "type": "json_schema", "json_schema": {"schema": {"type": "object", "b": 1,
                                                                                     "a": 2}}}}),
    "effort-none-json-object": ([{"role": "user", "content": "中文 émoji 👍"}],
                                {"reasoning_effort": None, "response_format": {"type": "json_object"},
                                 "tool_choice": "none"}),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_chat")
    write_tiny_folder(directory, num_hidden_layers=4, seed=0)
    return directory


@pytest.fixture(scope="module")
def loaded(folder):
    return load_chat(folder)


@pytest.fixture(scope="module")
def slow(folder):
    return KimiK3Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_jinja_template_and_python_renderer_agree(loaded, slow, name, add_generation_prompt):
    tokenizer, _ = loaded
    messages, options = CONVERSATIONS[name]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **options)
    assert text == render_text(messages, add_generation_prompt=add_generation_prompt, **options)
    python_ids = encode_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **options)
    # no marker text in these messages: the segment-wise ids are those of the flat text with its specials parsed
    assert python_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    for tok in (tokenizer, slow):
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      add_generation_prompt=add_generation_prompt, **options)["input_ids"]
        assert ids == python_ids
    assert encode_chat(slow, messages, add_generation_prompt=add_generation_prompt, **options) == python_ids


def test_format_facts():
    messages, options = CONVERSATIONS["tools-and-results-reordered"]
    text = render_text(messages, add_generation_prompt=True, **options)
    # block order: tool declarations, effort (max by default), messages, tool_choice, generation prompt
    order = [text.index(s) for s in ('type="tool-declare"', "thinking_effort=max", 'role="user"', 'type="tool-choice"')]
    assert order == sorted(order)
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert '"parameters":{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}' in text
    # JSON-string arguments become typed, deep-sorted elements; non-strings use json.dumps' default separators
    assert ('<|open|>argument key="flag" type="boolean"<|sep|>true<|close|>argument<|sep|>'
            '<|open|>argument key="none" type="null"<|sep|>null<|close|>argument<|sep|>'
            '<|open|>argument key="opts" type="object"<|sep|>{"a": [1.5, "x"], "b": 1}<|close|>argument') in text
    assert 'key="q" type="string"<|sep|>Rome & "more"<|close|>' in text
    # results in call order, indexed 1.., named after the call
    assert text.index('tool="get_weather" index="1"<|sep|>rain') < text.index('tool="search" index="2"<|sep|>news')
    assert text.count("<|open|>think<|sep|>Two calls.<|close|>think<|sep|>") == 1
    echoed = render_text(CONVERSATIONS["multi-turn-reasoning-echoed"][0])
    assert "<|open|>think<|sep|>Add them.<|close|>think<|sep|>" in echoed
    assert "<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>6" in echoed
    assert 'key="city"' not in render_text(CONVERSATIONS["unparseable-arguments-json-block"][0])
    assert '<|open|>json type="object"<|sep|>not json {<|close|>json' in render_text(
        CONVERSATIONS["unparseable-arguments-json-block"][0])


def test_user_typed_marker_text_stays_ordinary_tokens_on_both_paths(loaded, slow):
    """Marker text typed in a message is ordinary text in the Python encoder and in apply_chat_template alike (the
    exhaustive cases: tests/test_bad_inputs_chat.py)."""
    tokenizer, _ = loaded
    messages = [{"role": "user", "content": "say <|end_of_msg|> please"}]
    python_ids = encode_chat(tokenizer, messages)
    eom = tokenizer.convert_tokens_to_ids("<|end_of_msg|>")
    assert python_ids.count(eom) == 2  # the effort message's and the user message's, not the typed one
    for tok in (tokenizer, slow):
        assert tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == python_ids
    assert tokenizer.decode(python_ids) == tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("effort", ["extreme", "MAX", "medium"])
def test_unsupported_reasoning_effort_is_refused_both_ways(loaded, effort):
    """`medium` too: the release's encoder asserts low, high or max (its note text names medium, which it refuses)."""
    tokenizer, _ = loaded
    with pytest.raises(ChatFormatError, match="reasoning_effort must be low, high or max, as the release's encoder"):
        render_segments([{"role": "user", "content": "x"}], reasoning_effort=effort)
    with pytest.raises(Exception, match="reasoning_effort must be low, high or max, as the release's encoder"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, reasoning_effort=effort)


def test_thinking_off_developer_and_dynamic_tools_follow_the_release_encoder():
    """thinking=False: no effort message, no think sections, the generation prompt opens the response; developer
    messages are dropped; a system message with tools declares them where it stands, as new tools (the release's
    dynamic declaration: its own heading, no text)."""
    messages, options = CONVERSATIONS["thinking-off"]
    text = render_text(messages, add_generation_prompt=True, **options)
    assert "thinking-effort" not in text and "<|open|>think" not in text and "Add them." not in text
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert "<|open|>response<|sep|>4<|close|>response<|sep|>" in text
    plain = render_text([{"role": "user", "content": "x"}])
    assert render_text(CONVERSATIONS["developer-dropped"][0]) == plain
    assert render_text(CONVERSATIONS["developer-with-tools-dropped"][0]) == plain
    dynamic = render_text(*CONVERSATIONS["system-declares-tools"][:1], **CONVERSATIONS["system-declares-tools"][1])
    assert dynamic.count('type="tool-declare"') == 3
    # the tools argument: the first block, the usual heading; each declaring system message: where it stands, the
    # heading of tools added to the existing ones, and neither a message of its own nor its name
    assert dynamic.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the')
    assert dynamic.count("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                         "You have access to all existing and extended tools.\nHere are the specs for the extended "
                         "tools.\n\n```json\n") == 2
    assert dynamic.index("<|sep|>x<|close|>") < dynamic.index("Now search.") < dynamic.index('"name":"get_weather"')
    assert dynamic.count('<|open|>message role="system"<|sep|>') == 2 and "ignored" not in dynamic
    assert "thinking_effort=low" in render_text(*CONVERSATIONS["effort-low"][:1], **CONVERSATIONS["effort-low"][1])


def test_parser_recovers_reasoning_response_and_typed_tool_calls():
    messages, _ = CONVERSATIONS["tools-and-results-reordered"]
    assistant = render_text([messages[1]])
    parsed = parse_reply(assistant + "<|end_of_msg|>")
    assert parsed.complete and parsed.reasoning == "Two calls." and parsed.response == ""
    assert [(c.name, c.index) for c in parsed.tool_calls] == [("get_weather", 1), ("search", 2)]
    assert parsed.tool_calls[0].arguments == json.loads(CALLS[0]["function"]["arguments"])
    assert parsed.tool_calls[1].arguments == {"q": 'Rome & "more"'}
    # a reply continuing the generation prompt (inside <|open|>think<|sep|>), cut before the end
    cut = parse_reply("Thinking hard<|close|>think<|sep|><|open|>response<|sep|>Hel")
    assert (cut.reasoning, cut.response, cut.complete) == ("Thinking hard", "Hel", False)
    with pytest.raises(ChatFormatError, match="not well nested"):
        parse_reply("x<|close|>response<|sep|>")
    with pytest.raises(ChatFormatError, match="type number is not valid JSON"):
        parse_reply('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
                    '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="n" type="number"<|sep|>abc'
                    '<|close|>argument<|sep|>')


def _outcome(parse):
    try:
        reply = parse()
    except ChatFormatError as error:
        return "error", str(error)
    return reply.reasoning, reply.response, [(c.name, c.arguments, c.index) for c in reply.tool_calls], reply.complete


def test_the_parser_fed_in_pieces_says_what_parsing_each_prefix_whole_says():
    """A streamed reply is parsed as it grows (kimik3 serve): at every point the pieces fed so far must read as the
    whole text up to there does, whatever the pieces' bounds (inside a tag, a marker, an argument), nesting errors
    included. Random replies of the format's markup, tags cut short and markers written out as plain text."""
    words = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response", "message", "tools", "call",
             "argument", "json", ' tool="f"', ' key="k"', ' type="integer"', ' type="string"', "hello ", "12",
             '{"a": 1}', "<|", "op", "en|>", "x", "é", " "]
    opening = "why<|close|>think<|sep|><|open|>response<|sep|>"
    rng = random.Random(5)
    prefixes = errors = 0
    for _ in range(1500):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
        text = (opening if rng.random() < 0.5 else "") + text
        text = ("<|open|>message" if rng.random() < 0.2 else "") + text
        parser, fed, failed = ReplyParser(), 0, None
        for cut in sorted({rng.randint(0, len(text)) for _ in range(8)} | {len(text)}):
            whole = _outcome(lambda: parse_reply(text[:cut]))
            if failed is None:
                try:
                    parser.feed(text[fed:cut])
                except ChatFormatError as error:
                    failed = ("error", str(error))
                fed = cut
            assert (failed or _outcome(parser.reply)) == whole, text[:cut]
            prefixes, errors = prefixes + 1, errors + (whole[0] == "error")
    assert prefixes > 5000 and 0 < errors < prefixes / 4  # both kinds of outcome were met


class RecordingStreamer(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=False)
        self.pieces = []

    def on_finalized_text(self, text, stream_end=False):
        self.pieces.append(text)


def test_chat_generates_from_the_template_prompt_streams_and_stops_at_end_of_msg(loaded, monkeypatch):
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    tokenizer, model = loaded
    eom = tokenizer.convert_tokens_to_ids("<|end_of_msg|>")
    assert eom == N + 2 and model.generation_config.eos_token_id == eom

    class EndAtStep(LogitsProcessor):  # the random model would not end by itself: force <|end_of_msg|> at step 5
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - prompt_length == 5:
                scores[:, :] = -float("inf")
                scores[:, eom] = 0.0
            return scores

    expected_prompt = encode_chat(tokenizer, [{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    prompt_length = len(expected_prompt)
    seen = {}
    original = model.generate

    def spy(input_ids, **kwargs):
        seen["ids"] = input_ids[0].tolist()
        return original(input_ids, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    streamer = RecordingStreamer(tokenizer)
    result = chat(tokenizer, model, "Hi there", max_new_tokens=20, streamer=streamer,
                  logits_processor=LogitsProcessorList([EndAtStep()]))
    assert seen["ids"] == expected_prompt == result.prompt_ids
    assert len(result.new_ids) == 6 and result.new_ids[-1] == eom and eom not in result.new_ids[:-1]
    assert "".join(streamer.pieces) == tokenizer.decode(result.new_ids) == result.text
    assert isinstance(torch.tensor(result.new_ids), torch.Tensor)
