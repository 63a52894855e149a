"""Which packed MXFP4 kernel a decode step's routed experts should run (a diagnostic, not a test): both expert
matmuls of one MoE layer (gate_up N 6144 K 3584, down N 3584 K 3072) for b tokens x top-16, routed uniformly at
random over 64 experts (the benchmark model) and 896 (the release), on

* `gemv`: `mxfp4._mxfp4_gemv_fwd` (one program per routed row: each row reads its expert's packed bytes),
* `tiles`: `mxfp4._mxfp4_grouped_matmul_fwd` (16-row blocks of one expert; bf16 through Triton's microscaled dot,
  `tl.dot_scaled` on the codes and scales as stored),
* `byte_tiles`: the same with `MXFP4_SCALED_DOT` off (bytes decoded one code at a time in the kernel),
* `rows1`, `rows2`, `rows4` (candidates, defined here): the GEMV's decode with blocks of up to 1, 2 or 4 routed rows
  of one expert per program (each packed word read and decoded once for the block's rows) and tile shapes down to
  one scale group per column (BLOCK_KW 4), where a warp's threads span the columns and every thread of a warp reads
  the same x elements (one broadcast load) instead of each thread its own.

(The results files of 2026-12-02 also hold `word_tiles`, a kernel decoding whole words as the GEMV does, and
`dot_scaled_swap`, the microscaled dot with the weights as the wide operand: both measured slower and removed.)

Each timed as a CUDA graph replay (as inside the compiled decode step), after Triton's autotuning; the outputs are
checked against each other (f32 accumulation each: bf16 rounding apart). Prints and writes JSON (to $OUT or the
working directory): microseconds per layer and the packed bytes of the distinct experts hit over the time (TB/s).

    python benchmarks/diagnostics/diagnose_mxfp4_decode_paths.py
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
from kimik3.kernels._base import tl
from kimik3.kernels.moe import _expert_row_block

_ROWS_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=w, num_stages=st)
                 for bn, bkw, w, st in ((32, 4, 1, 3), (64, 4, 2, 3), (128, 4, 4, 3), (128, 4, 4, 4), (64, 8, 4, 3),
                                        (128, 8, 8, 3), (32, 8, 2, 4), (16, 64, 4, 2), (8, 128, 4, 2),
                                        (64, 16, 8, 2))]


@triton.autotune(configs=_ROWS_CONFIGS, key=["N", "KW", "PTX_DECODE", "ROWS"])
@triton.jit
def _gemv_rows_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KW, E, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KW: tl.constexpr, PTX_DECODE: tl.constexpr, ROWS: tl.constexpr):
    # mxfp4._mxfp4_gemv_kernel with a block of up to ROWS routed rows of one expert per program
    GROUPS: tl.constexpr = BLOCK_KW // 4
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, ROWS)
    if expert < E:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)
        p_rows = p_ptr + w_rows[:, None, None] * KW
        s_rows = s_ptr + w_rows[:, None] * (KW // 4)
        rows = row0 + tl.arange(0, ROWS)
        rmask = rows < row_end
        x_rows = x_ptr + rows.to(tl.int64) * (8 * KW)
        g_idx = tl.arange(0, GROUPS)
        q_idx = tl.arange(0, 4)
        acc = tl.zeros((ROWS, BLOCK_N, GROUPS), dtype=tl.float32)
        for g0 in range(0, KW // 4, GROUPS):
            g = g0 + g_idx
            gmask = g < KW // 4
            q = g[:, None] * 4 + q_idx[None, :]
            wmask = cmask[:, None] & gmask[None, :]
            word = tl.load(p_rows + q[None, :, :], mask=wmask[:, :, None], other=0)
            if PTX_DECODE:
                c0, c1, c2, c3, c4, c5, c6, c7 = mxfp4._e2m1_word_ptx(word)
            else:
                c0, c1, c2, c3, c4, c5, c6, c7 = mxfp4._e2m1_word(word)
            codes = tl.reshape(tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)),
                                       tl.join(tl.join(c1, c5), tl.join(c3, c7))), (BLOCK_N, GROUPS, 4, 8))
            x_at = 8 * q[:, :, None] + tl.arange(0, 8)[None, None, :]
            xv = tl.load(x_rows[:, None, None, None] + x_at[None, :, :, :],
                         mask=rmask[:, None, None, None] & gmask[None, :, None, None], other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(codes[None, :, :, :, :] * xv[:, None, :, :, :], axis=4), axis=3)
            factor = mxfp4._e8m0(tl.load(s_rows + g[None, :], mask=wmask, other=127).to(tl.int32))
            acc += (part * 16384.0) * factor[None, :, :]
        out = tl.sum(acc, axis=2)
        tl.store(o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def gemv_rows_fwd(rows_per_block):
    def fwd(xs, packed, scale, group_ends):
        xs, packed, scale, ends, out = mxfp4._mxfp4_matmul_operands(xs, packed, scale, group_ends)
        (num_rows, n), (num_experts, _, kh) = out.shape, packed.shape
        words = packed.view(torch.int32)

        def grid(meta):
            return (min(num_rows, triton.cdiv(num_rows, rows_per_block) + num_experts), triton.cdiv(n, meta["BLOCK_N"]))

        _gemv_rows_kernel[grid](xs, words, scale, out, ends, n, kh // 4, num_experts,
                                E_PAD=triton.next_power_of_2(num_experts), PTX_DECODE=mxfp4._ptx_decode(xs.device),
                                ROWS=rows_per_block)
        return out

    return fwd


SHAPES = {"gate_up": (6144, 3584), "down": (3584, 3072)}
POINTS = [(64, 1), (64, 2), (64, 4), (64, 8), (64, 16), (896, 1), (896, 8)]
TOP_K = 16


def main():
    dev = "cuda"
    torch.manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "points": []}
    for experts, tokens in POINTS:
        counts = uniform_routed_counts(tokens, experts, TOP_K, dev)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        hit = int((counts > 0).sum())
        rows = tokens * TOP_K
        point = {"experts": experts, "tokens": tokens, "distinct_experts": hit, "paths": {}}
        for name, (n, k) in SHAPES.items():
            # random codes, scales 2^-17 .. 2^-6; one matmul's stack on the device at a time (896 experts: 17 GB)
            packed = scale = None
            packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=dev)
            scale = torch.randint(110, 122, (experts, n, k // 32), dtype=torch.uint8, device=dev)
            xs = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            read = hit * n * (k // 2 + k // 32)
            outs = {}
            for path, fwd, scaled_dot in (("gemv", mxfp4._mxfp4_gemv_fwd, True),
                                          ("tiles", mxfp4._mxfp4_grouped_matmul_fwd, True),
                                          ("byte_tiles", mxfp4._mxfp4_grouped_matmul_fwd, False),
                                          ("rows1", gemv_rows_fwd(1), True), ("rows2", gemv_rows_fwd(2), True),
                                          ("rows4", gemv_rows_fwd(4), True)):
                mxfp4.MXFP4_SCALED_DOT = scaled_dot
                outs[path] = fwd(xs, packed, scale, ends)  # autotunes once per shape
                us = graph_us(lambda fwd=fwd: fwd(xs, packed, scale, ends), 20)
                entry = point["paths"].setdefault(path, {})
                entry[name] = {"us": round(us, 1), "TBps_distinct": round(read / us / 1e6, 2)}
            mxfp4.MXFP4_SCALED_DOT = True
            ref = outs["gemv"].float()
            scale_ref = ref.abs().max().item()
            for path in ("tiles", "byte_tiles", "rows1", "rows2", "rows4"):
                point["paths"][path][name]["max_diff_vs_gemv_rel"] = round(
                    (outs[path].float() - ref).abs().max().item() / scale_ref, 5)
        for entry in point["paths"].values():
            entry["layer_us"] = round(sum(entry[name]["us"] for name in SHAPES), 1)
        results["points"].append(point)
        print(json.dumps(point), flush=True)
    Path(os.environ.get("OUT", "."), "diagnose_mxfp4_decode_paths.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
