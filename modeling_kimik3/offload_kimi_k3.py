"""Routed experts kept off the device (docs/design.md, Routed experts off the device).

The load option `experts_offload="host"` keeps every MoE layer's routed-expert stacks (dense or packed MXFP4) in host
memory, pinned where CUDA exists; everything else stays where the load put it. After a layer's router has chosen,
`ExpertCache.gather` moves only the chosen experts that the layer's device cache does not hold and returns a compact
stack of the chosen experts on the compute device, with the routes renumbered into it. It imports no model file: the
model hands it its expert modules and their stacks."""

from collections import OrderedDict

import torch

from .parallel_kimi_k3 import PARALLEL_LOAD_KWARGS

EXPERTS_OFFLOAD_MODES = ("host",)
# device_map strategies transformers resolves by memory; with the offload the rest of the model goes to one device
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


class ExpertsOffloadError(ValueError):
    pass


def check_offload_request(experts_offload, experts_cache_bytes, load_kwargs: dict) -> None:
    """The load options, checked before anything is read."""
    if experts_offload is None:
        if experts_cache_bytes is not None:
            raise ExpertsOffloadError(f"experts_cache_bytes={experts_cache_bytes!r} needs experts_offload (one of "
                                      f"{list(EXPERTS_OFFLOAD_MODES)}): without it every expert is on the device")
        return
    if experts_offload not in EXPERTS_OFFLOAD_MODES:
        raise ExpertsOffloadError(f"experts_offload={experts_offload!r}: unknown; known: {list(EXPERTS_OFFLOAD_MODES)}")
    # the offload keeps whole expert stacks on one host and one device: a load split across ranks is refused
    for key in PARALLEL_LOAD_KWARGS:
        if load_kwargs.get(key) is not None:
            raise ExpertsOffloadError(f"experts_offload={experts_offload!r} with {key}: the offload keeps the routed "
                                      "experts of one device in its host's memory; tensor/expert parallelism is not "
                                      "supported with it")
    if isinstance(experts_cache_bytes, bool) or not isinstance(experts_cache_bytes, int):
        raise ExpertsOffloadError(f"experts_offload={experts_offload!r} needs experts_cache_bytes, a whole number of "
                                  f"bytes for the device's expert cache (got {experts_cache_bytes!r})")
    if experts_cache_bytes <= 0:
        raise ExpertsOffloadError(f"experts_cache_bytes={experts_cache_bytes}: must be > 0 (at least one expert per "
                                  "MoE layer)")


def offload_device_map(device_map, expert_modules: list[str]) -> tuple[dict | None, list[str]]:
    """(the device_map the load is given, the expert modules to offload). The routed experts are placed in host
    memory by the load itself (transformers' device_map), never passing through the device:

    * None: the model loads on the CPU, its experts offloaded there (host and device are one);
    * one device (a str, int or torch.device; a strategy such as "auto" means the first CUDA device, or the CPU):
      everything on it but the expert modules, mapped to "cpu";
    * a dict: the user's map, with "cpu" added for every expert module it does not name; an expert module it names
      (its own key, or keys inside it) on an accelerator stays there, not offloaded (the per-layer choice); one it
      names on "cpu" is offloaded; "disk" is accelerate's offload, refused with ours."""
    if device_map is None:
        return None, list(expert_modules)
    if isinstance(device_map, dict):
        placed = dict(device_map)
        offloaded = []
        for name in expert_modules:
            named = {placed[key] for key in placed if key == name or key.startswith(name + ".")}
            if not named:
                placed[name] = "cpu"
                offloaded.append(name)
            elif "disk" in named:
                raise ExpertsOffloadError(f"device_map puts {name} on 'disk' (accelerate's offload) with "
                                          "experts_offload='host': map it to 'cpu' or to a device, or leave it out")
            elif named == {"cpu"}:
                offloaded.append(name)
            elif "cpu" in named:
                raise ExpertsOffloadError(f"device_map splits {name} between 'cpu' and {sorted(map(str, named))}: an "
                                          "expert module is offloaded whole or kept on one device")
        return placed, offloaded
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES:
        device_map = 0 if torch.cuda.is_available() else "cpu"
    if not isinstance(device_map, (str, int, torch.device)):
        raise ExpertsOffloadError(f"device_map={device_map!r} with experts_offload: give a device, a strategy "
                                  f"({', '.join(DEVICE_MAP_STRATEGIES)}) or a dict")
    return {"": device_map, **dict.fromkeys(expert_modules, "cpu")}, list(expert_modules)


def expert_bytes(stacks) -> int:
    """The bytes of one expert across its stacks (every stack is [E, ...])."""
    return sum(stack[0].numel() * stack.element_size() for stack in stacks)


