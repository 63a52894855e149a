"""Routed experts kept off the device (docs/design.md, Routed experts off the device).

The load option `experts_offload="host"` keeps every MoE layer's routed-expert stacks (dense or packed MXFP4) in host
memory, pinned where CUDA exists; `experts_offload="disk"` maps them from the folder's safetensors shards instead
(file-backed, never read by transformers' loader: the OS pages them in from the disk when the cache asks for an
expert). Everything else stays where the load put it. After a layer's router has chosen, `ExpertCache.fetch` moves
only the chosen experts that the layer's device cache does not hold and returns a compact stack of the chosen experts
on the compute device, with the routes renumbered into it. With `experts_compute="host"` (or "auto", decided per
forward by `HostRates`) the chosen experts the device lacks are computed on the CPU where their bytes are instead
(`routed_split`): only their inputs and outputs cross. It imports no model file: the model hands it its class, its
expert modules and their stacks."""

import contextlib
import contextvars
import os
import re
from collections import OrderedDict

import torch
from torch import nn

from .release_layout_kimi_k3 import EXPERT_PARTS, RELEASE_TEXT_PREFIX, mxfp4_overflow_message, release_name
from .experts_format_kimi_k3 import EXPERTS_FORMATS
from .files_kimi_k3 import (
    _index_name,
    check_file_name,
    check_inside,
    dict_without_duplicate_keys,
    load_error,
    read_json,
    read_safetensors_header,
)
from .host_experts_kimi_k3 import (
    MEASURED_EXPERTS,
    STREAM_MAX_TOKENS,
    HostRates,
    HostShare,
    StreamedRoutes,
    measure_host_rates,
    routed_split,
    select_experts,
    to_device,
)
from .parallel_kimi_k3 import PARALLEL_LOAD_KWARGS

EXPERTS_OFFLOAD_MODES = ("host", "disk")
# where the chosen experts the device's cache lacks are computed: copied to the device ("device"), on the CPU over
# their bytes in host memory ("host"), or per forward whichever `HostRates` says is faster ("auto")
EXPERTS_COMPUTE_MODES = ("device", "host", "auto")
# experts_cache_bytes="auto": the cache takes what the GPU has free after the load, less the compact stack of one
# layer's experts (a prefill may choose every one) and AUTO_RESERVE_FRACTION of the GPU's memory for the sequence's
# cache and the forward's activations (at the release's size on one H200 that is 7 GB: its cache at 128K tokens and a
# 2K prefill chunk's workspace, docs/design.md); longer contexts or larger chunks take bytes from
# `kimik3 memory --plan --experts-offload host`
AUTO_CACHE = "auto"
AUTO_RESERVE_FRACTION = 0.05
# device_map strategies transformers resolves by memory; with the offload the rest of the model goes to one device
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


class ExpertsOffloadError(ValueError):
    pass


def check_offload_request(experts_offload, experts_cache_bytes, load_kwargs: dict, pretrained=None,
                          experts_compute: str | None = None) -> None:
    """The load options, checked before anything is read (`pretrained`: what the load is given, a local folder for
    the disk tier)."""
    if experts_offload is None:
        for key, value in (("experts_cache_bytes", experts_cache_bytes), ("experts_compute", experts_compute)):
            if value is not None:
                raise ExpertsOffloadError(f"{key}={value!r} needs experts_offload (one of "
                                          f"{list(EXPERTS_OFFLOAD_MODES)}): without it every expert is on the device")
        return
    if experts_compute is not None and (not isinstance(experts_compute, str)
                                        or experts_compute not in EXPERTS_COMPUTE_MODES):
        raise ExpertsOffloadError(f"experts_compute={experts_compute!r}: unknown; known: "
                                  f"{list(EXPERTS_COMPUTE_MODES)} (where the chosen experts the device lacks are "
                                  "computed)")
    if experts_offload not in EXPERTS_OFFLOAD_MODES:
        raise ExpertsOffloadError(f"experts_offload={experts_offload!r}: unknown; known: {list(EXPERTS_OFFLOAD_MODES)}")
    # the offload keeps whole expert stacks on one host and one device: a load split across ranks is refused
    for key in PARALLEL_LOAD_KWARGS:
        if load_kwargs.get(key) is not None:
            raise ExpertsOffloadError(f"experts_offload={experts_offload!r} with {key}: the offload keeps the routed "
                                      "experts of one device in its host's memory; tensor/expert parallelism is not "
                                      "supported with it")
    if experts_cache_bytes == AUTO_CACHE and isinstance(experts_cache_bytes, str):
        if not torch.cuda.is_available():
            raise ExpertsOffloadError(f"experts_cache_bytes={AUTO_CACHE!r} sizes the expert cache from a CUDA "
                                      "device's free memory, and CUDA is not available: give a whole number of bytes")
    elif isinstance(experts_cache_bytes, bool) or not isinstance(experts_cache_bytes, int):
        raise ExpertsOffloadError(f"experts_offload={experts_offload!r} needs experts_cache_bytes, a whole number of "
                                  f"bytes for the device's expert cache, or {AUTO_CACHE!r} (what the GPU has free "
                                  f"after the load) (got {experts_cache_bytes!r})")
    elif experts_cache_bytes <= 0:
        raise ExpertsOffloadError(f"experts_cache_bytes={experts_cache_bytes}: must be > 0 (at least one expert per "
                                  "MoE layer)")
    if experts_offload == "disk":
        if pretrained is not None:
            _local_folder(pretrained, load_kwargs)
        for key in ("state_dict", "gguf_file"):
            if load_kwargs.get(key) is not None:
                raise ExpertsOffloadError(f"experts_offload='disk' with {key}: the disk tier maps the routed experts "
                                          "from a folder's safetensors shards")


