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
"""The MoE layer's fast twins: the router's logits and the routed experts over plain (bf16) expert weights.

Routed experts go through grouped GEMMs (`torch.nn.functional.grouped_mm` / `torch._grouped_mm`), or at decode (a
few routed rows per expert, CUDA, no autograd) through the Triton grouped matmul `grouped_matmul_few_rows` (the
custom op `torch.ops.kimik3.grouped_matmul_few_rows`), which reads each routed expert's weights once where
grouped_mm pads every one-row group to a full GEMM tile. The routing around the matmuls (`_routed_experts`) and the
row-block search of the expert-grouped kernels are shared with the packed experts (mxfp4.py).

No host synchronisation: the routed slots are sorted by expert on the device, the group offsets are a device
cumsum, and the combine back to token order is a gather (Triton kernel when available, else a PyTorch gather +
f32 sum). Every shape depends only on the number of tokens, so torch.compile traces the same code into a compiled
(CUDA-graph) decode step. Autograd works through every step (grouped_mm has a backward in torch >= 2.9; the Triton
SiTU and combine have their own).

Launch rule: `FEW_ROWS_PER_EXPERT`, the routed rows per expert up to which the few-rows kernel runs.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference

from ._base import HAS_TRITON, as_rows, custom_op, needs_grad, tl, triton, twin
from .situ import situ_glu

# Up to this many routed rows per expert on average, the bf16 experts' matmuls run the few-rows Triton kernel (each
# block of 16 rows of an expert reads its weights again, so many rows belong to grouped_mm's GEMM tiles).
FEW_ROWS_PER_EXPERT = 4


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise ImportError("this torch has neither torch.nn.functional.grouped_mm nor torch._grouped_mm")
    return fn


# --------------------------------------------------------------------------------------------------------------
# Router logits: the reference's SGEMM on the same f32 values (bit-identical logits), with the activations' upcast as
# one vectorised pass (PyTorch's casting copy moved ~1.9 TB/s on the 8K prefill's [8192, 7168]). Faster forms of the
# product itself were not f32-accurate: a tensor-core GEMM written as f32 ~25x, a Triton f32 dot ~9x farther from the
# float64 logits than the SGEMM at the max (docs/benchmarks.md, Router upcast).


@triton.jit
def _upcast_kernel(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float32), mask=mask)


def upcast_f32(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """x.float() (exact for 16-bit x) as one Triton pass; a contiguous result."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        with torch.cuda.device(x.device):
            _upcast_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block, num_warps=8)
    return out


