"""The packed MXFP4 decode kernels under Nsight Compute (a diagnostic, not a test): why the GEMV reads the packed
bytes at about 2 TB/s and the tensor-core tiles at about 1 (docs/benchmarks.md, Packed experts at a few rows per
expert). The gate_up matmul of one MoE layer (N 6144, K 3584, 64 experts, top-16 routed uniformly) for

* `gemv_b1`: 1 token (16 routed rows, one per expert) on the GEMV (`mxfp4._mxfp4_gemv_fwd`),
* `gemv_b8`: 8 tokens (128 rows, about 2 per hit expert) on the GEMV,
* `tiles_b8`: the same on the 16-row tiles (`mxfp4._mxfp4_grouped_matmul_fwd`, `tl.dot_scaled`),
* `word_tiles_b8` / `word_tiles_via_f32_b8`: the same on the word tiles (`mxfp4._mxfp4_word_tiles_kernel`), each
  word decoded to scaled bf16 pairs (the default) or through f32 (MXFP4_WORD_TILES_BF16_PAIRS off),
* `rows{R}[_f32x]_b{1,8}`: a candidate, the GEMV's tiles and decode with up to R routed rows of one expert per
  program (each word loaded and decoded once for them, one accumulator a row), x as stored or converted to f32
  first (the conversion timed with it); its outputs are compared with the GEMV's,

each autotuned first, then run once inside an NVTX range named after it, so that

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 benchmarks/diagnostics/profile_mxfp4_decode.py

profiles exactly those launches (PROFILE_CASES=word_tiles_b8,gemv_b1 runs those cases only; "candidates" the
candidates below). Writes the autotuner's choices and each launch's time (CUDA events, outside
the profiler) to $OUT/profile_mxfp4_decode.json.
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
from kimik3.kernels import mxfp4
from kimik3.kernels.mxfp4 import _codes_in_order, _e2m1_word, _e2m1_word_ptx, _e8m0, _expert_row_block

N, K, EXPERTS, TOP_K = 6144, 3584, 64, 16


@triton.jit
def _row_part(codes, x_row, q, gmask, live, factor):
    xv = tl.load(x_row + 8 * q[:, :, None] + tl.arange(0, 8)[None, None, :], mask=gmask[:, None, None] & live,
                 other=0.0).to(tl.float32)
    return tl.sum(tl.sum(codes * xv[None, :, :, :], axis=3), axis=2) * factor


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=w, num_stages=2)
             for bn, bkw, w in ((8, 128, 4), (16, 64, 4), (16, 128, 4), (32, 32, 4), (32, 64, 4), (16, 32, 2))],
    key=["N", "KW", "ROWS"],
)
@triton.jit
def _rows_gemv_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KW, E, E_PAD: tl.constexpr, ROWS: tl.constexpr,
                      PTX_DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_KW // 4
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, ROWS)
    if expert < E:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)
        p_rows = p_ptr + w_rows[:, None, None] * KW
        s_rows = s_ptr + w_rows[:, None] * (KW // 4)
        x0 = x_ptr + row0.to(tl.int64) * (8 * KW)
        g_idx = tl.arange(0, GROUPS)
        q_idx = tl.arange(0, 4)
        acc0 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        for g0 in range(0, KW // 4, GROUPS):
            g = g0 + g_idx
            gmask = g < KW // 4
            q = g[:, None] * 4 + q_idx[None, :]
            wmask = cmask[:, None] & gmask[None, :]
            word = tl.load(p_rows + q[None, :, :], mask=wmask[:, :, None], other=0)
            if PTX_DECODE:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_ptx(word)
            else:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word(word)
            codes = tl.reshape(_codes_in_order(c0, c1, c2, c3, c4, c5, c6, c7), (BLOCK_N, GROUPS, 4, 8))
            factor = _e8m0(tl.load(s_rows + g[None, :], mask=wmask, other=127).to(tl.int32)) * 16384.0
            acc0 += _row_part(codes, x0, q, gmask, row0 < row_end, factor)
            if ROWS >= 2:
                acc1 += _row_part(codes, x0 + 8 * KW, q, gmask, row0 + 1 < row_end, factor)
            if ROWS >= 4:
                acc2 += _row_part(codes, x0 + 16 * KW, q, gmask, row0 + 2 < row_end, factor)
                acc3 += _row_part(codes, x0 + 24 * KW, q, gmask, row0 + 3 < row_end, factor)
        out = o_ptr + row0.to(tl.int64) * N + cols
        tl.store(out, tl.sum(acc0, axis=1).to(o_ptr.dtype.element_ty), mask=cmask & (row0 < row_end))
        if ROWS >= 2:
            tl.store(out + N, tl.sum(acc1, axis=1).to(o_ptr.dtype.element_ty), mask=cmask & (row0 + 1 < row_end))
        if ROWS >= 4:
            tl.store(out + 2 * N, tl.sum(acc2, axis=1).to(o_ptr.dtype.element_ty), mask=cmask & (row0 + 2 < row_end))
            tl.store(out + 3 * N, tl.sum(acc3, axis=1).to(o_ptr.dtype.element_ty), mask=cmask & (row0 + 3 < row_end))


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=w, num_stages=2)
             for bn, bkw, w in ((16, 16, 4), (16, 32, 4), (32, 16, 4), (8, 32, 2), (8, 16, 2), (16, 16, 2),
                                (32, 32, 8))],
    key=["N", "KW", "ROWS"],
)
@triton.jit
def _fma_rows_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KW, E, E_PAD: tl.constexpr, ROWS: tl.constexpr,
                     PTX_DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    # x in f32 [M, K]; the weights scaled once (shared by the rows), then one FMA a weight a row into a tile-shaped
    # accumulator, reduced once after the loop
    GROUPS: tl.constexpr = BLOCK_KW // 4
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, ROWS)
    if expert < E:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)
        p_rows = p_ptr + w_rows[:, None, None] * KW
        s_rows = s_ptr + w_rows[:, None] * (KW // 4)
        x0 = x_ptr + row0.to(tl.int64) * (8 * KW)
        g_idx = tl.arange(0, GROUPS)
        q_idx = tl.arange(0, 4)
        acc0 = tl.zeros((BLOCK_N, GROUPS, 4, 8), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N, GROUPS, 4, 8), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, GROUPS, 4, 8), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, GROUPS, 4, 8), dtype=tl.float32)
        for g0 in range(0, KW // 4, GROUPS):
            g = g0 + g_idx
            gmask = g < KW // 4
            q = g[:, None] * 4 + q_idx[None, :]
            wmask = cmask[:, None] & gmask[None, :]
            word = tl.load(p_rows + q[None, :, :], mask=wmask[:, :, None], other=0)
            if PTX_DECODE:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_ptx(word)
            else:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word(word)
            codes = tl.reshape(_codes_in_order(c0, c1, c2, c3, c4, c5, c6, c7), (BLOCK_N, GROUPS, 4, 8))
            factor = _e8m0(tl.load(s_rows + g[None, :], mask=wmask, other=127).to(tl.int32)) * 16384.0
            w = codes * factor[:, :, None, None]
            xo = 8 * q[:, :, None] + tl.arange(0, 8)[None, None, :]
            xm = gmask[:, None, None]
            acc0 += w * tl.load(x0 + xo, mask=xm & (row0 < row_end), other=0.0)[None, :, :, :]
            if ROWS >= 2:
                acc1 += w * tl.load(x0 + 8 * KW + xo, mask=xm & (row0 + 1 < row_end), other=0.0)[None, :, :, :]
            if ROWS >= 4:
                acc2 += w * tl.load(x0 + 16 * KW + xo, mask=xm & (row0 + 2 < row_end), other=0.0)[None, :, :, :]
                acc3 += w * tl.load(x0 + 24 * KW + xo, mask=xm & (row0 + 3 < row_end), other=0.0)[None, :, :, :]
        out = o_ptr + row0.to(tl.int64) * N + cols
        tl.store(out, tl.sum(tl.sum(tl.sum(acc0, axis=3), axis=2), axis=1).to(o_ptr.dtype.element_ty),
                 mask=cmask & (row0 < row_end))
        if ROWS >= 2:
            tl.store(out + N, tl.sum(tl.sum(tl.sum(acc1, axis=3), axis=2), axis=1).to(o_ptr.dtype.element_ty),
                     mask=cmask & (row0 + 1 < row_end))
        if ROWS >= 4:
            tl.store(out + 2 * N, tl.sum(tl.sum(tl.sum(acc2, axis=3), axis=2), axis=1).to(o_ptr.dtype.element_ty),
                     mask=cmask & (row0 + 2 < row_end))
            tl.store(out + 3 * N, tl.sum(tl.sum(tl.sum(acc3, axis=3), axis=2), axis=1).to(o_ptr.dtype.element_ty),
                     mask=cmask & (row0 + 3 < row_end))


def fma_rows_gemv(xs, packed, scale, ends, rows):
    num_rows, num_experts, n, kh = xs.shape[0], packed.shape[0], packed.shape[1], packed.shape[2]
    x = xs.float()
    out = torch.empty(num_rows, n, dtype=xs.dtype, device=xs.device)
    grid = lambda meta: (min(num_rows, triton.cdiv(num_rows, rows) + num_experts),  # noqa: E731
                         triton.cdiv(n, meta["BLOCK_N"]))
    _fma_rows_kernel[grid](x, packed.view(torch.int32), scale, out, ends, n, kh // 4, num_experts,
                           E_PAD=triton.next_power_of_2(num_experts), ROWS=rows,
                           PTX_DECODE=mxfp4._ptx_decode(xs.device))
    return out


def rows_gemv(xs, packed, scale, ends, rows, f32_x):
    num_rows, num_experts, n, kh = xs.shape[0], packed.shape[0], packed.shape[1], packed.shape[2]
    x = xs.float() if f32_x else xs
    out = torch.empty(num_rows, n, dtype=xs.dtype, device=xs.device)
    grid = lambda meta: (min(num_rows, triton.cdiv(num_rows, rows) + num_experts),  # noqa: E731
                         triton.cdiv(n, meta["BLOCK_N"]))
    _rows_gemv_kernel[grid](x, packed.view(torch.int32), scale, out, ends, n, kh // 4, num_experts,
                            E_PAD=triton.next_power_of_2(num_experts), ROWS=rows,
                            PTX_DECODE=mxfp4._ptx_decode(xs.device))
    return out


def main():
    torch.manual_seed(0)
    dev = "cuda"
    packed = torch.randint(0, 256, (EXPERTS, N, K // 2), dtype=torch.uint8, device=dev)
    scale = torch.randint(110, 122, (EXPERTS, N, K // 32), dtype=torch.uint8, device=dev)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "cases": {}}
    cases = (("gemv_b1", 1, mxfp4._mxfp4_gemv_fwd, mxfp4._mxfp4_gemv_kernel, {}),
             ("gemv_b8", 8, mxfp4._mxfp4_gemv_fwd, mxfp4._mxfp4_gemv_kernel, {}),
             ("tiles_b8", 8, mxfp4._mxfp4_grouped_matmul_fwd, mxfp4._mxfp4_scaled_dot_kernel,
              {"MXFP4_WORD_TILES": None}),
             ("word_tiles_b8", 8, mxfp4._mxfp4_grouped_matmul_fwd, mxfp4._mxfp4_word_tiles_kernel, {}),
             ("word_tiles_via_f32_b8", 8, mxfp4._mxfp4_grouped_matmul_fwd, mxfp4._mxfp4_word_tiles_kernel,
              {"MXFP4_WORD_TILES_BF16_PAIRS": False}))
    only = os.environ.get("PROFILE_CASES")  # a comma-separated subset of the cases' names (and "candidates")
    defaults = {name: getattr(mxfp4, name) for name in ("MXFP4_WORD_TILES", "MXFP4_WORD_TILES_BF16_PAIRS")}
    for name, tokens, fwd, kernel, settings in cases:
        if only and name not in only.split(","):
            continue
        for constant, value in {**defaults, **settings}.items():
            setattr(mxfp4, constant, value)
        counts = uniform_routed_counts(tokens, EXPERTS, TOP_K, dev)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        xs = torch.randn(tokens * TOP_K, K, device=dev, dtype=torch.bfloat16)
        fwd(xs, packed, scale, ends)  # autotunes
        torch.cuda.synchronize()
        us = graph_us(lambda: fwd(xs, packed, scale, ends), 20)
        hit = int((counts > 0).sum())
        rows_bytes = tokens * TOP_K * N * (K // 2 + K // 32)
        torch.cuda.nvtx.range_push("profile")  # ncu --nvtx-include "profile/"; the launches in order
        fwd(xs, packed, scale, ends)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        results["cases"][name] = {
            "us": round(us, 1), "distinct_experts": hit,
            "TBps_distinct": round(hit * N * (K // 2 + K // 32) / us / 1e6, 2),
            "TBps_row_bytes": round(rows_bytes / us / 1e6, 2),
            "config": str(kernel.best_config)}
        print(json.dumps({name: results["cases"][name]}), flush=True)
    for constant, value in defaults.items():
        setattr(mxfp4, constant, value)
    for tokens in (1, 8) if not only or "candidates" in only.split(",") else ():
        counts = uniform_routed_counts(tokens, EXPERTS, TOP_K, dev)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        xs = torch.randn(tokens * TOP_K, K, device=dev, dtype=torch.bfloat16)
        want = mxfp4._mxfp4_gemv_fwd(xs, packed, scale, ends).float()
        base = graph_us(lambda: mxfp4._mxfp4_gemv_fwd(xs, packed, scale, ends), 20)
        for rows in (1, 2, 4):
            name = f"fma_rows{rows}_b{tokens}"
            try:
                got = fma_rows_gemv(xs, packed, scale, ends, rows).float()
                us = graph_us(lambda: fma_rows_gemv(xs, packed, scale, ends, rows), 20)
                entry = {"us": round(us, 1), "gemv_us_same_run": round(base, 1),
                         "max_rel_diff_vs_gemv": (got - want).abs().max().item() / want.abs().max().item(),
                         "config": str(_fma_rows_kernel.best_config)}
            except Exception as error:  # noqa: BLE001 - a diagnostic: the next variant still runs
                entry = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            results["cases"][name] = entry
            print(json.dumps({name: entry}), flush=True)
        for rows in (1, 2, 4) if os.environ.get("ROWS_VARIANTS", "1") == "1" else ():
            for f32_x in (False, True):
                name = f"rows{rows}{'_f32x' if f32_x else ''}_b{tokens}"
                try:
                    got = rows_gemv(xs, packed, scale, ends, rows, f32_x).float()
                    us = graph_us(lambda: rows_gemv(xs, packed, scale, ends, rows, f32_x), 20)
                    if rows == 2 and not f32_x:
                        torch.cuda.nvtx.range_push("profile")  # ncu --nvtx-include "profile/"; the launches in order
                        rows_gemv(xs, packed, scale, ends, rows, f32_x)
                        torch.cuda.synchronize()
                        torch.cuda.nvtx.range_pop()
                    entry = {"us": round(us, 1), "gemv_us_same_run": round(base, 1),
                             "max_rel_diff_vs_gemv": (got - want).abs().max().item() / want.abs().max().item(),
                             "config": str(_rows_gemv_kernel.best_config)}
                except Exception as error:  # noqa: BLE001 - a diagnostic: the next variant still runs
                    entry = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                results["cases"][name] = entry
                print(json.dumps({name: entry}), flush=True)
    Path(os.environ.get("OUT", "."), "profile_mxfp4_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
