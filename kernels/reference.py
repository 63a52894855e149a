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
"""Pure-PyTorch references of the fast ops, under the names and signatures `kimik3.kernels.get_fast_op` returns.

`moe_experts`, `moe_experts_mxfp4`, `situ_glu` and `mxfp4_dequant` are the model's own references
(`modeling_kimik3/ops_kimi_k3.py`) in the fast paths' signatures, so the GPU tests compare against exactly what the
model computes without CUDA; `mla_decode` is the absorbed decode attention as one function. Slow on purpose: they
are the ground truth of the GPU tests.
"""

import functools

import torch

from kimik3.modeling.ops_kimi_k3 import dequantize_mxfp4 as mxfp4_dequant
from kimik3.modeling.ops_kimi_k3 import moe_experts as _moe_experts
from kimik3.modeling.ops_kimi_k3 import situ_glu


__all__ = ["situ_glu", "moe_experts", "moe_experts_mxfp4", "mla_decode", "mxfp4_dequant"]

DEFAULT_ROPE_DIM = 64  # qk_rope_head_dim of K3 (the P in an R+P latent row when kv_lora_rank is not given)


def moe_experts(
    x: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    beta: float | None = None,
    linear_beta: float | None = None,
) -> torch.Tensor:
    """Routed experts over fused 3-D weights (reference semantics of K3's latent MoE, k3_math 6.4).

    x [N, Dl]; topk_indices [N, k] (int); topk_weights [N, k] (f32); gate_up_proj [E, 2I, Dl] (rows [0:I] gate/w1,
    [I:2I] up/w3); down_proj [E, Dl, I] (w2). For each token: y = sum_e w_e * f32(E_e(x)) with
    E_e(x) = down_e @ situ(gate_e x, up_e x) computed and rounded in x.dtype; the sum is f32, cast to x.dtype.
    The model's reference (`ops_kimi_k3.moe_experts`) with SiTU; loops over the experts that are hit.
    """
    return _moe_experts(
        x, topk_indices, topk_weights,
        lambda expert: (gate_up_proj[expert], down_proj[expert]),
        gate_up_proj.shape[0],
        functools.partial(situ_glu, beta=beta, linear_beta=linear_beta),
    )


def mla_decode(
    q_lat: torch.Tensor,
    latent_cache: torch.Tensor,
    scale: float,
    kv_lora_rank: int | None = None,
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode attention (MQA over the shared latent cache; k3_math / kernels_perf 5).

    q_lat [B, H, S, R+P]: q_nope absorbed through W_UK (R = kv_lora_rank dims) concatenated with q_pe (P dims).
    latent_cache [B, T, R+P]: normalised c_kv (R) concatenated with k_pe (P), one row per cached token.
    p = softmax(scale * q_lat . cache) over the T cached tokens (f32), o_lat = p @ cache[..., :R] -> [B, H, S, R]
    in q_lat's dtype. `kv_lora_rank` None means R = (R+P) - 64 (K3's and DeepSeek's 64 rope dims). Every one of the S query rows sees all cached rows (no causal mask: append the new tokens to the
    cache first; S is 1 for plain decode). `seq_lens` [B] (int) masks rows >= seq_lens[b] (static caches).
    """
    if kv_lora_rank is None:
        kv_lora_rank = q_lat.shape[-1] - DEFAULT_ROPE_DIM
    q = q_lat.float()
    cache = latent_cache.float()
    scores = torch.einsum("bhsd,btd->bhst", q, cache) * scale
    if seq_lens is not None:
        pos = torch.arange(cache.shape[1], device=cache.device)
        valid = pos.view(1, -1) < seq_lens.view(-1, 1).to(pos.device)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhst,btr->bhsr", probs, cache[..., :kv_lora_rank])
    return out.to(q_lat.dtype)


def moe_experts_mxfp4(
    x: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_packed: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_packed: torch.Tensor,
    down_scale: torch.Tensor,
    beta: float | None = None,
    linear_beta: float | None = None,
) -> torch.Tensor:
    """`moe_experts` over packed MXFP4 experts (weight-only): the experts are dequantised to x.dtype first.

    gate_up_packed u8 [E, 2I, Dl/2], gate_up_scale u8 [E, 2I, Dl/32], down_packed u8 [E, Dl, I/2],
    down_scale u8 [E, Dl, I/32]."""
    gate_up = mxfp4_dequant(gate_up_packed, gate_up_scale, x.dtype)
    down = mxfp4_dequant(down_packed, down_scale, x.dtype)
    return moe_experts(x, topk_indices, topk_weights, gate_up, down, beta, linear_beta)
