"""`kimik3 serve` under tensor parallelism (docs/design.md, Serving): two gloo ranks load a tiny folder with a vision
tower with `tp_plan="auto"`, rank 0 serves over HTTP and both compute (tests/serve_parallel_worker.py, in the suite's
one launch of two ranks). Concurrent requests of different lengths, one of n=2, a streamed chat, a chat with an image,
a stream its client leaves early and one whose sampling fails on rank 0 (a 500 naming the error, on every rank); the
others get the greedy tokens one process gives each alone (fp32), and a request after them still does: the ranks ran
the same steps throughout."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kimik3.chat_format import encode_chat, parse_reply


@pytest.fixture(scope="module")
def served(two_rank_runs):
    return json.loads((two_rank_runs["parallel"] / "serve" / "served.json").read_text())


@pytest.fixture(scope="module")
def alone(two_rank_runs):
    folder = two_rank_runs["parallel"] / "serve" / "vision"
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)

    def generate(ids: list[int], new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        return out[0, len(ids):].tolist()

    return generate, tokenizer, model


def test_tensor_parallel_serving_gives_one_process_greedy_tokens(served, alone):
    generate, tokenizer, model = alone
    # the served model was sharded: rank 0 held half of the first layer's output projection (its input features)
    rows, columns = next(p for n, p in model.named_parameters() if n.endswith("layers.0.self_attn.o_proj.weight")).shape
    assert served["o_proj_held"] == [rows, columns // 2]
    for prompt, tokens in zip(served["prompts"], served["tokens"]):
        assert tokens == tokenizer.convert_ids_to_tokens(generate(prompt, 6))
    first = tokenizer.convert_ids_to_tokens(generate(served["prompts"][0], 6))
    assert served["twins"] == [first, first]  # n=2, greedy: both sequences of the shared prefill
    assert served["after"] == tokenizer.convert_ids_to_tokens(generate(served["prompts"][2], 6))
    chat = encode_chat(tokenizer, [{"role": "user", "content": "Which river flows through Vienna?"}],
                       add_generation_prompt=True, reasoning_effort="max")
    reply = parse_reply(tokenizer.decode(generate(chat, 8)))
    assert served["chat"] == reply.reasoning + reply.response
    assert served["stats"]["decode_forwards"] > 0 and served["stats"]["regroups"] > 1
    # rank 0's sampler failed for one request: that request got a 500 naming the error, the others their tokens
    assert "generation failed: ValueError: a sampler that fails on purpose" in served["failure"]


def test_an_image_served_under_tensor_parallelism_is_read_by_every_rank(served, alone, two_rank_runs):
    """The image's pixels reach the other rank with the step that brings its job: the first token's 20 likeliest
    log-probabilities are one process's with that picture (and far from those without it)."""
    from transformers import AutoProcessor

    from k3_test_utils import noise_image

    generate, tokenizer, model = alone
    processor = AutoProcessor.from_pretrained(two_rank_runs["parallel"] / "serve" / "vision", trust_remote_code=True)

    def first_logprobs(content):
        inputs = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True, return_tensors="pt",
                                               reasoning_effort="max")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
            return out.tolist(), torch.log_softmax(model(**inputs).logits[0, -1].float(), dim=-1)

    tokens, top = served["image"]
    want, first = first_logprobs([{"type": "text", "text": "What is it?"},
                                  {"type": "image", "image": noise_image(1)}])
    assert tokens == tokenizer.convert_ids_to_tokens(want)
    ids = tokenizer.convert_tokens_to_ids([token for token, _ in top])
    values = torch.tensor([value for _, value in top])
    assert (values - first[ids]).abs().max() < 1e-5
    from PIL import Image

    _, other = first_logprobs([{"type": "text", "text": "What is it?"},
                               {"type": "image", "image": Image.new("RGB", (140, 112), (0, 250, 120))}])
    assert (values - other[ids]).abs().max() > 1e-3
