"""Memory- and FMA-bound ops of an 8K prefill of the benchmark model on the GPU (a diagnostic, not a test; CUDA
events, bf16), each form against what the model ran before its own twin:

* `experts`: the routed experts' two grouped GEMMs (8192 tokens x top-16 of 64 experts, latent 3584, width 3072) by
  `grouped_mm` (what the model runs), by one cuBLAS mm per expert (group sizes known on the host), and one dense mm
  of the same rows (the ceiling of a GEMM this size); gate_up also as two grouped GEMMs over the weight's gate and up
  halves. TFLOP/s of the useful work. (The transposed form, out^T = W x^T with the rows as the 2-D operand's ragged
  N, was tried: grouped_mm asserts on the device unless every group's size is a multiple of 8.)
* `gather`: the experts' expert-sorted copy of the activations (131072 rows of 3584 from 8192): `index_select`
  against `moe.gather_rows` at several (rows, columns) per program; TB/s of the bytes written and read once.
* `conv`: the KDA short conv (+ SiLU) of one [8192, 12288] projection, no cached window: fla-core's Triton kernel
  (the twin's autograd path, as before) against `conv.causal_conv1d_prefill` at several (BLOCK_T, BLOCK_C, warps);
  TB/s of x read once and y written; the largest difference from the reference.

Router forms were also timed here once (a tensor-core GEMM written as f32, a Triton f32 dot): both rejected for
accuracy (docs/benchmarks.md, Router upcast), their JSON kept in benchmarks/results. Prints and writes JSON (to $OUT or
the working directory); arguments pick parts (default: all).

* `kda`: one KDA layer's gate + chunked recurrence, the decay computed before fla's chunk_kda against
  inside it (with and without fla's safe_gate); microseconds and the error against an f32 run.

* `attn_res` (branch wip/attn-res-fused): the fused residual add + AttnRes mix + RMSNorm against the three ops.

    python benchmarks/diagnostics/diagnose_prefill_ops.py [experts] [gather] [conv] [kda] [attn_res]
"""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import event_us, uniform_routed_counts  # noqa: E402
from kimik3.kernels import attn_res as attn_res_kernels
from kimik3.kernels import moe, norms
from kimik3.kernels.conv import _causal_conv1d_eager, causal_conv1d_prefill
from kimik3.kernels.kda import chunk_kda, kda_gate
from kimik3.modeling import ops_kimi_k3 as ops

TOKENS, TOP_K = 8192, 16
EXPERTS, LATENT, INTERMEDIATE = 64, 3584, 3072
GATHER_CONFIGS = [(32, 256), (8, 512), (64, 128), (64, 256), (16, 256)]
CONV_CONFIGS = [(32, 128, 4), (64, 128, 4), (16, 128, 4), (32, 128, 2), (16, 256, 4), (32, 64, 2), (64, 64, 4),
                (8, 256, 2), (16, 64, 2)]


