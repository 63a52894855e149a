"""The packed decode kernels side by side (a diagnostic, not a test): both expert matmuls of one MoE layer of the
benchmark model (gate_up N 6144 K 3584, down N 3584 K 3072, 64 experts, top-16 routed uniformly) at 1 to 32 tokens,
the same routes and operands for every variant, each autotuned and then timed as a CUDA graph replay:

* `gemv`: the GEMV (`mxfp4._mxfp4_gemv_fwd`, one program per routed row),
* `tiles`: the 16-row tiles through `tl.dot_scaled` (`mxfp4._mxfp4_grouped_matmul_fwd`, MXFP4_WORD_TILES None),
* `word_tiles_bf16` / `word_tiles_tf32`: the 16-row tiles from decoded words (`mxfp4._mxfp4_word_tiles_kernel`,
  MXFP4_WORD_TILES "bf16" or "tf32"); bf16 decodes each word straight to scaled bf16 pairs, and
  `word_tiles_bf16_via_f32` decodes it through f32 as the TF32 tiles do (MXFP4_WORD_TILES_BF16_PAIRS off).

Each output is compared with float64 products of the dequantised experts, relative to |x| @ |W|^T. Writes
$OUT/time_mxfp4_gemv_variants.json (or the working directory).

(h100_time_mxfp4_gemv_variants_2026-12-07.json also holds GEMV variants measured and removed: each step's loads
issued a step early (`gemv_prefetch`), x converted to f32 first (`gemv_f32x`), both, and up to 2 or 4 routed rows of
one expert per program decoding each word once for them (`shared_rows2`, `shared_rows4`);
h100_time_mxfp4_gemv_variants_2026-12-07_stages.json the GEMV's loop pipelined by Triton, 2 or 3 steps in flight
(`gemv_stages2`, `gemv_stages3`), measured slower at 1, 2 and 8 tokens and removed.)

    python3 benchmarks/diagnostics/time_mxfp4_gemv_variants.py [--variants gemv word_tiles_bf16 ...] [--tokens 1 8]
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
from kimik3.modeling import ops_kimi_k3 as ops  # noqa: E402

SHAPES = {"gate_up": (6144, 3584), "down": (3584, 3072)}
EXPERTS, TOP_K = 64, 16
DEFAULTS = mxfp4.MXFP4_WORD_TILES, mxfp4.MXFP4_WORD_TILES_BF16_PAIRS


def tiles(word_tiles, bf16_pairs=True):
    def run(xs, packed, scale, ends):
        mxfp4.MXFP4_WORD_TILES, mxfp4.MXFP4_WORD_TILES_BF16_PAIRS = word_tiles, bf16_pairs
        return mxfp4._mxfp4_grouped_matmul_fwd(xs, packed, scale, ends)
    return run


VARIANTS = {
    "gemv": mxfp4._mxfp4_gemv_fwd,
    "tiles": tiles(None),
    "word_tiles_bf16": tiles("bf16"),
    "word_tiles_bf16_via_f32": tiles("bf16", bf16_pairs=False),
    "word_tiles_tf32": tiles("tf32"),
}
TOKENS = (1, 2, 8, 16, 32)


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    stacks = {name: (torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device=dev),
                     torch.randint(110, 122, (EXPERTS, n, k // 32), dtype=torch.uint8, device=dev))
              for name, (n, k) in SHAPES.items()}
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "points": []}
    for tokens in args.tokens:
        counts = uniform_routed_counts(tokens, EXPERTS, TOP_K, dev)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        point = {"tokens": tokens, "distinct_experts": int((counts > 0).sum()),
                 "max_rows_per_expert": int(counts.max()), "variants": {}}
        for variant in args.variants:
            fn = VARIANTS[variant]
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
                    if variant.startswith("word_tiles"):
                        entry[name]["config"] = str(mxfp4._mxfp4_word_tiles_kernel.best_config)
                except Exception as error:  # noqa: BLE001 - a diagnostic: the next variant still runs
                    entry[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            if all("us" in v for v in entry.values()):
                entry["layer_us"] = round(sum(v["us"] for v in entry.values()), 1)
            point["variants"][variant] = entry
            print(json.dumps({"tokens": tokens, variant: entry}), flush=True)
        results["points"].append(point)
    mxfp4.MXFP4_WORD_TILES, mxfp4.MXFP4_WORD_TILES_BF16_PAIRS = DEFAULTS
    Path(os.environ.get("OUT", "."), "time_mxfp4_gemv_variants.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
