# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Triton kernels of Kimi K3 (importing this module requires `triton`).

* `situ_glu`            fused SiTU-GLU, forward and backward in Triton (autograd Function).
* `rms_norm`            KimiRMSNorm in one pass (forward only).
* `gated_rms_norm`      KDA's gated output norm (f32 throughout) in one pass (forward only).
* `kda_gate`            KDA's lower-bounded decay gate (f32) in one pass over the bf16 logits (forward only).
* `router_logits`       the reference's SGEMM after a one-pass Triton upcast of the activations (forward only).
* `mla_softmax`         the absorbed MLA decode's scale / mask / f32 softmax / rounding between its two GEMMs.
* `block_attn_res_mix`  AttnRes softmax depth-mixture; forward in Triton (one read pass for the scores, one for the
                        mix, no stacked copy of the candidates), backward analytic in PyTorch (per candidate, f32).
* `attn_res_mix_norm`   a layer's residual add, AttnRes mix and the RMSNorm after it in one pass per row (forward
                        only; the mix is not stored).
* `gather_rows`         the routed experts' expert-sorted copy of the activations (index_select; forward only).
* `moe_combine`         weighted f32 sum of the (rounded) expert outputs back to token order; Triton forward,
                        PyTorch backward.
* `mxfp4_dequant`       MXFP4 (E2M1 + E8M0) -> bf16/f32, bit-exact with the reference.
* `grouped_matmul_few_rows` expert-grouped matmul over plain expert weights for a few rows per expert (decode):
                        streams each routed expert's weight tiles once; forward only.
* `mxfp4_grouped_matmul` expert-grouped matmul over packed MXFP4 weights, dequantised tile by tile in registers;
                        gradient for the activations only.
* `causal_conv1d_step`  depthwise causal conv + SiLU over a few tokens after a cached window (decode), one launch.
* `causal_conv1d_prefill` the same over a prefill chunk (token x channel tiles, K shifted loads), one launch.
* `mxfp4_gemv`          the same product for 1-2 rows per expert (decode): one routed row per program, no
                        `tl.dot`, the weights decoded and summed in registers; gradient for the activations only.

Kernels avoid libdevice so they also run under `TRITON_INTERPRET=1` (fp32 inputs) for CPU debugging. Without
autograd recording, the public functions run their forwards as `torch.ops.kimik3.*` custom ops (custom_ops.py), which
torch.compile keeps as single graph nodes.
"""

import os

import torch
import triton
import triton.language as tl

from kimik3.modeling import ops_kimi_k3 as _reference_ops
from kimik3.modeling.ops_kimi_k3 import MXFP4_GROUP_SIZE

from . import custom_ops


# --------------------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _tanh_ratio(x, e):
    # tanh(x) as (numerator, denominator) given e = exp(-2|x|), so that a caller divides once for several factors
    ax = tl.abs(x)
    x2 = ax * ax
    small = ax < 0.0625
    num = tl.where(small, ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0)))), 1.0 - e)
    return tl.where(x < 0, -num, num), tl.where(small, 1.0, 1.0 + e)


@triton.jit
def _tanh(x):
    # tanh without libdevice: odd Taylor series near 0 (no cancellation), exp form elsewhere
    num, den = _tanh_ratio(x, tl.exp(-2.0 * tl.abs(x)))
    return num / den


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """View x [..., width] as [rows, width] with unit stride on the last dim (copy only if needed)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


# --------------------------------------------------------------------------------------------------------------
# SiTU-GLU