def offload_device_map(device_map, expert_modules: list[str], mode: str = "host") -> tuple[dict | None, dict]:
    """(the device_map the load is given, {expert module offloaded: its tier, "host" or "disk"}). With "host" the
    routed experts are placed in host memory by the load itself (transformers' device_map), never passing through the
    device; with "disk" they are left out of the load (`experts_kept_out_of_the_load`) and mapped from the shards
    after it:

    * None: the model loads on the CPU, its experts offloaded (host and device are one);
    * one device (a str, int or torch.device; a strategy such as "auto" means the first CUDA device, or the CPU):
      everything on it but the expert modules, mapped to "cpu" (host) or left out of the map (disk);
    * a dict: the user's map; an expert module it does not name is offloaded to the mode's tier (host: "cpu" added
      for it); one it names (its own key, or keys inside it) on an accelerator stays there, not offloaded (the
      per-layer choice); one it names on "cpu" is kept in host memory (the host tier, with either mode); "disk" is
      accelerate's offload, refused with ours."""
    disk = mode == "disk"
    unnamed = "disk" if disk else "host"
    if device_map is None:
        return None, dict.fromkeys(expert_modules, unnamed)
    if isinstance(device_map, dict):
        placed = dict(device_map)
        offloaded = {}
        for name in expert_modules:
            named = {placed[key] for key in placed if key == name or key.startswith(name + ".")}
            if not named:
                if not disk:
                    placed[name] = "cpu"
                offloaded[name] = unnamed
            elif "disk" in named:
                raise ExpertsOffloadError(f"device_map puts {name} on 'disk' (accelerate's offload) with "
                                          f"experts_offload={mode!r}: map it to 'cpu' or to a device, or leave it out")
            elif named == {"cpu"}:
                offloaded[name] = "host"
            elif "cpu" in named:
                raise ExpertsOffloadError(f"device_map splits {name} between 'cpu' and {sorted(map(str, named))}: an "
                                          "expert module is offloaded whole or kept on one device")
        return placed, offloaded
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES:
        device_map = 0 if torch.cuda.is_available() else "cpu"
    if not isinstance(device_map, (str, int, torch.device)):
        raise ExpertsOffloadError(f"device_map={device_map!r} with experts_offload: give a device, a strategy "
                                  f"({', '.join(DEVICE_MAP_STRATEGIES)}) or a dict")
    placed = {"": device_map} if disk else {"": device_map, **dict.fromkeys(expert_modules, "cpu")}
    return placed, dict.fromkeys(expert_modules, unnamed)


def auto_cache_bytes(free: int, total: int, bytes_per_expert: int, num_experts: int, num_layers: int) -> int:
    """The budget of experts_cache_bytes="auto" on a GPU with `free` of `total` bytes free after the load; refused
    by name when it would not hold one expert per MoE layer."""
    reserve = num_experts * bytes_per_expert + int(AUTO_RESERVE_FRACTION * total)
    budget = free - reserve
    if budget < num_layers * bytes_per_expert:
        raise ExpertsOffloadError(
            f"experts_cache_bytes={AUTO_CACHE!r}: the GPU has {free:,} of {total:,} bytes free after the load; less "
            f"one layer's compact stack ({num_experts} x {bytes_per_expert:,} bytes) and {AUTO_RESERVE_FRACTION:.0%} "
            f"of its memory for the forward, {max(budget, 0):,} bytes are left, less than one expert per MoE layer "
            f"({num_layers} x {bytes_per_expert:,}): keep more layers' experts off the GPU (device_map), or give "
            "experts_cache_bytes from `kimik3 memory --plan --experts-offload host`")
    return budget


def expert_bytes(stacks) -> int:
    """The bytes of one expert across its stacks (every stack is [E, ...]; meta stacks count as well)."""
    return sum(stack[0].numel() * stack.element_size() for stack in stacks)


class ExpertParts:
    """The experts of one layer as the release stores them, one file-backed tensor per expert and part (`experts.{E}.
    w1/w3/w2`): `parts[i][e]` holds the parts of our stack i for expert e, their rows in the order our fused stack
    stacks them (gate_up: w1 rows, then w3 rows). `copy_into` assembles one expert in its rows of the device's
    compact stacks, a copy straight from the mapped bytes, as a host stack's range is copied."""

    def __init__(self, parts: list[list[tuple[torch.Tensor, ...]]]):
        self.parts = parts
        self.bytes_per_expert = sum(t.numel() * t.element_size() for stack in parts for t in stack[0])

    def shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of one expert in each of our stacks, its parts' rows together."""
        return [((sum(part.shape[0] for part in stack[0]), *stack[0][0].shape[1:]), stack[0][0].dtype)
                for stack in self.parts]

    def expert(self, expert: int) -> tuple[torch.Tensor, ...]:
        """Expert `expert` as one tensor a stack of ours (its parts' rows together), in host memory (a copy)."""
        return tuple(select_experts(stack, [expert])[0] for stack in self.parts)

    def stacks(self, count: int) -> tuple[torch.Tensor, ...]:
        """The first `count` experts as stacks [count, ...] in our order, in host memory (a copy: what the rates of
        "auto" are timed on, `measure_host_rates`, where the module holds no stack of its own)."""
        return tuple(select_experts(stack, list(range(min(count, len(stack))))) for stack in self.parts)

    def copy_into(self, expert: int, outs: tuple[torch.Tensor, ...], non_blocking: bool) -> None:
        """Copies expert `expert`'s parts into `outs` (one tensor a stack, on the device), straight from the mapped
        bytes, as a host stack's `out.copy_(stack[e])`."""
        for stack, out in zip(self.parts, outs):
            row = 0
            for part in stack[expert]:
                out[row:row + part.shape[0]].copy_(part, non_blocking=non_blocking)
                row += part.shape[0]


