"""Routed experts computed where they live (`experts_compute`): with the experts in host memory, the chosen experts
the device's cache lacks run on the CPU over their bytes (or, per forward, are copied, whichever `HostRates` says is
faster); every placement gives the logits and greedy tokens of the model held on one device, bit for bit in fp32
(docs/design.md, Routed experts computed where they live). On a CPU-only machine host and device are one, so these
run the placement's whole path (the split of the routes, the worker thread, the combine in the reference's order)
with the reference on both sides; the CPU kernel's own agreement is tests/test_host_experts.py's."""

import pytest
import torch

from k3_test_utils import offloaded_copy
from kimik3.tiny import build_tiny_model, packed_mxfp4_copy
from kimik3.modeling.host_experts_kimi_k3 import HostRates, measure_host_rates
from kimik3.modeling.offload_kimi_k3 import ExpertsOffloadError, place_hot_experts


@pytest.fixture(scope="module")
def models():
    dense = build_tiny_model(seed=5, num_experts=16, top_k=6)
    return {"dense": dense, "mxfp4": packed_mxfp4_copy(dense)}


def _split_rates(model, routes_per_expert: float = 4.0) -> HostRates:
    """Rates under which a forward whose missing experts serve fewer than `routes_per_expert` routes each (decode)
    computes them on the CPU and one with more (a prefill) copies them: the CPU's byte rate out of the way, its
    flop rate set at the crossover for this model's expert size."""
    module = next(m for m in model.modules() if getattr(m, "offload", None) is not None)
    copy = 1e8
    return HostRates(copy_bytes_per_s=copy, host_bytes_per_s=1e15,
                     host_flops=routes_per_expert * module.offload.flops_per_route * copy
                     / model.experts_cache.bytes_per_expert)


def _placed(reference, compute, experts_per_layer=4, split=True):
    model = offloaded_copy(reference, experts_per_layer=experts_per_layer)
    model.experts_cache.compute = compute
    if split:
        model.experts_cache.rates = _split_rates(model)
    return model


def _decode(model, ids, steps):
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return logits


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
@pytest.mark.parametrize("placement", ["host", "auto", "host+hot"])
def test_every_placement_gives_the_one_device_logits(models, fmt, placement):
    reference = models[fmt]
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    want = _decode(reference, ids, steps=4)
    model = _placed(reference, placement.split("+")[0])
    cache = model.experts_cache
    if placement == "host+hot":
        _decode(model, ids[:1, :5], steps=0)  # a calibration prompt: its routes are counted
        placed = place_hot_experts(model)
        assert all(len(hot) == cache.capacity for hot in placed.values())
        assert placed == {layer: sorted(hot) for layer, hot in cache.pinned.items()}
    got = _decode(model, ids, steps=4)
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), (placement, step)
    # the CPU computed routes in every placement; "host" never copies a missing expert, "auto" copied the prefill's
    assert cache.host_routes > 0 and cache.host_experts > 0
    if placement.startswith("host"):
        assert cache.moves == 0
    else:
        assert cache.moves > 0
    assert cache.kernel_calls == 0  # a CPU model runs the reference (the kernel is for a CUDA model's host share)


def test_greedy_generation_and_a_cache_reused_across_calls(models):
    reference = models["mxfp4"]
    model = _placed(reference, "auto")
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    want = reference.generate(ids, **kwargs)
    first = model.generate(ids, **kwargs)
    routes_after_first = model.experts_cache.host_routes
    second = model.generate(ids, **kwargs)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert model.experts_cache.host_routes > routes_after_first > 0


