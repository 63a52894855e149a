"""A candidate for the packed prefill GEMM (a diagnostic, not a test; written 2026-12-07, not yet run on a GPU): the
packed grouped GEMM (`mxfp4._mxfp4_grouped_gemm_kernel`) with its weights decoded from 32-bit words as the word tiles
decode them (`mxfp4._e2m1_word_exact_ptx`: the E2M1 values in f16 pairs, exact f32 conversions, one multiply by the
group's scale), the eight codes of a word joined in k order, so x needs no even/odd split and one MMA takes the
step; with the decoded weights as the MMA's register operand (W_IS_A) it can also decode each word straight to
scaled bf16 pairs as the bf16 word tiles do (`word_gemm(..., bf16_pairs=True)`). Its machine code counts fewer
instructions a word than the byte-decoding GEMM's 73-112 (`sass_mxfp4_kernels.py --gemm`); the issue's prefill
target asks the packed GEMM for 80% of cuBLAS's bf16 grouped GEMM on the same groups, where it reached about half
(docs/benchmarks.md, Packed MXFP4 prefill).

On a GPU, `main()` times it beside the product's packed GEMM and grouped_mm over the dequantised experts, at one
MoE layer of the release's 896 experts for an 8K prefill (about 146 rows per expert; gate_up N 6144 K 3584, down N
3584 K 3072), and checks it against the reference. Writes $OUT/candidate_mxfp4_word_gemm.json.

    python3 benchmarks/diagnostics/candidate_mxfp4_word_gemm.py
"""

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import graph_us, uniform_routed_counts  # noqa: E402

from kimik3.kernels import mxfp4  # noqa: E402
from kimik3.kernels.mxfp4 import (  # noqa: E402
    _codes_in_order,
    _gemm_program_block,
    _scaled_word_codes,
    _store_tile,
    _tile_acc,
    _tile_dot,
)


@triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_KW": bkw, "GROUP_M": 8}, num_warps=w, num_stages=st)
             for bm, bn, bkw, w, st in ((128, 128, 8, 8, 3), (128, 128, 16, 8, 3), (128, 256, 8, 8, 3),
                                        (256, 128, 8, 8, 3), (64, 128, 16, 4, 3), (128, 128, 8, 4, 4))],
    # W_IS_A (a launch argument): the decoded weights as the MMA's register operand, out^T = W x^T
    key=["N", "KW", "E_PAD", "W_IS_A", "BF16_PAIRS"],
)
@triton.jit
def _word_gemm_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, M, N, KW, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GROUP_M: tl.constexpr, PTX_DECODE: tl.constexpr,
                      PRECISION: tl.constexpr, W_IS_A: tl.constexpr, BF16_PAIRS: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_KW // 4
    # the product GEMM's program order
    expert, row0, row_end, pid_n = _gemm_program_block(ends_ptr, M, N, E, E_PAD, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)
        p_rows = p_ptr + w_rows[:, None, None] * KW
        s_rows = s_ptr + w_rows[:, None] * (KW // 4)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * (8 * KW)
        acc = _tile_acc(BLOCK_M, BLOCK_N, W_IS_A)
        for g0 in range(0, KW // 4, GROUPS):
            # the word tiles' step: the f32 decode, or (BF16_PAIRS, with W_IS_A only) the bf16 pairs, whose codes are
            # then joined in k order too (in the shared-memory operand they do not compile with Triton 3.6, in either
            # order: docs/benchmarks.md, Packed MXFP4 GEMV)
            c0, c1, c2, c3, c4, c5, c6, c7 = _scaled_word_codes(p_rows, s_rows, g0, cmask, KW, GROUPS, PTX_DECODE,
                                                                BF16_PAIRS)
            w = tl.reshape(_codes_in_order(c0, c1, c2, c3, c4, c5, c6, c7),
                           (BLOCK_N, 8 * BLOCK_KW)).to(x_ptr.dtype.element_ty)
            k = 32 * g0 + tl.arange(0, 8 * BLOCK_KW)
            x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & (k < 8 * KW)[None, :], other=0.0)
            acc = _tile_dot(x, w, acc, W_IS_A, PRECISION)
        _store_tile(o_ptr, acc, rows, rmask, cols, cmask, N, W_IS_A)


def word_gemm(xs, packed, scale, group_ends, w_is_a=False, bf16_pairs=False):
    """`mxfp4.mxfp4_grouped_gemm`'s product (same arguments) through the candidate; bf16_pairs (bf16 x, W_IS_A, the
    PTX decode) decodes each word straight to scaled bf16 pairs."""
    xs, packed, scale, ends, out = mxfp4._mxfp4_matmul_operands(xs, packed, scale, group_ends)
    (num_rows, n), (num_experts, _, kh) = out.shape, packed.shape
    if num_rows == 0 or n == 0:
        return out

    def grid(meta):
        return (min(num_rows, triton.cdiv(num_rows, meta["BLOCK_M"]) + num_experts) * triton.cdiv(n, meta["BLOCK_N"]),)

    ptx = mxfp4._ptx_decode(xs.device)
    if bf16_pairs and not (w_is_a and ptx and xs.dtype == torch.bfloat16):
        raise ValueError("the bf16-pair decode needs bf16 x, W_IS_A and the PTX decode")
    _word_gemm_kernel[grid](xs, packed.view(torch.int32), scale, out, ends, num_rows, n, kh // 4, num_experts,
                            E_PAD=triton.next_power_of_2(num_experts), PTX_DECODE=ptx,
                            PRECISION=mxfp4._dot_precision(xs.dtype), W_IS_A=w_is_a, BF16_PAIRS=bf16_pairs)
    return out


def main():
    torch.manual_seed(0)
    dev = "cuda"
    experts, tokens, top_k = 896, 8192, 16
    counts = uniform_routed_counts(tokens, experts, top_k, dev)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "experts": experts, "tokens": tokens, "matmuls": {}}
    for name, (n, k) in {"gate_up": (6144, 3584), "down": (3584, 3072)}.items():
        packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=dev)
        scale = torch.randint(118, 122, (experts, n, k // 32), dtype=torch.uint8, device=dev)
        xs = torch.randn(tokens * top_k, k, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * tokens * top_k * n * k
        entry = {}
        want = mxfp4._mxfp4_grouped_gemm_fwd(xs, packed, scale, ends)
        entry["product_gemm_us"] = graph_us(lambda: mxfp4._mxfp4_grouped_gemm_fwd(xs, packed, scale, ends), 5)
        for tag, w_is_a, pairs in (("word_gemm", False, False), ("word_gemm_w_is_a", True, False),
                                   ("word_gemm_w_is_a_bf16_pairs", True, True)):
            got = word_gemm(xs, packed, scale, ends, w_is_a, pairs)
            entry[f"{tag}_us"] = graph_us(lambda: word_gemm(xs, packed, scale, ends, w_is_a, pairs), 5)
            entry[f"{tag}_config"] = str(_word_gemm_kernel.best_config)
            entry[f"{tag}_max_rel_diff_vs_product"] = ((got.float() - want.float()).abs().max()
                                                       / want.float().abs().max()).item()
        weight = mxfp4.mxfp4_dequant(packed, scale, torch.bfloat16).transpose(-2, -1)
        grouped_mm = mxfp4._grouped_mm_fn()
        entry["cublas_grouped_mm_us"] = graph_us(lambda: grouped_mm(xs, weight, offs=ends), 5)
        del weight
        for key in ("product_gemm_us", "word_gemm_us", "word_gemm_w_is_a_us", "word_gemm_w_is_a_bf16_pairs_us",
                    "cublas_grouped_mm_us"):
            entry[key.replace("_us", "_tflops")] = round(flops / entry[key] / 1e6, 1)
        results["matmuls"][name] = entry
        print(json.dumps({name: entry}), flush=True)
        del packed, scale, xs
        torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "."), "candidate_mxfp4_word_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
