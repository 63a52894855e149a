"""The packed GEMV's register cap (a diagnostic, not a test): Nsight Compute found `_mxfp4_gemv_kernel` at 98
registers a thread, 25% theoretical occupancy, 33% of cycles with no eligible warp at one token and its DRAM at half
its peak (docs/benchmarks.md, Packed MXFP4 GEMV). This times the kernel's tile configs with `maxnreg` caps (more
warps resident, perhaps spills) at 1 and 8 tokens (64 experts, top-16, gate_up N 6144 K 3584 and down N 3584 K
3072), each launched directly with its config, outputs compared with the autotuned kernel's. Writes
$OUT/sweep_mxfp4_gemv_registers.json.

    python benchmarks/diagnostics/sweep_mxfp4_gemv_registers.py
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

SHAPES = {"gate_up": (6144, 3584), "down": (3584, 3072)}
CONFIGS = [(bn, bkw, w, reg) for bn, bkw in ((16, 64), (16, 32), (8, 64), (32, 32), (16, 128))
           for w in (2, 4, 8) for reg in (None, 64, 80)]


def main():
    torch.manual_seed(0)
    dev = "cuda"
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "points": []}
    for name, (n, k) in SHAPES.items():
        packed = torch.randint(0, 256, (64, n, k // 2), dtype=torch.uint8, device=dev)
        scale = torch.randint(110, 122, (64, n, k // 32), dtype=torch.uint8, device=dev)
        words = packed.view(torch.int32)
        for tokens in (1, 8):
            counts = uniform_routed_counts(tokens, 64, 16, dev)
            ends = torch.cumsum(counts, 0).to(torch.int32)
            xs = torch.randn(tokens * 16, k, device=dev, dtype=torch.bfloat16)
            want = mxfp4._mxfp4_gemv_fwd(xs, packed, scale, ends)
            base = graph_us(lambda: mxfp4._mxfp4_gemv_fwd(xs, packed, scale, ends), 20)
            point = {"matmul": name, "tokens": tokens, "autotuned_us": round(base, 1),
                     "autotuned": str(mxfp4._mxfp4_gemv_kernel.best_config), "configs": []}
            for bn, bkw, w, reg in CONFIGS:
                out = torch.empty_like(want)

                def launch():
                    extra = {} if reg is None else {"maxnreg": reg}
                    mxfp4._mxfp4_gemv_kernel.fn[(xs.shape[0], triton.cdiv(n, bn))](
                        xs, words, scale, out, ends, n, k // 8, 64, min(2, triton.cdiv(xs.shape[0], 64)), E_PAD=64,
                        PTX_DECODE=True, BLOCK_N=bn,
                        BLOCK_KW=bkw, num_warps=w, num_stages=2, **extra)
                try:
                    launch()
                    us = graph_us(launch, 20)
                    entry = {"config": [bn, bkw, w, reg], "us": round(us, 1),
                             "equal_to_autotuned": bool(torch.equal(out, want))}
                except Exception as error:  # noqa: BLE001 - a diagnostic: the next config still runs
                    entry = {"config": [bn, bkw, w, reg], "error": f"{type(error).__name__}: {str(error)[:200]}"}
                point["configs"].append(entry)
            best = min((c for c in point["configs"] if "us" in c), key=lambda c: c["us"])
            point["best"] = best
            results["points"].append(point)
            print(json.dumps({key: point[key] for key in ("matmul", "tokens", "autotuned_us", "autotuned", "best")}),
                  flush=True)
            out_file = Path(os.environ.get("OUT", "."), "sweep_mxfp4_gemv_registers.json")
            out_file.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
