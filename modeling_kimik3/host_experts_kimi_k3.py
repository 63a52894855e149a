# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Routed experts computed where they live (docs/design.md, Routed experts computed where they live): with the
experts in host memory (offload_kimi_k3.py), the chosen experts the device's cache lacks run on the CPU over their
bytes instead of crossing to the device. `HostRates` weighs the two per forward, `measure_host_rates` times them,
`host_routes` runs the CPU's share (the format's kernel, or the reference), `HostShare` starts it on a worker thread
as soon as a layer's rows are queued, `routed_split` runs a layer's routes on both sides and sums them in the
reference's order. It imports nothing of the offload: the cache hands it what it needs."""

import torch


class HostRates:
    """The rates a forward's choice between computing its missing experts on the CPU and copying them to the device
    weighs (`experts_compute="auto"`): `copy_bytes_per_s` host -> device, `host_bytes_per_s` the CPU's rate over packed
    expert bytes with one token per expert (a memory-bound pass), `host_flops` its rate with many tokens per expert
    (compute-bound). `measure_host_rates` times them on this machine; the defaults are ASSUMPTIONS (PCIe 5.0 x16 pinned
    copies; a server socket's kernel at about 100 GB/s and 2 TFLOP/s) until then. Beside the experts, a MoE layer
    costs a fixed time on each path, which `streams` weighs: `stream_layer_s` where its routes are computed in the
    stream's order, `read_layer_s` where the host reads them first (the device idles while they cross). Both are
    ASSUMPTIONS measured on an H100's host, the figures of kimik3 memory's plan (kimik3/memory.py,
    STREAM_LAYER_S_ASSUMED and PIECEWISE_LAYER_S_ASSUMED; a test holds the two places equal)."""

    def __init__(self, copy_bytes_per_s: float = 50e9, host_bytes_per_s: float = 100e9, host_flops: float = 2e12,
                 measured: bool = False, stream_layer_s: float = 0.104e-3, read_layer_s: float = 1.5e-3):
        self.copy_bytes_per_s, self.host_bytes_per_s, self.host_flops = copy_bytes_per_s, host_bytes_per_s, host_flops
        self.measured = measured
        self.stream_layer_s, self.read_layer_s = stream_layer_s, read_layer_s

    def __repr__(self) -> str:
        return (f"HostRates(copy {self.copy_bytes_per_s / 1e9:.1f} GB/s, host {self.host_bytes_per_s / 1e9:.1f} GB/s, "
                f"{self.host_flops / 1e12:.2f} TFLOP/s, {'measured' if self.measured else 'assumed'})")

    def host_seconds(self, experts: int, routes: int, bytes_per_expert: int, flops_per_route: float) -> float:
        return max(experts * bytes_per_expert / self.host_bytes_per_s, routes * flops_per_route / self.host_flops)

    def copy_seconds(self, experts: int, bytes_per_expert: int) -> float:
        return experts * bytes_per_expert / self.copy_bytes_per_s

    def on_host(self, experts: int, routes: int, bytes_per_expert: int, flops_per_route: float) -> bool:
        """Whether `experts` missing experts serving `routes` routes are computed faster on the CPU than copied."""
        return self.host_seconds(experts, routes, bytes_per_expert, flops_per_route) < \
            self.copy_seconds(experts, bytes_per_expert)

    def streams(self, tokens: int, num_experts: int, top_k: int, bytes_per_expert: int, flops_per_route: float,
                held: int = 0) -> bool:
        """Whether a forward of `tokens` tokens computes its routes on the CPU in the stream's order under "auto",
        the layer holding `held` experts on the device. Decided before its routes are known, so for the experts it is
        expected to choose under uniform routing (`expected_distinct_experts`), each held with probability
        held / num_experts: streamed, the CPU computes the missing ones and the layer pays `stream_layer_s`; read,
        the layer pays `read_layer_s` and then computes them where `on_host` says (CPU or copy)."""
        missing = 1 - min(held, num_experts) / num_experts
        experts = round(expected_distinct_experts(num_experts, top_k, tokens) * missing)
        routes = tokens * top_k * missing
        host = self.host_seconds(experts, routes, bytes_per_expert, flops_per_route)
        read = min(host, self.copy_seconds(experts, bytes_per_expert))
        return host + self.stream_layer_s < read + self.read_layer_s


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts one MoE layer's router chooses for `tokens` tokens under uniform routing: each token
    picks top_k distinct of num_experts, tokens independently, so an expert is missed by all with probability
    (1 - top_k / num_experts) ** tokens."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def select_experts(stack, ids: list[int]) -> torch.Tensor:
    """The experts `ids` of one stack as a compact copy [len(ids), ...]: from a host stack [E, ...], or from the
    release's parts (a tuple of row pieces an expert, `offload_kimi_k3.ExpertParts.parts`), joined in our rows'
    order."""
    if isinstance(stack, torch.Tensor):
        return stack.index_select(0, torch.tensor(ids, dtype=torch.int64))
    return torch.stack([torch.cat(stack[e]) for e in ids])


