"""Routed experts in host memory on CUDA (offload_kimi_k3.py; docs/design.md, Routed experts off the device): the
chosen experts cross from pinned memory on the cache's copy stream while the block computes its latent
down-projection and shared experts, or on the compute stream (`side_stream = False`). Either way the compact stack
holds the same bytes as the device's full stack, so in fp32 the logits of prefill and decode, and the greedy tokens of
two generate() calls over one kept cache, are those of the same model held entirely on the GPU, bit for bit, dense and
packed, with a cache too small for one forward's choices (moves for that forward only) and one that holds them all.
Under torch's deterministic algorithms: without them the model on the GPU differs from itself between two calls
(2.5e-7 in fp32: atomic adds), and the offloaded model from it by as much."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from k3_test_utils import offloaded_copy  # noqa: E402


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def on_gpu(request):
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    model = build_tiny_model(seed=5, num_experts=16, top_k=6)
    return (model if request.param == "dense" else packed_mxfp4_copy(model)).cuda().eval()


@pytest.fixture(autouse=True)
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _offloaded(model, experts_per_layer, side_stream):
    from kimik3.modeling.modeling_kimi_k3 import KimiK3Experts

    copied = offloaded_copy(model, experts_per_layer)
    copied.experts_cache.side_stream = side_stream
    assert all(stack.device.type == "cpu" and stack.is_pinned()
               for module in copied.modules() if isinstance(module, KimiK3Experts) for stack in module.stacks())
    return copied


@pytest.mark.parametrize("side_stream", [True, False])
@pytest.mark.parametrize("experts_per_layer", [1, 16])
def test_offloaded_experts_give_the_logits_and_tokens_of_the_model_on_the_gpu(on_gpu, side_stream, experts_per_layer):
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

    model = _offloaded(on_gpu, experts_per_layer, side_stream)
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        caches = [KimiK3Cache(m.config) for m in (on_gpu, model)]
        want, got = (m(input_ids=ids, past_key_values=c, use_cache=True).logits for m, c in zip((on_gpu, model), caches))
        assert torch.equal(got, want)
        token = want[:, -1:].argmax(-1)
        for _ in range(3):
            want, got = (m(input_ids=token, past_key_values=c, use_cache=True).logits
                         for m, c in zip((on_gpu, model), caches))
            assert torch.equal(got, want)
            token = want[:, -1:].argmax(-1)
    moved = model.experts_cache.moves
    for seed in (2, 3):  # two calls over the one kept cache of experts
        prompt = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(seed)).cuda()
        plain = on_gpu.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), plain)
    if experts_per_layer < on_gpu.config.num_experts:  # too small for one forward's choices: every call moves
        assert model.experts_cache.moves > moved
    assert model.experts_cache.resident_bytes() <= model.experts_cache.budget_bytes