def test_the_auto_choice_follows_the_rates(models):
    """Few routes per missing expert: the CPU; a long prefill (many routes each): the copy. The rates decide, and
    the choice is per forward."""
    rates = HostRates(copy_bytes_per_s=50e9, host_bytes_per_s=200e9, host_flops=2e12)
    bytes_per_expert, flops = 17_498_112, 6 * 3072 * 3584  # one K3 expert, packed; one route through it
    assert rates.on_host(16, 16, bytes_per_expert, flops)          # decode, batch 1
    assert rates.on_host(122, 128, bytes_per_expert, flops)        # decode, batch 8
    assert not rates.on_host(896, 2048 * 16, bytes_per_expert, flops)  # a 2K prefill chunk
    model = _placed(models["dense"], "auto")
    prompt = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    assert model.experts_cache.moves > 0 and model.experts_cache.host_routes == 0  # 64 tokens: copied
    before = model.experts_cache.moves
    with torch.no_grad():  # one token: 6 experts chosen, the cache holds 4 a layer, the missing ones on the CPU
        model(out.logits[:1, -1:].argmax(-1), use_cache=False)
    assert model.experts_cache.host_routes > 0 and model.experts_cache.moves == before


def test_streaming_weighs_each_paths_per_layer_cost_and_the_held_experts():
    """"auto" streams a forward where the CPU's experts plus the stream's cost per layer beat the read path's best
    (CPU or copy) plus its route read; experts held on the device are computed by neither side."""
    bytes_per_expert, flops = 17_498_112, 6 * 3072 * 3584
    expert_s = bytes_per_expert / 50e9  # one expert's copy at 50 GB/s: 0.35 ms
    # the CPU 20% slower than the copy by bytes: at one token (16 experts, 1.1 ms behind) the route read it saves
    # (1.5 ms against the stream's 0.1) makes streaming faster; at 64 tokens (~612 experts, 43 ms behind) it is not
    rates = HostRates(copy_bytes_per_s=50e9, host_bytes_per_s=50e9 / 1.2, host_flops=1e15)
    assert rates.streams(1, 896, 16, bytes_per_expert, flops)
    assert not rates.streams(64, 896, 16, bytes_per_expert, flops)
    # with every expert held on the device neither side computes one: only the per-layer costs are left
    assert rates.streams(64, 896, 16, bytes_per_expert, flops, held=896)
    # the per-layer costs decide at the margin: a stream dearer than the read flips the one-token choice
    assert not HostRates(copy_bytes_per_s=50e9, host_bytes_per_s=50e9 / 1.2, host_flops=1e15, stream_layer_s=2e-3,
                         read_layer_s=1e-3).streams(1, 896, 16, bytes_per_expert, flops)
    # held experts shrink both sides: a CPU 40% slower is 2.2 ms behind over 16 missing experts (past the 1.4 ms
    # margin), 1.1 ms over the 8 missing when half are held
    slow = HostRates(copy_bytes_per_s=50e9, host_bytes_per_s=50e9 / 1.4, host_flops=1e15)
    assert 16 * 0.4 * expert_s > 1.5e-3 - 0.104e-3 > 8 * 0.4 * expert_s
    assert not slow.streams(1, 896, 16, bytes_per_expert, flops)
    assert slow.streams(1, 896, 16, bytes_per_expert, flops, held=448)


def _compiled_choice(module):
    """(a compiled step that returns x + 1 where the layer streams a forward of x's rows, else x - 1; the graphs its
    compiles made)"""
    import torch._dynamo

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()

    @torch.compile(backend=backend)
    def step(x):
        return x + 1 if module.offload.streams(x.shape[0], x.device, module.format, module._situ_betas()) else x - 1

    return step, graphs


