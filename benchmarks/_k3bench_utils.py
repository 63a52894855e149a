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
"""Helpers of benchmarks/bench_k3.py: import layout, budgeted sections with incremental JSON, timing, rooflines."""

import gc
import importlib
import importlib.util
import json
import math
import sys
import time
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# measured device-to-device copy on this H200 kind (docs/benchmarks.md, Machine, versions and model)
HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS_PER_S = 790e12  # measured 8192^3 bf16 GEMM on this H200 kind


def ensure_kimik3():
    """Make `kimik3.kernels` / `kimik3.modeling` / `kimik3.configuration` importable without `pip install -e .`."""
    try:
        importlib.import_module("kimik3.modeling.modeling_kimi_k3")
        importlib.import_module("kimik3.kernels")
        return "installed"
    except ImportError:
        pass
    pkg = types.ModuleType("kimik3")
    pkg.__path__ = [str(ROOT / "kimik3")]
    sys.modules["kimik3"] = pkg
    # kimik3/kernels.py is the kernels package itself (it points its __path__ at kernels/), found under kimik3/
    pkg.kernels = importlib.import_module("kimik3.kernels")
    for sub, folder in (("configuration", "configuration"), ("modeling", "modeling_kimik3")):
        spec = importlib.util.spec_from_file_location(
            f"kimik3.{sub}", ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"kimik3.{sub}"] = module
        spec.loader.exec_module(module)
        setattr(pkg, sub, module)
    return "path"


class Runner:
    """Runs named sections under one wall-clock budget; every result is written to the JSON file at once."""

    def __init__(self, out_path: Path, budget_s: float):
        self.out_path = Path(out_path)
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.results: dict = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def emit(self, key, value):
        self.results[key] = value
        print(json.dumps({key: value}, default=str), flush=True)
        tmp = self.out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.out_path)

    def section(self, name, fn, need_s: float = 0.0):
        if self.left() < need_s:
            self.emit(name, {"skipped": f"time budget ({self.left():.0f} s left, needs ~{need_s:.0f} s)"})
            return None
        start = time.monotonic()
        try:
            result = fn()
            if isinstance(result, dict):
                result.setdefault("section_wall_s", round(time.monotonic() - start, 2))
            self.emit(name, result)
            return result
        except torch.cuda.OutOfMemoryError as exc:
            self.emit(name, {"error": "CUDA OOM", "detail": str(exc)[:400],
                             "section_wall_s": round(time.monotonic() - start, 2)})
        except Exception as exc:  # keep going: one failure must not lose the other measurements
            self.emit(name, {"error": f"{type(exc).__name__}: {str(exc)[:400]}",
                             "traceback": traceback.format_exc()[-1500:],
                             "section_wall_s": round(time.monotonic() - start, 2)})
        finally:
            free_cuda()
        return None


def free_cuda():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def reset_peak():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def timed(fn, repeats: int = 1, warmup: int = 0):
    """Median seconds of `repeats` calls after `warmup` calls (CUDA-synchronised wall clock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2], times


def event_us(fn, iters: int, warmup: int = 3) -> float:
    """Mean microseconds per call of `iters` back-to-back calls after `warmup`, timed by CUDA events (no host
    synchronisation between calls: kernel-level timings)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def graph_us(fn, iters: int, warmup: int = 3) -> float:
    """Mean microseconds per replay of fn captured in a CUDA graph (GPU time without host launch cost, as inside the
    compiled decode step's graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return event_us(graph.replay, iters, warmup=1)


def copy_bytes_per_s(nbytes: int = 2 << 30, iters: int = 10) -> float:
    """This GPU's device-to-device copy rate, bytes read plus bytes written a second over `iters` copies of `nbytes`
    (how HBM_BYTES_PER_S was measured on the H200 kind), for a roofline of the card a run is on."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = event_us(lambda: dst.copy_(src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6)


# the operands fla's chunk_kda is handed for bf16 inputs (kernels.kda.KDA_CHUNK_OPERANDS), by the tag the benchmarks
# and diagnostics name them with: bf16 as given; fp16, 11 significant bits at bf16's bytes; f32 intermediates
KDA_OPERANDS = {"bf16": None, "f16": torch.float16, "f32": torch.float32}


def with_setting(module, name, value, fn):
    """fn() with the module constant `name` set to `value` (a kernel switch or threshold), restored afterwards."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        return fn()
    finally:
        setattr(module, name, saved)


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """host_experts_kimi_k3.expected_distinct_experts (the model's own formula)."""
    ensure_kimik3()
    from kimik3.modeling.host_experts_kimi_k3 import expected_distinct_experts as distinct

    return distinct(num_experts, top_k, batch)


def uniform_routed_counts(tokens: int, num_experts: int, top_k: int, device="cpu") -> torch.Tensor:
    """Routed rows per expert [num_experts] for `tokens` tokens, each choosing `top_k` distinct experts uniformly
    (what random weights route like)."""
    choice = torch.rand(tokens, num_experts, device=device).topk(top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(choice, minlength=num_experts)


def round_sig(x, digits=4):
    if x is None or x == 0 or not math.isfinite(x):
        return x
    return round(x, -int(math.floor(math.log10(abs(x)))) + (digits - 1))


def random_model(config, device, dtype: torch.dtype = torch.bfloat16):
    """KimiK3ForCausalLM with random weights built directly on `device` in `dtype` (the modules create their f32
    islands, A_log, dt_bias, convs and o_norm, in f32 themselves), with no uninitialised memory left in a parameter."""
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = KimiK3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for param in model.parameters():
            if not bool(torch.isfinite(param).all()):
                param.normal_(0.0, 0.02)
    return model.eval()