@twin("router_logits", needs=("triton",))
def router_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract and the same numbers as `ops_kimi_k3.router_logits`: the reference itself on the activations
    upcast in one pass (its own upcast of an f32 tensor is a no-op); forward only."""
    return _reference.router_logits(upcast_f32(hidden_states), weight)


# --------------------------------------------------------------------------------------------------------------
# MoE combine: y[t] = cast(sum_j w[t, j] * f32(o[pos[t, j]]))


@triton.jit
def _moe_combine_kernel(o_ptr, pos_ptr, w_ptr, y_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + j).to(tl.int64)
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += wj * tl.load(o_ptr + pos * D + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + cols, acc.to(y_ptr.dtype.element_ty), mask=m)


class _MoECombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, pos, out_dtype):
        num_tokens, k = weights.shape
        d = expert_out.shape[-1]
        expert_out = expert_out.contiguous()
        w = weights.float().contiguous()
        y = torch.empty(num_tokens, d, dtype=out_dtype, device=expert_out.device)
        if num_tokens and d:
            with torch.cuda.device(expert_out.device):  # Triton launches on the current device
                _moe_combine_kernel[(num_tokens, triton.cdiv(d, 1024))](
                    expert_out, pos, w, y, d, K=k, BLOCK=1024, num_warps=4
                )
        ctx.save_for_backward(expert_out, w, pos)
        ctx.wdtype = weights.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        expert_out, w, pos = ctx.saved_tensors
        num_tokens, k = w.shape
        d = expert_out.shape[-1]
        g = dy.float()
        flat_pos = pos.reshape(-1)
        d_out = torch.empty_like(expert_out)
        d_out[flat_pos] = (w.unsqueeze(-1) * g.unsqueeze(1)).reshape(-1, d).to(expert_out.dtype)
        picked = expert_out.index_select(0, flat_pos).view(num_tokens, k, d).float()
        d_w = torch.bmm(picked, g.unsqueeze(-1)).squeeze(-1).to(ctx.wdtype)
        return d_out, d_w, None, None


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype):
    """expert_out [M, D] (rows in expert-sorted order), weights [N, k] f32, pos [N, k] int64 (row of each routed
    slot in expert_out) -> [N, D] in out_dtype, f32 accumulation over j = 0..k-1. Has autograd."""
    return _MoECombine.apply(expert_out, weights, pos.contiguous(), out_dtype)


# --------------------------------------------------------------------------------------------------------------
# Row gather out[i] = x[index[i]]: the routed experts' expert-sorted copy of the activations (8K prefill: 131072 rows
# of 7 KB from 8192), where index_select wrote ~2.2 TB/s (docs/benchmarks.md, Row gather and prefill conv)


@triton.jit
def _gather_rows_kernel(x_ptr, idx_ptr, o_ptr, ROWS, D, stride_x, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < ROWS
    src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    m = rmask[:, None] & (cols < D)[None, :]
    v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m)
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], v, mask=m)


def gather_rows(x: torch.Tensor, index: torch.Tensor, block_rows: int = 32, block_d: int = 256) -> torch.Tensor:
    """x.index_select(0, index) for a 2-D x (unit stride on the last dim) and 1-D integer index, forward only;
    indices must lie in [0, x.shape[0]) (callers build them from a sort)."""
    rows, d = index.numel(), x.shape[1]
    x2 = as_rows(x, d)
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows and d:
        block_d = min(block_d, triton.next_power_of_2(d))
        with torch.cuda.device(x.device):
            _gather_rows_kernel[(triton.cdiv(rows, block_rows), triton.cdiv(d, block_d))](
                x2, index.contiguous(), out, rows, d, x2.stride(0), BLOCK_ROWS=block_rows, BLOCK_D=block_d,
                num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------------------
# Expert-grouped matmuls for few rows per expert (decode): each program takes one block of BLOCK_M expert-sorted rows
# of a single expert and a BLOCK_N slice of that expert's output columns.


@triton.jit
def _expert_row_block(ends_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # Row block `program_id(0)` of the expert-sorted rows, blocks never straddling two experts: found here from the
    # group ends (a prefix sum over the experts) rather than from a table built by a dozen small launches on the
    # host. Returns (expert, first row, end of the expert's rows); expert == E for the blocks past the last one.
    return _expert_row_block_of(tl.program_id(0), ends_ptr, E, E_PAD, BLOCK_M)


@triton.jit
def _expert_row_block_of(blk, ends_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # `_expert_row_block` for row block `blk` (kernels that order their programs themselves)
    e_idx = tl.arange(0, E_PAD)
    emask = e_idx < E
    ends = tl.load(ends_ptr + e_idx, mask=emask, other=0)
    starts = tl.load(ends_ptr + e_idx - 1, mask=emask & (e_idx > 0), other=0)
    blocks = tl.where(emask, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    block_ends = tl.cumsum(blocks, axis=0)
    expert = tl.sum((block_ends <= blk).to(tl.int32), axis=0)
    mine = e_idx == expert
    row0 = tl.sum(tl.where(mine, starts + (blk - block_ends + blocks) * BLOCK_M, 0), axis=0)
    row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return expert, row0, row_end


_FEW_ROWS_BLOCK_M = 16  # the smallest tl.dot tile: decode has a row or a few per expert


def _row_block_grid(num_rows, num_experts, n):
    def grid(meta):
        # an upper bound on the number of row blocks (each has a row, and at most one per expert is partial); the
        # ones past the last real block return at once
        return (min(num_rows, triton.cdiv(num_rows, _FEW_ROWS_BLOCK_M) + num_experts), triton.cdiv(n, meta["BLOCK_N"]))

    return grid


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else None  # f32 stays exact (no TF32)


# Plain (bf16/f16/f32) expert weights [E, N, K], K contiguous as the model stores gate_up_proj / down_proj: the inner
# loop streams [BLOCK_N, BLOCK_K] weight tiles along K, so with a row or a few per expert each routed expert's bytes
# are read once, by many programs at once (the aim: HBM speed), where grouped_mm pads every group to a GEMM tile.


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in ((32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 5), (64, 128, 4, 4), (64, 128, 8, 5),
                              (64, 256, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3))
    ],
    key=["N", "K", "E_PAD"],
)
@triton.jit
def _grouped_matmul_few_rows_kernel(x_ptr, w_ptr, o_ptr, ends_ptr, N, K, E, stride_xm, stride_we, stride_wn,
                                    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, BLOCK_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            kmask = k < K
            x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        out = o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def grouped_matmul_few_rows(xs: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """xs [M, K], its rows grouped by expert (group e is rows group_ends[e-1]:group_ends[e]); weight [E, N, K] in
    xs.dtype -> [M, N] in xs.dtype: each group times its expert transposed, f32 accumulation, as
    `grouped_mm(xs, weight.transpose(-2, -1), offs=group_ends)`. Rows past group_ends[-1] are left unwritten.

    The raw Triton launch (CUDA tensors, forward only): the model reaches it through the custom op
    `torch.ops.kimik3.grouped_matmul_few_rows`, which torch.compile keeps as one node. Built for few rows per
    expert: every block of 16 rows of an expert reads that expert's weights again."""
    if xs.dim() != 2 or weight.dim() != 3 or xs.shape[1] != weight.shape[2] or group_ends.shape != weight.shape[:1]:
        raise ValueError(f"grouped matmul shapes do not match: xs {tuple(xs.shape)} [M, K], weight "
                         f"{tuple(weight.shape)} [E, N, K], group_ends {tuple(group_ends.shape)} [E]")
    if weight.dtype != xs.dtype:
        raise TypeError(f"grouped matmul weight must be in the rows' dtype {xs.dtype}, got {weight.dtype}")
    num_rows, k = xs.shape
    num_experts, n, _ = weight.shape
    # unit stride along K is what the kernel streams; the model's stacks already have it (no copy)
    xs = xs if xs.stride(-1) == 1 else xs.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(num_rows, n, dtype=xs.dtype, device=xs.device)
    if num_rows == 0 or n == 0 or num_experts == 0:
        return out
    grid = _row_block_grid(num_rows, num_experts, n)
    with torch.cuda.device(xs.device):  # Triton launches on the current device
        _grouped_matmul_few_rows_kernel[grid](
            xs, weight, out, group_ends.to(torch.int32).contiguous(), n, k, num_experts, xs.stride(0),
            weight.stride(0), weight.stride(1), E_PAD=triton.next_power_of_2(num_experts),
            BLOCK_M=_FEW_ROWS_BLOCK_M, PRECISION=_dot_precision(xs.dtype),
        )
    return out