def test_a_compiled_step_is_traced_again_where_autos_choice_changes_not_wherever_the_cache_keeps_an_expert(models):
    """Under "auto" the read path keeps experts one forward after another; a compiled decode step reads only the
    layer's choice, so it is traced again where the choice changes (new rates), not at every expert kept (a guard on
    the cache's slots retraced the step each forward until dynamo's recompile limit, then ran it eagerly)."""
    model = _placed(models["mxfp4"], "auto")
    cache = model.experts_cache
    cache.in_stream = True  # on the CPU the stream's step runs at once
    module = next(m for m in model.modules() if getattr(m, "offload", None) is not None)
    if module.format.host_kernels() is None:
        pytest.fail("the host kernel is not built here: a C compiler is part of the test environment")
    cache.rates = HostRates(copy_bytes_per_s=1e15, host_bytes_per_s=1e3, host_flops=1e3)  # the read path copies
    step, graphs = _compiled_choice(module)
    x = torch.zeros(1)
    assert step(x).item() == -1 and step(x).item() == -1
    traced = len(graphs)
    for first in range(0, 16, 3):  # 6 experts a forward, 4 kept a layer: the kept ones change every forward
        chosen = torch.tensor([[(first + i) % 16 for i in range(6)]])
        module.offload.fetch(chosen, module.stacks(), torch.device("cpu")).wait()
        assert step(x).item() == -1
    assert len(cache.slots[module.offload.layer].slot_of) == 4
    assert len(graphs) == traced
    cache.rates = HostRates(copy_bytes_per_s=1e3, host_bytes_per_s=1e15, host_flops=1e15)  # now the CPU is faster
    assert step(x).item() == 1 and len(graphs) > traced


def test_autos_choice_in_a_compiled_step_follows_the_experts_the_read_path_keeps(models):
    """The choice to stream weighs the experts the layer holds: under rates where the CPU is behind the copy by more
    than the route read saves over the 6 experts a token chooses but not over the 4 it then misses once the layer
    holds 4 of its 16, the compiled step copies first and streams once the read path has filled the layer's slots."""
    model = _placed(models["mxfp4"], "auto")
    cache = model.experts_cache
    cache.in_stream = True
    module = next(m for m in model.modules() if getattr(m, "offload", None) is not None)
    if module.format.host_kernels() is None:
        pytest.fail("the host kernel is not built here: a C compiler is part of the test environment")
    behind = cache.bytes_per_expert * (1 / 0.5e9 - 1 / 1e9)  # the CPU's lag a missing expert
    cache.rates = HostRates(copy_bytes_per_s=1e9, host_bytes_per_s=0.5e9, host_flops=1e18, stream_layer_s=0.0,
                            read_layer_s=5 * behind)  # streams below 5 missing experts
    step, graphs = _compiled_choice(module)
    x = torch.zeros(1)
    assert step(x).item() == -1 and step(x).item() == -1  # nothing held: 6 missing experts, copied
    module.offload.fetch(torch.tensor([[0, 1, 2, 3, 4, 5]]), module.stacks(), torch.device("cpu")).wait()
    assert len(cache.slots[module.offload.layer].slot_of) == 4
    # the next fetch of the read path works the choices out again for the 4 held now
    module.offload.fetch(torch.tensor([[0, 1, 2, 3, 6, 7]]), module.stacks(), torch.device("cpu")).wait()
    traced = len(graphs)
    assert step(x).item() == 1 and len(graphs) > traced  # 4 of 16 held: about 4 missing, streamed


def test_the_runtime_rates_assume_what_the_plan_assumes():
    """HostRates (the model's code, which cannot import the package) and kimik3 memory's plan state the same
    assumptions: a changed figure in one place fails here."""
    from kimik3 import memory

    rates = HostRates()
    assert rates.copy_bytes_per_s == memory.H2D_BANDWIDTH_ASSUMED
    assert rates.host_bytes_per_s == memory.HOST_EXPERTS_BYTES_ASSUMED
    assert rates.host_flops == memory.HOST_EXPERTS_FLOPS_ASSUMED
    assert rates.stream_layer_s == memory.STREAM_LAYER_S_ASSUMED
    assert rates.read_layer_s == memory.PIECEWISE_LAYER_S_ASSUMED


