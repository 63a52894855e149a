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
"""Routed experts through grouped GEMMs (`torch.nn.functional.grouped_mm` / `torch._grouped_mm`), or at decode
(a few routed rows per expert, CUDA, no autograd) through the Triton grouped matmul `grouped_matmul_few_rows`, which
reads each routed expert's weights once where grouped_mm pads every one-row group to a full GEMM tile. Packed MXFP4
experts go through the Triton kernels that decode the packed bytes in registers (`moe_experts_mxfp4`).

No host synchronisation: the routed slots are sorted by expert on the device, the group offsets are a device
cumsum, and the combine back to token order is a gather (Triton kernel when available, else a PyTorch gather +
f32 sum). Every shape depends only on the number of tokens, so torch.compile traces the same code into a compiled
(CUDA-graph) decode step. Autograd works through every step (grouped_mm has a backward in torch >= 2.9; the Triton
SiTU and combine have their own).
"""

import torch
import torch.nn.functional as F

from kimik3.modeling.ops_kimi_k3 import situ_glu as _situ_reference

from . import custom_ops

# Up to this many routed rows per expert on average, the bf16 experts' matmuls run the few-rows Triton kernel (each
# block of 16 rows of an expert reads its weights again, so many rows belong to grouped_mm's GEMM tiles).
FEW_ROWS_PER_EXPERT = 4

