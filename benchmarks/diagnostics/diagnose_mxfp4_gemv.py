"""Where the packed MXFP4 GEMV's time goes (a diagnostic, not a test): the gate_up matmul of one decode token on the
benchmark model's shapes (64 experts, N 6144, K 3584; 16 routed rows, one per expert), timed per tile config for

* `gemv_ptx` / `gemv_portable`: the product kernel (`mxfp4._mxfp4_gemv_kernel`) with each decode,
* `gemv_ptx_x_f32`: the same with x handed over as f32 (the cast not timed),
* `probe_load`: the same tiles loaded and summed as integers (what streaming the words alone costs),
* `probe_decode`: loaded and decoded (f16-pair PTX) but not multiplied by x,
* `probe_strided_x`: decoded and multiplied by x loaded as eight strided scalars per word (the session-9 form,
  slower than the decode itself).

Prints and writes JSON (to $OUT or the working directory): microseconds and effective TB/s of the packed bytes.

    python benchmarks/diagnostics/diagnose_mxfp4_gemv.py
"""

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import event_us  # noqa: E402
from kimik3.kernels import mxfp4
from kimik3.kernels.mxfp4 import _e2m1_word_ptx

CONFIGS = [(8, 64, 2), (8, 128, 4), (16, 32, 2), (16, 64, 2), (16, 64, 4), (16, 128, 4), (16, 256, 8), (32, 32, 4),
           (32, 64, 4), (64, 32, 4)]


@triton.jit
def _probe_kernel(x_ptr, p_ptr, o_ptr, N, KW, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, MODE: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_KW // 4
    row = tl.program_id(0).to(tl.int64)  # routed row r multiplies expert r
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    p_rows = p_ptr + (row * N + cols.to(tl.int64))[:, None, None] * KW
    x_row = x_ptr + row * (8 * KW)
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for g0 in range(0, KW // 4, GROUPS):
        q = (g0 + tl.arange(0, GROUPS))[:, None] * 4 + tl.arange(0, 4)[None, :]
        word = tl.load(p_rows + q[None, :, :], mask=cmask[:, None, None], other=0)
        if MODE == 0:
            acc += tl.sum(word, axis=2).to(tl.float32)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_ptx(word)
            if MODE == 1:
                acc += tl.sum(((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)), axis=2)
            else:
                xq = x_row + 8 * q
                part = c0 * tl.load(xq).to(tl.float32)[None, :, :]
                part += c1 * tl.load(xq + 1).to(tl.float32)[None, :, :]
                part += c2 * tl.load(xq + 2).to(tl.float32)[None, :, :]
                part += c3 * tl.load(xq + 3).to(tl.float32)[None, :, :]
                part += c4 * tl.load(xq + 4).to(tl.float32)[None, :, :]
                part += c5 * tl.load(xq + 5).to(tl.float32)[None, :, :]
                part += c6 * tl.load(xq + 6).to(tl.float32)[None, :, :]
                part += c7 * tl.load(xq + 7).to(tl.float32)[None, :, :]
                acc += tl.sum(part, axis=2)
    tl.store(o_ptr + row * N + cols, tl.sum(acc, axis=1), mask=cmask)


def main():
    dev = "cuda"
    experts, rows, n, k = 64, 16, 6144, 3584
    kw = k // 8
    packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.randint(110, 122, (experts, n, k // 32), dtype=torch.uint8, device=dev)
    words = packed.view(torch.int32)
    xs = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    xs32 = xs.float()  # the same values as f32: does converting x in every program cost? (measured: no)
    ends = torch.cat([torch.arange(1, rows + 1), torch.full((experts - rows,), rows)]).to(dev, torch.int32)
    out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
    out32 = torch.empty(rows, n, device=dev, dtype=torch.float32)
    read = rows * n * (k // 2 + k // 32)
    results = {"shape": {"experts": experts, "rows": rows, "n": n, "k": k, "packed_bytes_read": read},
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    ref = mxfp4._mxfp4_gemv_fwd(xs, packed, scale, ends).float()
    results["autotuned_us"] = round(event_us(lambda: mxfp4._mxfp4_gemv_fwd(xs, packed, scale, ends), 50), 1)
    for bn, bkw, warps in CONFIGS:
        tag = f"n{bn}_kw{bkw}_w{warps}"
        grid = (rows, triton.cdiv(n, bn))
        row = {}
        for name, ptx, x in (("gemv_ptx", True, xs), ("gemv_ptx_x_f32", True, xs32), ("gemv_portable", False, xs)):
            def call(ptx=ptx, x=x):
                mxfp4._mxfp4_gemv_kernel.fn[grid](x, words, scale, out, ends, n, kw, experts,
                                                       min(2, triton.cdiv(rows, experts)), E_PAD=64,
                                                       BLOCK_N=bn, BLOCK_KW=bkw, PTX_DECODE=ptx, num_warps=warps)
            row[name] = event_us(call, 50)
            assert torch.allclose(out.float(), ref, rtol=2e-2, atol=1e-2), (tag, name)
        for name, mode in (("probe_load", 0), ("probe_decode", 1), ("probe_strided_x", 2)):
            row[name] = event_us(lambda mode=mode: _probe_kernel[grid](xs, words, out32, n, kw, BLOCK_N=bn,
                                                                       BLOCK_KW=bkw, MODE=mode, num_warps=warps), 50)
        results[tag] = {name: {"us": round(us, 1), "TBps": round(read / us / 1e6, 2)} for name, us in row.items()}
        print(tag, {name: v["TBps"] for name, v in results[tag].items()}, flush=True)
    print("autotuned", results["autotuned_us"], "us", round(read / results["autotuned_us"] / 1e6, 2), "TB/s")
    Path(os.environ.get("OUT", "."), "diagnose_mxfp4_gemv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
