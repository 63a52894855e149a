"""Routed experts kept in host memory (`experts_offload="host"`): the device's expert cache moves only the chosen
experts it lacks, stays within its byte budget, keeps hits across steps and calls, and the logits and greedy tokens
are those of the model held on one device, bit for bit in fp32 (docs/design.md, Routed experts off the device)."""

import copy
import types

import pytest
import torch

from k3_test_utils import offloaded_copy, refresh_adoption_fingerprints
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
    model = offloaded_copy(reference, experts_per_layer=8)  # every expert of the tiny model fits
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
    model = offloaded_copy(reference, experts_per_layer=16)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_runs_of_consecutive_missed_experts_are_one_copy_each():
    from kimik3.modeling.offload_kimi_k3 import _runs

    ids = [0, 1, 2, 5, 6, 9, 10, 11]
    assert _runs([0, 1, 2, 3, 4, 5, 6, 7], ids) == [(0, 0, 3), (3, 5, 2), (5, 9, 3)]
    assert _runs([0, 2, 3, 6, 7], ids) == [(0, 0, 1), (2, 2, 1), (3, 5, 1), (6, 10, 2)]  # held experts break runs
    assert _runs([], ids) == []
    assert _runs([4], ids) == [(4, 6, 1)]


def test_fetched_stacks_hold_the_chosen_rows_whatever_the_cache_held():
    """Compact stacks assembled from held experts (device copies) and runs of moved ones must be the source's rows of
    the chosen ids in ascending order, and the renumbered routes must point back at them, over choices that hit,
    miss, evict, and choose more than the cache holds."""
    from kimik3.modeling.offload_kimi_k3 import ExpertCache

    generator = torch.Generator().manual_seed(0)
    source = (torch.randn(10, 3, 4, generator=generator), torch.randint(0, 255, (10, 2), dtype=torch.uint8,
                                                                       generator=generator))
    per_expert = sum(stack[0].numel() * stack.element_size() for stack in source)
    cache = ExpertCache(3 * per_expert, 1, per_expert)
    for choice in ([[4, 5], [6, 4]], [[5, 7]], [[0, 1, 2], [3, 4, 5]], [[9, 8], [7, 9]], [[4, 6]]):
        top = torch.tensor(choice)
        moves = cache.moves
        held = set(cache.layers.get(0, ()))
        routes, compact = cache.fetch(0, top, source, torch.device("cpu")).wait()
        chosen = torch.unique(top)
        for got, stack in zip(compact, source):
            assert torch.equal(got, stack[chosen])
        assert torch.equal(chosen[routes], top)
        assert cache.moves - moves == len(set(chosen.tolist()) - held)
        assert cache.resident_bytes() <= cache.budget_bytes
        assert all(torch.equal(piece[0], source[0][e]) for e, piece in cache.layers[0].items())


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_a_small_cache_stays_within_its_budget_and_generates_the_same_tokens(dense, packed, fmt):
    reference = dense if fmt == "dense" else packed
    model = offloaded_copy(reference, experts_per_layer=1)  # fewer than one forward chooses: some moves are for it alone
    cache = model.experts_cache
    peaks, before, extra = [], {}, []

    def snapshot(experts):
        def hook(router, args):  # the moves start right after the block's router
            before["moves"], before["resident"] = cache.moves, set(cache.layers.get(experts.offload.layer, ()))
        return hook

    def check(module, args, out):
        peaks.append(cache.resident_bytes())
        missing = set(args[1].reshape(-1).tolist()) - before["resident"]
        extra.append(cache.moves - before["moves"] - len(missing))  # only the chosen experts it lacked, each once

    blocks = [module for module in model.modules() if isinstance(getattr(module, "experts", None), KimiK3Experts)]
    handles = [hook for block in blocks for hook in (block.gate.register_forward_pre_hook(snapshot(block.experts)),
                                                     block.experts.register_forward_hook(check))]
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
    model = offloaded_copy(dense, experts_per_layer=8)
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
    host = dict.fromkeys(NAMES, "host")
    assert offload_device_map(None, NAMES) == (None, host)  # a CPU model: its experts offloaded where they are
    for device in ("cuda:0", 0, torch.device("cuda", 1)):
        assert offload_device_map(device, NAMES) == ({"": device, NAMES[0]: "cpu", NAMES[1]: "cpu"}, host)
    # a strategy resolves to one device (no CUDA here: the CPU)
    assert offload_device_map("auto", NAMES)[0] == {"": "cpu", NAMES[0]: "cpu", NAMES[1]: "cpu"}
    # the user's dict: experts it does not name go to the host; named on a device they stay (the per-layer choice),
    # named on "cpu" (their own key or every key inside them) they are offloaded
    user = {"": 0, "model.layers.2": 1, NAMES[1]: 1}
    placed, offloaded = offload_device_map(user, NAMES)
    assert placed == {**user, NAMES[0]: "cpu"} and offloaded == {NAMES[0]: "host"} and user == {
        "": 0, "model.layers.2": 1, NAMES[1]: 1}
    inside = {"": 0, NAMES[0] + ".gate_up_proj": "cpu", NAMES[0] + ".down_proj": "cpu"}
    assert offload_device_map(inside, NAMES) == ({**inside, NAMES[1]: "cpu"}, host)
    assert offload_device_map({"": 0, "model.layers.1.mlp.experts_extra": 0}, NAMES)[1] == host  # not a child


