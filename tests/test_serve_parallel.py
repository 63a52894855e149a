"""`kimik3 serve` under tensor parallelism (docs/design.md, Serving): two gloo ranks load the tiny folder with
`tp_plan="auto"`, rank 0 serves over HTTP and both compute (tests/serve_parallel_worker.py, in the suite's one launch
of two ranks). Concurrent requests of different lengths, one of n=2, a streamed chat and a stream its client leaves
early get the greedy tokens one process gives each alone (fp32), and a request after the cancellation still does: the
ranks ran the same steps throughout."""

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
    folder = two_rank_runs["tiny_dir"]
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
    rows, columns = model.model.layers[0].self_attn.o_proj.weight.shape
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
