"""Routed experts kept in host memory (`experts_offload="host"`): the device's expert cache moves only the chosen
experts it lacks, stays within its byte budget, keeps hits across steps and calls, and the logits and greedy tokens
are those of the model held on one device, bit for bit in fp32 (docs/design.md, Routed experts off the device)."""

import copy
import types

import pytest
import torch

from kimik3.tiny import build_tiny_model, packed_mxfp4_copy
from kimik3.modeling.modeling_kimi_k3 import KimiK3Experts, KimiK3ForCausalLM
from kimik3.modeling.offload_kimi_k3 import (ExpertsOffloadError, expert_bytes, offload_device_map,
                                             offload_routed_experts)


@pytest.fixture(scope="module")
def dense():
    return build_tiny_model(seed=5)


@pytest.fixture(scope="module")
def packed(dense):
    return packed_mxfp4_copy(dense)


@pytest.fixture(scope="module")
def folder(dense, tmp_path_factory):
    path = tmp_path_factory.mktemp("offload")
    dense.save_pretrained(path)
    return path


def _experts(model):
    return [module for module in model.modules() if isinstance(module, KimiK3Experts)]


def _offloaded(model, experts_per_layer):
    """A copy of `model` with its experts offloaded and a cache of `experts_per_layer` experts per MoE layer."""
    copied = copy.deepcopy(model)
    experts = _experts(copied)
    one = expert_bytes(experts[0].stacks())
    copied.experts_cache = offload_routed_experts(experts, "host", experts_per_layer * one * len(experts))
    return copied


def _record_chosen(model):
    """Per forward, the set of experts each MoE layer's router chose (read at the gate, before the experts)."""
    chosen = []
    handles = [module.gate.register_forward_hook(
        lambda gate, args, out, layer=layer: chosen.append((layer, set(out[2].reshape(-1).tolist()))))
        for layer, module in enumerate(m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts"))]
    return chosen, handles


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_prefill_and_decode_logits_equal_and_only_missing_chosen_experts_move(dense, packed, fmt):
    reference = dense if fmt == "dense" else packed
    model = _offloaded(reference, experts_per_layer=8)  # every expert of the tiny model fits
    cache = model.experts_cache
    chosen, handles = _record_chosen(model)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids, use_cache=True)
        got = model(ids, use_cache=True)
        assert torch.equal(got.logits, want.logits)
        # the prefill moved each layer's chosen experts once, nothing else
        assert cache.moves == sum(len(experts) for _, experts in chosen) and cache.hits == 0
        want_past, got_past = want.past_key_values, got.past_key_values
        for step in range(3):
            token = want.logits[:, -1:].argmax(-1)
            before, resident = cache.moves, {layer: set(e) for layer, e in cache.layers.items()}
            chosen.clear()
            want = reference(token, past_key_values=want_past, use_cache=True)
            got = model(token, past_key_values=got_past, use_cache=True)
            assert torch.equal(got.logits, want.logits), step
            # a decode step moves exactly the chosen experts the cache did not hold
            assert cache.moves - before == sum(len(e - resident.get(layer, set())) for layer, e in chosen)
    for handle in handles:
        handle.remove()


def test_the_experts_sum_keeps_its_order():
    """With 6 routes per token the f32 sum's order shows in the last bit: the compact stack keeps the experts'
    ascending order (a reversed stack with its routes renumbered gives logits 2e-7 away)."""
    reference = build_tiny_model(seed=5, num_experts=16, top_k=6)
    model = _offloaded(reference, experts_per_layer=16)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_a_small_cache_stays_within_its_budget_and_generates_the_same_tokens(dense, packed, fmt):
    reference = dense if fmt == "dense" else packed
    model = _offloaded(reference, experts_per_layer=1)  # fewer than one forward chooses: some moves are for it alone
    cache = model.experts_cache
    peaks, before, extra = [], {}, []

    def snapshot(module, args):
        before["moves"], before["resident"] = cache.moves, set(cache.layers.get(module.offload.layer, ()))

    def check(module, args, out):
        peaks.append(cache.resident_bytes())
        missing = set(args[1].reshape(-1).tolist()) - before["resident"]
        extra.append(cache.moves - before["moves"] - len(missing))  # only the chosen experts it lacked, each once

    handles = [hook for module in _experts(model) for hook in (module.register_forward_pre_hook(snapshot),
                                                               module.register_forward_hook(check))]
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    want = reference.generate(ids, max_new_tokens=6, do_sample=False)
    got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert peaks and max(peaks) <= cache.budget_bytes and max(peaks) > 0
    assert extra and set(extra) == {0}
    assert all(len(entries) <= 1 for entries in cache.layers.values())
    for handle in handles:
        handle.remove()


def test_the_cache_is_kept_across_generate_calls(dense):
    model = _offloaded(dense, experts_per_layer=8)
    cache = model.experts_cache
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(3))
    want = dense.generate(ids, max_new_tokens=4, do_sample=False)
    first = model.generate(ids, max_new_tokens=4, do_sample=False)
    moves, hits = cache.moves, cache.hits
    second = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert moves > 0 and cache.moves == moves and cache.hits > hits  # the second call found every expert it chose