def test_device_map_of_the_disk_tier_leaves_the_experts_out_and_keeps_the_named_ones_on_the_host_or_a_device():
    disk = dict.fromkeys(NAMES, "disk")
    assert offload_device_map(None, NAMES, "disk") == (None, disk)
    assert offload_device_map(0, NAMES, "disk") == ({"": 0}, disk)  # the experts are not in the load at all
    assert offload_device_map("auto", NAMES, "disk") == ({"": "cpu"}, disk)
    # named on "cpu": that layer's experts in host memory (the host tier); named on a device: kept there
    user = {"": 0, NAMES[0]: "cpu", NAMES[1] + ".gate_up_proj": 1, NAMES[1] + ".down_proj": 1}
    assert offload_device_map(user, NAMES, "disk") == (user, {NAMES[0]: "host"})
    assert offload_device_map({"": 0}, NAMES, "disk") == ({"": 0}, disk)


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


def test_auto_budget_is_what_the_gpu_has_free_less_a_layer_stack_and_the_reserve(dense, monkeypatch):
    """experts_cache_bytes="auto": the budget is the device's free memory (plus what torch's allocator holds
    unused), less one layer's whole compact stack and 5% of the device; invented free figures, CUDA's queries
    stubbed (no GPU here); too little left is refused with the figures and what to do."""
    from kimik3.modeling import offload_kimi_k3 as offload

    one = expert_bytes(_experts(dense)[0].stacks())
    experts = dense.config.num_experts
    total = 1000 * one
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (200 * one, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 7 * one)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * one)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # this CPU build of torch cannot pin
    model = copy.deepcopy(dense)
    cache = offload_routed_experts(_experts(model), "host", "auto", device=torch.device("cuda", 0))
    assert cache.budget_bytes == 200 * one + 3 * one - experts * one - int(0.05 * total)
    assert cache.capacity == cache.budget_bytes // 3 // one
    with pytest.raises(ExpertsOffloadError, match=r"experts_cache_bytes='auto'.*less than one expert per MoE layer"):
        offload.auto_cache_bytes(free=experts * one + int(0.05 * total) + 2 * one, total=total,
                                 bytes_per_expert=one, num_experts=experts, num_layers=3)
    with pytest.raises(ExpertsOffloadError, match="CUDA device's free memory"):
        offload_routed_experts(_experts(copy.deepcopy(dense)), "host", "auto", device=torch.device("cpu"))


def test_auto_budget_without_cuda_is_refused_before_the_load(folder, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ExpertsOffloadError, match="CUDA is not available: give a whole number of bytes"):
        KimiK3ForCausalLM.from_pretrained(folder, experts_offload="host", experts_cache_bytes="auto")


