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
"""Pure-PyTorch references for the fast ops whose reference is not in `ops_kimi_k3`.

Same names and semantics as the fast paths that `kimik3.kernels.get_fast_op` returns (`moe_experts`, `mla_decode`,
`mxfp4_dequant`). They run on any device and are slow on purpose: they are the ground truth the GPU tests compare
against and the fallback the model uses without CUDA. The other references (`chunk_kda`, `fused_recurrent_kda`,
`causal_conv1d`, `block_attn_res_mix`, `situ_glu`, `dequantize_mxfp4`, `kda_gate`) live in
`modeling_kimik3/ops_kimi_k3.py`; this file does not import them so `kimik3.kernels` has no dependency on the
remote-code files.
"""

import torch


__all__ = ["situ_glu", "moe_experts", "moe_experts_mxfp4", "mla_decode", "mxfp4_dequant"]

DEFAULT_ROPE_DIM = 64  # qk_rope_head_dim of K3 (the P in an R+P latent row when kv_lora_rank is not given)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU, identical to `ops_kimi_k3.situ_glu`: [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(u/b2)] in f32, cast back.

    `beta` None means 1.0; `linear_beta` None leaves the up branch uncapped.
    """
    a, u = gate.float(), up.float()
    b1 = 1.0 if beta is None else float(beta)
    act = b1 * torch.tanh(a / b1) * torch.sigmoid(a)
    if linear_beta is not None:
        u = float(linear_beta) * torch.tanh(u / float(linear_beta))
    return (act * u).to(gate.dtype)


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
    Loops over the experts that are hit (host sync; reference only).
    """
    num_tokens, width = x.shape
    inter = down_proj.shape[-1]
    out = torch.zeros(num_tokens, width, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_indices).tolist():
        token, slot = torch.nonzero(topk_indices == expert, as_tuple=True)
        h = x[token] @ gate_up_proj[expert].to(x.dtype).t()
        act = situ_glu(h[:, :inter], h[:, inter:], beta, linear_beta)
        y = act @ down_proj[expert].to(x.dtype).t()  # rounded to x.dtype: the "bf16 expert output"
        out.index_add_(0, token, y.float() * topk_weights[token, slot].float().unsqueeze(-1))
    return out.to(x.dtype)


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


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 -> dense, same semantics as `ops_kimi_k3.dequantize_mxfp4`.

    packed uint8 [..., N, K/2] (low nibble = even element), scale uint8 [..., N, K/32] (E8M0, bias 127)
    -> [..., N, K] in `dtype`; value = E2M1(code) * 2^(scale - 127), computed in f32 (exact), then cast.
    """
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * 32 != k:
        raise ValueError(f"MXFP4 shapes do not match: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    table = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], k)
    factor = torch.exp2(scale.float() - 127.0).repeat_interleave(32, dim=-1)
    return (table[codes.long()] * factor).to(dtype)


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
