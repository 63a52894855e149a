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
"""Absorbed MLA decode attention: the reference's two batched GEMMs on cuBLAS with its scale / mask / f32 softmax /
rounding in two Triton kernels between them (per key block: max and exp-sum; then every block normalised), as one
custom op (`torch.ops.kimik3.mla_decode`).

All H heads (times S query rows) of a sequence form the M dimension of one GEMM against the shared latent cache
(MQA). The reference rounds where this does: scores in the cache dtype, times the scale (rounded again), masked with
the dtype's lowest value, softmax in f32, probabilities rounded to the cache dtype, PV accumulated by cuBLAS. Eager,
it replaces the reference's five elementwise passes over the scores; in a compiled static-cache step it is one graph
node and costs the same GPU time as inductor's fusion of the reference (docs/benchmarks.md, MLA decode op and static
buffers).
"""

import torch

from . import custom_ops


def mla_decode(
    q_lat: torch.Tensor,
    latent_cache: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """Same contract as `ops_kimi_k3.mla_decode`: q_lat [B, H, S, R+P], latent_cache [B, T, R+P], attention_mask bool
    [B, 1 or H, S, T] or None -> (o_lat [B, H, S, R] in q_lat's dtype, None: the probabilities are not kept).
    Forward only."""
    if custom_ops.needs_grad(q_lat, latent_cache):
        raise ValueError("the fast mla_decode has no backward; while autograd records the model runs the reference")
    o_lat = torch.ops.kimik3.mla_decode(q_lat, latent_cache, float(scale), int(kv_lora_rank), attention_mask)
    return o_lat, None


def mla_decode_cuda(q_lat, latent_cache, scale, kv_lora_rank, attention_mask):
    """The op's CUDA implementation: bmm, the fused softmax kernel, bmm on the strided first R latent columns."""
    batch, heads, s_len, width = q_lat.shape
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[0] != batch
                                       or attention_mask.shape[1] not in (1, heads)
                                       or attention_mask.shape[2:] != (s_len, latent_cache.shape[1])):
        raise ValueError(f"mla_decode: attention mask {tuple(attention_mask.shape)} does not broadcast to "
                         f"[{batch}, {heads}, {s_len}, {latent_cache.shape[1]}]")
    from . import triton_ops  # after the checks: a bad mask is named on any machine

    cache = latent_cache if latent_cache.dtype == q_lat.dtype else latent_cache.to(q_lat.dtype)
    scores = torch.bmm(q_lat.reshape(batch, heads * s_len, width), cache.transpose(1, 2))  # [B, H*S, T]
    probs = triton_ops.mla_softmax(scores, scale, attention_mask, heads, s_len)
    out = torch.bmm(probs, cache[:, :, :kv_lora_rank])
    return out.view(batch, heads, s_len, kv_lora_rank)