def host_routes(rows, sorted_ids, host_ids: list[int], stacks, fmt, run, situ_betas) -> tuple[torch.Tensor, int]:
    """(each host route's expert output, 1 if the format's CPU kernel computed them else 0). `rows` [R, Dl] on the
    CPU, sorted by expert (`sorted_ids`); `stacks`: the layer's host stacks [E, ...] in the format's order, or the
    release's parts in that order (`ExpertParts.parts`: the kernel reads them where they are mapped)."""
    ids = torch.tensor(host_ids, dtype=torch.int64)
    counts = torch.bincount(torch.searchsorted(ids, sorted_ids.long()), minlength=len(host_ids)).tolist()
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    if situ_betas is not None:
        out = fmt.run_on_host(rows, offsets, stacks, host_ids, situ_betas)
        if out is not None:
            return out, 1
    # the reference: the module's op over a copy of the chosen experts (a compact stack of them, not the layer's)
    compact = tuple(select_experts(stack, host_ids) for stack in stacks)
    local = torch.searchsorted(ids, sorted_ids.long()).unsqueeze(-1)
    return run(rows, local, torch.ones(local.shape), compact), 0


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`: on a GPU through pinned memory (torch's caching host allocator), so the copy
    is queued on the current stream and the CPU goes on, instead of a pageable copy that waits for the stream."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostShare:
    """The CPU's share of one layer's forward, started when made, as soon as the layer's latent rows are queued: the
    route split is worked out on the CPU from the routes `fetch` read (`fetched.top_cpu`), every row of `x` crosses to
    host memory in one queued copy, and the cache's worker thread waits for it, gathers the CPU routes' rows there and
    runs them (`host_routes`) while the calling thread goes on queueing the device's work (the shared experts, the
    device's share). `result()` is (the CPU routes' outputs, in pinned memory on a GPU, 1 if the format's kernel
    computed them else 0)."""

    def __init__(self, cache, x, fetched, stacks, fmt, run, situ_betas):
        top_k = fetched.top_cpu.shape[-1]
        flat = fetched.top_cpu.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.token_of = self.order // top_k
        sorted_ids = flat[self.order]
        on_host = torch.isin(sorted_ids, torch.tensor(fetched.host_ids, dtype=flat.dtype))
        self.host_at, self.device_at = on_host.nonzero().squeeze(1), (~on_host).nonzero().squeeze(1)
        self.local = torch.searchsorted(torch.tensor(fetched.ids, dtype=flat.dtype), sorted_ids[self.device_at])
        host_sorted, host_tokens = sorted_ids[self.host_at], self.token_of[self.host_at]
        if x.device.type == "cuda":
            # all rows (a decode step's few): no device-side gather, so nothing waits for the indices to cross first
            rows = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            rows.copy_(x, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(x.device))
        else:
            rows, ready = x, None
        use_kernel = cache.host_kernel if cache.host_kernel is not None else x.device.type == "cuda"
        # the worker thread runs under this thread's grad and inference modes (thread-local in torch)
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        pinned = x.device.type == "cuda"

        def share():
            if ready is not None:
                ready.synchronize()
            with torch.set_grad_enabled(modes[0]), torch.inference_mode(modes[1]):
                out, kernel = host_routes(rows.index_select(0, host_tokens), host_sorted, fetched.host_ids, stacks,
                                          fmt, run, situ_betas if use_kernel else None)
                if pinned:  # the way back is then one queued copy
                    out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True).copy_(out)
            return out, kernel

        self._job = cache.host_pool().submit(share)

    def result(self) -> tuple[torch.Tensor, int]:
        return self._job.result()


def routed_split(cache, x, top_indices, top_weights, fetched, stacks, fmt, run, situ_betas):
    """The routed experts' output when `fetched` computes some chosen experts on the CPU (`fetched.host_ids`), with
    `cache` the model's ExpertCache: every route's expert output (`run(rows, indices [R, 1], unit weights, stacks)`, the
    module's own op over the compact device stacks; on the CPU the format's kernel over the host stacks' bytes, or `run`
    over a copy of the chosen experts), then weighted and summed in f32 in the order `ops_kimi_k3.routed_experts` sums
    them (routes sorted by expert, stable), rounded once: a CPU model gives the reference's logits bit for bit.
    `situ_betas`: the SiTU-GLU's betas, None for another activation (the kernel is SiTU-only).

    The CPU's share is `fetched.host_share` where the caller started it (the MoE block does, before it queues the
    shared experts), else started here. On a GPU nothing here waits for the device but the CPU's share: the split's
    index vectors cross in one queued copy, the CPU's outputs come back from pinned memory, the device's share and the
    sums are queued behind them."""
    share = fetched.host_share or HostShare(cache, x, fetched, stacks, fmt, run, situ_betas)
    num_tokens = top_indices.shape[0]
    device = x.device
    pieces = (share.order, share.token_of, share.host_at, share.device_at, share.local)
    order_d, token_d, host_at_d, device_at_d, local_d = to_device(torch.cat(pieces), device).split(
        [piece.numel() for piece in pieces])
    per_route = torch.empty((share.order.numel(), x.shape[-1]), dtype=x.dtype, device=device)
    if share.device_at.numel():
        _, compact = fetched.wait()
        device_rows = x.index_select(0, token_d.index_select(0, device_at_d))
        per_route.index_copy_(0, device_at_d, run(device_rows, local_d.unsqueeze(-1),
                                                   torch.ones((share.device_at.numel(), 1), device=device), compact))
    host_out, kernel = share.result()
    per_route.index_copy_(0, host_at_d, host_out.to(device, non_blocking=True))
    cache.host_routes += share.host_at.numel()
    cache.kernel_calls += kernel
    return sum_routes(per_route, order_d, token_d, top_weights, num_tokens)


def sum_routes(per_route, order, token_of, top_weights, num_tokens: int) -> torch.Tensor:
    """Each token's routes summed as `ops_kimi_k3.routed_experts` sums them: `per_route` [R, Dl] the routes' expert
    outputs in the order `order` takes them (routes sorted by expert, stable), `token_of` each one's token, weighted
    in f32, added in that order into an f32 sum per token, rounded once to the outputs' dtype."""
    weighted = per_route.float() * top_weights.reshape(-1).index_select(0, order).unsqueeze(-1).float()
    combined = torch.zeros(num_tokens, per_route.shape[-1], dtype=torch.float32, device=per_route.device)
    return combined.index_add(0, token_of, weighted).to(per_route.dtype)


# Decode steps of up to this many tokens compute an offloaded layer's routes on the CPU in the stream's order
# (`StreamedRoutes`); longer forwards (a prefill chunk) read their routes on the host, whose split takes them once per
# forward (`routed_split`): the step's buffers are made per token count and kept, which a prefill's many counts would
# multiply.
STREAM_MAX_TOKENS = 64


class StreamedRoutes:
    """One offloaded layer's routes computed on the CPU in the device's stream order (docs/design.md, Routed experts
    computed where they live): the format's host step (`kernels`: kimik3.kernels.mxfp4_host) is queued between the
    copy of the layer's rows and routes into pinned memory and the copy of its outputs back, so no host thread reads
    the routes and a decode step captures as one CUDA graph. The routes to the experts the device's cache holds run
    there, over the cache's slots (offload_kimi_k3.LayerSlots: fixed stacks and a device map from expert to slot);
    the step leaves them out. Every route is summed on the device in the reference's order (`sum_routes`).

    A step (pinned buffers of fixed address) is made per (tokens, dtype, device) and kept. Making one cannot be
    traced: a compiled decode step finds its steps made (`prepare`, which the decode loop calls)."""

    def __init__(self, kernels, stacks, routes: torch.Tensor, top_k: int, situ_betas):
        self.kernels = kernels
        self.table = kernels.ExpertTable(stacks[:2], stacks[2:], routes)
        self.top_k, self.situ_betas = top_k, situ_betas
        self.steps: dict[tuple, int] = {}  # by (tokens, dtype, device): the step's number
        self._made = []  # the steps themselves (the kernels' registry holds them weakly)

    @torch.compiler.disable
    def prepare(self, tokens: int, dtype: torch.dtype, device: torch.device) -> int:
        """The number of the step for `tokens` tokens in `dtype` on `device`, made if new."""
        key = (tokens, dtype, device)
        if key not in self.steps:
            step = self.kernels.HostRouteStep(self.table, tokens, self.top_k, dtype, *self.situ_betas, device)
            self._made.append(step)
            self.steps[key] = self.kernels.register_step(step)
        return self.steps[key]

    def __call__(self, x, top_indices, top_weights, run, slots=None):
        """The layer's routed experts' output [T, Dl] for rows x [T, Dl]; `slots` the experts the device holds
        (`map`, `stacks`), `run` the module's op for them."""
        key = (x.shape[0], x.dtype, x.device)
        step = self.steps[key] if key in self.steps else self.prepare(*key)
        flat = top_indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // top_indices.shape[-1]
        if slots is None:
            return sum_routes(self.kernels.host_routes_in_stream(x, top_indices, step), order, token_of,
                              top_weights, x.shape[0])
        # the routes the device holds cross marked (-1 - expert), with the routes themselves: the step leaves out
        # exactly the routes the device computes, read from the map in the same stream order
        held = slots.map.index_select(0, flat) >= 0
        host_out = self.kernels.host_routes_in_stream(x, torch.where(held, -1 - flat, flat).view_as(top_indices),
                                                      step)
        slot = slots.map.index_select(0, flat.index_select(0, order))
        device_out = run(x.index_select(0, token_of), slot.clamp(min=0).unsqueeze(-1),
                         torch.ones((slot.numel(), 1), device=x.device), slots.stacks)
        per_route = torch.where((slot >= 0).unsqueeze(-1), device_out, host_out)
        return sum_routes(per_route, order, token_of, top_weights, x.shape[0])


# Experts `measure_host_rates` times the CPU over (at most; the disk tier's caller assembles this many): two decode
# steps' distinct experts at K3's top-16, so that consecutive timed steps read different experts (a step's 281 MB
# outgrow the CPU's caches)
MEASURED_EXPERTS = 32


def time_host_step(stacks, fmt, top_k: int, latent: int, dtype: torch.dtype, situ_betas, repeats: int = 3):
    """Seconds one token's `top_k` experts take through the format's host step (`StreamedRoutes`' own, run at once on
    the CPU), its fixed cost per call counted in as a layer pays it: best of `repeats` after a warm-up, each call over
    experts the previous one did not read where `stacks` hold enough (so none is timed from the CPU's caches). None
    where the format has no host step. `stacks`: host stacks [E, ...] in the format's order."""
    import time

    kernels = fmt.host_kernels() if situ_betas is not None else None
    if kernels is None:
        return None
    num_experts = stacks[0].shape[0]
    chosen = min(top_k, num_experts)
    table = kernels.ExpertTable(stacks[:2], stacks[2:], torch.zeros(num_experts, dtype=torch.int64))
    step = kernels.HostRouteStep(table, 1, chosen, dtype, *situ_betas, torch.device("cpu"))
    x = torch.randn(1, latent).to(dtype)
    windows = max(1, num_experts // chosen)
    times = []
    for repeat in range(repeats + 1):
        first = repeat % windows * chosen
        ids = torch.arange(first, first + chosen, dtype=torch.int64)[None]
        start = time.perf_counter()
        step.run(x, ids)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def measure_host_rates(module, device=None, repeats: int = 3, stacks=None) -> HostRates:
    """The rates of `HostRates` timed on this machine with one offloaded expert module's own stacks (or `stacks`,
    where the module holds none: the disk tier's release parts assembled, `offload_kimi_k3.ExpertParts.stacks`), each
    the best of `repeats` after a warm-up:

    * the CPU's rate over packed bytes, as a decode step runs it: one token's `top_k` experts through the format's
      host step (`time_host_step`), or through `host_routes` (the reference) where the format has none;
    * the compute rate: 32 tokens of one expert through `host_routes`;
    * the copy of one expert to `device` (host memory to host memory where it is the CPU)."""
    import time

    stacks, fmt = module.stacks() if stacks is None else stacks, module.format
    chosen = min(module.config.num_experts_per_token, stacks[0].shape[0])
    latent = module.latent_size
    betas = (module.config.activation_situ_beta, module.config.activation_situ_linear_beta)
    target = torch.device(device) if device is not None else torch.device("cpu")
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if target.type == "cuda":
                torch.cuda.synchronize(target)
            times.append(time.perf_counter() - start)
        return min(times)

    def host(tokens_each: int, count: int):
        rows = torch.randn(tokens_each * count, latent).to(dtype)
        sorted_ids = torch.arange(count).repeat_interleave(tokens_each)
        return lambda: host_routes(rows, sorted_ids, list(range(count)), stacks, fmt,
                                   lambda x, i, w, s: fmt.run(x, i, w, s, betas), betas)

    per_expert = sum(stack[0].numel() * stack.element_size() for stack in stacks)
    one_token = time_host_step(stacks, fmt, chosen, latent, dtype,
                               None if module.config.hidden_act == "silu" else betas, repeats)
    if one_token is None:
        one_token = best(host(1, chosen))
    many = 32
    many_tokens = best(host(many, 1))
    flops = 6 * module.intermediate_size * latent
    piece = tuple(stack[0] for stack in stacks)
    copy = best(lambda: [p.to(target, non_blocking=target.type == "cuda", copy=True) for p in piece])
    return HostRates(copy_bytes_per_s=per_expert / copy, host_bytes_per_s=chosen * per_expert / one_token,
                     host_flops=many * flops / many_tokens, measured=True)


__all__ = ["STREAM_MAX_TOKENS", "HostRates", "HostShare", "StreamedRoutes", "expected_distinct_experts", "host_routes",
           "measure_host_rates", "routed_split", "sum_routes", "time_host_step"]