def _runs(positions: list[int], ids: list[int]) -> list[tuple[int, int, int]]:
    """(first position in the compact stack, first expert id, count) for each run of `positions` (ascending) whose
    experts have consecutive ids: one copy a run and a stack instead of one an expert (a prefill moves whole ranges)."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][0] + runs[-1][2] == position and runs[-1][1] + runs[-1][2] == ids[position]:
            runs[-1][2] += 1
        else:
            runs.append([position, ids[position], 1])
    return [tuple(run) for run in runs]


class ExpertFetch:
    """The chosen experts of one layer's forward on their way to the device: `ExpertCache.fetch` has issued the
    copies of the missed ones (on the cache's copy stream on a GPU, so the work that does not need them runs
    meanwhile); `wait` adds the held ones (device to device, on the current stream), makes the current stream wait for
    the copies, lets the cache keep its share of the moved experts, and returns what `ExpertCache.gather` returns.
    The held experts' copies and the chosen ids' crossing wait for `wait` so that nothing the device's share alone
    needs delays what starts before it (the copies of the missed experts, the CPU's share). `host_ids`: the chosen
    experts this forward computes on the CPU instead (none copied; `routed_split`), in ascending id; `ids` are then
    the ones on the device. `top_cpu`: the routes as read from the device once (`routed_split` works out its split
    from them without reading again). `host_share`: the CPU's share once started (`LayerOffload.start_host_share`)."""

    def __init__(self, cache, layer: int, ids: list[int], top_indices: torch.Tensor,
                 compact: tuple[torch.Tensor, ...] | None, held: list[tuple[int, tuple]], missed: list[int], event,
                 host_ids: list[int], top_cpu: torch.Tensor):
        self.cache, self.layer, self.ids, self.top_indices = cache, layer, ids, top_indices
        self.compact, self.held, self.missed, self.event = compact, held, missed, event
        self.host_ids, self.top_cpu = list(host_ids), top_cpu
        self.host_share = None

    def wait(self):
        if self.compact is None:  # every chosen expert held: each compact stack is one stack of the held pieces
            self.compact = tuple(torch.stack(pieces) for pieces in zip(*(held for _, held in self.held)))
        else:
            for position, held in self.held:
                for out, piece in zip(self.compact, held):
                    out[position].copy_(piece)
        if self.event is not None:
            torch.cuda.current_stream(self.compact[0].device).wait_event(self.event)
        # the moved experts the cache keeps: their own copies of the compact rows, on the current stream
        wanted = set(self.ids)
        for position in self.missed:
            self.cache._keep(self.layer, self.ids[position], tuple(stack[position] for stack in self.compact), wanted)
        chosen = to_device(torch.tensor(self.ids, dtype=self.top_indices.dtype), self.top_indices.device)
        return torch.searchsorted(chosen, self.top_indices), self.compact


class LayerSlots:
    """One layer's cached experts in fixed places on the device: one tensor per stack [capacity, ...] (`stacks`),
    each cached expert in a slot of them (the cache's entries are views of its slot) and `map` [E] on the device
    (expert -> its slot, -1 where not cached). A slot and the map are written on the current stream, one after the
    other, so whatever reads the map in stream order (a streamed forward: host_experts_kimi_k3.StreamedRoutes) finds
    the expert it names in the slot."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], capacity: int, num_experts: int,
                 device: torch.device):
        # zeros: a free slot is read by the device's share of a streamed forward (its rows then discarded)
        self.stacks = tuple(torch.zeros((capacity, *shape), dtype=dtype, device=device) for shape, dtype in shapes)
        self.capacity = capacity
        self.map = torch.full((num_experts,), -1, dtype=torch.int64, device=device)
        self.free = list(range(capacity))
        self.slot_of: dict[int, int] = {}

    def store(self, expert: int, piece) -> tuple[torch.Tensor, ...]:
        """Copies `piece` (the expert's tensors, one a stack) into a free slot; returns the slot's views."""
        slot = self.free.pop()
        for stack, part in zip(self.stacks, piece):
            stack[slot].copy_(part)
        self.map[expert] = slot
        self.slot_of[expert] = slot
        return tuple(stack[slot] for stack in self.stacks)

    def drop(self, expert: int) -> None:
        self.map[expert] = -1
        self.free.append(self.slot_of.pop(expert))


def _source_layout(source) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], int]:
    """(shape and dtype of one expert in each stack, number of experts) of a layer's stacks [E, ...] or ExpertParts."""
    if isinstance(source, ExpertParts):
        return source.shapes(), len(source.parts[0])
    return [(tuple(stack.shape[1:]), stack.dtype) for stack in source], source[0].shape[0]


class ExpertCache:
    """The device's expert cache of one model. Its byte budget is split evenly across the offloaded MoE layers; each
    layer keeps at most `capacity` experts and evicts its least recently used one first, never one its current
    forward chose nor one `place` pinned; a layer's experts live in fixed slots (`LayerSlots`, `slots`). A chosen
    expert that does not fit (a forward choosing more experts than a layer keeps, as a prefill does) is moved for
    that forward only. Counts what moves (`moves`, `moved_bytes`), what
    hits, what the CPU computed (`host_experts`, `host_routes`, `kernel_calls`) and how often each layer routed to
    each expert (`routes`, the frequencies `place_hot_experts` places by).

    `compute` says where the chosen experts the layer lacks are computed: "device" (copied, the default), "host"
    (on the CPU over their bytes, never copied) or "auto" (per forward, whichever `rates` says is faster for that
    many experts and routes: the CPU at decode, the copy for a long prefill chunk). `host_kernel`: None runs the
    format's CPU kernel where the model computes on CUDA and the reference elsewhere (a CPU model's logits stay the
    reference's bit for bit); True or False forces it.

    On a GPU the host-to-device copies run on a copy stream of the cache's own while `side_stream` is true (the
    default), so that what a layer computes before its routed experts (the latent down-projection, the shared experts:
    `KimiK3SparseMoeBlock`) overlaps them; with `side_stream = False` they run on the current stream, in order.

    `in_stream`: with compute "host" (or "auto" where `rates.streams` says the CPU is faster for the experts a forward
    of that many tokens is expected to choose), a forward of up to STREAM_MAX_TOKENS tokens on CUDA computes every
    route to an expert the layer does not hold on the CPU in the stream's order (`StreamedRoutes`: no read of the
    routes by the host, one CUDA graph a decode step) where the format has a host step (packed MXFP4, SiTU, the
    package's kernel built); None (the default) there, True on the CPU too (its step runs at once), False never (the
    routes read on the host, `fetch`)."""

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
        self.slots: dict[int, LayerSlots] = {}
        self.pinned: dict[int, set] = {}
        self.routes: dict[int, torch.Tensor] = {}
        self.moves = self.moved_bytes = self.hits = 0
        self.host_experts = self.host_routes = self.kernel_calls = 0
        self.compute = "device"
        # bumped wherever what "auto" weighs changes at once (the rates, the placed experts, a cleared cache): each
        # layer's choices are worked out again (`LayerOffload.streams`)
        self.generation = 0
        self.rates = HostRates()
        self.host_kernel: bool | None = None
        self.side_stream = True
        self.in_stream: bool | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pool = None

    @property
    def rates(self) -> HostRates:
        return self._rates

    @rates.setter
    def rates(self, rates: HostRates) -> None:
        self._rates = rates
        self.generation += 1

    def resident_bytes(self) -> int:
        return sum(len(entries) for entries in self.layers.values()) * self.bytes_per_expert

    def clear(self) -> None:
        self.layers.clear()
        self.pinned.clear()
        self.slots.clear()
        self.generation += 1

    def route_counts(self, layer: int, num_experts: int) -> torch.Tensor:
        """The layer's routes counted per expert (`routes[layer]`, int64 on the CPU, one place an expert), made at its
        first use and then counted into in place (a streamed layer's host step holds its address)."""
        counts = self.routes.get(layer)
        if counts is None or counts.numel() < num_experts:
            grown = torch.zeros(num_experts, dtype=torch.int64)
            if counts is not None:
                grown[:counts.numel()] = counts
            counts = self.routes[layer] = grown
        return counts

    def layer_slots(self, layer: int, source, device: torch.device) -> LayerSlots:
        """The layer's slots (made at its first use, `capacity` of them, again after `capacity` changed while the
        layer held nothing): `source` its stacks or ExpertParts."""
        slots = self.slots.get(layer)
        if slots is not None and slots.capacity != self.capacity:
            if self.layers.get(layer):
                raise ExpertsOffloadError(
                    f"the expert cache's capacity is {self.capacity} experts a layer, but layer {layer} holds "
                    f"{len(self.layers[layer])} in {slots.capacity} slots: clear() the cache after changing it")
            slots = None
        if slots is None:
            shapes, num_experts = _source_layout(source)
            slots = self.slots[layer] = LayerSlots(shapes, self.capacity, num_experts, device)
        return slots

    def _copy_stream(self, device: torch.device):
        if device.type != "cuda" or not self.side_stream:
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def host_pool(self):
        """The one worker thread the CPU's share of a forward runs on while this thread drives the device."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimik3-host-experts")
        return self._pool

    def gather(self, layer: int, top_indices: torch.Tensor, source, device: torch.device):
        """(routes renumbered into the compact stacks, the compact stacks [U, ...] of the U chosen experts on
        `device`, in ascending expert id). `source`: the layer's stacks [E, ...] (host memory, or mapped from the
        shards) or its `ExpertParts`. The renumbering keeps the experts' order, so the experts' sum runs in the order
        it runs over the full stacks: the same result, bit for bit. One host sync (the chosen ids)."""
        return self.fetch(layer, top_indices, source, device).wait()

    def _on_host(self, experts: int, routes: int, flops_per_route: float) -> bool:
        if not experts or self.compute == "device":
            return False
        return self.compute == "host" or self.rates.on_host(experts, routes, self.bytes_per_expert, flops_per_route)

    def fetch(self, layer: int, top_indices: torch.Tensor, source, device: torch.device,
              flops_per_route: float = 0.0) -> ExpertFetch:
        """`gather`'s copies issued, not yet waited for (`ExpertFetch.wait`). With experts to move, the compact stacks
        are allocated on the current stream and the missed experts copied into them from the host on the copy stream,
        one copy per run of consecutive ids and stack, once the copy stream has waited for the current one (the
        stacks' memory is the current stream's), unless this forward computes them on the CPU (`compute`: over the
        host stacks or the release's parts where they are mapped); the held ones are added by `wait`."""
        # the forward's one read of its routes from the device: what is chosen, and how often, is counted here
        top_cpu = top_indices.to("cpu")
        per_expert = torch.bincount(top_cpu.reshape(-1).long())
        chosen_cpu = per_expert.nonzero().squeeze(1)  # ascending
        route_counts = per_expert[chosen_cpu]
        ids = chosen_cpu.tolist()
        shapes, num_experts = _source_layout(source)
        self.route_counts(layer, num_experts).index_add_(0, chosen_cpu, route_counts)
        entries = self.layers.setdefault(layer, OrderedDict())
        parts = source if isinstance(source, ExpertParts) else None
        absent = [(expert, int(count)) for expert, count in zip(ids, route_counts.tolist()) if expert not in entries]
        host_ids = []
        if self._on_host(len(absent), sum(c for _, c in absent), flops_per_route):
            host_ids = [expert for expert, _ in absent]
            ids = [expert for expert in ids if expert in entries]
            self.host_experts += len(host_ids)
        held, missed = [], []
        for position, expert in enumerate(ids):
            pieces = entries.get(expert)
            if pieces is None:
                missed.append(position)
                continue
            entries.move_to_end(expert)
            self.hits += 1
            held.append((position, pieces))
        compact = None
        if missed or not held:
            compact = tuple(torch.empty((len(ids), *shape), dtype=dtype, device=device) for shape, dtype in shapes)
        event = None
        if missed:
            self.layer_slots(layer, source, device)  # where `wait` keeps its share of the moved experts
            stream = self._copy_stream(device)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(device))
            # pinned host memory copies asynchronously; on CPU host and device are one (the cache still copies)
            non_blocking = device.type == "cuda"
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if parts is not None:
                    for position in missed:
                        parts.copy_into(ids[position], tuple(out[position] for out in compact), non_blocking)
                else:
                    for position, first, count in _runs(missed, ids):
                        for out, stack in zip(compact, source):
                            out[position:position + count].copy_(stack[first:first + count], non_blocking=non_blocking)
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
            self.moves += len(missed)
            self.moved_bytes += len(missed) * self.bytes_per_expert
        return ExpertFetch(self, layer, ids, top_indices, compact, held, missed, event, host_ids, top_cpu)

    def place(self, layer: int, experts: list[int], source, device: torch.device) -> None:
        """Keeps `experts` of `layer` on `device` for good: copied now from `source` (the layer's stacks, or the
        release's parts mapped from its shards), never evicted (hot experts: `place_hot_experts`). Refused beyond the
        layer's capacity."""
        experts = sorted(set(int(e) for e in experts))
        if len(experts) > self.capacity:
            raise ExpertsOffloadError(f"placing {len(experts)} experts on the device in layer {layer} of the cache: "
                                      f"it keeps {self.capacity} a layer (experts_cache_bytes)")
        entries = self.layers.setdefault(layer, OrderedDict())
        slots = self.layer_slots(layer, source, device)
        for expert in [e for e in entries if e not in experts]:
            del entries[expert]
            slots.drop(expert)
        for expert in experts:
            if expert not in entries:  # (the release's parts: the expert assembled from them, then copied)
                piece = source.expert(expert) if isinstance(source, ExpertParts) else \
                    tuple(stack[expert] for stack in source)
                entries[expert] = slots.store(expert, piece)
        self.pinned[layer] = set(experts)
        self.generation += 1

    def _keep(self, layer: int, expert: int, piece, wanted: set) -> None:
        """Keeps a moved expert (`piece`: its rows of the forward's compact stacks, copied into a slot)."""
        entries, pinned, slots = self.layers[layer], self.pinned.get(layer, set()), self.slots[layer]
        while len(entries) >= self.capacity:
            oldest = next((e for e in entries if e not in pinned), None)
            if oldest is None or oldest in wanted:
                # every cached expert is pinned or one this forward uses: this one is moved for it alone
                return
            del entries[oldest]
            slots.drop(oldest)
        entries[expert] = slots.store(expert, piece)


class LayerOffload:
    """What one offloaded expert module holds: its layer's number in the model's cache, and where its experts are
    read from when not from its own stacks (`ExpertParts`, the release's per-expert tensors mapped from disk);
    `file_backed`: its stacks (or parts) are mapped from the folder's shards (the disk tier)."""

    def __init__(self, cache: ExpertCache, layer: int, parts: ExpertParts | None = None, file_backed: bool = False,
                 flops_per_route: float = 0.0, top_k: int = 1, num_experts: int = 1):
        self.cache = cache
        self.layer = layer
        self.parts = parts
        self.file_backed = file_backed
        self.flops_per_route = flops_per_route  # one token through one expert: 2 x (2I x Dl + Dl x I)
        self.top_k, self.num_experts = top_k, num_experts
        # the streamed routes (`streams`): None until known, False where the format has no host step
        self.stream: StreamedRoutes | bool | None = None
        # "auto"'s choices (`streams`): bit t set where a forward of t tokens streams, worked out for the cache's
        # `generation` and the experts the layer held then (`auto_held`)
        self.auto_generation, self.auto_streams, self.auto_held = -1, 0, -1

    def fetch(self, top_indices, stacks, device) -> ExpertFetch:
        if self.cache.compute == "auto":  # the read path keeps experts: the choices follow what the layer holds
            self._choose()
        return self.cache.fetch(self.layer, top_indices, stacks if self.parts is None else self.parts, device,
                                self.flops_per_route)

    @torch.compiler.disable
    def _choose(self) -> None:
        """Works out "auto"'s choices for every forward that may stream (up to STREAM_MAX_TOKENS tokens) from the
        rates and the experts the layer holds now. A compiled step reads only the result (two ints), so it is traced
        again where a choice changes, not wherever the cache keeps one more expert."""
        cache, slots = self.cache, self.cache.slots.get(self.layer)
        held = len(slots.slot_of) if slots is not None else 0
        if held == self.auto_held and self.auto_generation == cache.generation:
            return
        self.auto_streams = sum(1 << tokens for tokens in range(1, STREAM_MAX_TOKENS + 1)
                                if cache.rates.streams(tokens, self.num_experts, self.top_k, cache.bytes_per_expert,
                                                       self.flops_per_route, held))
        self.auto_generation, self.auto_held = cache.generation, held

    def streams(self, tokens: int, device: torch.device, fmt, situ_betas) -> bool:
        """Whether a forward of `tokens` tokens on `device` computes this layer's routes in the stream's order
        (`ExpertCache.in_stream`)."""
        cache = self.cache
        if cache.compute == "device" or tokens > STREAM_MAX_TOKENS or situ_betas is None or cache.in_stream is False \
                or (cache.in_stream is None and device.type != "cuda"):
            return False
        if cache.compute == "auto":  # the experts the device holds run there, whichever path
            if self.auto_generation != cache.generation:
                self._choose()
            if not self.auto_streams >> tokens & 1:
                return False
        if self.stream is None:
            self.stream = False if fmt.host_kernels() is None else None
        return self.stream is not False

    @torch.compiler.disable
    def _streamed(self, stacks, fmt, situ_betas) -> StreamedRoutes:
        # made at the first streamed forward (a compiled step finds it made: `prepare_stream`); the host step reads
        # the release's parts where they are mapped (its gate and up apart), as it reads a host stack
        if self.stream is None:
            self.stream = StreamedRoutes(fmt.host_kernels(), self._host_source(stacks),
                                         self.cache.route_counts(self.layer, self.num_experts), self.top_k,
                                         situ_betas)
        return self.stream

    def prepare_stream(self, tokens: int, dtype: torch.dtype, device: torch.device, stacks, fmt,
                       situ_betas) -> bool:
        """Whether a forward of `tokens` tokens streams; makes what it uses if so, so that a compiled step finds it
        (the decode loop calls it before its first step)."""
        if not self.streams(tokens, device, fmt, situ_betas):
            return False
        self._streamed(stacks, fmt, situ_betas).prepare(tokens, dtype, device)
        return True

    def stream_routes(self, x, top_indices, top_weights, stacks, fmt, run, situ_betas):
        """The layer's routed experts computed in the stream's order (`StreamedRoutes`)."""
        stream = self.stream if isinstance(self.stream, StreamedRoutes) else self._streamed(stacks, fmt, situ_betas)
        # the experts this layer holds on the device (its slots, if any) run there
        return stream(x, top_indices, top_weights, run, self.cache.slots.get(self.layer))

    def _host_source(self, stacks):
        """What the CPU reads this layer's experts from: its host stacks, or the release's parts where mapped."""
        return stacks if self.parts is None else self.parts.parts

    def start_host_share(self, x, fetched: ExpertFetch, stacks, fmt, run, situ_betas) -> None:
        """Starts the CPU's share of `fetched` over the rows `x` (host_experts_kimi_k3.HostShare), once."""
        if fetched.host_ids and fetched.host_share is None:
            fetched.host_share = HostShare(self.cache, x, fetched, self._host_source(stacks), fmt, run, situ_betas)

    def routed_split(self, x, top_indices, top_weights, fetched: ExpertFetch, stacks, fmt, run, situ_betas):
        """The layer's routed experts when `fetched` computes some on the CPU (host_experts_kimi_k3.routed_split)."""
        return routed_split(self.cache, x, top_indices, top_weights, fetched, self._host_source(stacks), fmt, run,
                            situ_betas)

    def apply(self, module, fn) -> None:
        """`module._apply(fn)` (`model.to(...)`, `.cuda()`, `.half()`) for an offloaded expert module: its stacks stay
        where the offload keeps them, so `model.to(device)` moves the rest of the model and the cache moves what a
        forward chooses; a dtype change `fn` makes is made on the host (host stacks, pinned again), and refused for
        stacks mapped from the shards, which are used as stored. The cache is emptied (its experts are of the old
        device or dtype)."""
        pin = torch.cuda.is_available()
        for name, stack in module.named_parameters(recurse=False):
            if stack.device.type == "meta":  # the release layout's placeholders: the parts are the experts
                continue
            # what `fn` makes of a tensor like this one, on an empty tensor of its dtype and device
            dtype = fn(torch.empty(0, dtype=stack.dtype, device=stack.device)).dtype
            if dtype == stack.dtype:
                continue
            if self.file_backed:
                raise ExpertsOffloadError(
                    f"{str(stack.dtype).removeprefix('torch.')} -> {str(dtype).removeprefix('torch.')} of the routed "
                    f"experts' `{name}` (layer {self.layer} of the cache): with experts_offload='disk' they are "
                    "mapped from the shards and used as stored; load with the dtype you want (experts_offload='host' "
                    "converts at load)")
            host = stack.data.to(dtype)
            stack.data = host.pin_memory() if pin else host
        self.cache.clear()


def check_savable(model) -> None:
    """Refuses, before anything is written, a save_pretrained of a model whose routed experts are the release's
    per-expert tensors mapped from the shards (the disk tier through an adopted folder): the model holds no tensor
    of them (its stacks are placeholders on the meta device)."""
    for name, module in model.named_modules():
        offload = getattr(module, "offload", None)
        if isinstance(offload, LayerOffload) and offload.parts is not None:
            raise ExpertsOffloadError(
                f"save_pretrained: the routed experts `{name}` are mapped a tensor per expert from the release's "
                "shards (experts_offload='disk' through an adopted folder) and the model holds none of their tensors; "
                "nothing was written. Save a model loaded without experts_offload, or keep the release folder "
                "(`kimik3 adopt` makes another folder that points at it)")


def offload_routed_experts(experts_modules, mode: str, cache_bytes: int | str, mapped: dict | None = None,
                           device: torch.device | None = None, compute: str | None = None) -> ExpertCache:
    """Moves each module's stacks (`module.stacks()`) to host memory (pinned where CUDA exists), freezes them (the
    device's copies carry no gradient back) and gives each module its `LayerOffload`. Returns the model's cache.
    `mapped` ({module: its ExpertParts or None}, from `map_routed_experts`): modules whose experts are mapped from
    the shards, left where they are (a copy into pinned memory would read every byte of them); None: their own
    stacks are the mapped tensors. `device`: the CUDA device whose free memory sizes a cache_bytes="auto"."""
    check_offload_request(mode, cache_bytes, {}, experts_compute=compute)
    mapped = mapped or {}
    if not experts_modules:
        raise ExpertsOffloadError(f"experts_offload={mode!r}: the model has no routed experts (no MoE layer)")
    for module in experts_modules:
        if module.num_experts < module.config.num_experts:
            raise ExpertsOffloadError(f"experts_offload={mode!r}: the model holds {module.num_experts} of "
                                      f"{module.config.num_experts} experts per layer (expert parallelism), which the "
                                      "offload does not support")
    per_expert = expert_bytes(experts_modules[0].stacks())
    pin = torch.cuda.is_available()
    for layer, module in enumerate(experts_modules):
        if hasattr(module, "_hf_hook"):
            # a device_map with "cpu" next to a device gives the module accelerate's hook, which would move its whole
            # stacks at every forward; detaching it puts the weights back on the CPU, where the cache reads them
            from accelerate.hooks import remove_hook_from_module

            remove_hook_from_module(module)
        if module not in mapped:
            for stack in module.stacks():
                host = stack.data.to("cpu")
                stack.data = host.pin_memory() if pin else host
                stack.requires_grad_(False)
    if cache_bytes == AUTO_CACHE:  # measured once the stacks have left the device
        if device is None or torch.device(device).type != "cuda":
            raise ExpertsOffloadError(f"experts_cache_bytes={AUTO_CACHE!r} sizes the expert cache from a CUDA "
                                      f"device's free memory (device {device}): give a whole number of bytes")
        free, total = torch.cuda.mem_get_info(device)
        # blocks torch's allocator keeps reserved but unused are free for the cache too
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        cache_bytes = auto_cache_bytes(free, total, per_expert, experts_modules[0].num_experts, len(experts_modules))
    cache = ExpertCache(cache_bytes, len(experts_modules), per_expert)
    for layer, module in enumerate(experts_modules):
        module.offload = LayerOffload(cache, layer, mapped.get(module), file_backed=module in mapped,
                                      flops_per_route=6 * module.intermediate_size * module.latent_size,
                                      top_k=module.config.num_experts_per_token, num_experts=module.num_experts)
    cache.compute = compute or "device"
    if cache.compute == "auto":  # timed on the first layer's experts (the release's parts: a few of them assembled)
        parts = mapped.get(experts_modules[0])
        cache.rates = measure_host_rates(experts_modules[0], device,
                                         stacks=None if parts is None else parts.stacks(MEASURED_EXPERTS))
    return cache


def place_hot_experts(model, per_layer: int | None = None, routes: dict | None = None) -> dict[int, list[int]]:
    """Keeps each offloaded layer's most routed experts on the device for good (`ExpertCache.place`): `routes`
    ({layer: counts [E]}, default what the cache counted in the forwards so far, e.g. a calibration prompt's),
    `per_layer` of them (default the cache's capacity). Returns {layer: the placed ids}."""
    cache = getattr(model, "experts_cache", None)
    if cache is None:
        raise ExpertsOffloadError("place_hot_experts: the model's routed experts are not offloaded (experts_offload)")
    routes = cache.routes if routes is None else routes
    per_layer = cache.capacity if per_layer is None else per_layer
    placed = {}
    for module in model.modules():
        offload = getattr(module, "offload", None)
        if not isinstance(offload, LayerOffload):
            continue
        counts = routes.get(offload.layer)
        if counts is None or int(counts.sum()) == 0:
            raise ExpertsOffloadError(f"place_hot_experts: no routes counted for layer {offload.layer} of the cache: "
                                      "run a forward (a calibration prompt) first, or pass routes")
        top = torch.argsort(counts, descending=True, stable=True)[:per_layer]
        hot = sorted(int(e) for e in top if int(counts[e]) > 0)
        placed[offload.layer] = hot
        cache.place(offload.layer, hot, offload.parts if offload.parts is not None else module.stacks(),
                    _compute_device(model))
    return placed


def _compute_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


# --- the disk tier: the routed experts kept out of transformers' loader, then mapped from the shards -------------

# The load whose model construction `experts_kept_out_of_the_load` watches, in this thread's context only.
_UNREAD_LOAD: contextvars.ContextVar = contextvars.ContextVar("kimik3_experts_unread", default=None)


@contextlib.contextmanager
def experts_kept_out_of_the_load(model_class, names: list[str]):
    """transformers' loader reads every checkpoint tensor that lands on one of the model's state_dict keys (a
    device_map entry "meta" included) and leaves the others alone as unexpected keys. While this is open, the model
    of `model_class` that the load builds (seen at its first submodule's registration, torch's module registration
    hook, before its post_init) leaves the routed experts of the modules `names` out of its state_dict, so their
    tensors are never read nor their parameters materialised (they stay on the meta device), and it ignores their
    checkpoint keys as transformers' `_keys_to_ignore_on_load_unexpected` does, so the load reports nothing of them.
    Same on transformers 5.17 and 5.24 (both build the model, then read `model.state_dict()`). Undone on exit."""
    names = tuple(names)
    patterns = {r"(^|\.)" + re.escape(name) + r"\." for name in names}
    load = {"models": [], "handles": []}

    def leave_out(module, state_dict, prefix, local_metadata):
        for key in [key for key in state_dict if any(key.startswith(prefix + name + ".") for name in names)]:
            del state_dict[key]

    def registration(parent, name, child):
        if _UNREAD_LOAD.get() is not load or not isinstance(parent, model_class) \
                or any(model is parent for model in load["models"]):
            return None
        load["models"].append(parent)
        load["handles"].append(parent.register_state_dict_post_hook(leave_out))
        parent._keys_to_ignore_on_load_unexpected = set(type(parent)._keys_to_ignore_on_load_unexpected or ()) | \
            patterns
        return None

    token = _UNREAD_LOAD.set(load)
    hook = nn.modules.module.register_module_module_registration_hook(registration)
    try:
        yield load["models"]
    finally:
        hook.remove()
        _UNREAD_LOAD.reset(token)
        for handle in load["handles"]:
            handle.remove()
        for model in load["models"]:
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) - patterns