def test_from_pretrained_keeps_the_experts_in_host_memory(dense, folder):
    one = expert_bytes(_experts(dense)[0].stacks())
    model = KimiK3ForCausalLM.from_pretrained(folder, experts_offload="host", experts_cache_bytes=3 * 2 * one)
    experts = _experts(model)
    assert all(module.offload is not None for module in experts) and model.experts_cache.capacity == 2
    assert all(not stack.requires_grad and stack.device.type == "cpu" for m in experts for stack in m.stacks())
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense(ids).logits)
    assert model.experts_cache.moves > 0


NAMES = ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]


def test_device_map_puts_the_experts_on_the_host_and_keeps_the_ones_the_user_names_on_a_device():
    assert offload_device_map(None, NAMES) == (None, NAMES)  # a CPU model: its experts offloaded where they are
    for device in ("cuda:0", 0, torch.device("cuda", 1)):
        assert offload_device_map(device, NAMES) == ({"": device, NAMES[0]: "cpu", NAMES[1]: "cpu"}, NAMES)
    # a strategy resolves to one device (no CUDA here: the CPU)
    assert offload_device_map("auto", NAMES)[0] == {"": "cpu", NAMES[0]: "cpu", NAMES[1]: "cpu"}
    # the user's dict: experts it does not name go to the host; named on a device they stay (the per-layer choice),
    # named on "cpu" (their own key or every key inside them) they are offloaded
    user = {"": 0, "model.layers.2": 1, NAMES[1]: 1}
    placed, offloaded = offload_device_map(user, NAMES)
    assert placed == {**user, NAMES[0]: "cpu"} and offloaded == [NAMES[0]] and user == {"": 0, "model.layers.2": 1,
                                                                                         NAMES[1]: 1}
    inside = {"": 0, NAMES[0] + ".gate_up_proj": "cpu", NAMES[0] + ".down_proj": "cpu"}
    assert offload_device_map(inside, NAMES) == ({**inside, NAMES[1]: "cpu"}, NAMES)
    assert offload_device_map({"": 0, "model.layers.1.mlp.experts_extra": 0}, NAMES)[1] == NAMES  # not a child


@pytest.mark.parametrize("device_map, message", [
    pytest.param({"": 0, NAMES[0]: "disk"}, "puts model.layers.1.mlp.experts on 'disk'", id="offload-map-disk"),
    pytest.param({"": 0, NAMES[1] + ".gate_up_proj": "cpu", NAMES[1] + ".down_proj": 0},
                 "splits model.layers.2.mlp.experts between 'cpu'", id="offload-map-split-expert-module"),
    pytest.param(["cuda:0"], "give a device, a strategy", id="offload-map-not-a-map"),
])
def test_bad_device_maps_with_the_offload_are_refused_by_name(device_map, message):
    with pytest.raises(ExpertsOffloadError, match=message):
        offload_device_map(device_map, NAMES)