@triton.jit
def _situ_fwd_kernel(
    a_ptr, u_ptr, o_ptr, n_cols, stride_a, stride_u, stride_o, b1, inv_b1, b2, inv_b2,
    HAS_B2: tl.constexpr, SIGMOID_POW: tl.constexpr, BLOCK: tl.constexpr,
):
    # Arithmetic, not bytes, bounded the first form of this kernel (five divisions and three exps per element: 10.5
    # ms of an 8K prefill, docs/benchmarks.md, SiTU kernel). Here the two tanh and the sigmoid are ratios, the sigmoid's
    # exp is the gate tanh's squared when beta1 = 4 (the release), the betas are reciprocals (exact for 4; within an
    # f32 ulp for 25), and one division finishes the product. f32 error: a few ulps, far below the bf16 output's.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    g = a * inv_b1
    e_g = tl.exp(-2.0 * tl.abs(g))
    t_num, t_den = _tanh_ratio(g, e_g)
    # sigmoid(a) = 1 / (1 + e) for a >= 0 and e / (1 + e) below, e = exp(-|a|) = e_g ** (beta1 / 2)
    if SIGMOID_POW == 1:
        e = e_g
    elif SIGMOID_POW == 2:
        e = e_g * e_g
    else:
        e = tl.exp(-tl.abs(a))
    num = (b1 * t_num) * tl.where(a < 0, e, 1.0)
    den = t_den * (1.0 + e)
    if HAS_B2:
        h = u * inv_b2
        u_num, u_den = _tanh_ratio(h, tl.exp(-2.0 * tl.abs(h)))
        num = num * (b2 * u_num)
        den = den * u_den
    else:
        num = num * u
    tl.store(o_ptr + row * stride_o + cols, (num / den).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(
    a_ptr, u_ptr, g_ptr, da_ptr, du_ptr, n_cols, stride_a, stride_u, stride_g, stride_da, stride_du, b1, b2,
    HAS_B2: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(a / b1)
    s = tl.sigmoid(a)
    act = b1 * t * s
    dact = (1.0 - t * t) * s + b1 * t * s * (1.0 - s)
    if HAS_B2:
        tu = _tanh(u / b2)
        h = b2 * tu
        dh = 1.0 - tu * tu
    else:
        h = u
        dh = 1.0
    tl.store(da_ptr + row * stride_da + cols, (g * h * dact).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_du + cols, (g * act * dh).to(du_ptr.dtype.element_ty), mask=mask)


_SITU_BLOCK = 1024


def _situ_fwd(a2, u2, b1, b2, out_dtype):
    rows, n = a2.shape
    out = torch.empty(rows, n, dtype=out_dtype, device=a2.device)
    if rows and n:
        grid = (rows, triton.cdiv(n, _SITU_BLOCK))
        with torch.cuda.device(a2.device):  # Triton launches on the current device
            _situ_fwd_kernel[grid](
                a2, u2, out, n, a2.stride(0), u2.stride(0), out.stride(0), b1, 1.0 / b1,
                1.0 if b2 is None else b2, 1.0 if b2 is None else 1.0 / b2,
                HAS_B2=b2 is not None, SIGMOID_POW={2.0: 1, 4.0: 2}.get(b1, 0), BLOCK=_SITU_BLOCK, num_warps=4,
            )
    return out


class _SituGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, b1, b2):
        n = gate.shape[-1]
        a2, u2 = _rows(gate, n), _rows(up, n)
        out = _situ_fwd(a2, u2, b1, b2, gate.dtype)
        ctx.save_for_backward(a2, u2)
        ctx.b1, ctx.b2 = b1, b2
        ctx.shapes = (gate.shape, up.shape, gate.dtype, up.dtype)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, grad):
        a2, u2 = ctx.saved_tensors
        gshape, ushape, gdtype, udtype = ctx.shapes
        rows, n = a2.shape
        g2 = _rows(grad, n)
        da = torch.empty(rows, n, dtype=gdtype, device=a2.device)
        du = torch.empty(rows, n, dtype=udtype, device=a2.device)
        if rows and n:
            grid = (rows, triton.cdiv(n, _SITU_BLOCK))
            with torch.cuda.device(a2.device):  # Triton launches on the current device
                _situ_bwd_kernel[grid](
                    a2, u2, g2, da, du, n, a2.stride(0), u2.stride(0), g2.stride(0), da.stride(0), du.stride(0),
                    ctx.b1, 1.0 if ctx.b2 is None else ctx.b2,
                    HAS_B2=ctx.b2 is not None, BLOCK=_SITU_BLOCK, num_warps=4,
                )
        return da.view(gshape), du.view(ushape), None, None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """Fused SiTU-GLU, same contract as `ops_kimi_k3.situ_glu` (f32 math, result in gate's dtype); has autograd.

    `gate`/`up` may be strided views (e.g. the two halves of a fused gate_up projection)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    b1 = 1.0 if beta is None else float(beta)
    b2 = None if linear_beta is None else float(linear_beta)
    if custom_ops.needs_grad(gate, up):
        return _SituGLU.apply(gate, up, b1, b2)
    return torch.ops.kimik3.situ_glu(gate, up, b1, b2)  # one node under torch.compile


# --------------------------------------------------------------------------------------------------------------
# RMSNorms in one pass: KimiRMSNorm (the reference's six ops: f32 copy, square, mean, scale, cast back, weight) and
# the KDA output's gated norm (ten ops with f32 intermediates)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, D, stride_x, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps))
    # the two roundings of the reference: normalised row to the input dtype, then the product with the weight
    normed = (x * inv_rms).to(o_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * D + cols, (normed * w).to(o_ptr.dtype.element_ty), mask=m)


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.rms_norm` for a weight of the input's dtype; forward only (FAST_OPS declares it
    so: while autograd records, and under torch.compile, which fuses the reference itself, the reference runs)."""
    d = hidden_states.shape[-1]
    if weight.shape != (d,) or weight.dtype != hidden_states.dtype:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} {weight.dtype} does not fit hidden states "
                         f"[..., {d}] {hidden_states.dtype}")
    x = _rows(hidden_states, d)
    out = torch.empty(x.shape, dtype=hidden_states.dtype, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(d)
        with torch.cuda.device(x.device):
            _rms_norm_kernel[(x.shape[0],)](x, weight.contiguous(), out, d, x.stride(0), float(eps), BLOCK_D=block,
                                            num_warps=min(16, max(1, block // 512)))
    return out.view(hidden_states.shape)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, o_ptr, ROWS, D, stride_x, stride_g, eps, BLOCK_ROWS: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = (rows < ROWS)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))
    y = x * inv_rms[:, None] * w[None, :] * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(o_ptr + rows[:, None] * D + cols[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.gated_rms_norm` (all f32, one rounding to x's dtype) in one pass; forward only."""
    d = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (d,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit (gate as x, weight [{d}])")
    x2, g2 = _rows(x, d), _rows(gate, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        block_d = triton.next_power_of_2(d)
        block_rows = max(1, min(64, 4096 // block_d))
        with torch.cuda.device(x.device):
            _gated_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
                x2, g2, weight.contiguous(), out, rows, d, x2.stride(0), g2.stride(0), float(eps),
                BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=4)
    return out.view(x.shape)


# --------------------------------------------------------------------------------------------------------------
# KDA decay gate: g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias)), f32, in one pass over the bf16 logits (the reference
# runs five f32 ops, two of them broadcasting over heads)


@triton.jit
def _kda_gate_kernel(z_ptr, a_ptr, b_ptr, g_ptr, ROWS, C, HEAD_DIM, stride_z, lower_bound, BLOCK_ROWS: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    m = (rows < ROWS)[:, None] & cmask[None, :]
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=m, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + cols, mask=cmask, other=0.0)
    a = tl.load(a_ptr + cols // HEAD_DIM, mask=cmask, other=0.0)
    x = a[None, :] * (z + bias[None, :])
    tl.store(g_ptr + rows[:, None] * C + cols[None, :], lower_bound * (1.0 / (1.0 + tl.exp(-x))), mask=m)


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.kda_gate`; the lower-bounded (K3) form in one Triton pass, the softplus (Kimi
    Linear) form through the reference. exp(A_log) per head is computed by torch, as the reference does."""
    if lower_bound is None:
        return _reference_ops.kda_gate(z, A_log, dt_bias, lower_bound)
    num_heads, head_dim = z.shape[-2], z.shape[-1]
    channels = num_heads * head_dim
    if dt_bias.numel() != channels or A_log.numel() < num_heads:
        raise ValueError(f"kda_gate: logits [..., {num_heads}, {head_dim}] need dt_bias [{channels}] and A_log "
                         f"[>= {num_heads}], got {tuple(dt_bias.shape)} and {tuple(A_log.shape)}")
    z2 = _rows(z, channels)
    a = A_log.float()[:num_heads].exp().contiguous()
    bias = dt_bias.float().reshape(channels).contiguous()
    g = torch.empty(z2.shape, dtype=torch.float32, device=z.device)
    rows = z2.shape[0]
    if rows:
        block_c = min(1024, triton.next_power_of_2(channels))
        block_rows = max(1, 4096 // block_c)
        with torch.cuda.device(z.device):
            _kda_gate_kernel[(triton.cdiv(rows, block_rows), triton.cdiv(channels, block_c))](
                z2, a, bias, g, rows, channels, head_dim, z2.stride(0), float(lower_bound), BLOCK_ROWS=block_rows,
                BLOCK_C=block_c, num_warps=4)
    return g.view(z.shape)


# --------------------------------------------------------------------------------------------------------------
# Router logits: the reference's SGEMM on the same f32 values (bit-identical logits), with the activations' upcast as
# one vectorised pass (PyTorch's casting copy moved ~1.9 TB/s on the 8K prefill's [8192, 7168]). Faster forms of the
# product itself were not f32-accurate: a tensor-core GEMM written as f32 ~25x, a Triton f32 dot ~9x farther from the
# float64 logits than the SGEMM at the max (docs/benchmarks.md, Router upcast).


@triton.jit
def _upcast_kernel(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float32), mask=mask)


def upcast_f32(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """x.float() (exact for 16-bit x) as one Triton pass; a contiguous result."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        with torch.cuda.device(x.device):
            _upcast_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block, num_warps=8)
    return out


def router_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract and the same numbers as `ops_kimi_k3.router_logits`: the reference itself on the activations
    upcast in one pass (its own upcast of an f32 tensor is a no-op); forward only."""
    return _reference_ops.router_logits(upcast_f32(hidden_states), weight)


# --------------------------------------------------------------------------------------------------------------
# MLA decode softmax: the reference's scale, mask, f32 softmax and rounding between its two GEMMs, in two kernels


@triton.jit
def _mla_scaled_masked_scores(s_ptr, m_ptr, row, t, tm, scale, fill, H, S, stride_mb, stride_mh, stride_ms,
                              stride_mt, HAS_MASK: tl.constexpr):
    x = tl.load(s_ptr + t, mask=tm, other=0.0).to(tl.float32)
    x = (x * scale).to(s_ptr.dtype.element_ty).to(tl.float32)  # the scaled scores are a tensor of that dtype
    if HAS_MASK:
        m_row = m_ptr + (row // (H * S)) * stride_mb + ((row // S) % H) * stride_mh + (row % S) * stride_ms
        keep = tl.load(m_row + t.to(tl.int64) * stride_mt, mask=tm, other=0)
        x = tl.where(keep != 0, x, fill)
    return tl.where(tm, x, float("-inf"))


@triton.jit
def _mla_softmax_stats_kernel(s_ptr, m_ptr, ml_ptr, T, H, S, scale, fill, stride_mb, stride_mh, stride_ms, stride_mt,
                              HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one query row (sequence, head, new token) x one block of keys
    blk = tl.program_id(1)
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    x = _mla_scaled_masked_scores(s_ptr + row * T, m_ptr, row, t, t < T, scale, fill, H, S, stride_mb, stride_mh,
                                  stride_ms, stride_mt, HAS_MASK)
    m = tl.max(x, axis=0)
    out = (row * tl.num_programs(1) + blk) * 2
    tl.store(ml_ptr + out, m)
    tl.store(ml_ptr + out + 1, tl.sum(tl.exp(x - m), axis=0))


@triton.jit
def _mla_softmax_kernel(s_ptr, m_ptr, ml_ptr, p_ptr, T, H, S, scale, fill, stride_mb, stride_mh, stride_ms,
                        stride_mt, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.num_programs(1)
    b_idx = tl.arange(0, BLOCKS_PAD)
    bm = b_idx < blocks
    part_m = tl.load(ml_ptr + (row * blocks + b_idx) * 2, mask=bm, other=float("-inf"))
    part_l = tl.load(ml_ptr + (row * blocks + b_idx) * 2 + 1, mask=bm, other=0.0)
    m = tl.max(part_m, axis=0)
    l = tl.sum(tl.where(bm, part_l * tl.exp(part_m - m), 0.0), axis=0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    x = _mla_scaled_masked_scores(s_ptr + row * T, m_ptr, row, t, tm, scale, fill, H, S, stride_mb, stride_mh,
                                  stride_ms, stride_mt, HAS_MASK)
    tl.store(p_ptr + row * T + t, tl.div_rn(tl.exp(x - m), l).to(p_ptr.dtype.element_ty), mask=tm)


def mla_softmax(scores: torch.Tensor, scale: float, attention_mask: torch.Tensor | None, heads: int,
                s_len: int) -> torch.Tensor:
    """scores [B, H*S, T] (contiguous, the first GEMM's output) -> probabilities in scores' dtype, as
    `ops_kimi_k3.mla_decode` computes them: softmax_f32(masked_fill(scores * scale, ~mask, dtype min))."""
    t_len = scores.shape[-1]
    probs = torch.empty_like(scores)
    rows = scores.numel() // max(t_len, 1)
    if rows and t_len:
        if attention_mask is not None:
            mask = attention_mask.view(torch.uint8) if attention_mask.dtype == torch.bool else attention_mask
            strides = (mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(2), mask.stride(3))
        else:
            mask, strides = scores, (0, 0, 0, 0)  # not read
        block = min(2048, triton.next_power_of_2(t_len))
        blocks = triton.cdiv(t_len, block)
        stats = torch.empty(rows, blocks, 2, dtype=torch.float32, device=scores.device)
        args = (t_len, heads, s_len, float(scale), torch.finfo(scores.dtype).min, *strides)
        with torch.cuda.device(scores.device):
            # the row's max and exp-sum per key block, then every block normalised by the row's merged statistics
            _mla_softmax_stats_kernel[(rows, blocks)](scores, mask, stats, *args, HAS_MASK=attention_mask is not None,
                                                      BLOCK_T=block, num_warps=4)
            _mla_softmax_kernel[(rows, blocks)](scores, mask, stats, probs, *args, HAS_MASK=attention_mask is not None,
                                                BLOCK_T=block, BLOCKS_PAD=max(2, triton.next_power_of_2(blocks)),
                                                num_warps=4)
    return probs


# --------------------------------------------------------------------------------------------------------------
# Block Attention Residuals mix

_ATTN_RES_MAX_CANDIDATES = 16


@triton.jit
def _pick(i: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    p = c0
    if i == 1:
        p = c1
    if i == 2:
        p = c2
    if i == 3:
        p = c3
    if i == 4:
        p = c4
    if i == 5:
        p = c5
    if i == 6:
        p = c6
    if i == 7:
        p = c7
    if i == 8:
        p = c8
    if i == 9:
        p = c9
    if i == 10:
        p = c10
    if i == 11:
        p = c11
    if i == 12:
        p = c12
    if i == 13:
        p = c13
    if i == 14:
        p = c14
    if i == 15:
        p = c15
    return p


@triton.jit
def _attn_res_fwd_kernel(
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
    norm_w_ptr, proj_w_ptr, o_ptr, D, eps,
    N_CAND: tl.constexpr, N_POW2: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # the query w = norm_weight * proj_weight is formed here, in f32, block by block: built on the host it cost
    # three small launches (two casts, a product) per mix, two mixes per layer
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    idx = tl.arange(0, N_POW2)
    scores = tl.full([N_POW2], float("-inf"), dtype=tl.float32)
    # pass 1: score_i = (x_i . w) / rms(x_i)
    for i in tl.static_range(N_CAND):
        base = _pick(i, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15) + row * D
        acc_ss = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc_dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs
            m = cols < D
            x = tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
            w = tl.load(norm_w_ptr + cols, mask=m, other=0.0).to(tl.float32) * tl.load(
                proj_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
            acc_ss += x * x
            acc_dot += x * w
        s = tl.sum(acc_dot, axis=0) / tl.sqrt(tl.sum(acc_ss, axis=0) / D + eps)
        scores = tl.where(idx == i, s, scores)
    mx = tl.max(scores, axis=0)
    p = tl.exp(scores - mx)
    p = p / tl.sum(p, axis=0)
    # pass 2: mix of the raw candidates
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + offs
        m = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(N_CAND):
            base = _pick(i, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15) + row * D
            p_i = tl.sum(tl.where(idx == i, p, 0.0), axis=0)
            acc += p_i * tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * D + cols, acc.to(o_ptr.dtype.element_ty), mask=m)


def _attn_res_fwd(cands, norm_weight, proj_weight, eps, out_dtype):
    d = cands[0].shape[-1]
    norm_weight, proj_weight = norm_weight.reshape(-1).contiguous(), proj_weight.reshape(-1).contiguous()
    rows = cands[0].numel() // d
    out = torch.empty(rows, d, dtype=out_dtype, device=cands[0].device)
    n = len(cands)
    ptrs = list(cands) + [cands[0]] * (_ATTN_RES_MAX_CANDIDATES - n)
    if rows:
        with torch.cuda.device(out.device):  # Triton launches on the current device
            _attn_res_fwd_kernel[(rows,)](
                *ptrs, norm_weight, proj_weight, out, d, eps,
                N_CAND=n, N_POW2=max(2, triton.next_power_of_2(n)), BLOCK_D=1024, num_warps=4,
            )
    return out


def _attn_res_bwd_torch(cands, query, eps, grad):
    """Analytic backward, one candidate at a time in f32 (no stacked copy).

    s_i = r_i (V_i . w), r_i = (mean V_i^2 + eps)^-1/2, p = softmax(s), y = sum p_i V_i.
    dV_i = p_i g + ds_i (r_i w - (V_i . w) r_i^3 V_i / D), ds_i = p_i (g.V_i - sum_j p_j g.V_j), dw = sum_i ds_i r_i V_i.
    """
    d = query.numel()
    g = grad.reshape(-1, d).float()
    rs, dots, dps = [], [], []
    for c in cands:
        v = c.reshape(-1, d).float()
        rs.append(torch.rsqrt(v.pow(2).mean(dim=-1) + eps))
        dots.append(v @ query)
        dps.append((g * v).sum(dim=-1))
    r, a, dp = torch.stack(rs), torch.stack(dots), torch.stack(dps)  # [n, rows]
    p = torch.softmax(r * a, dim=0)
    ds = p * (dp - (p * dp).sum(dim=0, keepdim=True))
    grads, dw = [], torch.zeros_like(query)
    for i, c in enumerate(cands):
        v = c.reshape(-1, d).float()
        coef = (ds[i] * r[i]).unsqueeze(-1)
        dv = p[i].unsqueeze(-1) * g + coef * query - (coef * (a[i] * r[i] * r[i]).unsqueeze(-1) / d) * v
        dw += (coef * v).sum(dim=0)
        grads.append(dv.to(c.dtype).view(c.shape))
    return grads, dw


class _AttnResMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, norm_weight, proj_weight, eps, *cands):
        out = _attn_res_fwd(cands, norm_weight, proj_weight, eps, cands[-1].dtype)
        ctx.save_for_backward(norm_weight, proj_weight, *cands)
        ctx.eps = eps
        return out.view(cands[-1].shape)

    @staticmethod
    def backward(ctx, grad):
        norm_weight, proj_weight, *cands = ctx.saved_tensors
        query = norm_weight.float() * proj_weight.float().reshape(-1)
        grads, dw = _attn_res_bwd_torch(cands, query, ctx.eps, grad)
        d_norm = (dw * proj_weight.float().reshape(-1)).to(norm_weight.dtype)
        d_proj = (dw * norm_weight.float()).reshape(proj_weight.shape).to(proj_weight.dtype)
        return (d_norm, d_proj, None, *grads)


def block_attn_res_mix(
    candidates: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.block_attn_res_mix`: softmax(rms-normed keys . (norm_weight*proj)) mixture of the
    raw candidates [B, T, D] in f32, cast to the candidates' dtype. Forward in Triton; backward analytic (PyTorch).
    Up to 16 candidates, all of one shape and dtype."""
    n = len(candidates)
    if not 1 <= n <= _ATTN_RES_MAX_CANDIDATES:
        raise ValueError(f"block_attn_res_mix takes 1..{_ATTN_RES_MAX_CANDIDATES} candidates, got {n}")
    shape, dtype = candidates[0].shape, candidates[0].dtype
    if any(c.shape != shape or c.dtype != dtype for c in candidates):
        raise ValueError("block_attn_res_mix candidates must share shape and dtype")
    if not custom_ops.needs_grad(norm_weight, proj_weight, *candidates):
        return torch.ops.kimik3.block_attn_res_mix(candidates, norm_weight, proj_weight, float(eps))
    cands = [c if c.is_contiguous() else c.contiguous() for c in candidates]
    return _AttnResMix.apply(norm_weight, proj_weight, float(eps), *cands)


# The decoder layer's residual add, AttnRes mix and following RMSNorm in one program per row: the add and the norm
# cost no pass of their own and the mix is never written. The arithmetic is `_attn_res_fwd_kernel`'s and
# `_rms_norm_kernel`'s (its two roundings), the f32 sums over the whole row at once instead of chunk by chunk.


# candidates, row width: a row's candidates held in registers, each read once. One banked block + the prefix only:
# at 4 candidates the kernel ran slower than the separate twins (H200: 394-412 us against 315-398 us at 8192 x
# 7168, benchmarks/diagnostics/diagnose_prefill_ops.py attn_res), at 2 faster (170-189 against 192-275 us)
_ATTN_RES_ON_CHIP_MAX = (2, 8192)


@triton.jit
def _attn_res_mix_norm_on_chip_kernel(
    c0, c1, delta_ptr, new_prefix_ptr, norm_w_ptr, proj_w_ptr, out_w_ptr, o_ptr, D, res_eps, out_eps,
    N_CAND: tl.constexpr, ADD: tl.constexpr, N_POW2: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # The row of every candidate in registers ([N_POW2, BLOCK_D]), so each is read from memory once (the separate
    # twins read them twice for the scores and the mix, then the norm reads the mix), then the scores, the mix and
    # the norm.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    idx = tl.arange(0, N_POW2)
    act_ty = o_ptr.dtype.element_ty
    tile = tl.zeros([N_POW2, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(N_CAND):
        base = _pick(i, c0, c1, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0, c0) + row * D
        x = tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
        if ADD:
            if i == N_CAND - 1:
                x = (x + tl.load(delta_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)).to(act_ty)
                tl.store(new_prefix_ptr + row * D + cols, x, mask=m)
                x = x.to(tl.float32)
        tile = tl.where((idx == i)[:, None], x[None, :], tile)
    w = tl.load(norm_w_ptr + cols, mask=m, other=0.0).to(tl.float32) * tl.load(
        proj_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    scores = tl.sum(tile * w[None, :], axis=1) / tl.sqrt(tl.sum(tile * tile, axis=1) / D + res_eps)
    scores = tl.where(idx < N_CAND, scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, axis=0))
    p = p / tl.sum(p, axis=0)
    mixed = tl.sum(p[:, None] * tile, axis=0).to(act_ty).to(tl.float32)
    # the RMSNorm of the rounded mix: the normalised row rounded, then times the weight, rounded (the rms_norm twin)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(mixed * mixed, axis=0) / D + out_eps))
    normed = (mixed * inv_rms).to(act_ty).to(tl.float32)
    out_w = tl.load(out_w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * D + cols, (normed * out_w).to(act_ty), mask=m)


def attn_res_mix_norm(
    blocks: list[torch.Tensor], prefix: torch.Tensor | None, delta: torch.Tensor | None,
    res_norm_weight: torch.Tensor, res_proj_weight: torch.Tensor, res_eps: float, out_norm_weight: torch.Tensor,
    out_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ops_kimi_k3.attn_res_mix_norm` (new prefix bit-identical, the normed mix as the separate
    twins give it up to their f32 sums' order): one Triton pass per row for up to one block of up to 8192, else the
    add and the separate twins; forward only, eager only (FAST_OPS declares it so). Up to 15 blocks; blocks, prefix,
    delta and the out-norm weight of one dtype."""
    if prefix is None and delta is None:
        raise ValueError("attn_res_mix_norm needs a prefix or a delta")
    if custom_ops.needs_grad(prefix, delta, res_norm_weight, res_proj_weight, out_norm_weight, *blocks):
        raise ValueError("attn_res_mix_norm's fast twin has no backward; the reference runs while autograd records")
    n = len(blocks) + 1
    if n > _ATTN_RES_MAX_CANDIDATES:
        raise ValueError(f"attn_res_mix_norm takes 0..{_ATTN_RES_MAX_CANDIDATES - 1} blocks, got {len(blocks)}")
    last = prefix if prefix is not None else delta
    add = prefix is not None and delta is not None
    shape, dtype = last.shape, last.dtype
    given = [*blocks, last] + ([delta] if add else [])
    if any(t.shape != shape or t.dtype != dtype or t.device != last.device for t in given):
        raise ValueError(f"attn_res_mix_norm: blocks, prefix and delta must share shape, dtype and device, got "
                         f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in given]}")
    d = shape[-1]
    if out_norm_weight.shape != (d,) or out_norm_weight.dtype != dtype:
        raise ValueError(f"attn_res_mix_norm: out-norm weight {tuple(out_norm_weight.shape)} {out_norm_weight.dtype} "
                         f"does not fit the rows [..., {d}] {dtype}")
    if res_norm_weight.numel() != d or res_proj_weight.numel() != d:
        raise ValueError(f"attn_res_mix_norm: AttnRes weights {tuple(res_norm_weight.shape)} and "
                         f"{tuple(res_proj_weight.shape)} do not fit the rows [..., {d}]")
    if n > _ATTN_RES_ON_CHIP_MAX[0] or d > _ATTN_RES_ON_CHIP_MAX[1]:
        # where the one-pass kernel does not gain: the reference, whose add, AttnRes mix and RMSNorm dispatch to
        # their own twins (this declaration is the stricter one, so they are the fast ones)
        return _reference_ops.attn_res_mix_norm(blocks, prefix, delta, res_norm_weight, res_proj_weight, res_eps,
                                                out_norm_weight, out_eps)
    cands = [t.contiguous() for t in (*blocks, last)]
    delta_c = delta.contiguous() if add else cands[-1]
    new_prefix = torch.empty(shape, dtype=dtype, device=last.device) if add else last
    normed = torch.empty(shape, dtype=dtype, device=last.device)
    rows = last.numel() // d if d else 0
    if rows:
        block_d = triton.next_power_of_2(d)
        with torch.cuda.device(last.device):
            _attn_res_mix_norm_on_chip_kernel[(rows,)](
                *(cands + [cands[0]] * (_ATTN_RES_ON_CHIP_MAX[0] - n)), delta_c, new_prefix if add else normed,
                res_norm_weight.reshape(-1).contiguous(), res_proj_weight.reshape(-1).contiguous(),
                out_norm_weight.contiguous(), normed, d, float(res_eps), float(out_eps), N_CAND=n, ADD=add,
                N_POW2=2, BLOCK_D=block_d, num_warps=min(16, max(1, block_d // 512)),
            )
    return new_prefix, normed


# --------------------------------------------------------------------------------------------------------------
# MoE combine: y[t] = cast(sum_j w[t, j] * f32(o[pos[t, j]]))


@triton.jit
def _moe_combine_kernel(o_ptr, pos_ptr, w_ptr, y_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + j).to(tl.int64)
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += wj * tl.load(o_ptr + pos * D + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + cols, acc.to(y_ptr.dtype.element_ty), mask=m)


class _MoECombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, pos, out_dtype):
        num_tokens, k = weights.shape
        d = expert_out.shape[-1]
        expert_out = expert_out.contiguous()
        w = weights.float().contiguous()
        y = torch.empty(num_tokens, d, dtype=out_dtype, device=expert_out.device)
        if num_tokens and d:
            with torch.cuda.device(expert_out.device):  # Triton launches on the current device
                _moe_combine_kernel[(num_tokens, triton.cdiv(d, 1024))](
                    expert_out, pos, w, y, d, K=k, BLOCK=1024, num_warps=4
                )
        ctx.save_for_backward(expert_out, w, pos)
        ctx.wdtype = weights.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        expert_out, w, pos = ctx.saved_tensors
        num_tokens, k = w.shape
        d = expert_out.shape[-1]
        g = dy.float()
        flat_pos = pos.reshape(-1)
        d_out = torch.empty_like(expert_out)
        d_out[flat_pos] = (w.unsqueeze(-1) * g.unsqueeze(1)).reshape(-1, d).to(expert_out.dtype)
        picked = expert_out.index_select(0, flat_pos).view(num_tokens, k, d).float()
        d_w = torch.bmm(picked, g.unsqueeze(-1)).squeeze(-1).to(ctx.wdtype)
        return d_out, d_w, None, None


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype):
    """expert_out [M, D] (rows in expert-sorted order), weights [N, k] f32, pos [N, k] int64 (row of each routed
    slot in expert_out) -> [N, D] in out_dtype, f32 accumulation over j = 0..k-1. Has autograd."""
    return _MoECombine.apply(expert_out, weights, pos.contiguous(), out_dtype)


# --------------------------------------------------------------------------------------------------------------
# Row gather out[i] = x[index[i]]: the routed experts' expert-sorted copy of the activations (8K prefill: 131072 rows
# of 7 KB from 8192), where index_select wrote ~2.2 TB/s (docs/benchmarks.md, Row gather and prefill conv)


@triton.jit
def _gather_rows_kernel(x_ptr, idx_ptr, o_ptr, ROWS, D, stride_x, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < ROWS
    src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    m = rmask[:, None] & (cols < D)[None, :]
    v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m)
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], v, mask=m)


def gather_rows(x: torch.Tensor, index: torch.Tensor, block_rows: int = 32, block_d: int = 256) -> torch.Tensor:
    """x.index_select(0, index) for a 2-D x (unit stride on the last dim) and 1-D integer index, forward only;
    indices must lie in [0, x.shape[0]) (callers build them from a sort)."""
    rows, d = index.numel(), x.shape[1]
    x2 = _rows(x, d)
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows and d:
        block_d = min(block_d, triton.next_power_of_2(d))
        with torch.cuda.device(x.device):
            _gather_rows_kernel[(triton.cdiv(rows, block_rows), triton.cdiv(d, block_d))](
                x2, index.contiguous(), out, rows, d, x2.stride(0), BLOCK_ROWS=block_rows, BLOCK_D=block_d,
                num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------------------
# Causal conv1d over a few tokens after a cached window (decode, verify). fla's path pads the cached window to
# fla's [B, C, K] state (two launches), runs its conv and its final-state kernels, and slices the new window out
# (one more copy): five launches per projection for one token, three projections per KDA layer. Here one program
# per (channel block, sequence) reads the window straight from the cached state and the new inputs and writes the
# outputs and the new window: one launch.

CONV_STEP_MAX_TOKENS = 16  # above this the tokens are a prefill chunk: fla's parallel kernel


@triton.jit
def _causal_conv1d_step_kernel(x_ptr, s_ptr, w_ptr, y_ptr, ns_ptr, T, C, sx_b, sx_t, sx_c, ss_b, ss_c, ss_k,
                               K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    # position p of the sequence [cached window (K - 1) | x (T)] is state column p for p < K - 1, else token
    # p - (K - 1); the cached window is rounded to x's dtype first, as the reference concatenates in x's dtype
    b = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    j = tl.arange(0, K_PAD)
    w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=cmask[:, None] & (j < K)[None, :], other=0.0)
    w = w.to(tl.float32)
    for t in range(0, T + 1):
        # t < T: the taps of output t (positions t .. t + K - 1); t == T: the new window (positions T .. T + K - 2)
        width = K if t < T else K - 1
        p = t + j
        in_state = (p < K - 1)[None, :]
        valid = cmask[:, None] & (j < width)[None, :]
        cached = tl.load(s_ptr + b * ss_b + c[:, None] * ss_c + p[None, :] * ss_k, mask=valid & in_state, other=0.0)
        fresh = tl.load(x_ptr + b * sx_b + (p - (K - 1))[None, :] * sx_t + c[:, None] * sx_c, mask=valid & ~in_state,
                        other=0.0)
        window = tl.where(in_state, cached.to(y_ptr.dtype.element_ty), fresh)
        if t < T:
            acc = tl.sum(window.to(tl.float32) * w, axis=1)  # f32 taps, as F.conv1d on the f32 window
            y = acc * tl.sigmoid(acc)
            tl.store(y_ptr + (b * T + t) * C + c, y.to(y_ptr.dtype.element_ty), mask=cmask)
        else:
            tl.store(ns_ptr + (b * C + c[:, None]) * (K - 1) + j[None, :], window, mask=valid)


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor):
    """The reference `causal_conv1d` for a few tokens after a cached window: x [B, T, C] (any strides), weight
    [C, 1, K], conv_state [B, C, K-1] -> (y [B, T, C] in x.dtype, new conv_state [B, C, K-1] in x.dtype), one
    launch; f32 taps and SiLU. Forward only (the custom op `kimik3::causal_conv1d` calls it on CUDA)."""
    batch, tokens, channels = x.shape
    kernel_size = weight.shape[-1]
    if conv_state.shape != (batch, channels, kernel_size - 1):
        raise ValueError(f"causal_conv1d_step: conv_state {tuple(conv_state.shape)} does not match x "
                         f"{tuple(x.shape)} and a kernel of {kernel_size}")
    y = torch.empty(batch, tokens, channels, dtype=x.dtype, device=x.device)
    new_state = torch.empty(batch, channels, kernel_size - 1, dtype=x.dtype, device=x.device)
    w = weight.reshape(channels, kernel_size).contiguous()
    if batch and channels:
        block = 256
        with torch.cuda.device(x.device):  # Triton launches on the current device
            _causal_conv1d_step_kernel[(triton.cdiv(channels, block), batch)](
                x, conv_state, w, y, new_state, tokens, channels, *x.stride(), *conv_state.stride(),
                K=kernel_size, K_PAD=triton.next_power_of_2(kernel_size), BLOCK_C=block, num_warps=4,
            )
    return y, new_state


# --------------------------------------------------------------------------------------------------------------
# Causal conv1d over a prefill chunk: one program per (token block, channel block, sequence) reads its K shifted input
# tiles (the K - 1 rows before the block from x or the cached window) and writes the outputs. fla's kernel moved
# ~2.2 TB/s on the 8K prefill's [8192, 12288] projections (docs/benchmarks.md, Row gather and prefill conv).

CONV_PREFILL_BLOCKS = (16, 128, 4)  # BLOCK_T, BLOCK_C, num_warps


@triton.jit
def _causal_conv1d_prefill_kernel(x_ptr, s_ptr, w_ptr, y_ptr, T, C, sx_b, sx_t, ss_b, ss_c, ss_k,
                                  HAS_STATE: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                                  BLOCK_C: tl.constexpr, L2NORM: tl.constexpr):
    # input position p = t - (K - 1) + j of output t's tap j is token p for p >= 0, else column p + K - 1 of the
    # cached window (rounded to x's dtype, as the reference concatenates in x's dtype; zeros without a window)
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    live = t < T
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j
        fresh = live & (p >= 0)
        tap = tl.load(x_ptr + b * sx_b + p.to(tl.int64)[:, None] * sx_t + c[None, :],
                      mask=fresh[:, None] & cmask[None, :], other=0.0)
        if HAS_STATE:
            cached = live & (p < 0)
            old = tl.load(s_ptr + b * ss_b + c[None, :] * ss_c + (p + K - 1)[:, None] * ss_k,
                          mask=cached[:, None] & cmask[None, :], other=0.0)
            tap = tl.where(cached[:, None], old.to(y_ptr.dtype.element_ty), tap)
        w = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0).to(tl.float32)
        acc += tap.to(tl.float32) * w[None, :]
    y = acc * tl.sigmoid(acc)
    if L2NORM:
        # a tile row is one head (BLOCK_C == head_dim): fla's l2norm of the output as it would have been stored
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = y * (1 / tl.sqrt(tl.sum(y * y, axis=1) + 1e-6))[:, None]
    tl.store(y_ptr + (b * T + t.to(tl.int64))[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & cmask[None, :])


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                          blocks=CONV_PREFILL_BLOCKS, l2norm_head_dim: int = 0):
    """The reference `causal_conv1d` over a prefill chunk: x [B, T, C], weight [C, 1, K], conv_state [B, C, K-1] or
    None -> (y [B, T, C] in x.dtype, contiguous; new conv_state [B, C, K-1] in x.dtype); f32 taps and SiLU. Forward
    only (the custom op `kimik3::causal_conv1d` calls it on CUDA). `l2norm_head_dim` > 0: y L2-normalised per head in
    the same pass (tiles one head wide); a head width that is not a power of two up to 256 normalises afterwards."""
    batch, tokens, channels = x.shape
    kernel_size = weight.shape[-1]
    if conv_state is not None and conv_state.shape != (batch, channels, kernel_size - 1):
        raise ValueError(f"causal_conv1d_prefill: conv_state {tuple(conv_state.shape)} does not match x "
                         f"{tuple(x.shape)} and a kernel of {kernel_size}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(batch, tokens, channels, dtype=x.dtype, device=x.device)
    w = weight.reshape(channels, kernel_size).contiguous()
    state = conv_state if conv_state is not None else w  # any tensor: not read without HAS_STATE
    if l2norm_head_dim and channels % l2norm_head_dim:
        raise ValueError(f"causal_conv1d_prefill: {channels} channels are not whole heads of {l2norm_head_dim}")
    in_tiles = l2norm_head_dim in (16, 32, 64, 128, 256)
    if batch and tokens and channels:
        block_t, block_c, warps = blocks
        if l2norm_head_dim and in_tiles:
            block_c = l2norm_head_dim
        with torch.cuda.device(x.device):
            _causal_conv1d_prefill_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c), batch)](
                x, state, w, y, tokens, channels, x.stride(0), x.stride(1),
                *(conv_state.stride() if conv_state is not None else (0, 0, 0)), HAS_STATE=conv_state is not None,
                K=kernel_size, BLOCK_T=block_t, BLOCK_C=block_c, L2NORM=bool(l2norm_head_dim and in_tiles),
                num_warps=warps)
    if l2norm_head_dim and not in_tiles:
        y = _reference_ops.l2norm_heads(y, l2norm_head_dim).contiguous()
    # the new window: the last K - 1 positions of [cached window | x], in x's dtype
    keep = kernel_size - 1
    if tokens >= keep:  # a fresh tensor even where the transposed slice is contiguous (custom op outputs never alias)
        new_state = x.new_empty(batch, channels, keep).copy_(x[:, tokens - keep:].transpose(1, 2))
    else:
        previous = (conv_state.to(x.dtype) if conv_state is not None
                    else x.new_zeros(batch, channels, keep))
        new_state = torch.cat([previous[..., tokens:], x.transpose(1, 2)], dim=-1).contiguous()
    return y, new_state


# --------------------------------------------------------------------------------------------------------------
# MXFP4 dequantisation


@triton.jit
def _e2m1_bits(code):
    # The 3 magnitude bits of an E2M1 code placed at the top of an f32's exponent/mantissa field make 2^-126 times
    # the E2M1 value (codes 0 and 1 land on the denormals 0 and 2^-127), so one exact multiply by a power of two
    # decodes every code. Fewer instructions per weight than branching on the exponent.
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    return _e2m1_bits(code) * 8.507059173023462e37  # 2^126: the E2M1 value


@triton.jit
def _e8m0(sc):
    # 2^(sc - 127) exactly, built from its f32 bits: normal floats for sc >= 1, the denormal 2^-127 for sc == 0
    bits = tl.where(sc == 0, 0x00400000, sc << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_dequant_kernel(p_ptr, s_ptr, o_ptr, KH, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < KH
    byte = tl.load(p_ptr + row * KH + j, mask=m, other=0).to(tl.int32)
    sc = tl.load(s_ptr + row * (KH // 16) + j // 16, mask=m, other=127).to(tl.int32)
    factor = _e8m0(sc)
    lo = _e2m1(byte & 15) * factor
    hi = _e2m1(byte >> 4) * factor
    out = o_ptr + row * (2 * KH) + 2 * j
    tl.store(out, lo.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(out + 1, hi.to(o_ptr.dtype.element_ty), mask=m)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.dequantize_mxfp4` (bit-exact): packed u8 [..., N, K/2], scale u8 [..., N, K/32]
    -> [..., N, K] in dtype."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    kh = packed.shape[-1]
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * 16 != kh:
        raise ValueError(f"MXFP4 shapes do not match: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    return torch.ops.kimik3.mxfp4_dequant(packed, scale, dtype)  # one node under torch.compile


def _mxfp4_dequant_launch(packed, scale, dtype):
    kh = packed.shape[-1]
    p2 = packed.contiguous().view(-1, kh)
    s2 = scale.contiguous().view(-1, kh // 16)
    out = torch.empty(*packed.shape[:-1], 2 * kh, dtype=dtype, device=packed.device)
    if p2.shape[0] and kh:
        with torch.cuda.device(packed.device):  # Triton launches on the current device
            _mxfp4_dequant_kernel[(p2.shape[0], triton.cdiv(kh, 512))](p2, s2, out, kh, BLOCK=512, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------------------
# Expert-grouped matmuls for few rows per expert (decode): each program takes one block of BLOCK_M expert-sorted rows
# of a single expert and a BLOCK_N slice of that expert's output columns.


@triton.jit
def _expert_row_block(ends_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # Row block `program_id(0)` of the expert-sorted rows, blocks never straddling two experts: found here from the
    # group ends (a prefix sum over the experts) rather than from a table built by a dozen small launches on the
    # host. Returns (expert, first row, end of the expert's rows); expert == E for the blocks past the last one.
    blk = tl.program_id(0)
    e_idx = tl.arange(0, E_PAD)
    emask = e_idx < E
    ends = tl.load(ends_ptr + e_idx, mask=emask, other=0)
    starts = tl.load(ends_ptr + e_idx - 1, mask=emask & (e_idx > 0), other=0)
    blocks = tl.where(emask, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    block_ends = tl.cumsum(blocks, axis=0)
    expert = tl.sum((block_ends <= blk).to(tl.int32), axis=0)
    mine = e_idx == expert
    row0 = tl.sum(tl.where(mine, starts + (blk - block_ends + blocks) * BLOCK_M, 0), axis=0)
    row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return expert, row0, row_end


_FEW_ROWS_BLOCK_M = 16  # the smallest tl.dot tile: decode has a row or a few per expert


def _row_block_grid(num_rows, num_experts, n):
    def grid(meta):
        # an upper bound on the number of row blocks (each has a row, and at most one per expert is partial); the
        # ones past the last real block return at once
        return (min(num_rows, triton.cdiv(num_rows, _FEW_ROWS_BLOCK_M) + num_experts), triton.cdiv(n, meta["BLOCK_N"]))

    return grid


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else None  # f32 stays exact (no TF32)


# Plain (bf16/f16/f32) expert weights [E, N, K], K contiguous as the model stores gate_up_proj / down_proj: the inner
# loop streams [BLOCK_N, BLOCK_K] weight tiles along K, so with a row or a few per expert each routed expert's bytes
# are read once, by many programs at once (the aim: HBM speed), where grouped_mm pads every group to a GEMM tile.


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in ((32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 5), (64, 128, 4, 4), (64, 128, 8, 5),
                              (64, 256, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3))
    ],
    key=["N", "K", "E_PAD"],
)
@triton.jit
def _grouped_matmul_few_rows_kernel(x_ptr, w_ptr, o_ptr, ends_ptr, N, K, E, stride_xm, stride_we, stride_wn,
                                    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, BLOCK_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            kmask = k < K
            x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        out = o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def grouped_matmul_few_rows(xs: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """xs [M, K], its rows grouped by expert (group e is rows group_ends[e-1]:group_ends[e]); weight [E, N, K] in
    xs.dtype -> [M, N] in xs.dtype: each group times its expert transposed, f32 accumulation, as
    `grouped_mm(xs, weight.transpose(-2, -1), offs=group_ends)`. Rows past group_ends[-1] are left unwritten.

    The raw Triton launch (CUDA tensors, forward only): the model reaches it through the custom op
    `torch.ops.kimik3.grouped_matmul_few_rows`, which torch.compile keeps as one node. Built for few rows per
    expert: every block of 16 rows of an expert reads that expert's weights again."""
    if xs.dim() != 2 or weight.dim() != 3 or xs.shape[1] != weight.shape[2] or group_ends.shape != weight.shape[:1]:
        raise ValueError(f"grouped matmul shapes do not match: xs {tuple(xs.shape)} [M, K], weight "
                         f"{tuple(weight.shape)} [E, N, K], group_ends {tuple(group_ends.shape)} [E]")
    if weight.dtype != xs.dtype:
        raise TypeError(f"grouped matmul weight must be in the rows' dtype {xs.dtype}, got {weight.dtype}")
    num_rows, k = xs.shape
    num_experts, n, _ = weight.shape
    # unit stride along K is what the kernel streams; the model's stacks already have it (no copy)
    xs = xs if xs.stride(-1) == 1 else xs.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(num_rows, n, dtype=xs.dtype, device=xs.device)
    if num_rows == 0 or n == 0 or num_experts == 0:
        return out
    grid = _row_block_grid(num_rows, num_experts, n)
    with torch.cuda.device(xs.device):  # Triton launches on the current device
        _grouped_matmul_few_rows_kernel[grid](
            xs, weight, out, group_ends.to(torch.int32).contiguous(), n, k, num_experts, xs.stride(0),
            weight.stride(0), weight.stride(1), E_PAD=triton.next_power_of_2(num_experts),
            BLOCK_M=_FEW_ROWS_BLOCK_M, PRECISION=_dot_precision(xs.dtype),
        )
    return out


# --------------------------------------------------------------------------------------------------------------
# Grouped matmul over packed MXFP4 experts. Each weight tile is dequantised in registers inside the matmul loop, so
# HBM traffic is the routed experts' packed bytes (4.25 bits per weight) and never a dequantised copy. The even and
# odd input columns are two half-width dots (low nibble = even element), which needs no interleave.


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_KH": bkh}, num_warps=w, num_stages=st)
        for bn, bkh, w, st in ((64, 64, 4, 2), (64, 64, 4, 4), (128, 32, 4, 3), (128, 64, 8, 3), (32, 64, 2, 2),
                               (64, 128, 4, 3))
    ],
    key=["N", "KH", "E_PAD"],
)
@triton.jit
def _mxfp4_grouped_matmul_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KH, E, E_PAD: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr,
                                 PRECISION: tl.constexpr):
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, BLOCK_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * (2 * KH)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)  # rows of the [E*N, K/2] packed matrix
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, KH, BLOCK_KH):
            j = start + tl.arange(0, BLOCK_KH)
            jmask = j < KH
            xmask = rmask[:, None] & jmask[None, :]
            x_even = tl.load(x_rows + 2 * j[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_rows + 2 * j[None, :] + 1, mask=xmask, other=0.0)
            wmask = cmask[:, None] & jmask[None, :]
            byte = tl.load(p_ptr + w_rows[:, None] * KH + j[None, :], mask=wmask, other=0).to(tl.int32)
            sc = tl.load(s_ptr + w_rows[:, None] * (KH // 16) + j[None, :] // 16, mask=wmask, other=127).to(tl.int32)
            factor = _e8m0(sc)
            # exact in bf16/f32: an E2M1 value times a power of two
            w_even = (_e2m1(byte & 15) * factor).to(x_ptr.dtype.element_ty)
            w_odd = (_e2m1(byte >> 4) * factor).to(x_ptr.dtype.element_ty)
            acc = tl.dot(x_even, tl.trans(w_even), acc, input_precision=PRECISION)
            acc = tl.dot(x_odd, tl.trans(w_odd), acc, input_precision=PRECISION)
        out = o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def _mxfp4_matmul_operands(xs, packed, scale, group_ends):
    """Checked, contiguous operands of the packed matmuls and their [M, N] output (unwritten)."""
    num_rows, k = xs.shape
    num_experts, n, kh = packed.shape
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    if kh * 2 != k or scale.shape != (num_experts, n, k // MXFP4_GROUP_SIZE) or group_ends.shape != (num_experts,):
        raise ValueError(f"MXFP4 grouped matmul shapes do not match: x {tuple(xs.shape)}, packed "
                         f"{tuple(packed.shape)}, scale {tuple(scale.shape)}, group_ends {tuple(group_ends.shape)}")
    out = torch.empty(num_rows, n, dtype=xs.dtype, device=xs.device)
    return xs.contiguous(), packed.contiguous(), scale.contiguous(), group_ends.to(torch.int32).contiguous(), out


def _mxfp4_grouped_matmul_fwd(xs, packed, scale, group_ends):
    xs, packed, scale, ends, out = _mxfp4_matmul_operands(xs, packed, scale, group_ends)
    (num_rows, n), (num_experts, _, kh) = out.shape, packed.shape
    if num_rows == 0 or n == 0:
        return out
    grid = _row_block_grid(num_rows, num_experts, n)
    with torch.cuda.device(xs.device):  # Triton launches on the current device
        _mxfp4_grouped_matmul_kernel[grid](xs, packed, scale, out, ends, n, kh, num_experts,
                                           E_PAD=triton.next_power_of_2(num_experts),
                                           BLOCK_M=_FEW_ROWS_BLOCK_M, PRECISION=_dot_precision(xs.dtype))
    return out


class _MXFP4GroupedMatmul(torch.autograd.Function):
    """Gradient for x only (the packed weights are frozen): dx = dout @ W per group, through a transient
    dequantised copy and grouped_mm. `launch` is the forward kernel's launcher (tiles or GEMV)."""

    @staticmethod
    def forward(ctx, xs, packed, scale, group_ends, launch):
        ctx.save_for_backward(packed, scale, group_ends)
        return launch(xs, packed, scale, group_ends)

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, group_ends = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        from .moe import _grouped_mm_fn

        weight = mxfp4_dequant(packed, scale, grad_out.dtype)  # [E, N, K]
        return _grouped_mm_fn()(grad_out, weight, offs=group_ends.to(torch.int32)), None, None, None, None


def mxfp4_grouped_matmul(xs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                         group_ends: torch.Tensor) -> torch.Tensor:
    """xs [M, K], its rows grouped by expert (group e is rows group_ends[e-1]:group_ends[e]); packed u8 [E, N, K/2],
    scale u8 [E, N, K/32] -> [M, N] in xs.dtype: each group times its dequantised expert transposed, f32
    accumulation, as `grouped_mm(xs, dequant(packed).transpose(-2, -1), offs=group_ends)`.

    Built for few rows per expert: every block of 16 rows dequantises its expert's tiles again."""
    if custom_ops.needs_grad(xs):
        return _MXFP4GroupedMatmul.apply(xs, packed, scale, group_ends, _mxfp4_grouped_matmul_fwd)
    return torch.ops.kimik3.mxfp4_grouped_matmul(xs, packed, scale, group_ends)  # one node under compile


# --------------------------------------------------------------------------------------------------------------
# Packed MXFP4 GEMV for one or two routed rows per expert (decode). A tl.dot tile has at least 16 rows, so with a
# row or two per expert the tile kernel above wastes most of every dot and moves each decoded weight through shared
# memory first; here a program multiplies one routed row by a BLOCK_N slice of its expert's output columns on the
# CUDA cores: the packed bytes stream in along K as 32-bit words (4 words per scale group), each word's eight codes
# are decoded to f32 in registers, and the sum over K is a tl.sum. Rows of one expert each read its weights; up to
# two rows per expert that still beats the tile kernel, which decodes each tile once for 16 rows (measured on the
# H200: kernels/moe.py, MXFP4_GEMV_ROWS_PER_EXPERT).
#
# What bounds it (benchmarks/diagnostics/diagnose_mxfp4_gemv.py, docs/benchmarks.md, Packed MXFP4 GEMV): loading the
# words alone runs at 3.0-3.7 TB/s, loading and decoding them at 2.2-3.1, and x fetched as eight strided scalars per
# word dragged the whole kernel to 1.4; x is therefore one 16-byte load per word. On NVIDIA GPUs a word is decoded two
# codes per 32-bit operation: a code's magnitude bits placed at bits 9-11 of an f16 (exponent low bits + top mantissa
# bit) and its sign at bit 15 make the f16 2^-14 times the E2M1 value, denormal codes included, so four shift/mask
# steps decode the word into four f16 pairs and eight exact conversions give f32 (1.5 -> 2.0 TB/s against the
# portable decode). The portable decode (the interpreter, other backends) builds the same 2^-14-scaled values one
# code at a time; both are exact, and the 2^14 goes back into the group's scale.

_E2M1_F16_PAIRS_PTX = tl.constexpr("""
{
.reg .b32 m, s, p;
.reg .b16 lo, hi;
shl.b32 m, $8, 9; and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 12; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $0, lo; cvt.f32.f16 $4, hi;
shl.b32 m, $8, 5; and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 8; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $1, lo; cvt.f32.f16 $5, hi;
shl.b32 m, $8, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 4; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $2, lo; cvt.f32.f16 $6, hi;
shr.b32 m, $8, 3; and.b32 m, m, 0x0E000E00; and.b32 s, $8, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $3, lo; cvt.f32.f16 $7, hi;
}
""")  # a constexpr: jit functions read no other globals


@triton.jit
def _e2m1_word_ptx(word):
    # the eight codes of a little-endian word (nibble i = element i) times 2^-14, two per f16 pair: pair p holds
    # nibbles p and p + 4, i.e. the 16-bit halves of the word shifted alike
    c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
        _E2M1_F16_PAIRS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [word], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    return (c0.to(tl.float32, bitcast=True), c1.to(tl.float32, bitcast=True), c2.to(tl.float32, bitcast=True),
            c3.to(tl.float32, bitcast=True), c4.to(tl.float32, bitcast=True), c5.to(tl.float32, bitcast=True),
            c6.to(tl.float32, bitcast=True), c7.to(tl.float32, bitcast=True))


@triton.jit
def _e2m1_scaled(code):
    return _e2m1_bits(code) * 5.192296858534828e33  # 2^112: the E2M1 value times 2^-14, the PTX decode's scale


@triton.jit
def _e2m1_word(word):
    return (_e2m1_scaled(word), _e2m1_scaled(word >> 4), _e2m1_scaled(word >> 8), _e2m1_scaled(word >> 12),
            _e2m1_scaled(word >> 16), _e2m1_scaled(word >> 20), _e2m1_scaled(word >> 24), _e2m1_scaled(word >> 28))


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=w, num_stages=st)
        for bn, bkw, w, st in ((8, 128, 4, 2), (16, 64, 2, 2), (16, 64, 4, 2), (16, 128, 4, 2), (16, 256, 8, 2),
                               (32, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2))
    ],
    key=["N", "KW", "PTX_DECODE"],
)
@triton.jit
def _mxfp4_gemv_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KW, E, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_KW: tl.constexpr, PTX_DECODE: tl.constexpr):
    # p_ptr: the packed bytes as int32 words, KW = K/8 per row; one E8M0 scale per 4 words (K % 32 == 0), so the
    # tile is [BLOCK_N rows, GROUPS scale groups, 4 words] and only whole groups are masked
    GROUPS: tl.constexpr = BLOCK_KW // 4
    # row program_id(0) and its expert: the tile kernels' row-block search with blocks of one row
    expert, row, _ = _expert_row_block(ends_ptr, E, E_PAD, 1)
    if expert < E:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)  # rows of the [E*N, K/8] word matrix
        p_rows = p_ptr + w_rows[:, None, None] * KW
        s_rows = s_ptr + w_rows[:, None] * (KW // 4)
        x_row = x_ptr + row.to(tl.int64) * (8 * KW)
        g_idx = tl.arange(0, GROUPS)
        q_idx = tl.arange(0, 4)
        # one partial sum per (column, scale group) slot; reduced over the groups once at the end
        acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        for g0 in range(0, KW // 4, GROUPS):
            g = g0 + g_idx
            gmask = g < KW // 4
            q = g[:, None] * 4 + q_idx[None, :]  # word index along the row: [GROUPS, 4]
            wmask = cmask[:, None] & gmask[None, :]
            word = tl.load(p_rows + q[None, :, :], mask=wmask[:, :, None], other=0)
            if PTX_DECODE:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_ptx(word)
            else:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word(word)
            # [BLOCK_N, GROUPS, 4 words, 8 codes]: join puts its pair last, so the last join is the fastest index
            # (code i = 4a + 2b + c). Code i of word q multiplies element 8q + i of x, loaded as one 16-byte vector
            # per word (eight strided loads per word cost more than the decode: docs/benchmarks.md, Packed MXFP4 GEMV).
            # Products of 2^-14-scaled E2M1 values with 16-bit x are exact in f32; the group's power-of-two scale
            # (times 2^14) multiplies its 32-term sum
            codes = tl.reshape(tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)),
                                       tl.join(tl.join(c1, c5), tl.join(c3, c7))), (BLOCK_N, GROUPS, 4, 8))
            xv = tl.load(x_row + 8 * q[:, :, None] + tl.arange(0, 8)[None, None, :], mask=gmask[:, None, None],
                         other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(codes * xv[None, :, :, :], axis=3), axis=2)
            factor = _e8m0(tl.load(s_rows + g[None, :], mask=wmask, other=127).to(tl.int32))
            acc += (part * 16384.0) * factor
        out = tl.sum(acc, axis=1)
        tl.store(o_ptr + row.to(tl.int64) * N + cols, out.to(o_ptr.dtype.element_ty), mask=cmask)


MXFP4_PTX_DECODE = True  # the f16-pair decode where it can run (off: the portable decode, for side-by-side runs)


def _ptx_decode(device: torch.device) -> bool:
    # the f16-pair decode is NVIDIA PTX: not for ROCm, not for the interpreter (CPU debugging)
    return (MXFP4_PTX_DECODE and device.type == "cuda" and torch.version.hip is None
            and os.environ.get("TRITON_INTERPRET") != "1")


def _mxfp4_gemv_fwd(xs, packed, scale, group_ends):
    xs, packed, scale, ends, out = _mxfp4_matmul_operands(xs, packed, scale, group_ends)
    (num_rows, n), (num_experts, _, kh) = out.shape, packed.shape
    if num_rows == 0 or n == 0:
        return out
    # K/2 bytes per row, a multiple of 16: whole little-endian words (a view, unless the bytes start off a word)
    words = (packed if packed.storage_offset() % 4 == 0 else packed.clone()).view(torch.int32)

    def grid(meta):
        return (num_rows, triton.cdiv(n, meta["BLOCK_N"]))

    with torch.cuda.device(xs.device):  # Triton launches on the current device
        _mxfp4_gemv_kernel[grid](xs, words, scale, out, ends, n, kh // 4, num_experts,
                                 E_PAD=triton.next_power_of_2(num_experts), PTX_DECODE=_ptx_decode(xs.device))
    return out


def mxfp4_gemv(xs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               group_ends: torch.Tensor) -> torch.Tensor:
    """`mxfp4_grouped_matmul` (same arguments, same numbers: f32 accumulation, one rounding to xs.dtype) as a GEMV
    for one or two rows per expert: each routed row reads its expert's packed bytes once, with no 16-row tile.
    Rows past group_ends[-1] are left unwritten. Without autograd recording it runs as the custom op
    `torch.ops.kimik3.mxfp4_gemv` (one node under torch.compile); gradient for xs only."""
    if custom_ops.needs_grad(xs):
        return _MXFP4GroupedMatmul.apply(xs, packed, scale, group_ends, _mxfp4_gemv_fwd)
    return torch.ops.kimik3.mxfp4_gemv(xs, packed, scale, group_ends)  # one node under compile