def test_a_placement_pins_its_experts_against_eviction(models):
    model = _placed(models["dense"], "device", experts_per_layer=3)
    cache = model.experts_cache
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(ids)
    placed = place_hot_experts(model, per_layer=2)
    with torch.no_grad():
        for seed in range(4):
            model(torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(seed)))
    for layer, hot in placed.items():
        assert set(hot) <= set(cache.layers[layer])  # still held after forwards that evicted others


def _place_over_capacity(model):
    module = next(m for m in model.modules() if getattr(m, "offload", None) is not None)
    model.experts_cache.place(0, [0, 1, 2], module.stacks(), "cpu")


@pytest.mark.parametrize("call, message", [
    (lambda model, plain: place_hot_experts(model), "no routes counted for layer 0 of the cache: run a forward"),
    (lambda model, plain: _place_over_capacity(model),
     "placing 3 experts on the device in layer 0 of the cache: it keeps 2 a layer"),
    (lambda model, plain: place_hot_experts(plain), "the model's routed experts are not offloaded"),
], ids=["place-no-routes", "place-over-capacity", "place-not-offloaded"])
def test_bad_placements_are_refused_by_name(models, call, message):
    model = _placed(models["dense"], "host", experts_per_layer=2)
    with pytest.raises(ExpertsOffloadError, match=message):
        call(model, models["dense"])


@pytest.mark.parametrize("offload, options, message", [
    ("host", dict(experts_compute="gpu"), r"experts_compute='gpu': unknown; known: \['device', 'host', 'auto'\]"),
    ("host", dict(experts_compute=True), r"experts_compute=True: unknown"),
    (None, dict(experts_compute="host"), r"experts_compute='host' needs experts_offload"),
], ids=["compute-unknown-mode", "compute-not-a-string", "compute-without-offload"])
def test_bad_compute_options_are_refused_by_name(offload, options, message):
    from kimik3.modeling.offload_kimi_k3 import check_offload_request

    with pytest.raises(ExpertsOffloadError, match=message):
        check_offload_request(offload, 10**6 if offload else None, {}, None, **options)


def test_the_load_option_reaches_the_cache(models, tmp_path):
    """`from_pretrained(..., experts_compute=...)` through the Auto classes of a saved folder: the cache computes
    where it was told, and an unknown value is refused before anything is read."""
    from transformers import AutoModelForCausalLM

    models["mxfp4"].save_pretrained(tmp_path)
    options = dict(experts_offload="host", experts_cache_bytes=10**6, trust_remote_code=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_compute="host", **options)
    assert loaded.experts_cache.compute == "host"
    # the folder's own copy of the code raises its own ExpertsOffloadError, a ValueError
    with pytest.raises(ValueError, match="experts_compute='cpu': unknown"):
        AutoModelForCausalLM.from_pretrained(tmp_path, experts_compute="cpu", **options)


def test_measured_rates_are_positive_and_say_so(models):
    model = _placed(models["mxfp4"], "device")
    module = next(m for m in model.modules() if getattr(m, "offload", None) is not None)
    rates = measure_host_rates(module)
    assert rates.measured and "measured" in repr(rates)
    assert rates.copy_bytes_per_s > 0 and rates.host_bytes_per_s > 0 and rates.host_flops > 0


def test_the_cpus_rate_is_timed_on_the_streams_own_step_over_experts_the_last_repeat_did_not_read(models,
                                                                                                   monkeypatch):
    """The CPU's byte rate is a decode step's: one token's top-k experts through the host step a stream runs, each
    repeat over experts the previous one did not read (so none is timed from the CPU's caches)."""
    from kimik3.kernels import mxfp4_host

    model = _placed(models["mxfp4"], "device")
    module = next(m for m in model.modules() if getattr(m, "offload", None) is not None)
    if module.format.host_kernels() is None:
        pytest.fail("the host kernel is not built here: a C compiler is part of the test environment")
    seen, run = [], mxfp4_host.HostRouteStep.run
    monkeypatch.setattr(mxfp4_host.HostRouteStep, "run", lambda step, x, ids: (seen.append(ids), run(step, x, ids))[1])
    rates = measure_host_rates(module, repeats=3)
    assert len(seen) == 4 and all(ids.shape == (1, module.config.num_experts_per_token) for ids in seen)
    assert all(set(a.tolist()[0]).isdisjoint(b.tolist()[0]) for a, b in zip(seen, seen[1:]))
    assert rates.measured and rates.host_bytes_per_s > 0