@pytest.mark.parametrize("options, message", [
    pytest.param({"experts_offload": "gpu", "experts_cache_bytes": 10 ** 6}, "unknown; known: ['host', 'disk']",
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
    pytest.param({"experts_offload": "host", "experts_cache_bytes": "automatic"}, "or 'auto'",
                 id="offload-budget-unknown-word"),
    pytest.param({"experts_offload": "host", "experts_cache_bytes": "10GB"}, "a whole number of bytes",
                 id="offload-budget-a-size-string"),
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


def test_the_release_layout_loads_with_its_expertsoffloaded_copy(tmp_path):
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
    assert experts and all(m.format.name == "mxfp4" and m.offload is not None for m in experts)
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, whole(ids).logits)
    assert model.experts_cache.moves > 0


# --- the disk tier (experts_offload="disk"): the routed experts never pass through transformers' loader; they are
# mapped from the folder's shards, file-backed, and the cache gathers from the mapping --------------------------------

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from kimik3.modeling.files_kimi_k3 import KimiK3LoadError  # noqa: E402
from kimik3.modeling.offload_kimi_k3 import ShardMapper  # noqa: E402


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds `tensor`'s bytes (/proc/self/maps), None for anonymous memory: a tensor read
    into memory, or copied, has no file behind it."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


@pytest.fixture
def reads(monkeypatch):
    """The checkpoint tensors transformers' loader reads (materialises) during a load: every safetensors slice it
    takes is watched (5.17 and 5.24 open the shards with `safe_open` and take `get_slice` of every key)."""
    import transformers.modeling_utils as modeling_utils

    seen, real_open = [], modeling_utils.safe_open

    class Slice:
        def __init__(self, inner, name):
            self._inner, self._name = inner, name

        def __getitem__(self, index):
            seen.append(self._name)
            return self._inner[index]

        def __getattr__(self, attr):
            return getattr(self._inner, attr)

    class Opened:
        def __init__(self, *args, **kwargs):
            self._inner = real_open(*args, **kwargs)

        def get_slice(self, name):
            return Slice(self._inner.get_slice(name), name)

        def __getattr__(self, attr):
            return getattr(self._inner, attr)

    monkeypatch.setattr(modeling_utils, "safe_open", Opened)
    return seen


@pytest.fixture(scope="module")
def packed_folder(packed, tmp_path_factory):
    path = tmp_path_factory.mktemp("offload_packed")
    packed.save_pretrained(path)
    return path


def _check_decode_and_reused_cache(model, reference, steps=3):
    """Prefill, decode steps and a second generate() (a cache reused across calls): logits and tokens equal."""
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got = reference(ids, use_cache=True), model(ids, use_cache=True)
        assert torch.equal(got.logits, want.logits)
        for step in range(steps):
            token = want.logits[:, -1:].argmax(-1)
            want = reference(token, past_key_values=want.past_key_values, use_cache=True)
            got = model(token, past_key_values=got.past_key_values, use_cache=True)
            assert torch.equal(got.logits, want.logits), step
    tokens = reference.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=4, do_sample=False), tokens)
    moves = model.experts_cache.moves
    assert torch.equal(model.generate(ids[:1], max_new_tokens=4, do_sample=False), tokens)
    assert moves > 0 and model.experts_cache.moves == moves  # the second call found every expert in the cache


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
def test_disk_tier_maps_our_layout_without_the_loader_reading_an_expert(dense, packed, folder, packed_folder, fmt,
                                                                        reads):
    reference, path = (dense, folder) if fmt == "dense" else (packed, packed_folder)
    model, info = KimiK3ForCausalLM.from_pretrained(path, experts_offload="disk", experts_cache_bytes=10 ** 6,
                                                    output_loading_info=True)
    assert reads and not [name for name in reads if ".mlp.experts." in name]  # the rest was read, no expert
    assert not info["unexpected_keys"] and not info["missing_keys"]  # and the load reports nothing of them
    shard = os.path.realpath(path / "model.safetensors")
    for module in _experts(model):
        assert module.offload.parts is None
        for stack in module.stacks():  # the module's own stacks, file-backed: the bytes stay in the shard
            assert _mapped_file(stack) == shard and not stack.untyped_storage().resizable()
    _check_decode_and_reused_cache(model, reference)
    # nothing of the load is left behind: the model's state_dict has the experts again, a new model too
    assert sum(".mlp.experts." in key for key in model.state_dict()) == 3 * len(_experts(model)[0].stacks())
    assert not any("experts" in pattern for pattern in model._keys_to_ignore_on_load_unexpected)
    assert any(".mlp.experts." in key for key in KimiK3ForCausalLM(model.config).state_dict())


