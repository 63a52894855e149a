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
"""The fast twins that launch their own kernels, as `torch.library` custom ops (`torch.ops.kimik3.*`).

torch.compile cannot look inside a Triton launch wrapped in Python (or inside fla), so each such forward is one
custom op with a fake implementation (output shapes, dtypes and strides from the inputs alone): a compiled graph
keeps it as one node, with no graph break, and a CUDA graph (static-cache decode, mode "reduce-overhead") captures
its launches. Registered at import on any machine: nothing here imports Triton or fla or touches CUDA; the CUDA
implementations import them when first called. On every other device an op runs the pure-PyTorch reference, so the
ops can be checked (`torch.library.opcheck`) on a CPU machine.

The ops are forward-only (no autograd formula): the twins in triton_ops / fla_ops call them when no gradient is
recorded and keep their autograd paths otherwise; `FAST_OPS` declares them `traceable_forward`. None of them mutates
an input: the recurrent and conv states come back as new tensors, which the cache copies in (`mutates_args=()`).
Every output is contiguous, on both the real and the fake side.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference

__all__ = ["OPS", "needs_grad"]


def needs_grad(*tensors) -> bool:
    """Whether autograd records through any of these tensors (None entries skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------------------------------------------
# SiTU-GLU


@torch.library.custom_op("kimik3::situ_glu", mutates_args=())
def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: Optional[float]) -> Tensor:
    return _reference.situ_glu(gate, up, beta, linear_beta).contiguous()


@situ_glu.register_kernel("cuda")
def _situ_glu_cuda(gate, up, beta, linear_beta):
    from . import triton_ops

    n = gate.shape[-1]
    out = triton_ops._situ_fwd(triton_ops._rows(gate, n), triton_ops._rows(up, n), beta, linear_beta, gate.dtype)
    return out.view(gate.shape)


@situ_glu.register_fake
def _(gate, up, beta, linear_beta):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


# --------------------------------------------------------------------------------------------------------------
# Block AttnRes mix


@torch.library.custom_op("kimik3::block_attn_res_mix", mutates_args=())
def block_attn_res_mix(candidates: List[Tensor], norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    return _reference.block_attn_res_mix(list(candidates), norm_weight, proj_weight, eps).contiguous()


@block_attn_res_mix.register_kernel("cuda")
def _block_attn_res_mix_cuda(candidates, norm_weight, proj_weight, eps):
    from . import triton_ops

    cands = [c.contiguous() for c in candidates]
    return triton_ops._attn_res_fwd(cands, norm_weight, proj_weight, eps, cands[-1].dtype).view(cands[-1].shape)


@block_attn_res_mix.register_fake
def _(candidates, norm_weight, proj_weight, eps):
    last = candidates[-1]
    return torch.empty(last.shape, dtype=last.dtype, device=last.device)


# --------------------------------------------------------------------------------------------------------------
# KDA decode step and the short conv (fla)


@torch.library.custom_op("kimik3::fused_recurrent_kda", mutates_args=())
def fused_recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                        initial_state: Optional[Tensor], output_final_state: bool,
                        use_qk_l2norm_in_kernel: bool) -> Tuple[Tensor, Tensor]:
    """(o, final state); without output_final_state the state is an empty f32 tensor (a schema has no None)."""
    o, final = _reference.fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                                              use_qk_l2norm_in_kernel)
    return o.contiguous(), _state_out(final, initial_state, q)


@fused_recurrent_kda.register_kernel("cuda")
def _fused_recurrent_kda_cuda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    from . import fla_ops

    o, final = fla_ops._fla_fused_recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=fla_ops._state(initial_state),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o.to(v.dtype).contiguous(), _state_out(final if output_final_state else None, initial_state, q)


def _state_out(final, initial_state, like):
    if final is None:
        return like.new_empty(0, dtype=torch.float32)
    # an op's output may not be one of its inputs (a zero-step call hands the initial state back)
    return final.clone() if final is initial_state else final.contiguous()


@fused_recurrent_kda.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if not output_final_state:
        return o, q.new_empty(0, dtype=torch.float32)
    batch, _, heads, k_dim = k.shape
    return o, q.new_empty(batch, heads, k_dim, v.shape[-1], dtype=torch.float32)


@torch.library.custom_op("kimik3::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Optional[Tensor], l2norm_head_dim: int = 0
                  ) -> Tuple[Tensor, Tensor]:
    y, state = _reference.causal_conv1d(x, weight, conv_state, l2norm_head_dim)
    return y.contiguous(), state.clone() if state is conv_state else state.contiguous()


@causal_conv1d.register_kernel("cuda")
def _causal_conv1d_cuda(x, weight, conv_state, l2norm_head_dim=0):
    from . import triton_ops

    if conv_state is not None and x.shape[1] <= triton_ops.CONV_STEP_MAX_TOKENS:
        y, state = triton_ops.causal_conv1d_step(x, weight, conv_state)  # decode: one launch, outputs contiguous
        return _reference.l2norm_heads(y, l2norm_head_dim), state
    return triton_ops.causal_conv1d_prefill(x, weight, conv_state, l2norm_head_dim=l2norm_head_dim)


@causal_conv1d.register_fake
def _(x, weight, conv_state, l2norm_head_dim=0):
    batch, _, channels = x.shape
    state = torch.empty(batch, channels, weight.shape[-1] - 1, dtype=x.dtype, device=x.device)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), state


# --------------------------------------------------------------------------------------------------------------
# Expert-grouped matmuls for few rows per expert (decode)


