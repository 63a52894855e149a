"""Speculative rounds on the static cache on CUDA (generate_kimi_k3.py; docs/design.md, Decode loop): each round
compiled and captured as a CUDA graph, `decode_block_steps` rounds a host read. In fp32 with chunk_kda's reference
(the default fp32 matmul precision) the round computes what plain decode steps compute, so the speculative greedy
tokens are the decode loop's plain greedy tokens, with a sliced draft, a draft that always agrees (the target
itself), and prompt lookup; the acceptance the loop reports is within its possible range and all-accepted for the
agreeing draft. bf16 is left to the benchmark (bench_serving.py --only spec_static), where the rounding of a
(k+1)-token verify may part from one-token steps."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

NEW = 24


@pytest.fixture(scope="module")
def model():
    from kimik3.tiny import build_tiny_model

    return build_tiny_model(num_hidden_layers=4, seed=3).cuda().eval()


def _generate(model, ids, **kwargs):
    from kimik3.modeling import generate_kimi_k3 as loop

    return loop.generate(ids, model=model, cache_implementation="static", do_sample=False, eos_token_id=None,
                         max_new_tokens=NEW, decode_block_steps=2, **kwargs)


@pytest.mark.parametrize("draft", ["slice", "agrees", "lookup"])
def test_captured_rounds_give_the_plain_greedy_tokens(model, draft):
    from kimik3.draft import slice_draft_model

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, 9), generator=generator)
    if draft == "lookup":  # a repetitive prompt, so lookups find matches
        ids = ids.repeat(1, 3)
    ids = ids.cuda()
    plain = _generate(model, ids)
    report = {}
    if draft == "lookup":
        kwargs = {"prompt_lookup_num_tokens": 3}
    else:
        kwargs = {"assistant_model": model if draft == "agrees" else slice_draft_model(model, 2),
                  "num_assistant_tokens": 3}
    got = _generate(model, ids, decode_fallback=False, decode_report=report, **kwargs)
    assert torch.equal(got, plain)
    assert report["rounds"] >= 2 and 0 <= report["accepted"] <= report["proposed"]
    if draft == "agrees":
        assert report["accepted"] == report["proposed"]