@pytest.fixture(scope="module")
def release_folders(tmp_path_factory):
    """An adopted release folder (release layout, MXFP4 per-expert tensors, links into the release folder) and the
    model loaded from it whole."""
    from transformers import AutoModelForCausalLM

    from kimik3.convert import testing
    from kimik3.convert.adopt import adopt

    tmp = tmp_path_factory.mktemp("offload_release")
    release = testing.write_release_checkpoint(tmp / "release" / "k3", seed=5, num_layers=3, num_experts=4).path
    adopt(release, tmp / "adopted", experts_format="mxfp4")
    whole = AutoModelForCausalLM.from_pretrained(str(tmp / "adopted"), trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    return release, tmp / "adopted", whole


def test_disk_tier_maps_the_release_layout_a_tensor_per_expert_through_an_adopted_folder(release_folders, reads):
    from transformers import AutoModelForCausalLM

    release, adopted, whole = release_folders
    model = AutoModelForCausalLM.from_pretrained(str(adopted), experts_offload="disk", experts_cache_bytes=10 ** 6,
                                                 trust_remote_code=True, dtype=torch.float32).eval()
    assert reads and not [name for name in reads if ".block_sparse_moe.experts." in name]
    experts = [m for m in model.modules() if type(m).__name__ == "KimiK3Experts"]
    assert len(experts) == 2 and all(m.format.name == "mxfp4" and m.offload.parts is not None for m in experts)
    for module in experts:
        assert all(stack.device.type == "meta" for stack in module.stacks())  # never materialised
        for stack in module.offload.parts.parts:
            for pieces in stack:
                for piece in pieces:  # the adopted folder's link resolves into the release folder's shard
                    where = _mapped_file(piece)
                    assert where is not None and os.path.dirname(where) == os.path.realpath(release)
    _check_decode_and_reused_cache(model, whole)


def test_disk_tier_release_parts_stream_their_routes_to_the_cpu_kernel_where_they_are_mapped(release_folders,
                                                                                            monkeypatch):
    """experts_compute="host" on the disk tier of an adopted release folder: each layer's routes are computed by the
    host step over the release's w1, w3 and w2 where they are mapped (gate and up apart, no copy of an expert), in
    the stream's order (forced on the CPU, where the step runs at once): no route is read by the host and no expert
    moves for forwards up to STREAM_MAX_TOKENS tokens. The kernel's f32 sums run in its own order, so the logits are
    close to the whole model's (not bit for bit) and the greedy tokens equal."""
    from transformers import AutoModelForCausalLM

    from kimik3.kernels import mxfp4_host

    assert mxfp4_host.library() is not None, mxfp4_host.unavailable_reason()
    _, adopted, whole = release_folders
    model = AutoModelForCausalLM.from_pretrained(str(adopted), experts_offload="disk", experts_cache_bytes=10 ** 6,
                                                 experts_compute="host", trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    model.experts_cache.in_stream = True
    reads = []
    cache_class = type(model.experts_cache)  # the folder's copy of the code (trust_remote_code)
    fetch = cache_class.fetch
    monkeypatch.setattr(cache_class, "fetch", lambda self, *a, **k: reads.append(1) or fetch(self, *a, **k))
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got = whole(ids, use_cache=True), model(ids, use_cache=True)
        for step in range(4):
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
            token = want.logits[:, -1:].argmax(-1)
            assert torch.equal(got.logits[:, -1:].argmax(-1), token), step
            want = whole(token, past_key_values=want.past_key_values, use_cache=True)
            got = model(token, past_key_values=got.past_key_values, use_cache=True)
    assert not reads and model.experts_cache.moves == 0
    layers = [m.offload for m in model.modules() if getattr(m, "offload", None) is not None]
    assert len(layers) == 2
    for layer in layers:  # the step's table holds the mapped parts themselves
        assert type(layer.stream).__name__ == "StreamedRoutes" and layer.stream.table.stacks[0] is layer.parts.parts[0]
        assert int(model.experts_cache.routes[layer.layer].sum()) == (10 + 4 * 2) * layer.top_k


@pytest.mark.parametrize("kernel", [False, True])  # the reference, the format's kernel
def test_the_read_paths_cpu_share_reads_the_release_parts_where_they_are_mapped(release_folders, kernel):
    """experts_compute="host" with the routes read by the host (a prefill chunk's path; `in_stream = False`) on the
    release's disk tier: the CPU's share is computed over the mapped parts, not copied (no expert moves). The
    reference joins the chosen experts' parts into a compact copy (`select_experts`) and gives the whole model's
    logits bit for bit; the format's kernel reads w1, w3 and w2 where they are and is close (its f32 order)."""
    from transformers import AutoModelForCausalLM

    _, adopted, whole = release_folders
    model = AutoModelForCausalLM.from_pretrained(str(adopted), experts_offload="disk", experts_cache_bytes=10 ** 6,
                                                 experts_compute="host", trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    cache = model.experts_cache
    cache.in_stream, cache.host_kernel = False, kernel
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want, got = whole(ids, use_cache=True), model(ids, use_cache=True)
        for step in range(3):
            if kernel:
                torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
            else:
                assert torch.equal(got.logits, want.logits), step
            token = want.logits[:, -1:].argmax(-1)
            want = whole(token, past_key_values=want.past_key_values, use_cache=True)
            got = model(token, past_key_values=got.past_key_values, use_cache=True)
    assert cache.moves == 0 and cache.host_routes > 0 and (cache.kernel_calls > 0) == kernel


def test_hot_experts_of_the_release_disk_tier_are_placed_from_its_parts_and_run_on_the_device(release_folders):
    """place_hot_experts on the release's disk tier (each expert's w1, w3 and w2 mapped apart): the hot ones are
    assembled from the parts into the cache's slots (equal to the fused stacks of the model loaded whole; it was
    refused before), and a streamed decode (forced on the CPU) runs them on the device and the rest on the CPU, with
    the whole model's greedy tokens."""
    import sys

    from transformers import AutoModelForCausalLM

    _, adopted, whole = release_folders
    model = AutoModelForCausalLM.from_pretrained(str(adopted), experts_offload="disk", experts_cache_bytes=10 ** 6,
                                                 experts_compute="host", trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    model.experts_cache.in_stream = True
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        model(ids)  # a calibration prompt: its routes counted
    offload = sys.modules[type(model.experts_cache).__module__]  # the folder's copy of the code
    placed = offload.place_hot_experts(model, per_layer=2)
    held = [m for m in whole.modules() if type(m).__name__ == "KimiK3Experts"]
    cache = model.experts_cache
    for layer, experts in placed.items():
        assert len(experts) == 2 and set(cache.pinned[layer]) == set(experts)
        slots = cache.slots[layer]
        for expert in experts:
            for slot_stack, stack in zip(slots.stacks, held[layer].stacks()):
                assert torch.equal(slot_stack[slots.slot_of[expert]], stack[expert])
    kwargs = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), whole.generate(ids, **kwargs))


def test_auto_on_the_release_disk_tier_times_its_rates_on_assembled_parts(release_folders):
    """experts_compute="auto" times the CPU and the copy on the first layer's experts at load; on the release's disk
    tier the module holds none of its own (meta placeholders: the load raised before), so a few are assembled from
    the mapped parts, equal to the fused stacks of the model loaded whole; its tokens are the whole model's."""
    from transformers import AutoModelForCausalLM

    _, adopted, whole = release_folders
    model = AutoModelForCausalLM.from_pretrained(str(adopted), experts_offload="disk", experts_cache_bytes=10 ** 6,
                                                 experts_compute="auto", trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    rates = model.experts_cache.rates
    assert rates.measured and min(rates.copy_bytes_per_s, rates.host_bytes_per_s, rates.host_flops) > 0
    offloaded, held = ([m for m in each.modules() if type(m).__name__ == "KimiK3Experts"][0]  # the folder's classes
                       for each in (model, whole))
    for assembled, stack in zip(offloaded.offload.parts.stacks(3), held.stacks()):
        assert torch.equal(assembled, stack[:3])
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(8))
    kwargs = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), whole.generate(ids, **kwargs))


