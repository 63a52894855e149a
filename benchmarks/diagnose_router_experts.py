"""Two parts of the MoE block of an 8K prefill on the GPU (a diagnostic, not a test; CUDA events, bf16):

* `router`: the f32 router logits of 8192 tokens at the benchmark model's 64 experts and the release's 896, width
  7168: the reference (both operands upcast, FFMA SGEMM) against the fast twin (one 16-bit GEMM written as f32,
  `kimik3.kernels.moe.router_logits`). Both against float64 logits: max and mean absolute error, and the fraction of
  tokens whose top-16 set differs from the float64 one; the bf16-rounded logits (the error k3_math 8.1 warns about)
  for scale.
* `experts`: the routed experts' two grouped GEMMs (8192 tokens x top-16 of 64 experts, latent 3584, width 3072) by
  `grouped_mm` (what the model runs), by one cuBLAS mm per expert (group sizes known on the host), and one dense mm
  of the same rows (the ceiling of a GEMM this size). TFLOP/s of the useful work.

Prints and writes JSON (to $OUT or the working directory).

    python benchmarks/diagnose_router_experts.py
"""

import json
import os
from pathlib import Path

import torch

from _k3bench_utils import event_us
from kimik3.kernels import moe
from kimik3.modeling import ops_kimi_k3 as ops

TOKENS, WIDTH, TOP_K = 8192, 7168, 16
EXPERTS, LATENT, INTERMEDIATE = 64, 3584, 3072


def _top_sets(logits):
    return logits.topk(TOP_K, dim=-1).indices.sort(dim=-1).values


def router(results):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH, device="cuda").to(torch.bfloat16)
    for experts in (EXPERTS, 896):
        w = (torch.randn(experts, WIDTH, device="cuda") * 0.02).to(torch.bfloat16)
        exact = x.double() @ w.double().t()
        truth = _top_sets(exact)
        row = {}
        forms = {"reference_upcast_sgemm": lambda: ops.router_logits(x, w),
                 "fast_bf16_gemm_f32_out": lambda: moe.router_logits(x, w)}
        for name, fn in forms.items():
            logits = fn()
            err = (logits.double() - exact).abs()
            row[name] = {"us": round(event_us(fn, 20), 1), "max_abs_err": float(err.max()),
                         "mean_abs_err": float(err.mean()),
                         "sets_differing_from_f64": float((_top_sets(logits) != truth).any(-1).float().mean())}
        rounded = ops.router_logits(x, w).to(torch.bfloat16).double()
        row["bf16_rounded_logits"] = {"max_abs_err": float((rounded - exact).abs().max()),
                                      "sets_differing_from_f64": float((_top_sets(rounded) != truth).any(-1)
                                                                       .float().mean())}
        results[f"router_{experts}_experts"] = row
        print(experts, json.dumps(row))


def experts(results):
    torch.manual_seed(0)
    top = torch.rand(TOKENS, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices.reshape(-1)
    counts = torch.bincount(top, minlength=EXPERTS)
    ends = counts.cumsum(0).to(torch.int32)
    rows = top.numel()
    sizes = counts.tolist()
    gemms = {"gate_up": (LATENT, 2 * INTERMEDIATE), "down": (INTERMEDIATE, LATENT)}
    grouped_mm = moe._grouped_mm_fn()
    for name, (k, n) in gemms.items():
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(EXPERTS, n, k, device="cuda") * 0.02).to(torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows * k * n

        def per_expert():
            start = 0
            for e, size in enumerate(sizes):
                torch.mm(x[start:start + size], w[e].t(), out=out[start:start + size])
                start += size

        forms = {"grouped_mm": lambda: grouped_mm(x, w.transpose(-2, -1), offs=ends),
                 "per_expert_mm": per_expert,
                 "dense_mm_same_rows": lambda: torch.mm(x, w[0].t(), out=out)}
        ref = grouped_mm(x, w.transpose(-2, -1), offs=ends)
        per_expert()
        row = {"rows": rows, "k": k, "n": n, "rows_per_expert": [min(sizes), max(sizes)],
               "per_expert_equals_grouped": bool(torch.equal(out, ref))}
        for form, fn in forms.items():
            us = event_us(fn, 10)
            row[form] = {"us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1)}
        results[f"experts_{name}"] = row
        print(name, json.dumps(row))


def main():
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    router(results)
    experts(results)
    out = Path(os.environ.get("OUT", ".")) / "diagnose_router_experts.json"
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
