"""Which packed MXFP4 kernel a decode step's routed experts should run (a diagnostic, not a test): both expert
matmuls of one MoE layer (gate_up N 6144 K 3584, down N 3584 K 3072) for b tokens x top-16, routed uniformly at
random over 64 experts (the benchmark model) and 896 (the release), on

* `gemv`: `mxfp4._mxfp4_gemv_fwd` (one program per routed row: each row reads its expert's packed bytes),
* `dot_scaled_swap` / `dot_scaled`: 16-row blocks of one expert through Triton's microscaled dot (`tl.dot_scaled`,
  the codes and scales as stored), the weights as the MMA's wide operand or x,
* `byte_tiles`: the tile kernel (`mxfp4._mxfp4_grouped_matmul_fwd`: bytes decoded one code at a time, x as the
  MMA's wide operand).

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
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import graph_us  # noqa: E402
from kimik3.kernels import mxfp4
from kimik3.kernels.moe import _FEW_ROWS_BLOCK_M, _expert_row_block, _row_block_grid


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_KH": bkh}, num_warps=w, num_stages=st)
             for bn, bkh, w, st in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                                    (64, 256, 4, 2), (128, 32, 4, 4))],
    key=["N", "KH", "E_PAD", "SWAP"],
)
@triton.jit
def _dot_scaled_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KH, E, E_PAD: tl.constexpr, SWAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr):
    # Triton's microscaled dot (tl.dot_scaled: the e2m1 codes and e8m0 scales handed over as stored, upcast by
    # Triton), SWAP: the weights as the MMA's wide operand
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, BLOCK_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * (2 * KH)
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, KH, BLOCK_KH):
            j = start + tl.arange(0, BLOCK_KH)
            k = 2 * start + tl.arange(0, 2 * BLOCK_KH)
            g = start // 16 + tl.arange(0, BLOCK_KH // 16)
            w = tl.load(p_ptr + w_rows[:, None] * KH + j[None, :], mask=cmask[:, None] & (j < KH)[None, :], other=0)
            sc = tl.load(s_ptr + w_rows[:, None] * (KH // 16) + g[None, :],
                         mask=cmask[:, None] & (g < KH // 16)[None, :], other=127)
            x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & (k < 2 * KH)[None, :], other=0.0)
            if SWAP:
                acc = tl.dot_scaled(w, sc, "e2m1", tl.trans(x), None, "bf16", acc)
            else:
                acc = tl.dot_scaled(x, None, "bf16", tl.trans(w), sc, "e2m1", acc)
        if SWAP:
            tl.store(o_ptr + rows.to(tl.int64)[None, :] * N + cols[:, None], acc.to(o_ptr.dtype.element_ty),
                     mask=cmask[:, None] & rmask[None, :])
        else:
            tl.store(o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(o_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])


def dot_scaled_fwd(xs, packed, scale, ends, swap):
    out = torch.empty(xs.shape[0], packed.shape[1], dtype=xs.dtype, device=xs.device)
    grid = _row_block_grid(xs.shape[0], packed.shape[0], packed.shape[1])
    _dot_scaled_kernel[grid](xs, packed, scale, out, ends, packed.shape[1], packed.shape[2], packed.shape[0],
                             E_PAD=triton.next_power_of_2(packed.shape[0]), SWAP=swap, BLOCK_M=_FEW_ROWS_BLOCK_M)
    return out

SHAPES = {"gate_up": (6144, 3584), "down": (3584, 3072)}
POINTS = [(64, 1), (64, 2), (64, 4), (64, 8), (64, 16), (896, 1), (896, 8)]
TOP_K = 16


def routed_groups(experts: int, tokens: int, device) -> torch.Tensor:
    """Group ends of tokens x top-16 routes, uniform random distinct experts per token."""
    choice = torch.rand(tokens, experts, device=device).topk(TOP_K, dim=-1).indices.flatten()
    return torch.cumsum(torch.bincount(choice, minlength=experts), 0).to(torch.int32)


def main():
    dev = "cuda"
    torch.manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "points": []}
    stacks = {}
    for experts, tokens in POINTS:
        ends = routed_groups(experts, tokens, dev)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        hit = int((counts > 0).sum())
        rows = tokens * TOP_K
        point = {"experts": experts, "tokens": tokens, "distinct_experts": hit, "paths": {}}
        for name, (n, k) in SHAPES.items():
            key = (experts, name)
            if key not in stacks:  # random codes, scales 2^-17 .. 2^-6
                stacks.clear()  # one layer's stack on the device at a time (896 experts: 17 GB of gate_up)
                stacks[key] = (torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=dev),
                               torch.randint(110, 122, (experts, n, k // 32), dtype=torch.uint8, device=dev))
            packed, scale = stacks[key]
            xs = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            read = hit * n * (k // 2 + k // 32)
            outs = {}
            for path, fwd in (("gemv", mxfp4._mxfp4_gemv_fwd),
                              ("dot_scaled_swap", lambda *a: dot_scaled_fwd(*a, True)),
                              ("dot_scaled", lambda *a: dot_scaled_fwd(*a, False)),
                              ("byte_tiles", mxfp4._mxfp4_grouped_matmul_fwd)):
                outs[path] = fwd(xs, packed, scale, ends)  # autotunes once per shape
                us = graph_us(lambda fwd=fwd: fwd(xs, packed, scale, ends), 20)
                entry = point["paths"].setdefault(path, {})
                entry[name] = {"us": round(us, 1), "TBps_distinct": round(read / us / 1e6, 2)}
            ref = outs["gemv"].float()
            scale_ref = ref.abs().max().item()
            for path in ("dot_scaled_swap", "dot_scaled", "byte_tiles"):
                point["paths"][path][name]["max_diff_vs_gemv_rel"] = round(
                    (outs[path].float() - ref).abs().max().item() / scale_ref, 5)
        for entry in point["paths"].values():
            entry["layer_us"] = round(sum(entry[name]["us"] for name in SHAPES), 1)
        results["points"].append(point)
        print(json.dumps(point), flush=True)
    Path(os.environ.get("OUT", "."), "diagnose_mxfp4_decode_paths.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
