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
"""Block Attention Residuals in Triton (`ops_kimi_k3.block_attn_res_mix`, `attn_res_mix_norm`).

* `block_attn_res_mix`: the softmax depth-mixture; forward in Triton (one read pass for the scores, one for the mix,
  no stacked copy of the candidates), backward analytic in PyTorch (per candidate, f32). Without autograd recording
  it runs as the custom op `torch.ops.kimik3.block_attn_res_mix` (one node under torch.compile).
* `attn_res_mix_norm`: a layer's residual add, AttnRes mix and the RMSNorm after it in one pass per row (forward
  only, eager only, as FAST_OPS declares it; the mix is not stored). Its launch rule: one banked block + the prefix
  of rows up to 8192 wide (`_ATTN_RES_ON_CHIP_MAX`), else the add and the separate twins.
"""

from typing import List

import torch
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference

from ._base import custom_op, needs_grad, tl, triton, twin


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


@twin("block_attn_res_mix", needs=("triton",))
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
    # the custom op has no autograd formula: it runs while no gradient is recorded, the autograd Function otherwise
    if not needs_grad(norm_weight, proj_weight, *candidates):
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


@twin("attn_res_mix_norm", needs=("triton",))
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
        return _reference.attn_res_mix_norm(blocks, prefix, delta, res_norm_weight, res_proj_weight, res_eps,
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


@custom_op("block_attn_res_mix")
def _block_attn_res_mix_op(candidates: List[Tensor], norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    return _reference.block_attn_res_mix(list(candidates), norm_weight, proj_weight, eps).contiguous()


@_block_attn_res_mix_op.register_kernel("cuda")
def _(candidates, norm_weight, proj_weight, eps):
    cands = [c.contiguous() for c in candidates]
    return _attn_res_fwd(cands, norm_weight, proj_weight, eps, cands[-1].dtype).view(cands[-1].shape)


@_block_attn_res_mix_op.register_fake
def _(candidates, norm_weight, proj_weight, eps):
    last = candidates[-1]
    return torch.empty(last.shape, dtype=last.dtype, device=last.device)