def test_disk_tier_keeps_the_layers_the_device_map_names_on_the_host(dense, folder, reads):
    model = KimiK3ForCausalLM.from_pretrained(folder, experts_offload="disk", experts_cache_bytes=10 ** 6,
                                              device_map={"": "cpu", "model.layers.2.mlp.experts": "cpu"})
    assert sorted({name.rsplit(".", 1)[0] for name in reads if ".mlp.experts." in name}) == [
        "model.layers.2.mlp.experts"]  # that layer read into host memory by the loader, the others mapped
    assert all(module.offload is not None for module in _experts(model))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense(ids).logits)


# a safetensors file written by hand, so a header can say what the format allows but our reader refuses
def _write_safetensors(path, tensors: dict, edit=None, pad: int = 8):
    header, blobs, offset = {}, [], 0
    names = {torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8", torch.bfloat16: "BF16"}
    for name, tensor in tensors.items():
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if edit is not None:
        edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def _folder_with(tmp_path, shards: dict, weight_map=None):
    folder = tmp_path / "model"
    folder.mkdir()
    for shard, tensors in shards.items():
        _write_safetensors(folder / shard, tensors)
    if weight_map is None:
        weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


STACK = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)


def test_moving_an_offloaded_model_keeps_its_experts_where_the_offload_keeps_them(dense):
    """model.to(device) moves the rest of the model and leaves the offloaded stacks in host memory (the cache moves
    what a forward chooses): shown with the meta device as the destination; a dtype change converts the host stacks,
    empties the cache, and gives the logits of the model converted whole."""
    model = offloaded_copy(dense, experts_per_layer=2)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids)
    assert model.experts_cache.resident_bytes() > 0
    moved = copy.deepcopy(model).to("meta")
    assert moved.get_input_embeddings().weight.device.type == "meta"
    assert all(stack.device.type == "cpu" for module in _experts(moved) for stack in module.stacks())
    wide = model.to(torch.float64)
    assert all(stack.dtype == torch.float64 for module in _experts(wide) for stack in module.stacks())
    assert wide.experts_cache.resident_bytes() == 0
    with torch.no_grad():
        assert torch.equal(wide(ids).logits, copy.deepcopy(dense).to(torch.float64)(ids).logits)