def test_the_load_places_the_experts_on_the_host_through_transformers_device_map(folder, dense, monkeypatch):
    """transformers' loader is given the map: every expert module of the model it builds on "cpu" (so it reads them
    there, never onto the device), the rest where the user said; the offload takes those modules, and the logits
    are the model's."""
    from transformers import PreTrainedModel

    given = []
    original = PreTrainedModel.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        given.append(kwargs.get("device_map"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(recording))
    model = KimiK3ForCausalLM.from_pretrained(folder, device_map="cpu", experts_offload="host",
                                              experts_cache_bytes=10 ** 6)
    names = [name for name, module in model.named_modules() if isinstance(module, KimiK3Experts)]
    assert len(names) == 3 and given == [{"": "cpu", **dict.fromkeys(names, "cpu")}]
    assert all(module.offload is not None for module in _experts(model))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense(ids).logits)


def test_an_accelerate_hook_on_an_expert_module_is_detached_with_its_weights_back(dense):
    """A device_map with "cpu" beside a device gives the expert modules accelerate's offload hook (weights on meta,
    moved whole at every forward); the offload detaches it, the stacks come back, and the logits are the model's."""
    from accelerate import cpu_offload

    model = copy.deepcopy(dense)
    experts = _experts(model)
    cpu_offload(experts[0], execution_device=torch.device("cpu"))
    assert experts[0].stacks()[0].device.type == "meta"
    one = expert_bytes(_experts(dense)[0].stacks())
    model.experts_cache = offload_routed_experts(experts, "host", 8 * one * len(experts))
    assert not hasattr(experts[0], "_hf_hook") and experts[0].stacks()[0].device.type == "cpu"
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense(ids).logits)


@pytest.mark.parametrize("options, message", [
    pytest.param({"experts_offload": "gpu", "experts_cache_bytes": 10 ** 6}, "unknown; known: ['host']",
                 id="offload-unknown-mode"),
    pytest.param({"experts_offload": "host"}, "needs experts_cache_bytes", id="offload-no-budget"),
    pytest.param({"experts_offload": "host", "experts_cache_bytes": 0}, "must be > 0", id="offload-budget-zero"),
    pytest.param({"experts_offload": "host", "experts_cache_bytes": -4096}, "must be > 0",
                 id="offload-budget-negative"),
    pytest.param({"experts_offload": "host", "experts_cache_bytes": True}, "a whole number of bytes",
                 id="offload-budget-bool"),
    pytest.param({"experts_offload": "host", "experts_cache_bytes": 100}, "3 layers x 12288 bytes = 36864 bytes at least",
                 id="offload-budget-below-one-expert"),
    pytest.param({"experts_cache_bytes": 10 ** 6}, "needs experts_offload", id="offload-budget-without-offload"),
    pytest.param({"experts_offload": "host", "experts_cache_bytes": 10 ** 6, "tp_plan": "auto"},
                 "with tp_plan", id="offload-with-tensor-parallel"),
])
def test_bad_offload_options_are_refused_by_name(folder, options, message):
    with pytest.raises(ExpertsOffloadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KimiK3ForCausalLM.from_pretrained(folder, **options)


def test_expert_parallel_shares_are_refused():
    config = types.SimpleNamespace(num_experts=8)
    share = types.SimpleNamespace(num_experts=4, config=config, stacks=lambda: (torch.zeros(4, 2),))
    with pytest.raises(ExpertsOffloadError, match="holds 4 of 8 experts per layer"):
        offload_routed_experts([share], "host", 10 ** 6)


def test_the_release_layout_loads_with_its_experts_offloaded(tmp_path):
    """The offload composes with the release loader: an adopted release folder (release layout on disk, packed
    experts fused at load) loads through the Auto class with its experts on the host, with the logits of the same
    folder loaded whole."""
    from transformers import AutoModelForCausalLM

    from kimik3.convert import testing
    from kimik3.convert.adopt import adopt

    release = testing.write_release_checkpoint(tmp_path / "release" / "k3", seed=5, num_layers=2, num_experts=4).path
    adopt(release, tmp_path / "adopted", experts_format="mxfp4")
    load = {"trust_remote_code": True, "dtype": torch.float32}
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adopted"), **load).eval()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "adopted"), device_map="cpu", experts_offload="host",
                                                 experts_cache_bytes=10 ** 6, **load).eval()
    experts = [m for m in model.modules() if type(m).__name__ == "KimiK3Experts"]
    assert experts and all(m.packed and m.offload is not None for m in experts)
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, whole(ids).logits)
    assert model.experts_cache.moves > 0
