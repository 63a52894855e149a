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
"""Absorbed MLA decode attention as two well-shaped batched GEMMs (no SDPA, so no math-path fallback).

All H heads (times S query rows) of a sequence form the M dimension of one GEMM against the shared latent cache
(MQA), so the cache is read by two cuBLAS bmm calls: scores in f32 (bf16 products, f32 accumulate and output), f32
softmax, probabilities in the cache dtype (as flash attention does), PV in f32 accumulation.
"""

import torch


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    try:
        return torch.bmm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):  # older torch: no out_dtype overload
        return torch.bmm(a.float(), b.float())


def mla_decode(
    q_lat: torch.Tensor, latent_cache: torch.Tensor, scale: float, kv_lora_rank: int, attention_mask: None = None
) -> tuple[torch.Tensor, None]:
    """Same contract as `ops_kimi_k3.mla_decode` without a mask (with one, the model calls the reference):
    q_lat [B, H, S, R+P], latent_cache [B, T, R+P] -> (o_lat [B, H, S, R] in q_lat's dtype, None: the probabilities
    are not kept)."""
    if attention_mask is not None:
        raise ValueError("the fast mla_decode takes no attention mask; masked decode runs ops_kimi_k3.mla_decode")
    batch, heads, s_len, dim = q_lat.shape
    cache = latent_cache if latent_cache.dtype == q_lat.dtype else latent_cache.to(q_lat.dtype)
    q = q_lat.reshape(batch, heads * s_len, dim)
    scores = _bmm_f32(q, cache.transpose(1, 2))  # [B, H*S, T]
    scores.mul_(scale)
    probs = torch.softmax(scores, dim=-1).to(cache.dtype)
    out = torch.bmm(probs, cache[:, :, :kv_lora_rank])  # [B, H*S, R]
    return out.view(batch, heads, s_len, kv_lora_rank), None
