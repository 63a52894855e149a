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
"""RMSNorms in one Triton pass (forward only, eager: FAST_OPS declares them so; under torch.compile inductor fuses the
references itself): `rms_norm` (KimiRMSNorm) and `gated_rms_norm` (KDA's gated output norm, f32 throughout)."""

import torch

from ._base import as_rows, tl, triton, twin


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


@twin("rms_norm", needs=("triton",))
def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.rms_norm` for a weight of the input's dtype; forward only (FAST_OPS declares it
    so: while autograd records, and under torch.compile, which fuses the reference itself, the reference runs)."""
    d = hidden_states.shape[-1]
    if weight.shape != (d,) or weight.dtype != hidden_states.dtype:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} {weight.dtype} does not fit hidden states "
                         f"[..., {d}] {hidden_states.dtype}")
    x = as_rows(hidden_states, d)
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


@twin("gated_rms_norm", needs=("triton",))
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.gated_rms_norm` (all f32, one rounding to x's dtype) in one pass; forward only."""
    d = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (d,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                         f"{tuple(weight.shape)} do not fit (gate as x, weight [{d}])")
    x2, g2 = as_rows(x, d), as_rows(gate, d)
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
