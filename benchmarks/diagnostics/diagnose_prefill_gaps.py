"""Where an eager 8K prefill waits on the host (a diagnostic, not a test): the benchmark model (bench_k3.py's
`k3_config`, random bf16 weights) prefills 8K tokens once to warm up, then once under
`torch.cuda.set_sync_debug_mode("warn")`, recording the Python stack of every synchronising CUDA call, and once
under the profiler, measuring the idle time between consecutive kernels on the stream (the gaps that the wall adds
to the kernel time) and the kernels on each side of the longest; then once more, listing the GPU time of PyTorch's
memory-bound ops (copies, fills, adds, gathers) by op and input shapes.

Prints and writes JSON (to $OUT or the working directory).

    python benchmarks/diagnostics/diagnose_prefill_gaps.py
"""

import collections
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for bench_k3
from bench_k3 import K, K3Driver, build, k3_config, prefill, random_ids  # noqa: E402

from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

OWN = ("kimik3", "fla", "transformers", "bench_k3")


def sync_sites(drv, ids):
    """Python frames (ours, fla's, transformers') of each synchronising call in one prefill, counted."""
    sites = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if any(o in f.filename for o in OWN)]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        sites[key] += 1

    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.inference_mode():
                prefill(drv, ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [{"site": site, "count": n} for site, n in sites.most_common()]


def stream_gaps(drv, ids, top=25):
    """Idle time between consecutive GPU kernels/copies of one prefill, the largest gaps with the kernel after them."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            prefill(drv, ids)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in gpu)
    gaps = []
    for before, after in zip(gpu, gpu[1:]):
        idle = after.time_range.start - before.time_range.end
        if idle > 0:
            gaps.append((idle, before.name[:80], after.name[:80]))
    gaps.sort(reverse=True)
    span = gpu[-1].time_range.end - gpu[0].time_range.start if gpu else 0
    return {"wall_ms": round(wall * 1e3, 2), "kernel_ms": round(busy / 1e3, 2), "gpu_span_ms": round(span / 1e3, 2),
            "idle_in_span_ms": round(sum(g[0] for g in gaps) / 1e3, 2), "gaps": len(gaps),
            "idle_over_50us_ms": round(sum(g[0] for g in gaps if g[0] > 50) / 1e3, 2),
            "largest": [{"idle_us": round(i, 1), "after": b, "before": a} for i, b, a in gaps[:top]]}


def elementwise_sites(drv, ids, ops=("aten::copy_", "aten::fill_", "aten::add", "aten::mul", "aten::index_select",
                                      "aten::cat", "aten::zero_", "aten::to", "aten::_to_copy")):
    """GPU time of the memory-bound PyTorch ops of one prefill, by op and input shapes (the shapes tell the call
    sites apart; the profiler's Python stacks came back empty here on the H200)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            prefill(drv, ids)
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in ops and e.self_device_time_total > 0:
            rows.append({"op": e.key, "calls": e.count, "gpu_ms": round(e.self_device_time_total / 1e3, 3),
                         "shapes": str(e.input_shapes)[:120]})
    rows.sort(key=lambda r: -r["gpu_ms"])
    return rows[:30]


def main():
    torch.manual_seed(0)
    model = build(KimiK3ForCausalLM, k3_config())
    drv = K3Driver(model)
    ids = random_ids(1, 8 * K)
    with torch.inference_mode():
        prefill(drv, ids)
        torch.cuda.synchronize()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": 8 * K}
    results["sync_sites"] = sync_sites(drv, ids)
    results["gaps"] = stream_gaps(drv, ids)
    results["elementwise_sites"] = elementwise_sites(drv, ids)
    print(json.dumps(results, indent=1)[:6000])
    Path(os.environ.get("OUT", "."), "diagnose_prefill_gaps.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