def experts(results):
    torch.manual_seed(0)
    counts = uniform_routed_counts(TOKENS, EXPERTS, TOP_K, "cuda")
    ends = counts.cumsum(0).to(torch.int32)
    rows = TOKENS * TOP_K
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
        if name == "gate_up":
            forms["gate_and_up_grouped_mm"] = lambda: (grouped_mm(x, w[:, :INTERMEDIATE].transpose(-2, -1), offs=ends),
                                                       grouped_mm(x, w[:, INTERMEDIATE:].transpose(-2, -1), offs=ends))
        ref = grouped_mm(x, w.transpose(-2, -1), offs=ends)
        per_expert()
        row = {"rows": rows, "k": k, "n": n, "rows_per_expert": [min(sizes), max(sizes)],
               "per_expert_equals_grouped": bool(torch.equal(out, ref))}
        for form, fn in forms.items():
            us = event_us(fn, 10)
            row[form] = {"us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1)}
        results[f"experts_{name}"] = row
        print(name, json.dumps(row))


def gather(results):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, LATENT, device="cuda").to(torch.bfloat16)
    index = torch.rand(TOKENS, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices.reshape(-1).argsort() // TOP_K
    moved = index.numel() * LATENT * 2 + x.numel() * 2
    ref = x.index_select(0, index)
    forms = {"index_select": lambda: x.index_select(0, index)}
    for blocks in GATHER_CONFIGS:
        forms["triton_" + "_".join(map(str, blocks))] = lambda b=blocks: moe.gather_rows(x, index, *b)
    row = {}
    for name, fn in forms.items():
        us = event_us(fn, 20)
        row[name] = {"us": round(us, 1), "TBps": round(moved / us / 1e6, 2), "equal": bool(torch.equal(fn(), ref))}
    results["gather"] = row
    print("gather", json.dumps(row))


def conv(results):
    torch.manual_seed(0)
    x = torch.randn(1, TOKENS, 12288, device="cuda").to(torch.bfloat16)
    weight = torch.randn(12288, 1, 4, device="cuda") * 0.5
    moved = 2 * x.numel() * 2
    ref = ops.causal_conv1d(x, weight, None)[0]
    forms = {"fla": lambda: _causal_conv1d_eager(x, weight, None)}
    for blocks in CONV_CONFIGS:
        forms["triton_" + "_".join(map(str, blocks))] = (
            lambda b=blocks: causal_conv1d_prefill(x, weight, None, b))
    row = {}
    for name, fn in forms.items():
        us = event_us(fn, 20)
        row[name] = {"us": round(us, 1), "TBps": round(moved / us / 1e6, 2),
                     "max_abs_diff_vs_reference": float((fn()[0].float() - ref.float()).abs().max())}
    results["conv"] = row
    print("conv", json.dumps(row))


def kda(results):
    """One KDA layer's decay and chunked recurrence at the K3 shape (8192 tokens, 96 heads of 128): our Triton gate
    + fla's chunk_kda on the precomputed decay (what the model ran before the gate moved into fla) against fla computing
    the decay inside its chunk cumsum, with and without its safe_gate diagonal tiles; each output's error against the
    reference ops (f32 chunked math) on the same inputs."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    torch.manual_seed(0)
    heads, dim = 96, 128
    q, k, v = (torch.randn(1, TOKENS, heads, dim, device="cuda").to(torch.bfloat16) for _ in range(3))
    raw = torch.randn(1, TOKENS, heads, dim, device="cuda").to(torch.bfloat16)
    A_log = torch.zeros(128, device="cuda")
    A_log[:heads] = torch.randn(heads, device="cuda") * 0.5
    dt_bias = torch.randn(heads * dim, device="cuda") * 0.5
    beta = torch.sigmoid(torch.randn(1, TOKENS, heads, device="cuda"))
    lb = -5.0
    gate_fast = kda_gate
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)

    def separate():
        return chunk_kda(q, k, v, gate_fast(raw, A_log, dt_bias, lb), beta, **kw)

    def in_kernel(safe):
        def run():
            return fla_chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=A_log[:heads],
                                 dt_bias=dt_bias, lower_bound=lb, safe_gate=safe, **kw)
        return run

    with torch.inference_mode():
        gold = ops.chunk_kda(q, k, v, ops.kda_gate(raw, A_log, dt_bias, lb), beta, **kw)[0].double()
    forms = {"gate_then_chunk_kda": separate, "gate_in_kernel": in_kernel(False),
             "gate_in_kernel_safe_gate": in_kernel(True)}
    part = {}
    for name, fn in forms.items():
        with torch.inference_mode():
            us = event_us(fn, 20)
            o = fn()[0].double()
        part[name] = {"us": round(us, 1), "rel_err_vs_f32": float((o - gold).norm() / gold.norm())}
    results["kda"] = part
    print("kda", part, flush=True)


def attn_res(results):
    """A decoder layer's residual add + AttnRes mix + RMSNorm at [8192, 7168] bf16: the fused twin (rows on chip for
    one block + the prefix, else the add and the separate twins) against the three separate ops (bf16 add, the mix twin, the norm
    twin), with 1, 3 and 8 banked blocks, on the MLP side (with the add) and the attention side (without)."""
    torch.manual_seed(0)
    d = 7168
    rows = torch.randn(10, TOKENS, d, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    proj = (0.05 * torch.randn(1, d, device="cuda")).to(torch.bfloat16)
    mix, norm = attn_res_kernels.block_attn_res_mix, norms.rms_norm
    part = {}
    for n_blocks in (1, 3, 8):
        blocks = list(rows[:n_blocks])
        for side, delta in (("mlp", rows[9]), ("attention", None)):
            prefix = rows[8]

            def fused():
                return attn_res_kernels.attn_res_mix_norm(blocks, prefix, delta, w, proj, 1e-5, w, 1e-6)

            def separate():
                p = prefix + delta if delta is not None else prefix
                return p, norm(mix([*blocks, p], w, proj, 1e-5), w, 1e-6)

            with torch.inference_mode():
                got, want = fused()[1], separate()[1]
                part[f"{side}_{n_blocks}_blocks"] = {
                    "fused_us": round(event_us(fused, 20), 1), "separate_us": round(event_us(separate, 20), 1),
                    "equal_fraction": float((got == want).float().mean())}
    results["attn_res"] = part
    print("attn_res", part, flush=True)


def main():
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = {"experts": experts, "gather": gather, "conv": conv, "kda": kda, "attn_res": attn_res}
    for name in sys.argv[1:] or parts:
        parts[name](results)
    out = Path(os.environ.get("OUT", ".")) / "diagnose_prefill_ops.json"
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
