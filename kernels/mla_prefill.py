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
"""`attention_with_lse` through PyTorch's fused attention ops that also return the log-sum-exp.

Used by the blockwise MLA prefill over a long cache (same contract as `ops_kimi_k3.attention_with_lse`). cuDNN's
fused attention first: it takes MLA's unequal head dims (q/k 192, v 128) as they are and runs at 600-620 TFLOP/s on
an H200, against 250-280 for the flash op (`benchmarks/bench_k3.py --only kernels_attention`,
docs/benchmarks.md). Where cuDNN refuses (an older cuDNN, another GPU, a dtype), the flash op, which needs equal
head dims: V (128) is zero-padded to the q/k dim (192) and the output cropped (the padded columns only add zeros).
Inference only (the LSE output has no gradient).
"""

import torch
import torch.nn.functional as F

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
