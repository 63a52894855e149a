"""The packed GEMV's variants side by side (a diagnostic, not a test): both expert matmuls of one MoE layer of the
benchmark model (gate_up N 6144 K 3584, down N 3584 K 3072, 64 experts, top-16 routed uniformly) at 1, 8 and 32
tokens, the same routes and operands for every variant, each autotuned and then timed as a CUDA graph replay:

* `gemv[_prefetch][_f32x]`: the product kernel (`mxfp4._mxfp4_gemv_fwd`) with `MXFP4_GEMV_PREFETCH` and
  `MXFP4_GEMV_X_F32` each off or on (both off: the kernel as it was before either),
* `shared_rows{2,4}`: `profile_mxfp4_decode.shared_rows_gemv`, the product kernel's loop with up to 2 or 4 routed
  rows of one expert per program (each word decoded once for them, absent rows skipped),
* `tiles`: the 16-row tiles (`mxfp4._mxfp4_grouped_matmul_fwd`), at 8 and 32 tokens.

Each output is compared with the reference (`mxfp4._mxfp4_grouped_matmul_reference`) relative to |x| @ |W|^T.
Writes $OUT/time_mxfp4_gemv_variants.json (or the working directory).

    python3 benchmarks/diagnostics/time_mxfp4_gemv_variants.py
"""

import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _k3bench_utils import graph_us, uniform_routed_counts  # noqa: E402
from profile_mxfp4_decode import shared_rows_gemv  # noqa: E402

from kimik3.kernels import mxfp4  # noqa: E402
from kimik3.modeling import ops_kimi_k3 as ops  # noqa: E402

SHAPES = {"gate_up": (6144, 3584), "down": (3584, 3072)}
EXPERTS, TOP_K = 64, 16


def gemv(prefetch, f32_x):
    def run(xs, packed, scale, ends):
        mxfp4.MXFP4_GEMV_PREFETCH, mxfp4.MXFP4_GEMV_X_F32 = prefetch, f32_x
        return mxfp4._mxfp4_gemv_fwd(xs, packed, scale, ends)
    return run


VARIANTS = {
    "gemv": gemv(False, False),
    "gemv_prefetch": gemv(True, False),
    "gemv_f32x": gemv(False, True),
    "gemv_prefetch_f32x": gemv(True, True),
    "shared_rows2": lambda xs, packed, scale, ends: shared_rows_gemv(xs, packed, scale, ends, 2),
    "shared_rows4": lambda xs, packed, scale, ends: shared_rows_gemv(xs, packed, scale, ends, 4),
    "tiles": mxfp4._mxfp4_grouped_matmul_fwd,
}


def error_vs_reference(out, xs, packed, scale, ends):
    """max |out - ref| / (|x| @ |W|^T) over the routed rows, float64, the dequantised experts hit."""
    worst, start = 0.0, 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            weight = ops.dequantize_mxfp4(packed[expert], scale[expert], torch.float32).double()
            x = xs[start:end].double()
            err = (out[start:end].double() - x @ weight.T).abs() / (x.abs() @ weight.abs().T).clamp_min(1e-30)
            worst = max(worst, err.max().item())
        start = end
    return worst


def main():
    torch.manual_seed(0)
    dev = "cuda"
    stacks = {name: (torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device=dev),
                     torch.randint(110, 122, (EXPERTS, n, k // 32), dtype=torch.uint8, device=dev))
              for name, (n, k) in SHAPES.items()}
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "points": []}
    for tokens in (1, 8, 32):
        counts = uniform_routed_counts(tokens, EXPERTS, TOP_K, dev)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        point = {"tokens": tokens, "distinct_experts": int((counts > 0).sum()),
                 "max_rows_per_expert": int(counts.max()), "variants": {}}
        for variant, fn in VARIANTS.items():
            if variant == "tiles" and tokens == 1 or variant.startswith("shared") and tokens == 1:
                continue
            entry = {}
            for name, (n, k) in SHAPES.items():
                packed, scale = stacks[name]
                xs = torch.randn(tokens * TOP_K, k, device=dev, dtype=torch.bfloat16)
                try:
                    out = fn(xs, packed, scale, ends)  # autotunes
                    torch.cuda.synchronize()
                    us = graph_us(lambda: fn(xs, packed, scale, ends), 20)
                    entry[name] = {"us": round(us, 1),
                                   "TBps_distinct": round(point["distinct_experts"] * n * (k // 2 + k // 32) / us / 1e6,
                                                          2),
                                   "err_vs_reference": error_vs_reference(out, xs, packed, scale, ends)}
                except Exception as error:  # noqa: BLE001 - a diagnostic: the next variant still runs
                    entry[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            if all("us" in v for v in entry.values()):
                entry["layer_us"] = round(sum(v["us"] for v in entry.values()), 1)
            point["variants"][variant] = entry
            print(json.dumps({"tokens": tokens, variant: entry}), flush=True)
        results["points"].append(point)
    mxfp4.MXFP4_GEMV_PREFETCH, mxfp4.MXFP4_GEMV_X_F32 = True, True
    Path(os.environ.get("OUT", "."), "time_mxfp4_gemv_variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