def test_the_disk_tier_refuses_a_dtype_change_of_its_mapped_experts_and_a_save_of_release_parts(folder,
                                                                                                   release_folders):
    from transformers import AutoModelForCausalLM

    mapped = KimiK3ForCausalLM.from_pretrained(folder, experts_offload="disk", experts_cache_bytes=10 ** 6)
    with pytest.raises(ExpertsOffloadError, match=r"float32 -> bfloat16 of the routed experts' `gate_up_proj`.*used "
                                                  "as stored"):
        mapped.to(torch.bfloat16)
    _, adopted, _ = release_folders
    model = AutoModelForCausalLM.from_pretrained(str(adopted), experts_offload="disk", experts_cache_bytes=10 ** 6,
                                                 trust_remote_code=True, dtype=torch.float32)
    model.to("cpu")  # the release parts stay mapped, the placeholders on meta: no copy out of a meta tensor
    target = folder.parent / "saved_from_release_parts"
    # (the adopted folder's own code: its ExpertsOffloadError, a ValueError)
    with pytest.raises(ValueError, match=r"save_pretrained: the routed experts `\S*layers\.\d+\.mlp\.experts` are "
                                         r"mapped a tensor per expert.*nothing was written"):
        model.save_pretrained(target)
    assert not target.exists()


def test_the_shard_mapper_gives_file_backed_views_of_the_bytes(tmp_path):
    folder = _folder_with(tmp_path, {"a.safetensors": {"s": STACK, "x": torch.ones(3, dtype=torch.uint8)}})
    mapped = ShardMapper(str(folder)).tensor("s", torch.float32, (2, 3, 4))
    assert torch.equal(mapped, STACK) and _mapped_file(mapped) == str(folder / "a.safetensors")


def _truncate(folder):
    path = folder / "a.safetensors"
    path.write_bytes(path.read_bytes()[:-10])


def _offsets_past_end(folder):
    _write_safetensors(folder / "a.safetensors", {"s": STACK}, edit=lambda h: h["s"].update(
        shape=[2, 3, 8], data_offsets=[0, 192]))


def _outside(folder, name):
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"s": name}}))


def _symlink_out(folder):
    outside = folder.parent / "elsewhere.safetensors"
    shutil.move(folder / "a.safetensors", outside)
    os.symlink(outside, folder / "a.safetensors")


def _misaligned(folder):
    _write_safetensors(folder / "a.safetensors", {"x": torch.ones(3, dtype=torch.uint8), "s": STACK})
    _outside(folder, "a.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"s": "a.safetensors", "x": "a.safetensors"}}))


def _header_lacks(folder):
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"s": "a.safetensors", "t": "a.safetensors"}}))


@pytest.mark.parametrize("spoil, tensor, dtype, shape, message", [
    pytest.param(_truncate, "s", torch.float32, (2, 3, 4), "file is truncated", id="disk-truncated-shard"),
    pytest.param(_offsets_past_end, "s", torch.float32, (2, 3, 8), r"data ends at byte \d+ but the file has only \d+ bytes",
                 id="disk-offsets-past-end"),
    pytest.param(None, "s", torch.bfloat16, (2, 3, 4), "holds F32, the model holds this tensor as bfloat16",
                 id="disk-wrong-dtype"),
    pytest.param(None, "s", torch.float32, (2, 4, 3), r"has shape \[2, 3, 4\], the model needs \[2, 4, 3\]",
                 id="disk-wrong-shape"),
    pytest.param(lambda f: _outside(f, "../a.safetensors"), "s", torch.float32, (2, 3, 4), "refusing shard name",
                 id="disk-shard-outside-folder"),
    pytest.param(lambda f: _outside(f, str(f / "a.safetensors")), "s", torch.float32, (2, 3, 4),
                 "refusing shard name", id="disk-shard-absolute-path"),
    pytest.param(_symlink_out, "s", torch.float32, (2, 3, 4), "outside the folder", id="disk-shard-symlink-out"),
    pytest.param(None, "t", torch.float32, (2, 3, 4), "the index names no such tensor", id="disk-tensor-not-indexed"),
    pytest.param(_header_lacks, "t", torch.float32, (2, 3, 4), "the shard's header lacks it",
                 id="disk-tensor-not-in-header"),
    pytest.param(_misaligned, "s", torch.float32, (2, 3, 4), r"starts at byte \d+, not a multiple of its 4-byte",
                 id="disk-misaligned-tensor"),
])
def test_the_shard_mapper_refuses_bad_shards_by_file_and_tensor(tmp_path, spoil, tensor, dtype, shape, message):
    folder = _folder_with(tmp_path, {"a.safetensors": {"s": STACK}})
    if spoil is not None:
        spoil(folder)
    with pytest.raises(KimiK3LoadError, match=message) as caught:
        ShardMapper(str(folder)).tensor(tensor, dtype, shape)
    assert str(folder) in str(caught.value) or str(folder.parent) in str(caught.value)


