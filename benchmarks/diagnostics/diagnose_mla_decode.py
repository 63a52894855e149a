"""A split-K (flash-decoding) MLA decode kernel against what the compiled decode step runs today (a diagnostic and
prototype, not the product; issue 16: "the MLA latent read at 64K").

In a static-cache decode step the absorbed MLA attention runs `ops_kimi_k3.mla_decode` with the cache's key-valid
mask over the whole static buffer: a bf16 score GEMM [B, 96 heads, T], scale, mask and an f32 softmax (fused by
inductor), then the probabilities times the latents, a second read of the cache. An H200 run (before the aligned static
buffers) put the 64K step 0.41 ms (b=1) and 2.26 ms (b=8) above the 4K step, against 0.03 / 0.28 ms of extra latent
bytes at the HBM roofline. The kernel here reads each latent once: every program takes a block of query rows (heads x
new tokens of one sequence) and a span of the context, keeps an online softmax and an f32 [rows, 512] accumulator, and a
second kernel merges the spans by their log-sum-exp. Masked keys get a finite -1e30 score (a row with no valid key then
averages all keys, as the reference's finfo.min fill does), keys past the buffer -inf.

    python benchmarks/diagnostics/diagnose_mla_decode.py                 # H200: correctness and timings, JSON to $OUT
    TRITON_INTERPRET=1 python benchmarks/diagnostics/diagnose_mla_decode.py --check-only  # CPU: small sizes

Status (H200; docs/benchmarks.md, MLA decode op and static buffers): correct on the GPU, but slower than the cuBLAS
GEMMs at every size (b=8 64K: best of 60 configs 658 us against 476 us for the compiled reference; b=1 64K: 111 against
72): not adopted. The 64K step's extra time came from unaligned static buffers instead (fixed in the cache). The H200
runs timed the model's earlier fast twin (f32 scores, no mask) as `cublas_twin_unmasked`; the script now times the
current one (`kimik3.kernels.mla`, the same unmasked call) as `fast_twin_unmasked`.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import event_us, graph_us  # noqa: E402
from kimik3.modeling import ops_kimi_k3 as ops

@triton.jit
def _mla_decode_split_kernel(q_ptr, c_ptr, v_ptr, acc_ptr, ml_ptr, T, ROWS, S, SPLIT_T, scale,
                             stride_qb, stride_qr, stride_cb, stride_ct, stride_vb, stride_vs,
                             R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                             HAS_MASK: tl.constexpr, ONE_QUERY: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < ROWS
    split = tl.program_id(2)
    r_idx = tl.arange(0, R)
    p_idx = tl.arange(0, P)
    q_rows = q_ptr + b * stride_qb + rows.to(tl.int64)[:, None] * stride_qr
    q_lat = tl.load(q_rows + r_idx[None, :], mask=rmask[:, None], other=0.0)
    q_pe = tl.load(q_rows + R + p_idx[None, :], mask=rmask[:, None], other=0.0)
    m_i = tl.full((BLOCK_R,), -3.0e38, tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, R), tl.float32)
    t_begin = split * SPLIT_T
    for t0 in range(t_begin, t_begin + SPLIT_T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < T
        c_rows = c_ptr + b * stride_cb + t.to(tl.int64)[:, None] * stride_ct
        latent = tl.load(c_rows + r_idx[None, :], mask=tmask[:, None], other=0.0)
        k_pe = tl.load(c_rows + R + p_idx[None, :], mask=tmask[:, None], other=0.0)
        s = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION) * scale
        if HAS_MASK and ONE_QUERY:  # one new token: every row reads the same mask row
            valid = tl.load(v_ptr + b * stride_vb + t, mask=tmask, other=0)
            s = tl.where(valid[None, :] != 0, s, -1e30)  # finite: a row with no valid key stays finite (uniform)
        elif HAS_MASK:  # key-valid mask [B, S, T]: query row h * S + i reads row i
            valid = tl.load(v_ptr + b * stride_vb + (rows % S).to(tl.int64)[:, None] * stride_vs + t[None, :],
                            mask=rmask[:, None] & tmask[None, :], other=0)
            s = tl.where(valid != 0, s, -1e30)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # probabilities in the cache dtype for the second product, as flash attention (and the fast twin) round them
        acc = tl.dot(p.to(latent.dtype), latent, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out = (b * ROWS + rows.to(tl.int64)) * tl.num_programs(2) + split
    tl.store(acc_ptr + out[:, None] * R + r_idx[None, :], acc, mask=rmask[:, None])
    tl.store(ml_ptr + out * 2, m_i, mask=rmask)
    tl.store(ml_ptr + out * 2 + 1, l_i, mask=rmask)


@triton.jit
def _mla_decode_combine_kernel(acc_ptr, ml_ptr, o_ptr, SPLITS, R: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    smask = sp < SPLITS
    m = tl.load(ml_ptr + (row * SPLITS + sp) * 2, mask=smask, other=-3.0e38)
    l = tl.load(ml_ptr + (row * SPLITS + sp) * 2 + 1, mask=smask, other=0.0)
    w = tl.where(smask, tl.exp(m - tl.max(m, axis=0)), 0.0)
    r_idx = tl.arange(0, R)
    acc = tl.load(acc_ptr + (row * SPLITS + sp)[:, None] * R + r_idx[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(w * l, axis=0)
    tl.store(o_ptr + row * R + r_idx, o.to(o_ptr.dtype.element_ty))


def mla_decode_split_k(q_lat, latent_cache, scale, kv_lora_rank, key_valid=None, block_r=32, block_t=32,
                       num_warps=8, target_programs=None, num_stages=None):
    """q_lat [B, H, S, R+P], latent_cache [B, T, R+P], key_valid bool [B, S, T] or None -> o_lat [B, H, S, R]."""
    batch, heads, s_len, width = q_lat.shape
    t_len = latent_cache.shape[1]
    rank, pe = kv_lora_rank, width - kv_lora_rank
    q = q_lat.reshape(batch, heads * s_len, width).contiguous()
    cache = latent_cache.to(q.dtype).contiguous()
    rows = heads * s_len
    row_blocks = triton.cdiv(rows, block_r)
    if target_programs is None:
        target_programs = 4 * (torch.cuda.get_device_properties(q.device).multi_processor_count
                               if q.is_cuda else 4)
    splits = max(1, min(triton.cdiv(t_len, block_t), triton.cdiv(target_programs, batch * row_blocks)))
    split_t = triton.cdiv(triton.cdiv(t_len, splits), block_t) * block_t
    splits = triton.cdiv(t_len, split_t)
    acc = torch.empty(batch, rows, splits, rank, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, rows, splits, 2, dtype=torch.float32, device=q.device)
    valid = key_valid.to(torch.uint8).contiguous() if key_valid is not None else acc  # dummy pointer when unmasked
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _mla_decode_split_kernel[(batch, row_blocks, splits)](
        q, cache, valid, acc, ml, t_len, rows, s_len, split_t, scale, q.stride(0), q.stride(1), cache.stride(0),
        cache.stride(1), valid.stride(0) if key_valid is not None else 0,
        valid.stride(1) if key_valid is not None else 0, R=rank, P=pe, BLOCK_R=block_r, BLOCK_T=block_t,
        HAS_MASK=key_valid is not None, ONE_QUERY=s_len == 1, PRECISION=precision, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}))
    out = torch.empty(batch, rows, rank, dtype=q.dtype, device=q.device)
    _mla_decode_combine_kernel[(batch * rows,)](acc, ml, out, splits, R=rank,
                                                SPLITS_PAD=triton.next_power_of_2(splits))
    return out.view(batch, heads, s_len, rank)


def reference_f64(q_lat, cache, scale, rank, key_valid):
    scores = torch.einsum("bhsd,btd->bhst", q_lat.double(), cache.double()) * scale
    if key_valid is not None:
        scores = scores.masked_fill(~key_valid[:, None], torch.finfo(torch.float64).min)
    return torch.einsum("bhst,btr->bhsr", torch.softmax(scores, dim=-1), cache[..., :rank].double())


def check(device, dtype, shapes, tol, **launch):
    worst = {}
    for batch, heads, s_len, t_len in shapes:
        g = torch.Generator().manual_seed(batch * 1000 + t_len)
        q = torch.randn(batch, heads, s_len, 576, generator=g).to(device, dtype)
        cache = torch.randn(batch, t_len, 576, generator=g).to(device, dtype)
        valid = torch.rand(batch, s_len, t_len, generator=g).to(device) < 0.7
        valid[0, :, :] = False  # a sequence with no valid key: every key weighs the same, as in the reference
        for name, mask in (("masked", valid), ("unmasked", None)):
            got = mla_decode_split_k(q, cache, 576 ** -0.5, 512, mask, **launch)
            want = reference_f64(q, cache, 576 ** -0.5, 512, mask)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            worst[f"{name}_b{batch}_h{heads}_s{s_len}_t{t_len}"] = err
            assert err < tol, (name, batch, heads, s_len, t_len, err)
            if mask is not None:  # the model's reference op, masked the same way
                ref_op = ops.mla_decode(q, cache, 576 ** -0.5, 512, mask[:, None])[0]
                worst[f"{name}_b{batch}_t{t_len}_vs_reference_op"] = (
                    (got.double() - ref_op.double()).abs().max() / ref_op.double().abs().max()).item()
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check-only", action="store_true", help="small correctness checks (CPU interpreter)")
    args = parser.parse_args()
    if args.check_only or not torch.cuda.is_available():
        worst = check("cpu", torch.float32, [(2, 3, 1, 70), (1, 2, 2, 33)], 1e-5, block_r=16, block_t=16,
                      target_programs=8)
        print(json.dumps(worst, indent=1))
        return
    from kimik3.kernels.mla import mla_decode as fast_twin

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "check_f32": check("cuda", torch.float32, [(2, 96, 1, 4100), (1, 96, 2, 1000)], 1e-5),
               "check_bf16": check("cuda", torch.bfloat16, [(2, 96, 1, 4100), (1, 96, 2, 1000)], 2e-2)}
    scale, bf = 576 ** -0.5, torch.bfloat16
    compiled_ref = torch.compile(lambda q, c, m: ops.mla_decode(q, c, scale, 512, m)[0], dynamic=False)
    for batch, t_len in ((1, 4096), (8, 4096), (1, 65536), (8, 65536)):
        q = torch.randn(batch, 96, 1, 576, device="cuda", dtype=bf)
        cache = torch.randn(batch, t_len, 576, device="cuda", dtype=bf)
        valid = torch.ones(batch, 1, t_len, device="cuda", dtype=torch.bool)
        valid[:, :, -64:] = False  # the unfilled tail of a static buffer
        latent_bytes = cache.numel() * cache.element_size()
        row = {"latent_bytes": latent_bytes, "hbm_roofline_us": round(latent_bytes / 4.3e12 * 1e6, 1)}
        timings = {
            "reference_masked_eager": lambda: ops.mla_decode(q, cache, scale, 512, valid[:, None])[0],
            "reference_masked_compiled": lambda: compiled_ref(q, cache, valid[:, None]),
            "fast_twin_unmasked": lambda: fast_twin(q, cache, scale, 512)[0],
            "split_k_masked": lambda: mla_decode_split_k(q, cache, scale, 512, valid),
        }
        for name, fn in timings.items():
            with torch.inference_mode():
                us = event_us(fn, 20)
            try:
                with torch.inference_mode():
                    gpu_us = graph_us(fn, 20)
            except Exception as exc:  # not capturable
                gpu_us = float("nan")
                row[f"{name}_graph_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            row[name] = {"us": round(us, 1), "TBps": round(latent_bytes / us / 1e6, 2), "graph_us": round(gpu_us, 1),
                         "graph_TBps": round(latent_bytes / gpu_us / 1e6, 2)}
        with torch.inference_mode():
            want = ops.mla_decode(q, cache, scale, 512, valid[:, None])[0].float()
            got = mla_decode_split_k(q, cache, scale, 512, valid).float()
        row["split_k_rel_err_vs_reference"] = ((got - want).norm() / want.norm()).item()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        launches = {f"r{r}_t{t}_w{w}_s{st}_p{p}": dict(block_r=r, block_t=t, num_warps=w, num_stages=st,
                                                       target_programs=p * sms)
                    for r, t, w in ((64, 32, 8), (64, 64, 8), (32, 64, 8), (32, 32, 4), (16, 64, 4))
                    for st in (1, 2, 3) for p in (1, 2, 4)} if t_len > 4096 else {}
        sweep = {}
        for name, launch in launches.items():
            try:
                with torch.inference_mode():
                    sweep[name] = round(event_us(lambda: mla_decode_split_k(q, cache, scale, 512, valid, **launch),
                                                 10), 1)
            except Exception as exc:  # a config that does not compile (registers, shared memory)
                sweep[name] = type(exc).__name__
        row["split_k_sweep_us"] = sweep
        timed = {name: us for name, us in sweep.items() if isinstance(us, float)}
        if timed:
            best = min(timed, key=timed.get)
            with torch.inference_mode():
                best_graph_us = graph_us(lambda: mla_decode_split_k(q, cache, scale, 512, valid, **launches[best]), 20)
            row["split_k_best"] = {"config": best, "us": timed[best], "TBps": round(latent_bytes / timed[best] / 1e6, 2),
                                   "graph_us": round(best_graph_us, 1)}
        results[f"b{batch}_t{t_len // 1024}k"] = row
        print(f"b{batch}_t{t_len // 1024}k", {k: v for k, v in row.items()}, flush=True)
    Path(os.environ.get("OUT", "."), "diagnose_mla_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
