"""Packed MXFP4 experts at prefill (a diagnostic, not a test): one MoE layer's two expert matmuls at K3's widths
(gate_up N 6144 x K 3584, down N 3584 x K 3072) with 896 experts and `tokens` x top-16 routed rows (random scores:
near-uniform routing, ~146 rows per expert at 8K tokens), timed for

* `dequantised_stack`: the whole stack dequantised to bf16 (Triton) and `grouped_mm` (the prefill path before the
  packed GEMM),
* `dequantised_chunks`: `mxfp4.mxfp4_dequantised_matmul`, chunks of experts dequantised within
  `MXFP4_DEQUANT_CHUNK_BYTES` (the path beyond `MXFP4_GEMM_ROWS_PER_EXPERT`),
* `grouped_mm_bf16`: `grouped_mm` alone on that bf16 stack (the dequantisation not timed),
* `gemm_words` (`_f32`): the packed grouped GEMM (`mxfp4._mxfp4_word_gemm_kernel`, the default), the words decoded
  to scaled bf16 pairs on Hopper, or (`_f32`) through f32 as elsewhere,
* `gemm_w_is_a` / `gemm_x_is_a` (`_bcast`): the byte-decoding GEMM (`mxfp4._mxfp4_grouped_gemm_kernel`,
  `MXFP4_GEMM_WORDS` off) with the decoded weights as the MMA's register operand or as the shared-memory one, the
  scales gathered per byte or loaded once per group and broadcast (each GEMM's autotuned config printed),
* `grouped_mm_bf16_64_experts`: `grouped_mm` with the same rows over 64 bf16 experts (2048 rows each: the
  benchmark model's expert count, the speed the 896-expert prefill is held to),

each with milliseconds, TFLOP/s, the peak of memory allocated above the inputs (and that peak less the output: the
transient), and the packed GEMM's largest difference from the dequantised path (relative to its largest value).
Writes JSON to $OUT or the working directory.

    python benchmarks/diagnostics/diagnose_mxfp4_prefill.py --tokens 8192,32768
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import event_us, uniform_routed_counts  # noqa: E402
from kimik3.kernels import mxfp4  # noqa: E402
from kimik3.kernels.moe import _grouped_mm_fn  # noqa: E402

SHAPES = {"gate_up": (6144, 3584), "down": (3584, 3072)}
TOP_K = 16


def routed_rows(tokens, num_experts, k, device):
    return torch.cumsum(uniform_routed_counts(tokens, num_experts, k, device), 0).to(torch.int32)


def measure(fn, iters=5):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return event_us(fn, iters, warmup=1) / 1e3, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--variants", default="gemm_words,gemm_words_f32,gemm_x_is_a_bcast",
                        help="packed GEMM variants: gemm_words[_f32] (the word GEMM; _f32: its f32 decode), "
                             "gemm_{w,x}_is_a[_bcast] (the byte GEMM; _bcast: scales broadcast from one load a group)")
    args = parser.parse_args()
    dev = "cuda"
    bf = torch.bfloat16
    torch.manual_seed(0)
    defaults = mxfp4.MXFP4_GEMM_WORDS, mxfp4.MXFP4_GEMM_W_IS_A, mxfp4.MXFP4_GEMM_SCALE_BCAST, mxfp4._gemm_bf16_pairs
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, (n, k) in SHAPES.items():
        packed = torch.randint(0, 256, (args.experts, n, k // 2), device=dev, dtype=torch.uint8)
        scale = torch.randint(118, 122, (args.experts, n, k // 32), device=dev, dtype=torch.uint8)
        for tokens in (int(t) for t in args.tokens.split(",")):
            ends = routed_rows(tokens, args.experts, TOP_K, dev)
            xs = torch.randn(tokens * TOP_K, k, device=dev, dtype=bf)
            flops = 2 * xs.shape[0] * n * k
            row = {}

            def record(label, fn):
                ms, peak = measure(fn)
                out_bytes = xs.shape[0] * n * xs.element_size()
                row[label] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                              "peak_gib": round(peak / 2**30, 2), "transient_gib": round((peak - out_bytes) / 2**30, 2)}
                print(json.dumps({f"{name}_{tokens}": {label: row[label]}}), flush=True)

            def dequantised_stack():
                weight = mxfp4.mxfp4_dequant(packed, scale, bf)
                return _grouped_mm_fn()(xs, weight.transpose(-2, -1), offs=ends)

            record("dequantised_stack", dequantised_stack)
            before = dequantised_stack().float()
            record("dequantised_chunks", lambda: mxfp4.mxfp4_dequantised_matmul(xs, packed, scale, ends))
            weight = mxfp4.mxfp4_dequant(packed, scale, bf)
            record("grouped_mm_bf16", lambda: _grouped_mm_fn()(xs, weight.transpose(-2, -1), offs=ends))
            del weight
            for label in args.variants.split(","):
                words = label.startswith("gemm_words")
                mxfp4.MXFP4_GEMM_WORDS = words
                mxfp4.MXFP4_GEMM_W_IS_A = label.startswith("gemm_w_is_a")
                mxfp4.MXFP4_GEMM_SCALE_BCAST = label.endswith("_bcast")
                mxfp4._gemm_bf16_pairs = (lambda _: False) if label == "gemm_words_f32" else defaults[3]
                kernel = mxfp4._mxfp4_word_gemm_kernel if words else mxfp4._mxfp4_grouped_gemm_kernel
                try:
                    record(label, lambda: mxfp4._mxfp4_grouped_gemm_fwd(xs, packed, scale, ends))
                    after = mxfp4._mxfp4_grouped_gemm_fwd(xs, packed, scale, ends).float()
                    row[label]["max_rel_diff"] = float((after - before).abs().max() / before.abs().max())
                    row[label]["config"] = str(kernel.best_config)
                except Exception as error:  # a config the compiler refuses: say so, keep measuring
                    row[label] = {"error": repr(error)[:300]}
                print(json.dumps({f"{name}_{tokens}": {label: row[label]}}), flush=True)
            (mxfp4.MXFP4_GEMM_WORDS, mxfp4.MXFP4_GEMM_W_IS_A, mxfp4.MXFP4_GEMM_SCALE_BCAST,
             mxfp4._gemm_bf16_pairs) = defaults
            w64 = torch.randn(64, n, k, device=dev, dtype=bf)
            ends64 = routed_rows(tokens, 64, TOP_K, dev)
            record("grouped_mm_bf16_64_experts", lambda: _grouped_mm_fn()(xs, w64.transpose(-2, -1), offs=ends64))
            del w64
            results[f"{name}_{tokens}"] = row
        del packed, scale
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / "diagnose_mxfp4_prefill.json"
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