def test_the_kernel_runs_the_cpu_share_when_asked(models):
    """Forced on (as on a CUDA model), the format's kernel computes the host share: close to the reference (its
    sums' order), not bit for bit."""
    reference = models["mxfp4"]
    model = _placed(reference, "host")
    model.experts_cache.host_kernel = True
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert model.experts_cache.kernel_calls > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_decode_loop_runs_an_offloaded_model_and_its_compiled_step_breaks_only_where_the_host_reads_routes(
        monkeypatch):
    """With the experts in host memory the decode loop runs the model (the one-device tokens), and its compiled step
    is piecewise (generate_kimi_k3's `piecewise_decode_step`): the graph breaks at the expert module's offloaded calls
    and nowhere else, so each piece between them is one graph CUDA can capture (a break anywhere else would be a
    sync inside a piece). The MoE block is where the offloaded model differs from the one whose whole step traces as
    one graph (tests/test_decode_loop.py), so it is compiled here with a recording backend; on CUDA the whole step
    is, its pieces captured by torch's cudagraph trees (tests/gpu/test_offload_host_compute_gpu.py)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import kimik3.modeling.generate_kimi_k3 as loop
    from kimik3.modeling.modeling_kimi_k3 import KimiK3SparseMoeBlock

    reference = build_tiny_model(num_hidden_layers=2, seed=1, num_experts=16, top_k=6).eval()
    model = _placed(reference, "host")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=5, do_sample=False, cache_implementation="static", decode_block_steps=2,
                  decode_compile=False)
    assert torch.equal(loop.generate(ids, model=model, **kwargs), loop.generate(ids, model=reference, **kwargs))
    assert model.experts_cache.host_routes > 0

    pieces = []

    def recording(graph, inputs):
        pieces.append(graph)
        return graph.forward

    block = next(m for m in model.modules() if isinstance(m, KimiK3SparseMoeBlock))
    rows = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(8))
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        want = block(rows)
        got = torch.compile(block, backend=recording, dynamic=False)(rows)
    # (under compile the elementwise ops run their references, not the fused twins: fp32 rounding, not bits)
    torch.testing.assert_close(got, want)
    assert pieces
    offloaded_calls = ("_fetch_offloaded", "start_host_share", "_routed_offloaded")
    breaks = counters["graph_break"]
    assert breaks and all(any(name in reason for name in offloaded_calls) for reason in breaks), list(breaks)
    assert {name for name in offloaded_calls if any(name in reason for reason in breaks)} == set(offloaded_calls)
    torch._dynamo.reset()


def test_the_piecewise_step_raises_dynamos_recompile_limits_with_the_layers(monkeypatch):
    """Each decoder layer is its own compiled frame of the piecewise step (the cache is indexed by its number): under
    dynamo's default limit (8 versions of a frame) a 93-layer model would run every layer past the 8th eagerly,
    silently. The step's call raises the limits with the layers; the limits outside it stay as they were."""
    import types

    import torch._dynamo

    import kimik3.modeling.generate_kimi_k3 as loop

    seen = []

    def step(model, *args):
        seen.append(torch._dynamo.config.recompile_limit)
        return args

    monkeypatch.setattr(loop, "decode_step", step)
    monkeypatch.setattr(loop, "PIECEWISE_OPTIONS", {"backend": "eager"})
    monkeypatch.setattr(loop, "_PIECEWISE_STEP", None)
    before = torch._dynamo.config.recompile_limit
    text = types.SimpleNamespace(num_hidden_layers=93)
    model = types.SimpleNamespace(config=types.SimpleNamespace(get_text_config=lambda: text))
    torch._dynamo.reset()
    loop.piecewise_decode_step()(model, torch.zeros(1))
    assert seen and seen[0] >= 2 * 93 > before
    assert torch._dynamo.config.recompile_limit == before
    torch._dynamo.reset()


