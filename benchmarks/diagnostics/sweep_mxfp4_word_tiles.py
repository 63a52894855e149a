"""The packed bf16 word tiles' tile configs, each timed alone (a diagnostic, not a test): `_mxfp4_word_tiles_kernel`
launched directly with every config below at 1, 8 and 32 tokens over both expert matmuls of one MoE layer of the
benchmark model (gate_up N 6144 K 3584, down N 3584 K 3072, 64 experts, top-16 routed uniformly), each as a CUDA graph
replay, its output compared with the autotuned kernel's (max |difference| / max |output|: another BLOCK_KW sums k in
other MMA steps).

Why these configs: Triton 3.6 copies a load into shared memory ahead of its step (the pipeline) only where each
thread's share is at least 4 bytes. At 8 words a row a step (BLOCK_KW 8) a step's scales are 2 bytes a row, so
their load stays in the step, which then waits for it; at 16 words (4 scale bytes a row) with 128 or 256 columns
and 4 or 8 warps it is pipelined (sm_90 compile on the CPU, `sass_mxfp4_kernels.py`), at 128 registers a thread
against 80, and register caps (`maxnreg`) for more resident warps: 96 lets 5 of those 128-thread programs share an
SM instead of 4 (no loads or stores of spilled registers in the loop at 96, sm_90 compile on the CPU), 72 lets 7
of the tuned tile's share one instead of 6 (4 spilled loads a step). The autotuner's configs are the first ten.
Writes $OUT/sweep_mxfp4_word_tiles.json.

    python3 benchmarks/diagnostics/sweep_mxfp4_word_tiles.py [--tokens 1 8 32]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import graph_us, uniform_routed_counts  # noqa: E402

from kimik3.kernels import mxfp4  # noqa: E402
from kimik3.kernels.moe import _FEW_ROWS_BLOCK_M, _row_block_grid  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the layer the packed-decode timings share
from time_mxfp4_gemv_variants import EXPERTS, SHAPES, TOP_K  # noqa: E402
# (BLOCK_N, BLOCK_KW, warps, stages, W_IS_A, maxnreg): the autotuner's, then the pipelined-scale ones, deeper
# pipelines and register caps
CONFIGS = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_KW"], c.num_warps, c.num_stages, c.kwargs["W_IS_A"], None)
           for c in mxfp4._mxfp4_word_tiles_kernel.configs] + [
    (128, 16, 4, 3, False, None), (128, 16, 4, 4, False, None), (256, 16, 8, 3, False, None),
    (256, 16, 8, 4, False, None), (128, 8, 4, 4, False, None), (128, 8, 4, 2, False, None),
    (256, 8, 8, 3, False, None), (64, 8, 4, 4, False, None), (128, 16, 4, 3, False, 96), (128, 8, 4, 3, False, 72)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32])
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    mxfp4.MXFP4_WORD_TILES, mxfp4.MXFP4_WORD_TILES_BF16_PAIRS = "bf16", True
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "points": []}
    out_file = Path(os.environ.get("OUT", "."), "sweep_mxfp4_word_tiles.json")
    stacks = {name: (torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device=dev),
                     torch.randint(110, 122, (EXPERTS, n, k // 32), dtype=torch.uint8, device=dev))
              for name, (n, k) in SHAPES.items()}
    for tokens in args.tokens:
        counts = uniform_routed_counts(tokens, EXPERTS, TOP_K, dev)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        distinct = int((counts > 0).sum())
        for name, (n, k) in SHAPES.items():
            packed, scale = stacks[name]
            words = packed.view(torch.int32)
            xs = torch.randn(tokens * TOP_K, k, device=dev, dtype=torch.bfloat16)
            want = mxfp4._mxfp4_grouped_matmul_fwd(xs, packed, scale, ends)  # autotunes
            base = graph_us(lambda: mxfp4._mxfp4_grouped_matmul_fwd(xs, packed, scale, ends), 20)
            point = {"tokens": tokens, "matmul": name, "distinct_experts": distinct, "autotuned_us": round(base, 1),
                     "autotuned": str(mxfp4._mxfp4_word_tiles_kernel.best_config), "configs": []}
            bytes_read = distinct * n * (k // 2 + k // 32)
            for bn, bkw, w, st, w_is_a, reg in CONFIGS:
                out = torch.empty_like(want)
                grid = _row_block_grid(xs.shape[0], EXPERTS, n)({"BLOCK_N": bn})

                def launch():
                    mxfp4._mxfp4_word_tiles_kernel.fn[grid](
                        xs, words, scale, out, ends, n, k // 8, EXPERTS, E_PAD=EXPERTS, BLOCK_M=_FEW_ROWS_BLOCK_M,
                        TF32=False, PTX_DECODE=True, BF16_PAIRS=True, BLOCK_N=bn, BLOCK_KW=bkw, W_IS_A=w_is_a,
                        num_warps=w, num_stages=st, **({} if reg is None else {"maxnreg": reg}))
                entry = {"config": [bn, bkw, w, st, w_is_a, reg]}
                try:
                    launch()
                    us = graph_us(launch, 20)
                    entry.update(us=round(us, 1), TBps_distinct=round(bytes_read / us / 1e6, 2),
                                 rel_diff_vs_autotuned=float((out.float() - want.float()).abs().max()
                                                             / want.float().abs().max()))
                except Exception as error:  # noqa: BLE001 - a diagnostic: the next config still runs
                    entry["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                point["configs"].append(entry)
            point["best"] = min((c for c in point["configs"] if "us" in c), key=lambda c: c["us"])
            results["points"].append(point)
            print(json.dumps({key: point[key] for key in ("tokens", "matmul", "autotuned_us", "autotuned", "best")}),
                  flush=True)
            out_file.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
