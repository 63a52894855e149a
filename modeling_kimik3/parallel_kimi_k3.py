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
"""Tensor-parallel pieces K3 needs beyond transformers' built-in styles (5.17 through 5.24+).

KDA keeps per-head parameters that no forward of their own reads: `A_log` [H], `dt_bias` [H*D] and the depthwise
short-conv weights [H*D, 1, K] (the attention passes `conv.weight` to the conv op). transformers' `colwise` style
shards a 3-D weight on dim 1, so these get their own parameter style, `kimi_k3_heads`: Shard(0) on the TP mesh,
heads being the leading axis of every one of them. The attention reads this rank's slice through `local_shard`.
The style enters transformers' registry when a load asks for tensor parallelism (`check_release_load` calls
`register_head_shard_style`), not when this file is imported.
"""

import torch
from torch import nn


HEAD_SHARD_STYLE = "kimi_k3_heads"


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a tensor-parallel parameter (a DTensor); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def register_head_shard_style() -> None:
    """Adds `kimi_k3_heads` to transformers' parallel styles; a second call finds it there and does nothing."""
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
    except ImportError:  # torch without distributed, or a transformers without DTensor tensor parallel
        return
    if HEAD_SHARD_STYLE in ALL_PARALLEL_STYLES:
        return

    class KimiK3HeadShard(TensorParallelLayer):
        """A parameter whose leading axis is heads (or head-major channels): Shard(0) on the TP mesh."""

        def shard_param(self, module: nn.Module, param: str, mesh) -> None:
            meta = module._parameters.get(param)
            if meta is None:
                return
            module._parameters[param] = nn.Parameter(
                distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None), requires_grad=meta.requires_grad
            )

    ALL_PARALLEL_STYLES.register(HEAD_SHARD_STYLE, KimiK3HeadShard())