@pytest.mark.parametrize("hot", [False, True])
def test_streamed_routes_give_the_one_device_tokens_and_read_no_route(models, hot, monkeypatch):
    """experts_compute="host" with the routes computed on the CPU in the stream's order (`in_stream`; on CUDA the
    default, forced here on the CPU, where the step runs at once): the host step (the format's kernel) computes every
    route to an expert not placed on the device, and no route is read by the host (`ExpertCache.fetch` is never
    called) for forwards up to STREAM_MAX_TOKENS tokens; a longer one reads them. The kernel's f32 sums run in its
    own order, so the logits are close to the one-device model's (not bit for bit), the greedy tokens equal. Placed
    experts run on the device over the cache's slots (its entries are views of them)."""
    import kimik3.modeling.offload_kimi_k3 as offload
    from kimik3.modeling.host_experts_kimi_k3 import StreamedRoutes

    reference = models["mxfp4"]
    model = _placed(reference, "host", split=False)
    cache = model.experts_cache
    cache.in_stream = True
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    if hot:
        _decode(model, ids[:1, :5], steps=0)  # a calibration prompt, its routes counted by the host step
        place_hot_experts(model)
    reads = []
    fetch = offload.ExpertCache.fetch
    monkeypatch.setattr(offload.ExpertCache, "fetch", lambda self, *a, **k: reads.append(a[1].shape) or
                        fetch(self, *a, **k))
    monkeypatch.setattr(offload, "STREAM_MAX_TOKENS", 16)  # the 18-token prompt reads its routes, decode does not
    want, got = _decode(reference, ids, steps=4), _decode(model, ids, steps=4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    layers = [m.offload for m in model.modules() if getattr(m, "offload", None) is not None]
    assert len(reads) == len(layers) and all(shape[0] == 18 for shape in reads)  # the prompt's forward only
    assert all(isinstance(layer.stream, StreamedRoutes) and (layer.layer in cache.slots) == hot for layer in layers)
    for layer in layers:  # every decode route counted (the prompt's by the read, the calibration's by the step)
        assert int(cache.routes[layer.layer].sum()) == (5 * 6 if hot else 0) + 18 * 6 + 4 * 2 * 6
    if hot:  # the placed experts are held once, in the layer's slots, which the device's map names
        slots = cache.slots[0]
        for expert in cache.pinned[0]:
            assert cache.layers[0][expert][0].data_ptr() == slots.stacks[0][slots.slot_of[expert]].data_ptr()
            assert int(slots.map[expert]) == slots.slot_of[expert]
        assert int((slots.map >= 0).sum()) == cache.capacity == len(cache.pinned[0])


def test_a_streamed_step_compiles_as_one_graph_and_the_loop_captures_it_whole(models):
    """Streamed, the MoE block has no graph break (fullgraph compiles it; the host step is one custom op), and the
    decode loop does not take the piecewise step (`_routes_read_by_host` is false once the steps are made); its
    tokens are the one-device model's. On CUDA the loop captures a block of steps as one graph
    (tests/gpu/test_offload_host_compute_gpu.py)."""
    import torch._dynamo

    import kimik3.modeling.generate_kimi_k3 as loop
    from kimik3.modeling.modeling_kimi_k3 import KimiK3SparseMoeBlock

    reference = packed_mxfp4_copy(build_tiny_model(num_hidden_layers=2, seed=1, num_experts=16, top_k=6)).eval()
    model = _placed(reference, "host", split=False)
    model.experts_cache.in_stream = True
    assert loop._routes_read_by_host(model, 2) is False
    assert loop._routes_read_by_host(model, 1000) is True  # a forward past STREAM_MAX_TOKENS reads its routes
    block = next(m for m in model.modules() if isinstance(m, KimiK3SparseMoeBlock))
    rows = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(8))
    torch._dynamo.reset()
    with torch.no_grad():
        want = block(rows)
        got = torch.compile(block, backend="eager", fullgraph=True, dynamic=False)(rows)
    torch.testing.assert_close(got, want)
    torch._dynamo.reset()
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=5, do_sample=False, cache_implementation="static", decode_block_steps=2,
                  decode_compile=False)
    assert torch.equal(loop.generate(ids, model=model, **kwargs), loop.generate(ids, model=reference, **kwargs))