def _grouped_matmul_reference(xs, weight, group_ends):
    """Each group of rows times its expert transposed, f32 accumulation, rounded to xs.dtype (the Triton kernels'
    numbers); rows past group_ends[-1] are zero."""
    out = torch.zeros(xs.shape[0], weight.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            out[start:end] = (xs[start:end].float() @ weight[expert].float().t()).to(xs.dtype)
        start = end
    return out


@torch.library.custom_op("kimik3::grouped_matmul_few_rows", mutates_args=())
def grouped_matmul_few_rows(xs: Tensor, weight: Tensor, group_ends: Tensor) -> Tensor:
    """xs [M, K] grouped by expert, weight [E, N, K] -> [M, N], as `grouped_mm(xs, weight.mT, offs=group_ends)`."""
    return _grouped_matmul_reference(xs, weight, group_ends)


@grouped_matmul_few_rows.register_kernel("cuda")
def _grouped_matmul_few_rows_cuda(xs, weight, group_ends):
    from . import triton_ops

    return triton_ops.grouped_matmul_few_rows(xs, weight, group_ends)


@grouped_matmul_few_rows.register_fake
def _(xs, weight, group_ends):
    return torch.empty(xs.shape[0], weight.shape[1], dtype=xs.dtype, device=xs.device)


# --------------------------------------------------------------------------------------------------------------
# Packed MXFP4 experts


@torch.library.custom_op("kimik3::mxfp4_dequant", mutates_args=())
def mxfp4_dequant(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return _reference.dequantize_mxfp4(packed, scale, dtype).contiguous()


@mxfp4_dequant.register_kernel("cuda")
def _mxfp4_dequant_cuda(packed, scale, dtype):
    from . import triton_ops

    return triton_ops._mxfp4_dequant_launch(packed, scale, dtype)


@mxfp4_dequant.register_fake
def _(packed, scale, dtype):
    return torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=dtype, device=packed.device)


def _mxfp4_grouped_matmul_reference(xs, packed, scale, group_ends):
    """Each group times its dequantised expert, f32 accumulation (the numbers of both packed Triton kernels)."""
    return _grouped_matmul_reference(xs, _reference.dequantize_mxfp4(packed, scale, torch.float32), group_ends)


def _mxfp4_grouped_matmul_fake(xs, packed, scale, group_ends):
    return torch.empty(xs.shape[0], packed.shape[1], dtype=xs.dtype, device=xs.device)


@torch.library.custom_op("kimik3::mxfp4_grouped_matmul", mutates_args=())
def mxfp4_grouped_matmul(xs: Tensor, packed: Tensor, scale: Tensor, group_ends: Tensor) -> Tensor:
    """xs [M, K] grouped by expert, packed [E, N, K/2], scale [E, N, K/32] -> [M, N]; CUDA: the tile kernel."""
    return _mxfp4_grouped_matmul_reference(xs, packed, scale, group_ends)


@mxfp4_grouped_matmul.register_kernel("cuda")
def _mxfp4_grouped_matmul_cuda(xs, packed, scale, group_ends):
    from . import triton_ops

    return triton_ops._mxfp4_grouped_matmul_fwd(xs, packed, scale, group_ends)


mxfp4_grouped_matmul.register_fake(_mxfp4_grouped_matmul_fake)


@torch.library.custom_op("kimik3::mxfp4_gemv", mutates_args=())
def mxfp4_gemv(xs: Tensor, packed: Tensor, scale: Tensor, group_ends: Tensor) -> Tensor:
    """`mxfp4_grouped_matmul` for one or two rows per expert; CUDA: the GEMV kernel (one program per routed row)."""
    return _mxfp4_grouped_matmul_reference(xs, packed, scale, group_ends)


@mxfp4_gemv.register_kernel("cuda")
def _mxfp4_gemv_cuda(xs, packed, scale, group_ends):
    from . import triton_ops

    return triton_ops._mxfp4_gemv_fwd(xs, packed, scale, group_ends)


mxfp4_gemv.register_fake(_mxfp4_grouped_matmul_fake)


# --------------------------------------------------------------------------------------------------------------
# Absorbed MLA decode attention (cuBLAS + the Triton softmax between its GEMMs)


@torch.library.custom_op("kimik3::mla_decode", mutates_args=())
def mla_decode(q_lat: Tensor, latent_cache: Tensor, scale: float, kv_lora_rank: int,
               attention_mask: Optional[Tensor]) -> Tensor:
    return _reference.mla_decode(q_lat, latent_cache, scale, kv_lora_rank, attention_mask)[0].contiguous()


@mla_decode.register_kernel("cuda")
def _mla_decode_cuda(q_lat, latent_cache, scale, kv_lora_rank, attention_mask):
    from . import mla

    return mla.mla_decode_cuda(q_lat, latent_cache, scale, kv_lora_rank, attention_mask)


@mla_decode.register_fake
def _(q_lat, latent_cache, scale, kv_lora_rank, attention_mask):
    return torch.empty(*q_lat.shape[:-1], kv_lora_rank, dtype=q_lat.dtype, device=q_lat.device)


OPS = {
    "situ_glu": situ_glu,
    "block_attn_res_mix": block_attn_res_mix,
    "fused_recurrent_kda": fused_recurrent_kda,
    "causal_conv1d": causal_conv1d,
    "grouped_matmul_few_rows": grouped_matmul_few_rows,
    "mxfp4_dequant": mxfp4_dequant,
    "mxfp4_grouped_matmul": mxfp4_grouped_matmul,
    "mxfp4_gemv": mxfp4_gemv,
    "mla_decode": mla_decode,
}