def _grouped_matmul_reference(xs, weight, group_ends):
    """Each group of rows times its expert transposed, f32 accumulation, rounded to xs.dtype (the Triton kernels'
    numbers); rows past group_ends[-1] are zero."""
    out = torch.zeros(xs.shape[0], weight.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            out[start:end] = (xs[start:end].float() @ weight[expert].float().t()).to(xs.dtype)
        start = end
    return out


@custom_op("grouped_matmul_few_rows")
def _grouped_matmul_few_rows_op(xs: Tensor, weight: Tensor, group_ends: Tensor) -> Tensor:
    """xs [M, K] grouped by expert, weight [E, N, K] -> [M, N], as `grouped_mm(xs, weight.mT, offs=group_ends)`."""
    return _grouped_matmul_reference(xs, weight, group_ends)


@_grouped_matmul_few_rows_op.register_kernel("cuda")
def _(xs, weight, group_ends):
    return grouped_matmul_few_rows(xs, weight, group_ends)


@_grouped_matmul_few_rows_op.register_fake
def _(xs, weight, group_ends):
    return torch.empty(xs.shape[0], weight.shape[1], dtype=xs.dtype, device=xs.device)


# --------------------------------------------------------------------------------------------------------------
# Routed experts

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
    own_kernels = HAS_TRITON and x.is_cuda and not torch.compiler.is_compiling()
    if own_kernels and not needs_grad(x):  # the Triton gather has no backward
        xs = gather_rows(x, order // k)  # [N*k, Dl], expert-sorted
    else:
        xs = x.index_select(0, order // k)
    h = gate_up_matmul(xs, offs)  # [N*k, 2I]
    situ = situ_glu if own_kernels else _reference.situ_glu
    act = situ(h[:, :inter], h[:, inter:], beta, linear_beta)
    out = down_matmul(act, offs)  # [N*k, Dl], rounded to x.dtype
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=x.device)  # row of slot (t, j) in `out`
    pos = pos.view(num_tokens, k)
    if own_kernels:
        return moe_combine(out, topk_weights, pos, x.dtype)
    return _combine_torch(out, topk_weights, pos, x.dtype)


def few_rows_per_expert(num_routed_rows: int, num_experts: int) -> bool:
    """Whether the routed rows (tokens x top-k) are few enough per expert for the few-rows kernel: decode and small
    batches. A static condition on shapes, so a compiled decode step picks its path at trace time."""
    return num_routed_rows <= FEW_ROWS_PER_EXPERT * num_experts


def _few_rows_kernel_runs_on(x) -> bool:
    # the custom op's CUDA implementation is the Triton kernel (elsewhere it is the reference loop)
    return x.device.type == "cuda" and HAS_TRITON


def _use_few_rows_kernel(x, gate_up_proj, down_proj, num_routed_rows) -> bool:
    # the custom op is forward-only: autograd (training) and many rows (prefill) keep grouped_mm; so do tensor-parallel
    # (DTensor) weights, whose sharded product the custom op has no rule for
    return (_few_rows_kernel_runs_on(x) and not needs_grad(x, gate_up_proj, down_proj)
            and not any(hasattr(w, "to_local") for w in (x, gate_up_proj, down_proj))
            and few_rows_per_expert(num_routed_rows, gate_up_proj.shape[0]))


@twin("moe_experts", check=_grouped_mm_fn)
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
