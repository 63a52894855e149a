"""The packed MXFP4 decode kernels under Nsight Compute (a diagnostic, not a test): why the GEMV reads the packed
bytes at about 2 TB/s and the tensor-core tiles at about 1 (docs/benchmarks.md, Packed experts at a few rows per
expert). The gate_up matmul of one MoE layer (N 6144, K 3584, 64 experts, top-16 routed uniformly) for

* `gemv_b1`: 1 token (16 routed rows, one per expert) on the GEMV (`mxfp4._mxfp4_gemv_fwd`),
* `gemv_b8`: 8 tokens (128 rows, about 2 per hit expert) on the GEMV,
* `tiles_b8`: the same on the 16-row tiles (`mxfp4._mxfp4_grouped_matmul_fwd`, `tl.dot_scaled`),

each autotuned first, then run once inside an NVTX range named after it, so that

    ncu --clock-control none --nvtx --nvtx-include "profile/" --set full python3 benchmarks/diagnostics/profile_mxfp4_decode.py

profiles exactly those three launches. Writes the autotuner's choices and each launch's time (CUDA events, outside
the profiler) to $OUT/profile_mxfp4_decode.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import graph_us, uniform_routed_counts  # noqa: E402
from kimik3.kernels import mxfp4

N, K, EXPERTS, TOP_K = 6144, 3584, 64, 16


def main():
    torch.manual_seed(0)
    dev = "cuda"
    packed = torch.randint(0, 256, (EXPERTS, N, K // 2), dtype=torch.uint8, device=dev)
    scale = torch.randint(110, 122, (EXPERTS, N, K // 32), dtype=torch.uint8, device=dev)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "cases": {}}
    for name, tokens, fwd, kernel in (("gemv_b1", 1, mxfp4._mxfp4_gemv_fwd, mxfp4._mxfp4_gemv_kernel),
                                      ("gemv_b8", 8, mxfp4._mxfp4_gemv_fwd, mxfp4._mxfp4_gemv_kernel),
                                      ("tiles_b8", 8, mxfp4._mxfp4_grouped_matmul_fwd,
                                       mxfp4._mxfp4_scaled_dot_kernel)):
        counts = uniform_routed_counts(tokens, EXPERTS, TOP_K, dev)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        xs = torch.randn(tokens * TOP_K, K, device=dev, dtype=torch.bfloat16)
        fwd(xs, packed, scale, ends)  # autotunes
        torch.cuda.synchronize()
        us = graph_us(lambda: fwd(xs, packed, scale, ends), 20)
        hit = int((counts > 0).sum())
        rows_bytes = tokens * TOP_K * N * (K // 2 + K // 32)
        torch.cuda.nvtx.range_push(f"profile/{name}")
        fwd(xs, packed, scale, ends)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        results["cases"][name] = {
            "us": round(us, 1), "distinct_experts": hit,
            "TBps_distinct": round(hit * N * (K // 2 + K // 32) / us / 1e6, 2),
            "TBps_row_bytes": round(rows_bytes / us / 1e6, 2),
            "config": str(kernel.best_config)}
        print(json.dumps({name: results["cases"][name]}), flush=True)
    Path(os.environ.get("OUT", "."), "profile_mxfp4_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