# The packed MXFP4 experts' three paths, by routed rows per expert on average: up to MXFP4_GEMV_ROWS_PER_EXPERT the
# GEMV kernel (each routed row reads its expert's packed bytes), up to MXFP4_TILE_ROWS_PER_EXPERT the tile kernel
# (one decode of each tile per 16 rows of an expert), beyond that the stack dequantised once and the grouped GEMMs
# (prefill). On the H200 (docs/benchmarks.md, Packed MXFP4 GEMV) the GEMV's matmuls take 0.14 ms against the tiles' 0.38
# ms at 1 row per expert, and 1.01 ms against 1.19 ms at 2 (8 tokens x top-16 over 64 experts), though a second row
# re-reads its expert: the GEMV stops at 2.
MXFP4_GEMV_ROWS_PER_EXPERT = 2
MXFP4_TILE_ROWS_PER_EXPERT = 16


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise ImportError("this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    return fn


try:  # Triton parts are optional: without them the same math runs in PyTorch (the packed experts need them)
    from . import triton_ops as _triton_ops
    from .triton_ops import gather_rows as _gather_rows_triton
    from .triton_ops import moe_combine as _moe_combine_triton
    from .triton_ops import situ_glu as _situ_triton
except ImportError:  # pragma: no cover - depends on the environment
    _triton_ops = None
    _gather_rows_triton = None
    _moe_combine_triton = None
    _situ_triton = None


def _combine_torch(expert_out, weights, pos, out_dtype):
    num_tokens, k = weights.shape
    picked = expert_out.index_select(0, pos.reshape(-1)).view(num_tokens, k, -1)
    return (picked.float() * weights.float().unsqueeze(-1)).sum(dim=1).to(out_dtype)


def _routed_experts(x, topk_indices, topk_weights, num_experts, inter, gate_up_matmul, down_matmul, beta,
                    linear_beta):
    """Sort the routed slots by expert, run `gate_up_matmul(xs, group_ends)`, SiTU, `down_matmul(act, group_ends)`
    and combine back to token order; the two matmuls are grouped over the experts."""
    num_tokens = x.shape[0]
    k = topk_indices.shape[-1]
    flat = topk_indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # routed slots grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    # Under torch.compile the grouped GEMMs stay and the elementwise parts are left to the compiler to fuse (our
    # Triton kernels are opaque to it). The op as a whole is declared traceable (FAST_OPS), so this inner choice is
    # the op's own; the device test is for direct callers (the CPU tests run this routing on CPU grouped_mm).
    own_kernels = x.is_cuda and not torch.compiler.is_compiling()
    if own_kernels and _gather_rows_triton is not None and not custom_ops.needs_grad(x):
        xs = _gather_rows_triton(x, order // k)  # [N*k, Dl], expert-sorted
    else:
        xs = x.index_select(0, order // k)
    h = gate_up_matmul(xs, offs)  # [N*k, 2I]
    situ = _situ_triton if (_situ_triton is not None and own_kernels) else _situ_reference
    act = situ(h[:, :inter], h[:, inter:], beta, linear_beta)
    out = down_matmul(act, offs)  # [N*k, Dl], rounded to x.dtype
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=x.device)  # row of slot (t, j) in `out`
    pos = pos.view(num_tokens, k)
    if _moe_combine_triton is not None and own_kernels:
        return _moe_combine_triton(out, topk_weights, pos, x.dtype)
    return _combine_torch(out, topk_weights, pos, x.dtype)


def few_rows_per_expert(num_routed_rows: int, num_experts: int) -> bool:
    """Whether the routed rows (tokens x top-k) are few enough per expert for the few-rows kernel: decode and small
    batches. A static condition on shapes, so a compiled decode step picks its path at trace time."""
    return num_routed_rows <= FEW_ROWS_PER_EXPERT * num_experts


def _few_rows_kernel_runs_on(x) -> bool:
    # the custom op's CUDA implementation is the Triton kernel (elsewhere it is the reference loop)
    return x.device.type == "cuda" and _triton_ops is not None


def _use_few_rows_kernel(x, gate_up_proj, down_proj, num_routed_rows) -> bool:
    # the custom op is forward-only: autograd (training) and many rows (prefill) keep grouped_mm; so do tensor-parallel
    # (DTensor) weights, whose sharded product the custom op has no rule for
    return (_few_rows_kernel_runs_on(x) and not custom_ops.needs_grad(x, gate_up_proj, down_proj)
            and not any(hasattr(w, "to_local") for w in (x, gate_up_proj, down_proj))
            and few_rows_per_expert(num_routed_rows, gate_up_proj.shape[0]))


def moe_experts(
    x: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    beta: float | None = None,
    linear_beta: float | None = None,
) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.moe_experts`; x [N, Dl] -> [N, Dl] in x.dtype.

    gate_up_proj [E, 2I, Dl], down_proj [E, Dl, I] in x.dtype (bf16 on the fast path). With few routed rows per
    expert (`few_rows_per_expert`) on CUDA and no gradient recorded, both matmuls are the custom op
    `torch.ops.kimik3.grouped_matmul_few_rows` (one node of a compiled graph); otherwise grouped_mm."""
    if _use_few_rows_kernel(x, gate_up_proj, down_proj, x.shape[0] * topk_indices.shape[-1]):
        matmul = torch.ops.kimik3.grouped_matmul_few_rows
    else:
        matmul = _grouped_mm_over_experts
    return _routed_experts(
        x, topk_indices, topk_weights, gate_up_proj.shape[0], gate_up_proj.shape[1] // 2,
        lambda xs, offs: matmul(xs, gate_up_proj, offs),
        lambda act, offs: matmul(act, down_proj, offs),
        beta, linear_beta,
    )


def _grouped_mm_over_experts(xs, weight, group_ends):
    return _grouped_mm_fn()(xs, weight.transpose(-2, -1), offs=group_ends)


def mxfp4_experts_path(num_routed_rows: int, num_experts: int) -> str:
    """How the packed experts run for this many routed rows (tokens x top-k): "gemv", "tiles" or "dequantised"
    (module constants above). A static condition on shapes, so a compiled decode step picks its path at trace time."""
    if num_routed_rows <= MXFP4_GEMV_ROWS_PER_EXPERT * num_experts:
        return "gemv"
    if num_routed_rows <= MXFP4_TILE_ROWS_PER_EXPERT * num_experts:
        return "tiles"
    return "dequantised"


def moe_experts_mxfp4(
    x, topk_indices, topk_weights, gate_up_packed, gate_up_scale, down_packed, down_scale, beta=None,
    linear_beta=None,
):
    """Same contract as `ops_kimi_k3.moe_experts_mxfp4`; x and the routing weights get gradients, the
    packed weights are frozen.

    With few routed rows per expert (decode, small batches; `mxfp4_experts_path`), both expert matmuls read the
    packed weights and decode them in registers: HBM traffic is the routed experts' packed bytes. At one row
    per expert that is the Triton GEMV (one program per routed row), up to 16 the Triton grouped matmul (16-row
    tiles). With more rows (prefill), every row block would dequantise its tiles again, so the stack is dequantised
    once into a transient x.dtype copy and goes through the grouped GEMMs (docs/benchmarks.md)."""
    num_experts = gate_up_packed.shape[0]
    path = mxfp4_experts_path(x.shape[0] * topk_indices.shape[-1], num_experts)
    if path == "dequantised":
        return moe_experts_mxfp4_dequantised(x, topk_indices, topk_weights, gate_up_packed, gate_up_scale,
                                             down_packed, down_scale, beta, linear_beta)
    matmul = _triton_ops.mxfp4_gemv if path == "gemv" else _triton_ops.mxfp4_grouped_matmul
    return _routed_experts(
        x, topk_indices, topk_weights, num_experts, gate_up_packed.shape[1] // 2,
        lambda xs, offs: matmul(xs, gate_up_packed, gate_up_scale, offs),
        lambda act, offs: matmul(act, down_packed, down_scale, offs),
        beta, linear_beta,
    )


def moe_experts_mxfp4_dequantised(
    x, topk_indices, topk_weights, gate_up_packed, gate_up_scale, down_packed, down_scale, beta=None,
    linear_beta=None,
):
    """`moe_experts_mxfp4` for many rows per expert: the packed stack dequantised once (Triton) into a transient
    x.dtype copy, then the grouped-GEMM `moe_experts`."""
    gate_up = _triton_ops.mxfp4_dequant(gate_up_packed, gate_up_scale, x.dtype)
    down = _triton_ops.mxfp4_dequant(down_packed, down_scale, x.dtype)
    return moe_experts(x, topk_indices, topk_weights, gate_up, down, beta, linear_beta)