class ExpertCache:
    """The device's expert cache of one model. Its byte budget is split evenly across the offloaded MoE layers; each
    layer keeps at most `capacity` experts and evicts its least recently used one first, never one its current
    forward chose. A chosen expert that does not fit (a forward choosing more experts than a layer keeps, as a
    prefill does) is moved for that forward only. Counts what moves (`moves`, `moved_bytes`) and what hits."""

    def __init__(self, budget_bytes: int, num_layers: int, bytes_per_expert: int):
        per_layer = budget_bytes // num_layers
        if per_layer < bytes_per_expert:
            raise ExpertsOffloadError(
                f"experts_cache_bytes={budget_bytes}: less than one expert per offloaded MoE layer ({num_layers} "
                f"layers x {bytes_per_expert} bytes = {num_layers * bytes_per_expert} bytes at least)")
        self.budget_bytes = budget_bytes
        self.bytes_per_expert = bytes_per_expert
        self.capacity = per_layer // bytes_per_expert
        self.layers: dict[int, OrderedDict] = {}
        self.moves = self.moved_bytes = self.hits = 0

    def resident_bytes(self) -> int:
        return sum(len(entries) for entries in self.layers.values()) * self.bytes_per_expert

    def clear(self) -> None:
        self.layers.clear()

    def gather(self, layer: int, top_indices: torch.Tensor, stacks, device: torch.device):
        """(routes renumbered into the compact stacks, the compact stacks [U, ...] of the U chosen experts on
        `device`, in ascending expert id). The renumbering keeps the experts' order, so the experts' sum runs in
        the order it runs over the full stacks: the same result, bit for bit. One host sync (the chosen ids)."""
        chosen = torch.unique(top_indices)  # sorted
        ids = chosen.tolist()
        entries = self.layers.setdefault(layer, OrderedDict())
        wanted = set(ids)
        for expert in ids:
            if expert in entries:
                entries.move_to_end(expert)
                self.hits += 1
        pieces = []
        for expert in ids:
            piece = entries.get(expert)
            if piece is None:
                non_blocking = device.type == "cuda"
                # a copy even where host and device are one (CPU): the cache holds its own tensors, as on a GPU
                piece = tuple(stack[expert].to(device, non_blocking=non_blocking, copy=True) for stack in stacks)
                self.moves += 1
                self.moved_bytes += self.bytes_per_expert
                self._keep(entries, expert, piece, wanted)
            pieces.append(piece)
        compact = tuple(torch.stack([piece[i] for piece in pieces]) for i in range(len(stacks)))
        return torch.searchsorted(chosen, top_indices), compact

    def _keep(self, entries: OrderedDict, expert: int, piece, wanted: set) -> None:
        while len(entries) >= self.capacity:
            oldest = next(iter(entries))
            if oldest in wanted:  # every cached expert is one this forward uses: this one is moved for it alone
                return
            del entries[oldest]
        entries[expert] = piece


class LayerOffload:
    """What one offloaded expert module holds: its layer's number in the model's cache."""

    def __init__(self, cache: ExpertCache, layer: int):
        self.cache = cache
        self.layer = layer

    def gather(self, top_indices, stacks, device):
        return self.cache.gather(self.layer, top_indices, stacks, device)


def offload_routed_experts(experts_modules, mode: str, cache_bytes: int) -> ExpertCache:
    """Moves each module's stacks (`module.stacks()`) to host memory (pinned where CUDA exists), freezes them (the
    device's copies carry no gradient back) and gives each module its `LayerOffload`. Returns the model's cache."""
    check_offload_request(mode, cache_bytes, {})
    if not experts_modules:
        raise ExpertsOffloadError(f"experts_offload={mode!r}: the model has no routed experts (no MoE layer)")
    for module in experts_modules:
        if module.num_experts < module.config.num_experts:
            raise ExpertsOffloadError(f"experts_offload={mode!r}: the model holds {module.num_experts} of "
                                      f"{module.config.num_experts} experts per layer (expert parallelism), which the "
                                      "offload does not support")
    cache = ExpertCache(cache_bytes, len(experts_modules), expert_bytes(experts_modules[0].stacks()))
    pin = torch.cuda.is_available()
    for layer, module in enumerate(experts_modules):
        if hasattr(module, "_hf_hook"):
            # a device_map with "cpu" next to a device gives the module accelerate's hook, which would move its whole
            # stacks at every forward; detaching it puts the weights back on the CPU, where the cache reads them
            from accelerate.hooks import remove_hook_from_module

            remove_hook_from_module(module)
        for stack in module.stacks():
            host = stack.data.to("cpu")
            stack.data = host.pin_memory() if pin else host
            stack.requires_grad_(False)
        module.offload = LayerOffload(cache, layer)
    return cache


__all__ = ["DEVICE_MAP_STRATEGIES", "EXPERTS_OFFLOAD_MODES", "ExpertCache", "ExpertsOffloadError", "LayerOffload",
           "check_offload_request", "expert_bytes", "offload_device_map", "offload_routed_experts"]
