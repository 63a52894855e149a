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

Packed MXFP4 experts (docs/design.md, Parallelism) are parameters without gradient, so transformers' own styles shard
them: `grouped_gemm` by expert, `packed_colwise` for gate_up (split along its output rows, its scale groups running
along the untouched input dim). down_proj is split along its input dim, the intermediate width, which is also the
dim its 32-value groups run along: `kimi_k3_mxfp4_rowwise` is `rowwise`'s Shard(-1) that first refuses, by name, a
tensor-parallel degree that would cut a group between two ranks.

The styles enter transformers' registry when a load asks for tensor or expert parallelism (`check_release_load`
calls `register_shard_styles`), not when this file is imported; after such a load, `compact_local_shards` leaves each
rank holding its share only.
"""

import torch
from torch import nn

from .experts_format_kimi_k3 import MXFP4


HEAD_SHARD_STYLE = "kimi_k3_heads"
# The from_pretrained options that ask transformers for tensor (or expert) parallelism.
PARALLEL_LOAD_KWARGS = ("tp_plan", "tp_size", "distributed_config", "device_mesh")
MXFP4_ROWWISE_STYLE = MXFP4.tp_styles["down_proj"]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a tensor-parallel parameter (a DTensor); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def gather_read_shards(read: torch.Tensor, like) -> torch.Tensor:
    """The whole 1-D checkpoint tensor of which `read` is this rank's slice as transformers' shard-on-read loader cut
    it for the parameter `like` (a DTensor): the loader slices the file's tensor by `like`'s placements over the
    file's own length, so from a tensor longer than the parameter (the release's zero-padded A_log) a rank reads its
    share of the file, not its heads (docs/design.md, Parallelism). One exchange of the shares' lengths and one
    all-gather of the shares, over `like`'s mesh: a collective, which every rank of the mesh reaches for every such
    tensor, as every rank converts the same tensors in the same order."""
    from torch.distributed.tensor import DTensor

    mesh, placements = like.device_mesh, like.placements
    lengths = DTensor.from_local(torch.tensor([read.shape[0]], device=read.device), mesh, placements,
                                 run_check=False).full_tensor()
    whole = DTensor.from_local(read.contiguous(), mesh, placements, run_check=False,
                               shape=torch.Size([int(lengths.sum())]), stride=(1,))
    return whole.full_tensor()


def local_part(whole: torch.Tensor, like) -> torch.Tensor:
    """This rank's part of `whole` (the full value of the DTensor parameter `like`), as `like` places it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(whole.shape, like.device_mesh, like.placements)
    return whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


def compact_local_shards(model: nn.Module) -> int:
    """Gives every sharded parameter whose local slice is a view into a larger tensor (transformers' loader slices a
    whole checkpoint tensor read on the host, so a CPU rank kept every expert of the tensor behind its share) a
    storage of its own; a parameter shared by several modules stays shared. Returns the bytes released."""
    from torch.distributed.tensor import DTensor

    replaced, released = {}, 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            if id(param) not in replaced:
                share = param.to_local()
                extra = share.untyped_storage().nbytes() - share.numel() * share.element_size()
                if extra <= 0:
                    replaced[id(param)] = param
                    continue
                released += extra
                compact = DTensor.from_local(share.clone(), param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())
                replaced[id(param)] = nn.Parameter(compact, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]
    return released


def global_index(tensor: torch.Tensor, index: list[int]) -> list[int]:
    """The index into the whole tensor of `index` into this rank's slice of `tensor` (a DTensor on a 1-D mesh, split
    evenly: Shard, or transformers' _StridedShard of fused gate/up rows); any other tensor's index as it is."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return list(index)
    (placement,), mesh = placements, tensor.device_mesh
    dim = getattr(placement, "dim", None)
    if dim is None:  # replicated
        return list(index)
    dim %= tensor.dim()
    rank, size, full = mesh.get_local_rank(), mesh.size(), tensor.shape[dim]
    split = getattr(placement, "split_factor", 1)  # _StridedShard: `split` blocks, each split over the ranks
    chunk = full // split // size
    block, within = divmod(index[dim], chunk)
    return [block * (full // split) + rank * chunk + within if d == dim else i for d, i in enumerate(index)]


def check_whole_mxfp4_groups(module: nn.Module, param: str, tp_size: int, name: str | None = None) -> None:
    """Raises ValueError naming the tensor unless `tp_size` ranks each get the same whole number of MXFP4 groups of
    `param` (a `*_packed` codes or `*_scale` tensor of `module`, split along its last dim). The groups are counted
    from the scales (one per group), so no group size is restated here."""
    name = name or param
    codes_suffix, scale_suffix = MXFP4.suffixes
    suffix = next((s for s in MXFP4.suffixes if param.endswith(s)), None)
    scale = module._parameters.get(param.removesuffix(suffix) + scale_suffix) if suffix else None
    if scale is None:
        raise ValueError(f"`{name}`: the {MXFP4_ROWWISE_STYLE} style shards the codes (`*{codes_suffix}`) and "
                         f"scales (`*{scale_suffix}`) of packed MXFP4 tensors only")
    groups = scale.shape[-1]
    if groups % tp_size:
        raise ValueError(
            f"`{name}`: its {groups} MXFP4 group(s) along the input dim cannot be split over {tp_size} "
            f"tensor-parallel ranks without cutting a group; choose a tensor-parallel size that divides {groups}, "
            "expert parallelism (whole experts per rank) or experts_format='dense'"
        )


def register_shard_styles() -> None:
    """Adds `kimi_k3_heads` and `kimi_k3_mxfp4_rowwise` to transformers' parallel styles; a second call finds them
    there and does nothing."""
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
    except ImportError:  # torch without distributed, or a transformers without DTensor tensor parallel
        return

    def shard(module: nn.Module, param: str, mesh, dim: int) -> None:
        meta = module._parameters.get(param)
        if meta is not None:
            module._parameters[param] = nn.Parameter(
                distribute_tensor(meta, mesh, [Shard(dim)], src_data_rank=None), requires_grad=meta.requires_grad
            )

    # transformers 5.25 passes shard_param `config=` and `mesh_manager=` by keyword (5.17-5.24: neither); the styles
    # here need neither, and take whatever a version passes
    class KimiK3HeadShard(TensorParallelLayer):
        """A parameter whose leading axis is heads (or head-major channels): Shard(0) on the TP mesh."""

        def shard_param(self, module: nn.Module, param: str, mesh, **kwargs) -> None:
            shard(module, param, mesh, 0)

    class KimiK3Mxfp4Rowwise(TensorParallelLayer):
        """Packed MXFP4 codes or scales split along their input (last) dim, whole groups per rank: Shard(-1)."""

        def validate_param(self, module: nn.Module, param: str, mesh, parameter_name=None) -> None:
            check_whole_mxfp4_groups(module, param, mesh.size(), parameter_name)

        def shard_param(self, module: nn.Module, param: str, mesh, **kwargs) -> None:
            shard(module, param, mesh, -1)

    for name, style in ((HEAD_SHARD_STYLE, KimiK3HeadShard), (MXFP4_ROWWISE_STYLE, KimiK3Mxfp4Rowwise)):
        if name not in ALL_PARALLEL_STYLES:
            ALL_PARALLEL_STYLES.register(name, style())