def _without(path, name):
    """A copy of our folder without the tensor `name` (shard and index agree, so the folder checks pass)."""
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _release_with(release_folders, tmp_path, change):
    """A copy of the release folder, adopted, then its first MoE layer's shard changed by `change(tensors)` (adopt
    itself refuses what the convert plan refuses; the adopted folder's links see the change)."""
    from kimik3.convert.adopt import adopt

    release = tmp_path / "release"
    shutil.copytree(release_folders[0], release)
    adopt(release, tmp_path / "adopted", experts_format="mxfp4")
    index = json.loads((release / "model.safetensors.index.json").read_text())
    prefix = "language_model.model.layers.1.block_sparse_moe.experts."
    shard = next(s for name, s in index["weight_map"].items() if name.startswith(prefix))
    tensors = load_file(release / shard)
    for name in change(tensors, prefix):
        index["weight_map"][name] = shard
    save_file(tensors, str(release / shard), metadata={"format": "pt"})
    (release / "model.safetensors.index.json").write_text(json.dumps(index))
    refresh_adoption_fingerprints(tmp_path / "adopted")
    return tmp_path / "adopted"


def _extra_expert(tensors, prefix):
    added = {prefix.replace("experts.", f"experts.4.{name.split('experts.0.', 1)[1]}"): value.clone()
             for name, value in tensors.items() if name.startswith(prefix + "0.")}
    tensors.update(added)
    return added


def _infinite_scale(tensors, prefix):
    tensors[prefix + "2.w3.weight_scale"][1, 0] = 255
    return []


@pytest.mark.parametrize("make, options, message", [
    pytest.param(lambda f, r, t: (_without(f, "model.layers.2.mlp.experts.down_proj"), f)[1], {},
                 "tensor `model.layers.2.mlp.experts.down_proj`: the index lacks this tensor",
                 id="disk-missing-expert-tensor"),
    pytest.param(lambda f, r, t: f, {"dtype": torch.bfloat16},
                 "tensor `model.layers.1.mlp.experts.gate_up_proj`: holds F32, the model holds this tensor as bfloat16",
                 id="disk-experts-dtype-differs-from-the-load"),
    pytest.param(lambda f, r, t: r[1], {"experts_format": "dense"}, "stored packed .MXFP4. and experts_offload='disk' "
                 "maps them as stored: load with experts_format='mxfp4'", id="disk-release-mxfp4-as-dense"),
    pytest.param(lambda f, r, t: f, {"experts_format": "mxfp4"}, "tensor `model.layers.1.mlp.experts.down_proj`: "
                 "the routed experts are stored dense and experts_offload='disk' maps them as stored: load with "
                 "experts_format='dense'", id="disk-dense-folder-as-mxfp4"),
    pytest.param(lambda f, r, t: _release_with(r, t, _extra_expert), {},
                 r"experts\.4\.w1\.weight_packed`: the index names this tensor under the routed experts",
                 id="disk-release-extra-expert"),
    pytest.param(lambda f, r, t: _release_with(r, t, _infinite_scale), {},
                 r"experts\.2\.w3\.weight_scale`: E8M0 scale byte 0xFF", id="disk-release-infinite-scale"),
])
def test_the_disk_tier_refuses_folders_it_cannot_map_by_name(folder, release_folders, tmp_path, make, options,
                                                               message):
    ours = tmp_path / "ours"
    shutil.copytree(folder, ours)
    path = make(ours, release_folders, tmp_path)
    with pytest.raises(KimiK3LoadError, match=message):
        KimiK3ForCausalLM.from_pretrained(path, experts_offload="disk", experts_cache_bytes=10 ** 6, **options)


