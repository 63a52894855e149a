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
"""SiTU-GLU, K3's gated activation (`ops_kimi_k3.situ_glu`): one Triton pass forward and one backward (an autograd
Function), and without autograd recording the custom op `torch.ops.kimik3.situ_glu` (one node under torch.compile).

Kernels avoid libdevice so they also run under `TRITON_INTERPRET=1` (fp32 inputs) for CPU debugging.
"""

from typing import Optional

import torch
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference

from ._base import as_rows, custom_op, needs_grad, tl, triton, twin


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
        a2, u2 = as_rows(gate, n), as_rows(up, n)
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
        g2 = as_rows(grad, n)
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


@twin("situ_glu", needs=("triton",))
def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """Fused SiTU-GLU, same contract as `ops_kimi_k3.situ_glu` (f32 math, result in gate's dtype); has autograd.

    `gate`/`up` may be strided views (e.g. the two halves of a fused gate_up projection)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    b1 = 1.0 if beta is None else float(beta)
    b2 = None if linear_beta is None else float(linear_beta)
    # the custom op has no autograd formula: it runs while no gradient is recorded, the autograd Function otherwise
    if needs_grad(gate, up):
        return _SituGLU.apply(gate, up, b1, b2)
    return torch.ops.kimik3.situ_glu(gate, up, b1, b2)  # one node under torch.compile


@custom_op("situ_glu")
def _situ_glu_op(gate: Tensor, up: Tensor, beta: float, linear_beta: Optional[float]) -> Tensor:
    return _reference.situ_glu(gate, up, beta, linear_beta).contiguous()


@_situ_glu_op.register_kernel("cuda")
def _(gate, up, beta, linear_beta):
    n = gate.shape[-1]
    return _situ_fwd(as_rows(gate, n), as_rows(up, n), beta, linear_beta, gate.dtype).view(gate.shape)


@_situ_glu_op.register_fake
def _(gate, up, beta, linear_beta):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
