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
"""Kimi Delta Attention's fast twins: the chunked prefill and the recurrent decode step through fla-core 0.6.0
(`pip install fla-core`, used as a dependency and imported when a twin is loaded), and the decay gate in Triton.

* `chunk_kda`, `fused_recurrent_kda`: same signature/contract as the references: q, k, g [B, T, H, K],
  v [B, T, H, V], beta [B, T, H] (post-sigmoid), g the log-space decay already computed (fla's
  `use_gate_in_kernel=False`), state [B, H, K, V] f32 -> (o in v.dtype, final state f32 or None). `chunk_kda`
  also takes the raw decay logits as `g` with `use_gate_in_kernel=True`, `A_log`, `dt_bias` and `lower_bound` (fla's
  fused gate + chunk cumsum; K3's bounded gate on fla's `safe_gate` path) where no gradient is recorded; under
  autograd the reference gate runs first and fla's chunked form takes the decay as before.
  `chunk_kda` has autograd (fla's). `fused_recurrent_kda` is forward-only (FAST_OPS declares it so: the model keeps
  the reference while a gradient is recorded) and runs as the custom op `torch.ops.kimik3.fused_recurrent_kda`, so
  torch.compile (the static-cache decode step) keeps it as one graph node. The reference's `chunk_size` is a memory
  knob of its own chunked loop; fla's kernels are tuned for 64-token chunks and always use them.
* `kda_gate`: K3's lower-bounded decay gate (f32) in one Triton pass over the bf16 logits (forward only).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference

from ._base import as_rows, custom_op, needs_grad, tl, triton, twin

_FLA_KDA = "fla.ops.kda"

# fla's chunk kernels keep their intermediates (the intra-chunk Aqk/Akk, the WY factors w/u, the per-chunk states
# and corrected values) in the operands' dtype: with bf16 operands each is rounded to bf16 (8 significant bits)
# between kernels, the error the bf16 fast path adds over the bf16 reference path (docs/design.md, bf16). A forward
# without autograd can hand fla other operands, holding the same bf16 values, and round the output once:
#   None           the operands' own dtype (bf16 intermediates)
#   torch.float16  11 significant bits at bf16's bytes and tensor-core rate; fp16's range is kept by powers of two
#                  (`_half_operands`); +3-5% on an 8K prefill (docs/benchmarks.md, fp32 and bf16 on CUDA against the references)
#   torch.float32  TF32 dots and f32 intermediates; +6.7%
KDA_CHUNK_OPERANDS = None

# fp16 operands: v and the initial state are scaled by one power of two (the output and the state are linear in
# them jointly, so it is undone exactly) to |v| <= 2^V_EXPONENT and |state| <= 2^STATE_EXPONENT. The delta rule over
# unit keys keeps a written key direction's value a convex mix of the v's (at most sqrt(V) * max|v| = 2^3.5 max|v|),
# so the chunk states and corrected values keep about 2^6 of headroom below fp16's 2^16, while values 2^-20 of the
# largest still have fp16's full precision
V_EXPONENT = 6
STATE_EXPONENT = 10


def _state(initial_state):
    if initial_state is None:
        return None
    return initial_state.float().contiguous()


@twin("chunk_kda", needs=(_FLA_KDA,))
def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    chunk_size=None,  # the reference's memory knob, passed by the model to either twin; fla always chunks by 64
    use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
):
    from fla.ops.kda import chunk_kda as _fla_chunk_kda

    out_dtype = v.dtype
    gate = {}
    training = needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state)
    if use_gate_in_kernel and training:
        # training: the decay from the reference gate (its autograd), then fla's chunked form on it, the path the
        # GPU backward tests hold; fla's fused gate backward is not used
        g = _reference.kda_gate(g, A_log, dt_bias, lower_bound)
    elif use_gate_in_kernel:
        # fla's gate kernel reads A_log[h] for the heads present, so the release's zero-padded [128] A_log is passed
        # as its first H entries. K3's lower-bounded gate (-5 <= lb < 0) runs fla's safe_gate path: the decay bound
        # keeps the diagonal tiles' exponentials in f32 range, so they go through tensor-core dots
        # (docs/architecture.md, Chunked KDA; the official code's setting)
        gate = dict(use_gate_in_kernel=True, A_log=A_log[: g.shape[-2]], dt_bias=dt_bias, lower_bound=lower_bound,
                    safe_gate=lower_bound is not None and -5 <= lower_bound < 0)
    operands = KDA_CHUNK_OPERANDS
    state, inverse = _state(initial_state), None
    if operands is None or training or v.dtype in (operands, torch.float32):
        pass  # fla on the operands as they come (f32 stays f32: the TF32 switch decides its dots)
    elif operands == torch.float32:
        q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    elif operands == torch.float16:
        q, k, v, state, inverse = _half_operands(q, k, v, state, use_qk_l2norm_in_kernel)
    else:
        raise ValueError(f"kernels.kda.KDA_CHUNK_OPERANDS = {operands!r}: None, torch.float16 or torch.float32")
    o, final = _fla_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=64, **gate,
    )
    if inverse is None:
        return o.to(out_dtype), (final if output_final_state else None)
    return _scaled(o, inverse, out_dtype), (final.mul_(inverse) if output_final_state else None)


def _power_of_two(x: Tensor, exponent: int, at_most_one: bool = False) -> Tensor:
    """2^e (f32, shape [1]) with max|x| * 2^e <= 2^exponent, e within [-100, 100] (all zeros: 2^exponent); with
    `at_most_one`, never above 1. Non-finite values keep their kind: inf * 2^e is inf, NaN stays NaN."""
    low, high = torch.aminmax(x)
    # frexp: max|x| = m * 2^p with 0.5 <= m < 1, so max|x| < 2^p
    _, power = torch.frexp(torch.maximum(high, -low).float().reshape(1))
    e = (exponent - power).clamp(-100, 0 if at_most_one else 100)
    return torch.ldexp(torch.ones(1, device=x.device), e)


def _scaled(x: Tensor, factor: Tensor, dtype: torch.dtype) -> Tensor:
    # x * factor computed in f32 (a 1-element f32 factor promotes the product; 16-bit values times a power of two
    # are exact) and written once in dtype
    return torch.mul(x, factor, out=torch.empty(x.shape, dtype=dtype, device=x.device))


def _half_operands(q, k, v, state, qk_normalized_in_kernel):
    """fla's fp16 operands for bf16 q, k, v and the f32 initial state; returns (q, k, v, state, inverse), where the
    output and the final state times `inverse` are the unscaled ones. bf16 values are exact in fp16 within its range,
    which powers of two keep them in:
    * v and the state share one factor (`V_EXPONENT`, `STATE_EXPONENT`): up or down, exact either way;
    * q and k: the model's are unit vectors (the conv's L2 norm), which fp16 holds as they are; normalized in the
      kernel (raw projections) each is scaled down only, by its own power of two, where it reaches 2^14 (the
      normalization is invariant to it up to its eps, 2^-28 of such a norm)."""
    factor = _power_of_two(v, V_EXPONENT)
    if state is not None:
        factor = torch.minimum(factor, _power_of_two(state, STATE_EXPONENT))
        state = state * factor
    if qk_normalized_in_kernel:
        q, k = (_scaled(x, _power_of_two(x, 14, at_most_one=True), torch.float16) for x in (q, k))
    else:
        q, k = q.to(torch.float16), k.to(torch.float16)
    return q, k, _scaled(v, factor, torch.float16), state, factor.reciprocal()


@twin("fused_recurrent_kda", needs=(_FLA_KDA,))
def fused_recurrent_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
):
    o, final = torch.ops.kimik3.fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                   use_qk_l2norm_in_kernel)
    return o, (final if output_final_state else None)


@custom_op("fused_recurrent_kda")
def _fused_recurrent_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                            initial_state: Optional[Tensor], output_final_state: bool,
                            use_qk_l2norm_in_kernel: bool) -> Tuple[Tensor, Tensor]:
    """(o, final state); without output_final_state the state is an empty f32 tensor (a schema has no None)."""
    o, final = _reference.fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                                              use_qk_l2norm_in_kernel)
    return o.contiguous(), _state_out(final, initial_state, q)


@_fused_recurrent_kda_op.register_kernel("cuda")
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    from fla.ops.kda import fused_recurrent_kda as _fla_fused_recurrent_kda

    o, final = _fla_fused_recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=_state(initial_state),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o.to(v.dtype).contiguous(), _state_out(final if output_final_state else None, initial_state, q)


def _state_out(final, initial_state, like):
    if final is None:
        return like.new_empty(0, dtype=torch.float32)
    # an op's output may not be one of its inputs (a zero-step call hands the initial state back)
    return final.clone() if final is initial_state else final.contiguous()


@_fused_recurrent_kda_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if not output_final_state:
        return o, q.new_empty(0, dtype=torch.float32)
    batch, _, heads, k_dim = k.shape
    return o, q.new_empty(batch, heads, k_dim, v.shape[-1], dtype=torch.float32)


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


@twin("kda_gate", needs=("triton",))
def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.kda_gate`; the lower-bounded (K3) form in one Triton pass, the softplus (Kimi
    Linear) form through the reference. exp(A_log) per head is computed by torch, as the reference does."""
    if lower_bound is None:
        return _reference.kda_gate(z, A_log, dt_bias, lower_bound)
    num_heads, head_dim = z.shape[-2], z.shape[-1]
    channels = num_heads * head_dim
    if dt_bias.numel() != channels or A_log.numel() < num_heads:
        raise ValueError(f"kda_gate: logits [..., {num_heads}, {head_dim}] need dt_bias [{channels}] and A_log "
                         f"[>= {num_heads}], got {tuple(dt_bias.shape)} and {tuple(A_log.shape)}")
    z2 = as_rows(z, channels)
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