# safetensors dtypes of the tensors the tier maps, as torch dtypes (a stack's dtype is the model's)
_TORCH_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "BF16": torch.bfloat16, "F16": torch.float16,
                 "F32": torch.float32, "F64": torch.float64, "I16": torch.int16, "I32": torch.int32,
                 "I64": torch.int64}


class ShardMapper:
    """The weights of one local folder as its index (or single file) names them: only plain file names of the
    folder, resolving inside it (an adopted folder's links into its release folder are the exception, as for every
    load: files_kimi_k3.check_inside), each header read once as strictly as the format (read_safetensors_header:
    offsets within the file, no overlap, no hole), each file mapped once, privately (a write would copy a page, the
    file is never written) and never read here: `tensor` is a view of the mapping, file-backed, no copy."""

    def __init__(self, folder: str, variant: str | None = None):
        self.folder = folder
        self._headers: dict[str, dict] = {}
        self._maps: dict[str, torch.Tensor] = {}
        index_name, single_name = _index_name(variant)
        index_path, single_path = os.path.join(folder, index_name), os.path.join(folder, single_name)
        if os.path.lexists(index_path):
            check_inside(folder, index_path)
            index = read_json(index_path, object_pairs_hook=dict_without_duplicate_keys)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise load_error(index_path, "not a safetensors index (needs a `weight_map` object mapping tensor "
                                 "names to shard file names)")
            self.index_path, self.weight_map = index_path, weight_map
        elif os.path.lexists(single_path):
            check_inside(folder, single_path)
            self.index_path = single_path
            self.weight_map = dict.fromkeys(self._header(single_name), single_name)
        else:
            raise load_error(folder, f"holds neither {index_name} nor {single_name}: experts_offload='disk' maps the "
                             "routed experts from the folder's safetensors weights")

    def _path(self, shard, tensor) -> str:
        check_file_name(shard, self.index_path, what="shard", suffix=".safetensors", tensor=tensor)
        path = os.path.join(self.folder, shard)
        check_inside(self.folder, path)
        return path

    def _header(self, shard, tensor=None) -> dict:
        if shard not in self._headers:
            self._headers[shard] = read_safetensors_header(self._path(shard, tensor))[0]
        return self._headers[shard]

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The file-backed tensor `name` of the index, which must be `dtype` and `shape` as the model holds it."""
        shard = self.weight_map.get(name)
        if shard is None:
            raise load_error(self.index_path, "the index names no such tensor: the routed experts mapped from disk "
                             "need it", name)
        path = self._path(shard, name)
        entry = self._header(shard, name).get(name)
        if entry is None:
            raise load_error(path, "the index names this tensor but the shard's header lacks it", name)
        kind, found, begin, end = entry
        if _TORCH_DTYPES.get(kind) != dtype:
            raise load_error(path, f"holds {kind}, the model holds this tensor as {str(dtype).removeprefix('torch.')}: "
                             "a mapped tensor is used as stored, without a conversion (load with the dtype the "
                             "file holds, or use experts_offload='host', which converts)", name)
        if tuple(found) != tuple(shape):
            raise load_error(path, f"has shape {list(found)}, the model needs {list(shape)}", name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if begin % itemsize:
            raise load_error(path, f"its data starts at byte {begin}, not a multiple of its {itemsize}-byte elements: "
                             "it cannot be mapped without a copy", name)
        whole = self._maps.get(shard)
        if whole is None:
            size = os.stat(path).st_size
            if size < end:  # the header was read moments ago: the file shrank since
                raise load_error(path, f"file is truncated: the tensor's data ends at byte {end} but the file has "
                                 f"only {size} bytes", name)
            whole = self._maps[shard] = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
        return whole[begin:end].view(dtype).view(shape)

    def names_under(self, prefix: str) -> set[str]:
        return {name for name in self.weight_map if name.startswith(prefix)}


def _release_stacks(module) -> list[tuple[str, str]]:
    """(the fused tensor, the release suffix of its parts) of each of `module.stacks()`, in its order: MXFP4's
    `gate_up_proj_packed` -> (`gate_up_proj`, `weight_packed`), dense `down_proj` -> (`down_proj`, `weight`)."""
    return [(stack, release) for stack in module.STACKS for release in module.format.release_suffixes]


def _stored_as(name: str, stacks) -> object:
    """The experts format whose tensor names `name` has, ours (`gate_up_proj_packed`) or the release's
    (`w1.weight_packed`), else None."""
    last = name.rsplit(".", 1)[-1]
    for fmt in EXPERTS_FORMATS.values():
        if last in fmt.release_suffixes or last in {stack + suffix for stack in stacks for suffix in fmt.suffixes}:
            return fmt
    return None


def _check_names(shards: ShardMapper, prefix: str, expected: list[str], module_name: str, module) -> None:
    """The index's tensors under one expert module's prefix must be exactly those the mapping reads: a missing one
    is named, and so is one more (an extra expert, or a format the model does not hold), which transformers' loader,
    told to ignore these keys, would not report."""
    fmt, stacks = module.format, module.STACKS
    found = shards.names_under(prefix)
    missing = [name for name in expected if name not in found]
    extra = sorted(found - set(expected))
    stored = {_stored_as(name, stacks) for name in extra}
    if missing and extra and len(stored) == 1 and None not in stored and fmt not in stored:
        (stored,) = stored
        how = ("decoding them is a copy: experts_offload='host' does it" if fmt.trainable
               else f"storing them as {fmt.name} is a conversion")
        raise load_error(shards.index_path, f"the routed experts are stored {stored.description} and "
                         "experts_offload='disk' maps them as stored: load with "
                         f"experts_format='{stored.name}' ({how})", extra[0])
    if missing:
        raise load_error(shards.index_path, f"the index lacks this tensor of the routed experts `{module_name}`, "
                         "which experts_offload='disk' maps from the shards", missing[0])
    if extra:
        raise load_error(shards.index_path, f"the index names this tensor under the routed experts `{module_name}`, "
                         f"which the model does not hold ({len(expected)} tensors expected: an extra expert, or a "
                         "format other than the model's experts_format)", extra[0])


def _dtype_of(model) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)


def map_routed_experts(folder: str, model, names: list[str], variant: str | None = None) -> dict:
    """Maps the routed experts of the modules `names` (left on the meta device by the load) from the folder's
    shards; {module: ExpertParts | None}. Our layout (a fused stack a tensor, e.g. `...mlp.experts.gate_up_proj`)
    becomes the module's parameters, file-backed; the release layout (`...block_sparse_moe.experts.{E}.w1...`,
    through an adopted folder) is mapped a tensor per expert and part, an `ExpertParts` the cache assembles from,
    while the module's parameters stay on the meta device. Names are looked up as the text model's and under the
    composite model's `language_model.` prefix. Kept-packed release experts are checked for scales that decode to
    non-finite values (as the release loader's RejectInfiniteScales and check_packed_experts)."""
    shards = ShardMapper(folder, variant)
    modules = dict(model.named_modules())
    dtype = _dtype_of(model)
    mapped = {}
    for name in names:
        module = modules[name]
        stack_names = module.stack_names()
        stacks = dict(zip(stack_names, module.stacks()))
        ours_prefix = next((p + name + "." for p in ("", RELEASE_TEXT_PREFIX) if shards.names_under(p + name + ".")),
                           None)
        release = release_name(name + ".")[:-1]  # `...mlp.experts` -> `...block_sparse_moe.experts`
        release_prefix = next((p + release + "." for p in ("", RELEASE_TEXT_PREFIX)
                               if shards.names_under(p + release + ".")), None)
        if ours_prefix is not None:
            expected = [ours_prefix + stack for stack in stack_names]
            _check_names(shards, ours_prefix, expected, name, module)
            for stack_name, full in zip(stack_names, expected):
                stack = stacks[stack_name]
                mapped_stack = shards.tensor(full, stack.dtype, tuple(stack.shape))
                module.register_parameter(stack_name, nn.Parameter(mapped_stack, requires_grad=False))
            mapped[module] = None
        elif release_prefix is not None:
            parts, expected = [], []
            for stack_name, (fused, suffix) in zip(stack_names, _release_stacks(module)):
                stack = stacks[stack_name]
                part_names = EXPERT_PARTS[fused]
                rows = stack.shape[1] // len(part_names)
                experts = []
                for expert in range(stack.shape[0]):
                    names_e = [f"{release_prefix}{expert}.{part}.{suffix}" for part in part_names]
                    expected += names_e
                    experts.append(names_e)
                parts.append((stack, rows, experts))
            _check_names(shards, release_prefix, expected, name, module)
            source = [[tuple(shards.tensor(n, stack.dtype, (rows, *stack.shape[2:])) for n in experts_e)
                       for experts_e in experts] for stack, rows, experts in parts]
            _check_release_values(shards, source, parts, dtype, module.format)
            mapped[module] = ExpertParts(source)
        else:
            raise load_error(shards.index_path, f"names no tensor of the routed experts `{name}` (neither our "
                             f"`{name}.*` nor the release's `{release}.{{E}}.*`, bare or under `{RELEASE_TEXT_PREFIX}`"
                             "): experts_offload='disk' maps them from the folder's shards")
    return mapped


def _check_release_values(shards: ShardMapper, source, parts, dtype, fmt) -> None:
    """Every mapped expert's stored values must decode to finite values in the model's dtype (the format says which
    do not: for MXFP4 it reads the scales, 1/16 of the codes' bytes, and codes only where a scale is high). `source`
    holds the stacks in the format's order, each [expert][part]."""
    per_stack = len(fmt.suffixes)
    for first in range(0, len(source), per_stack):
        tensors = source[first:first + per_stack]
        for expert in range(len(tensors[0])):
            for part in range(len(tensors[0][expert])):
                found = fmt.first_overflow(tuple(t[expert][part] for t in tensors), dtype)
                if found is not None:
                    where, byte, code = found
                    tensor = parts[first + per_stack - 1][2][expert][part]
                    raise load_error(os.path.join(shards.folder, shards.weight_map[tensor]),
                                     mxfp4_overflow_message(where, byte, code, dtype), tensor)


def _local_folder(path, load_kwargs) -> str:
    """The local folder a disk-tier load maps from (the folder named, and its `subfolder`)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ExpertsOffloadError(f"experts_offload='disk' with {path!r}: the disk tier maps the routed experts from "
                                  "the shards of a local folder (download the model and name its folder)")
    subfolder = load_kwargs.get("subfolder") or ""
    return os.path.join(os.fspath(path), subfolder) if subfolder else os.fspath(path)


def load_with_experts_offloaded(load, model_class, path, load_args, load_kwargs: dict, mode: str, cache_bytes: int,
                                names: list[str], compute: str | None = None):
    """`load(path, ...)` (transformers' from_pretrained, returning (model, loading info)) with the routed experts of
    the modules `names` offloaded to `mode`'s tier and the model's `experts_cache` set: "host" through the device_map
    (`offload_device_map`), "disk" kept out of the load and mapped from the folder's shards after it."""
    folder = _local_folder(path, load_kwargs) if mode == "disk" else None  # checked before the load already
    load_kwargs["device_map"], tiers = offload_device_map(load_kwargs.get("device_map"), names, mode)
    on_disk = [name for name, tier in tiers.items() if tier == "disk"]
    with experts_kept_out_of_the_load(model_class, on_disk) if on_disk else contextlib.nullcontext():
        loaded = load(path, *load_args, **load_kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    mapped = map_routed_experts(folder, model, on_disk, load_kwargs.get("variant")) if on_disk else {}
    modules = dict(model.named_modules())
    # "auto" reads the free memory of the device the model computes on (where its embeddings are)
    device = model.get_input_embeddings().weight.device
    model.experts_cache = offload_routed_experts([modules[name] for name in tiers], mode, cache_bytes, mapped, device,
                                                 compute)
    return loaded


__all__ = ["AUTO_CACHE", "DEVICE_MAP_STRATEGIES", "EXPERTS_COMPUTE_MODES", "EXPERTS_OFFLOAD_MODES", "ExpertCache",
           "ExpertFetch", "ExpertParts", "ExpertsOffloadError", "LayerOffload", "place_hot_experts", "ShardMapper",
           "auto_cache_bytes", "check_offload_request",
           "check_savable", "expert_bytes", "experts_kept_out_of_the_load", "load_with_experts_offloaded",
           "map_routed_experts", "offload_device_map", "offload_routed_experts"]
