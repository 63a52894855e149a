"""Which packed MXFP4 kernel a decode step's routed experts should run (a diagnostic, not a test): both expert
matmuls of one MoE layer (gate_up N 6144 K 3584, down N 3584 K 3072) for b tokens x top-16, routed uniformly at
random over 64 experts (the benchmark model) and 896 (the release), on

* `gemv`: `mxfp4._mxfp4_gemv_fwd` (one program per routed row: each row reads its expert's packed bytes),
* `tiles`: `mxfp4._mxfp4_grouped_matmul_fwd` (16-row blocks of one expert; bf16 through Triton's microscaled dot,
  `tl.dot_scaled` on the codes and scales as stored),
* `byte_tiles`: the same with `MXFP4_SCALED_DOT` off (bytes decoded one code at a time in the kernel).

(The results files of 2026-12-02 also hold `word_tiles`, a kernel decoding whole words as the GEMV does, and
`dot_scaled_swap`, the microscaled dot with the weights as the wide operand: both measured slower and removed;
the file of 2026-12-03 `rows1`, `rows2`, `rows4`, the GEMV's decode with blocks of up to 1, 2 or 4 routed rows of one
expert per program and tile shapes down to one scale group per column: 2.2-11× slower than the GEMV, removed.)

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
                                          ("byte_tiles", mxfp4._mxfp4_grouped_matmul_fwd, False)):
                mxfp4.MXFP4_SCALED_DOT = scaled_dot
                outs[path] = fwd(xs, packed, scale, ends)  # autotunes once per shape
                us = graph_us(lambda fwd=fwd: fwd(xs, packed, scale, ends), 20)
                entry = point["paths"].setdefault(path, {})
                entry[name] = {"us": round(us, 1), "TBps_distinct": round(read / us / 1e6, 2)}
            mxfp4.MXFP4_SCALED_DOT = True
            ref = outs["gemv"].float()
            scale_ref = ref.abs().max().item()
            for path in ("tiles", "byte_tiles"):
                point["paths"][path][name]["max_diff_vs_gemv_rel"] = round(
                    (outs[path].float() - ref).abs().max().item() / scale_ref, 5)
        for entry in point["paths"].values():
            entry["layer_us"] = round(sum(entry[name]["us"] for name in SHAPES), 1)
        results["points"].append(point)
        print(json.dumps(point), flush=True)
    Path(os.environ.get("OUT", "."), "diagnose_mxfp4_decode_paths.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
