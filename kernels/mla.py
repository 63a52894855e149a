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
"""MLA attention's fast twins: the absorbed decode attention over the latent cache (`mla_decode`) and the blockwise
prefill's attention with its log-sum-exp (`attention_with_lse`).

`mla_decode`: the reference's two batched GEMMs on cuBLAS with its scale / mask / f32 softmax / rounding in two
Triton kernels between them (per key block: max and exp-sum; then every block normalised), as one custom op
(`torch.ops.kimik3.mla_decode`). All H heads (times S query rows) of a sequence form the M dimension of one GEMM
against the shared latent cache (MQA). The reference rounds where this does: scores in the cache dtype, times the
scale (rounded again), masked with the dtype's lowest value, softmax in f32, probabilities rounded to the cache
dtype, PV accumulated by cuBLAS. Eager, it replaces the reference's five elementwise passes over the scores; in a
compiled static-cache step it is one graph node and costs the same GPU time as inductor's fusion of the reference
(docs/benchmarks.md, MLA decode op and static buffers). Forward only (FAST_OPS declares it so).

`attention_with_lse`: PyTorch's fused attention ops that also return the log-sum-exp, for the blockwise MLA prefill
over a long cache (same contract as `ops_kimi_k3.attention_with_lse`). cuDNN's fused attention first: it takes MLA's
unequal head dims (q/k 192, v 128) as they are and runs at 600-620 TFLOP/s on an H200, against 250-280 for the flash
op (`benchmarks/bench_k3.py --only kernels_attention`, docs/benchmarks.md). Where cuDNN refuses (an older cuDNN,
another GPU, a dtype), the flash op, which needs equal head dims: V (128) is zero-padded to the q/k dim (192) and the
output cropped (the padded columns only add zeros). Inference only (the LSE output has no gradient).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference

from ._base import custom_op, tl, triton, twin


# --------------------------------------------------------------------------------------------------------------
# Absorbed MLA decode attention (cuBLAS + the Triton softmax between its GEMMs)


@twin("mla_decode", needs=("triton",))
def mla_decode(
    q_lat: torch.Tensor,
    latent_cache: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """Same contract as `ops_kimi_k3.mla_decode`: q_lat [B, H, S, R+P], latent_cache [B, T, R+P], attention_mask bool
    [B, 1 or H, S, T] or None -> (o_lat [B, H, S, R] in q_lat's dtype, None: the probabilities are not kept)."""
    o_lat = torch.ops.kimik3.mla_decode(q_lat, latent_cache, float(scale), int(kv_lora_rank), attention_mask)
    return o_lat, None


@custom_op("mla_decode")
def _mla_decode_op(q_lat: Tensor, latent_cache: Tensor, scale: float, kv_lora_rank: int,
                   attention_mask: Optional[Tensor]) -> Tensor:
    return _reference.mla_decode(q_lat, latent_cache, scale, kv_lora_rank, attention_mask)[0].contiguous()


@_mla_decode_op.register_kernel("cuda")
def _(q_lat, latent_cache, scale, kv_lora_rank, attention_mask):
    return mla_decode_cuda(q_lat, latent_cache, scale, kv_lora_rank, attention_mask)


def mla_decode_cuda(q_lat, latent_cache, scale, kv_lora_rank, attention_mask):
    """The op's CUDA implementation: bmm, the fused softmax kernel, bmm on the strided first R latent columns."""
    batch, heads, s_len, width = q_lat.shape
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[0] != batch
                                       or attention_mask.shape[1] not in (1, heads)
                                       or attention_mask.shape[2:] != (s_len, latent_cache.shape[1])):
        raise ValueError(f"mla_decode: attention mask {tuple(attention_mask.shape)} does not broadcast to "
                         f"[{batch}, {heads}, {s_len}, {latent_cache.shape[1]}]")
    cache = latent_cache if latent_cache.dtype == q_lat.dtype else latent_cache.to(q_lat.dtype)
    scores = torch.bmm(q_lat.reshape(batch, heads * s_len, width), cache.transpose(1, 2))  # [B, H*S, T]
    probs = mla_softmax(scores, scale, attention_mask, heads, s_len)
    out = torch.bmm(probs, cache[:, :, :kv_lora_rank])
    return out.view(batch, heads, s_len, kv_lora_rank)


@_mla_decode_op.register_fake
def _(q_lat, latent_cache, scale, kv_lora_rank, attention_mask):
    return torch.empty(*q_lat.shape[:-1], kv_lora_rank, dtype=q_lat.dtype, device=q_lat.device)


# The reference's scale, mask, f32 softmax and rounding between the two GEMMs, in two kernels


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
# Attention with its log-sum-exp (the blockwise prefill over a long cache)

# (device, dtype, q/k dim, v dim) where cuDNN refused once: the flash op from then on, without asking again
_CUDNN_REFUSED: set = set()


def _flash_op(device_type: str):
    if device_type == "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _cudnn(query, key, value, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, causal, False, scale=scale)[:2]
    return out.float(), lse.float().reshape(query.shape[:-1])


def _flash(query, key, value, scale, causal):
    v_dim, qk_dim = value.shape[-1], query.shape[-1]
    if v_dim < qk_dim:
        value = F.pad(value, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        raise ValueError(f"attention_with_lse: value dim {v_dim} larger than the query/key dim {qk_dim}")
    result = _flash_op(query.device.type)(query, key, value, 0.0, causal, scale=scale)
    out, lse = result[0], result[1]
    return out[..., :v_dim].float(), lse.float().reshape(query.shape[:-1])


def _cudnn_case(query, value) -> tuple:
    return query.device, query.dtype, query.shape[-1], value.shape[-1]


def attention_backend(query, value) -> str:
    """"cudnn" or "flash": the op `attention_with_lse` runs for tensors like these."""
    if query.device.type != "cuda":
        return "flash"
    return "flash" if _cudnn_case(query, value) in _CUDNN_REFUSED else "cudnn"


@twin("attention_with_lse")
def attention_with_lse(query, key, value, scale: float, causal: bool):
    value = value.to(query.dtype)
    if attention_backend(query, value) == "cudnn":
        try:
            return _cudnn(query, key, value, scale, causal)
        except torch.cuda.OutOfMemoryError:  # a resource limit, not a refusal: the caller sees it
            raise
        except RuntimeError:  # not supported for these inputs here: remembered, then flash
            _CUDNN_REFUSED.add(_cudnn_case(query, value))
    return _flash(query, key, value, scale, causal)
