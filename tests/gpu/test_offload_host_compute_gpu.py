"""Routed experts computed where they live on a CUDA model (`experts_compute`; docs/design.md, Routed experts
computed where they live): the chosen experts the device's cache lacks run on the CPU (the format's kernel over the
packed bytes in pinned memory, on the cache's worker thread while the GPU computes its share), the routes' outputs
come back and are summed in the reference's order. The CPU's f32 sums are not the GPU's, so in fp32 the logits agree
within the two devices' rounding (not bit for bit, as the copy placements of test_offload_gpu.py do), and the greedy
tokens are the same; in bf16 they stay within the one-device model's own distance from its fp32 logits."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from k3_test_utils import offloaded_copy  # noqa: E402


def _count_graph_captures(monkeypatch) -> list:
    """torch.cuda.graph counted from here on: the returned list grows by one a capture."""
    captures, graph = [], torch.cuda.graph

    def count(*args, **kwargs):
        captures.append(1)
        return graph(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "graph", count)
    return captures


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def on_gpu(request):
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    model = build_tiny_model(seed=5, num_experts=16, top_k=6)
    return (model if request.param == "dense" else packed_mxfp4_copy(model)).cuda().eval(), request.param


def _computed_on_host(model, compute, experts_per_layer=4, in_stream=None):
    copied = offloaded_copy(model, experts_per_layer)
    copied.experts_cache.compute = compute
    copied.experts_cache.in_stream = in_stream
    return copied


@pytest.mark.parametrize("compute", ["host", "auto"])
def test_the_cpu_share_gives_the_gpu_models_logits_and_tokens(on_gpu, compute):
    from kimik3.modeling.host_experts_kimi_k3 import measure_host_rates

    model, fmt = on_gpu
    placed = _computed_on_host(model, compute, in_stream=False)  # the routes read by the host (streamed: below)
    if compute == "auto":
        module = next(m for m in placed.modules() if getattr(m, "offload", None) is not None)
        placed.experts_cache.rates = measure_host_rates(module, torch.device("cuda"))
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        want, got = model(ids).logits, placed(ids).logits
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(placed.generate(ids, **kwargs), model.generate(ids, **kwargs))
    cache = placed.experts_cache
    if compute == "host":
        assert cache.host_routes > 0 and cache.moves == 0
        # the packed format runs its CPU kernel on a CUDA model; dense runs the reference on the CPU
        assert (cache.kernel_calls > 0) == (fmt == "mxfp4")


def test_bf16_stays_as_close_as_the_gpu_models_own_bf16(on_gpu):
    model, _ = on_gpu
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        exact = model(ids).logits
        half = copy.deepcopy(model).to(torch.bfloat16)
        own = (half(ids).logits.float() - exact).abs().max().item()
        placed = _computed_on_host(half, "host", in_stream=False)
        got = (placed(ids).logits.float() - exact).abs().max().item()
    assert placed.experts_cache.host_routes > 0
    assert got <= 2 * own + 1e-3, (got, own)


@pytest.mark.parametrize("compute", ["device", "host"])
def test_the_decode_loop_captures_the_step_piece_by_piece(on_gpu, compute, monkeypatch):
    """With the experts in host memory the decode loop compiles its step with a graph break at each read of the
    routes (generate_kimi_k3's `piecewise_decode_step`) and torch's cudagraph trees capture every piece: none is
    skipped (`cudagraph_or_error` turns a skip into an error), CUDA graphs are captured, and the greedy tokens are
    the GPU model's."""
    import torch._dynamo
    import torch._inductor.config

    from kimik3.modeling import generate_kimi_k3 as loop

    model, _ = on_gpu
    placed = _computed_on_host(model, compute, in_stream=False)
    captures, graph = [], torch.cuda.graph

    def counted(*args, **kwargs):
        captures.append(1)
        return graph(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "graph", counted)
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)
    monkeypatch.setattr(loop, "_PIECEWISE_STEP", None)
    torch._dynamo.reset()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(8)).cuda()
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static")
    want = loop.generate(ids, model=model, decode_compile=False, **kwargs)
    got = loop.generate(ids, model=placed, decode_compile=True, **kwargs)
    assert torch.equal(got, want)
    moe_layers = sum(1 for m in placed.modules() if getattr(m, "offload", None) is not None)
    assert len(captures) >= 2 * moe_layers  # at least the pieces before and after each layer's routed experts
    cache = placed.experts_cache
    assert (cache.host_routes > 0) == (compute == "host")
    torch._dynamo.reset()