def test_streamed_routes_run_the_experts_the_cache_holds_on_the_device(models):
    """The experts a copying prefill left in the device's cache (its slots) are computed there by a streamed decode,
    the others on the CPU: with the host's copy of every cached expert zeroed, the decode still gives the one-device
    logits (were a cached expert's routes computed on the CPU, its zeroed bytes would change them)."""
    reference = models["mxfp4"]
    model = _placed(reference, "device", experts_per_layer=8, split=False)
    cache = model.experts_cache
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        want_out = reference(ids, use_cache=True)
        assert all(len(entries) == 8 for entries in cache.layers.values())
        for module in model.modules():
            if getattr(module, "offload", None) is not None:
                held = list(cache.layers[module.offload.layer])
                for stack in module.stacks():
                    stack.data[held] = 0
        cache.compute, cache.in_stream = "host", True
        token = out.logits[:, -1:].argmax(-1)
        got = model(token, past_key_values=out.past_key_values, use_cache=True).logits
        want = reference(token, past_key_values=want_out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.moves > 0 and all(int((slots.map >= 0).sum()) == 8 for slots in cache.slots.values())


def test_a_capacity_changed_under_held_experts_is_refused_by_name(models):
    """A layer's experts live in slots made at its first use, `capacity` of them: a capacity changed while the layer
    holds experts is refused by name (never a slot past the stacks), and after `clear()` the slots are made anew."""
    from kimik3.modeling.offload_kimi_k3 import ExpertsOffloadError

    model = _placed(models["dense"], "device", experts_per_layer=3, split=False)
    cache = model.experts_cache
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(12)))
        cache.capacity = 5
        with pytest.raises(ExpertsOffloadError, match=r"capacity is 5 experts a layer, but layer 0 holds 3 in 3 "
                                                      r"slots: clear\(\) the cache after changing it"):
            model(torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(13)))
        cache.clear()
        model(torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(13)))
    assert all(slots.capacity == 5 and len(cache.layers[layer]) == 5 for layer, slots in cache.slots.items())


def test_speculative_rounds_run_in_the_loop_when_every_route_streams(models, caplog):
    """A round is captured whole, so the loop runs speculative rounds for an offloaded model only where no route is
    read by the host (every layer streams at the round's widths): then its tokens are plain greedy's and rounds ran;
    with the routes read it falls back to transformers' loop, saying why."""
    import logging

    import kimik3.modeling.generate_kimi_k3 as loop

    reference = models["mxfp4"]
    phrase = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([phrase, phrase, phrase[:, :3]], dim=1)
    kwargs = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", eos_token_id=None)
    want = loop.generate(ids, model=reference, **kwargs)
    for in_stream in (True, False):
        model = _placed(reference, "host", split=False)
        model.experts_cache.in_stream = in_stream
        report = {}
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            got = loop.generate(ids, model=model, prompt_lookup_num_tokens=3, decode_fallback=False,
                                decode_report=report, **kwargs)
        assert torch.equal(got, want)
        if in_stream:
            assert report["rounds"] >= 2 and "decode loop not used" not in caplog.text
        else:
            assert not report and "routed experts in host memory whose routes the host reads" in caplog.text