@pytest.mark.parametrize("path, options, message", [
    pytest.param("org/model", {}, "the disk tier maps the routed experts from the shards of a local folder",
                 id="disk-not-a-local-folder"),
    pytest.param(None, {"gguf_file": "model.gguf"}, "with gguf_file: the disk tier maps", id="disk-with-gguf"),
])
def test_the_disk_tier_needs_a_local_folder_of_safetensors(folder, path, options, message):
    with pytest.raises(ExpertsOffloadError, match=message):
        KimiK3ForCausalLM.from_pretrained(path or folder, experts_offload="disk", experts_cache_bytes=10 ** 6,
                                          **options)


# --- `kimik3 memory --plan --experts-offload disk`: the tier in the plan -------------------------------------------

def test_the_disk_plan_adds_the_disk_read_of_what_the_page_cache_lacks(dense):
    from kimik3.memory import DISK_BANDWIDTH_ASSUMED, H2D_BANDWIDTH_ASSUMED, offload_plan

    config, gpu = dense.config, 3 * 10 ** 9  # beside the plan's reserve (a CUDA context's 1 GB, the allocator's 2%)
    plan = offload_plan(config, gpu, 10 ** 9, 256, mode="host")
    small = {"experts_cache": plan["moe_layers"] * plan["bytes_per_expert"]}  # one expert a layer: experts move
    host = offload_plan(config, gpu, 10 ** 9, 256, mode="host", **small)
    experts = host["host"]["experts"]
    assert host["decode"]["moved_bytes"] > 0
    for page_cache in (0, experts // 4, experts):
        plan = offload_plan(config, gpu, page_cache, 256, mode="disk", disk_bandwidth=2e9, **small)
        from_disk = 1 - page_cache / experts
        assert plan["host"]["from_disk"] == pytest.approx(from_disk) and plan["fits"]
        moved, gpu_bytes = plan["decode"]["moved_bytes"], plan["decode"]["gpu_bytes"]
        assert moved == host["decode"]["moved_bytes"]  # the same experts move, from farther away
        # beside the moves, the GPU's own read and the piecewise loop's reads of the routes
        want = moved / H2D_BANDWIDTH_ASSUMED + from_disk * moved / 2e9 + gpu_bytes / plan["hbm_bandwidth"] \
            + plan["decode"]["piecewise_ms"] / 1e3
        assert plan["decode"]["step_ms"] == pytest.approx(want * 1e3)
        p = plan["prefill"]
        assert p["transfer_s"] == pytest.approx(p["moved_bytes"] * (1 / H2D_BANDWIDTH_ASSUMED + from_disk / 2e9))
    # the whole set in the page cache: the host tier's bounds
    assert offload_plan(config, gpu, experts, 256, mode="disk", **small)["decode"]["step_ms"] == pytest.approx(
        host["decode"]["step_ms"])
    assert offload_plan(config, gpu, 0, 256, mode="disk")["disk_bandwidth"] == DISK_BANDWIDTH_ASSUMED == 7e9


def test_the_disk_plan_of_the_release_on_one_h200(capsys):
    from kimik3.cli import main

    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB", "--experts-offload", "disk", "--context", "128K",
            "--prefill-chunk", "1024", "--json"]
    assert main(base + ["--host-mem", "1500GB"]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert main(base) == 0  # no --host-mem: no page cache counted, every moved expert read from the disk
    paged = json.loads(capsys.readouterr().out)
    assert cached["fits"] and paged["fits"] and cached["host"]["from_disk"] == 0 and paged["host"]["from_disk"] == 1
    # the experts' part: about 92 x 16 x 17.5 MB moved at 50 GB/s, from the disk at 7 GB/s as well when not cached;
    # beside it the GPU's own read and the piecewise loop's 92 reads of the routes
    experts = {name: plan["decode"]["step_ms"] - plan["decode"]["piecewise_ms"] - plan["decode"]["gpu_ms"]
               for name, plan in
               (("cached", cached), ("paged", paged))}
    assert 500 < experts["cached"] < 600 and 4000 < experts["paged"] < 4500


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--experts-offload", "host", "--host-mem", "1500GB", "--disk-bandwidth", "7GB/s"],
                 "argument --disk-bandwidth: only with --experts-offload disk", id="memory-plan-disk-bandwidth-not-disk"),
    pytest.param(["--disk-bandwidth", "7GB/s"], "argument --disk-bandwidth: only with --experts-offload",
                 id="memory-plan-disk-bandwidth-without-offload"),
])
def test_the_disk_plans_bad_options_exit_2_naming_the_option(capsys, argv, message):
    from kimik3.cli import main

    assert main(["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB"] + argv) == 2
    assert "kimik3 memory: error: " + message in capsys.readouterr().err
