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
"""`attention_with_lse` through PyTorch's flash-attention op, which also returns the log-sum-exp.

Used by the blockwise MLA prefill over a long cache (same contract as `ops_kimi_k3.attention_with_lse`). Flash
needs equal q/k/v head dims, so V (128) is zero-padded to the q/k dim (192) and the output cropped: the padded
columns only add zeros. Inference only (the LSE output has no gradient).
"""

import torch
import torch.nn.functional as F


def _flash_op(device_type: str):
    if device_type == "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attention_with_lse(query, key, value, scale: float, causal: bool):
    v_dim, qk_dim = value.shape[-1], query.shape[-1]
    if v_dim < qk_dim:
        value = F.pad(value, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        raise ValueError(f"attention_with_lse: value dim {v_dim} larger than the query/key dim {qk_dim}")
    result = _flash_op(query.device.type)(query, key, value.to(query.dtype), 0.0, causal, scale=scale)
    out, lse = result[0], result[1]
    return out[..., :v_dim].float(), lse.float().reshape(query.shape[:-1])