@pytest.mark.parametrize("hot", [False, True])
def test_streamed_routes_run_in_one_captured_decode_step(hot, monkeypatch):
    """experts_compute="host" on CUDA computes the routes on the CPU in the stream's order (host_experts_kimi_k3's
    `StreamedRoutes`): no host read of the routes, so the decode loop compiles its step whole (fullgraph) and
    captures each block as one CUDA graph. Eager logits within the two devices' rounding, the loop's greedy tokens
    the GPU model's, the routes counted by the host step (and with experts placed on the GPU, those run there)."""
    import torch._dynamo

    from kimik3.modeling import generate_kimi_k3 as loop
    from kimik3.modeling.offload_kimi_k3 import place_hot_experts
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    model = packed_mxfp4_copy(build_tiny_model(seed=5, num_experts=16, top_k=6)).cuda().eval()
    placed = _computed_on_host(model, "host")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        if hot:
            placed(ids[:1, :5])  # a calibration prompt (streamed: 5 tokens), its routes counted by the step
            assert all(len(e) == placed.experts_cache.capacity for e in place_hot_experts(placed).values())
        want, got = model(ids).logits, placed(ids).logits
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert loop._routes_read_by_host(placed, 2) is False
    layers = [m.offload for m in placed.modules() if getattr(m, "offload", None) is not None]
    assert all((layer.layer in placed.experts_cache.slots) == hot for layer in layers)
    counted = sum(int(layer.cache.routes[layer.layer].sum()) for layer in layers)
    assert counted >= len(layers) * (2 * 9 * 6)

    captures = _count_graph_captures(monkeypatch)
    torch._dynamo.reset()
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static",
                  decode_block_steps=4)
    want = loop.generate(ids, model=model, decode_compile=False, **kwargs)
    got = loop.generate(ids, model=placed, decode_compile=True, **kwargs)
    assert torch.equal(got, want)
    assert 1 <= len(captures) <= 2  # the loop's own graphs (a block of steps, a one-step tail): the step whole
    torch._dynamo.reset()


def test_streamed_routes_in_bf16_stay_as_close_as_the_gpu_models_own_bf16():
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    model = packed_mxfp4_copy(build_tiny_model(seed=5, num_experts=16, top_k=6)).cuda().eval()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        exact = model(ids).logits
        half = copy.deepcopy(model).to(torch.bfloat16)
        own = (half(ids).logits.float() - exact).abs().max().item()
        placed = _computed_on_host(half, "host")
        got = (placed(ids).logits.float() - exact).abs().max().item()
    from kimik3.modeling.host_experts_kimi_k3 import StreamedRoutes

    assert all(isinstance(m.offload.stream, StreamedRoutes) for m in placed.modules()
               if getattr(m, "offload", None) is not None)
    assert got <= 2 * own + 1e-3, (got, own)


def test_the_release_disk_tier_streams_its_routes_over_the_mapped_parts(tmp_path, monkeypatch):
    """An adopted release folder loaded through the Auto class with its experts on the disk tier
    (experts_offload="disk": each expert's w1, w3 and w2 mapped from the release's shards) and experts_compute="host"
    on CUDA: every decode route is computed by the host step over the mapped parts in the stream's order (no route
    read, no expert moved; the hot ones placed from the parts run on the GPU), the decode loop captures the step
    whole, and the greedy tokens are those of the folder loaded whole on the GPU."""
    import sys

    import torch._dynamo
    from transformers import AutoModelForCausalLM

    from kimik3.convert import testing
    from kimik3.convert.adopt import adopt

    release = testing.write_release_checkpoint(tmp_path / "release" / "k3", seed=5, num_layers=3,
                                               num_experts=8).path
    adopt(release, tmp_path / "adopted", experts_format="mxfp4")
    load = dict(trust_remote_code=True, dtype=torch.float32)
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adopted"), device_map="cuda", **load).eval()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adopted"), device_map="cuda", experts_offload="disk",
                                                 experts_cache_bytes=10 ** 6, experts_compute="host", **load).eval()
    layers = [m.offload for m in model.modules() if getattr(m, "offload", None) is not None]
    assert layers and all(layer.parts is not None for layer in layers)
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        model(ids[:1, :5])  # a calibration prompt, streamed
        offload = sys.modules[type(model.experts_cache).__module__]  # the folder's copy of the code
        offload.place_hot_experts(model, per_layer=2)
        torch.testing.assert_close(model(ids).logits, whole(ids).logits, rtol=2e-4, atol=2e-4)
    assert model.experts_cache.moves == 0
    assert all(type(layer.stream).__name__ == "StreamedRoutes" and layer.layer in model.experts_cache.slots
               for layer in layers)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, cache_implementation="static")
    want = whole.generate(ids, **kwargs)
    captures = _count_graph_captures(monkeypatch)
    torch._dynamo.reset()
    assert torch.equal(model.generate(ids, **kwargs), want)
    assert 1 <= len(captures) <= 2  # the loop's own graphs (a block of steps, a one-step tail): the step whole
    assert model.experts_cache.moves == 0
    torch._dynamo.reset()
