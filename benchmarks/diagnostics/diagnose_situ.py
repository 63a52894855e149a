"""What bounds the Triton SiTU-GLU forward (a diagnostic, not a test): on the three shapes of an 8K prefill of the
benchmark model (routed experts: 8192 tokens x top-16 rows of the fused [gate | up] output, intermediate 3072; shared
experts: 8192 x 6144; layer 0's dense MLP: 8192 x 33792), bf16, release betas (4, 25), timed by CUDA events for

* `session11` (the JSON key the kept results use): the kernel's first form (a division per tanh / sigmoid / beta,
  three exps; copied here),
* `current`: `situ._situ_fwd_kernel` (ratios, one division, the sigmoid's exp from the gate tanh's),
  at several (BLOCK, num_warps),
* `add`: torch.add(gate, up) into the output, the same bytes moved: the bandwidth floor.

Each form's bf16 output is compared with the PyTorch reference (fraction of bit-equal elements). Prints and writes
JSON (to $OUT or the working directory).

    python benchmarks/diagnostics/diagnose_situ.py
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
from kimik3.kernels import situ
from kimik3.kernels.situ import _tanh
from kimik3.modeling import ops_kimi_k3 as ops

SHAPES = {"routed": (8192 * 16, 3072), "shared": (8192, 6144), "dense": (8192, 33792)}
CONFIGS = [(512, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]


@triton.jit
def _situ_first_form_kernel(a_ptr, u_ptr, o_ptr, n_cols, stride_a, stride_u, stride_o, b1, b2, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = b1 * _tanh(a / b1) * tl.sigmoid(a)
    u = b2 * _tanh(u / b2)
    tl.store(o_ptr + row * stride_o + cols, (act * u).to(o_ptr.dtype.element_ty), mask=mask)


def main():
    dev, b1, b2 = "cuda", 4.0, 25.0
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for name, (rows, n) in SHAPES.items():
        torch.manual_seed(0)
        h = (torch.randn(rows, 2 * n, device=dev) * 3).to(torch.bfloat16)
        gate, up = h[:, :n], h[:, n:]
        out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
        ref = ops.situ_glu(gate, up, b1, b2)
        moved = 3 * rows * n * 2  # bytes: both halves read, the product written
        row = {}

        def record(tag, us):
            row[tag] = {"us": round(us, 1), "TBps": round(moved / us / 1e6, 2),
                        "bit_equal": round(float((out == ref).float().mean()), 6)}

        def old():
            _situ_first_form_kernel[(rows, triton.cdiv(n, 1024))](gate, up, out, n, gate.stride(0), up.stride(0),
                                                                 out.stride(0), b1, b2, BLOCK=1024, num_warps=4)
        record("session11", event_us(old, 20))
        for block, warps in CONFIGS:
            def new(block=block, warps=warps):
                situ._situ_fwd_kernel[(rows, triton.cdiv(n, block))](
                    gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), b1, 1 / b1, b2, 1 / b2,
                    HAS_B2=True, SIGMOID_POW=2, BLOCK=block, num_warps=warps)
            record(f"current_b{block}_w{warps}", event_us(new, 20))
        add_us = event_us(lambda: torch.add(gate, up, out=out), 20)  # the same bytes, no arithmetic to speak of
        row["add"] = {"us": round(add_us, 1), "TBps": round(moved / add_us / 1e6, 2)}
        results[name] = row
        print(name, {tag: (v["us"], v.get("TBps"), v.get("bit_equal")) for tag, v in row.items()}, flush=True)
    Path(os.environ.get("OUT", "."), "diagnose_situ.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
