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
"""KDA's short causal conv (`ops_kimi_k3.causal_conv1d`): depthwise causal conv + SiLU over [B, T, C] after a cached
window of the last K - 1 pre-conv inputs, with each head's L2 norm where asked.

Without autograd recording it is the custom op `torch.ops.kimik3.causal_conv1d` (one node of a compiled decode
step) on two Triton kernels of its own: up to `CONV_STEP_MAX_TOKENS` tokens after a cached window the decode step
(one launch), else the prefill tiles. While autograd records: fla-core's conv, which has a Triton backward (fla keeps a
[B, C, K] state whose last K-1 columns are the previous inputs; the adapter pads / slices).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference

from ._base import custom_op, needs_grad, tl, triton, twin


@twin("causal_conv1d", needs=("fla.modules.causal_conv1d",))
def causal_conv1d(x, weight, conv_state=None, l2norm_head_dim=0):
    # the custom op (own kernels) has no autograd formula: while a gradient is recorded, fla's conv, which has one
    if needs_grad(x, weight, conv_state):
        y, state = _causal_conv1d_eager(x, weight, conv_state)
        return _reference.l2norm_heads(y, l2norm_head_dim), state
    return torch.ops.kimik3.causal_conv1d(x, weight, conv_state, l2norm_head_dim)


def _causal_conv1d_eager(x, weight, conv_state):
    from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d

    channels, kernel_size = weight.shape[0], weight.shape[-1]
    w = weight.reshape(channels, kernel_size)
    init = None
    if conv_state is not None:
        init = F.pad(conv_state.to(x.dtype), (1, 0)).contiguous()  # [B, C, K]: column 0 is never read
    y, final = _fla_causal_conv1d(
        x, w, None, None, initial_state=init, output_final_state=True, activation="silu", backend="triton"
    )
    return y, final[..., 1:]


@custom_op("causal_conv1d")
def _causal_conv1d_op(x: Tensor, weight: Tensor, conv_state: Optional[Tensor], l2norm_head_dim: int = 0
                      ) -> Tuple[Tensor, Tensor]:
    y, state = _reference.causal_conv1d(x, weight, conv_state, l2norm_head_dim)
    return y.contiguous(), state.clone() if state is conv_state else state.contiguous()


@_causal_conv1d_op.register_kernel("cuda")
def _(x, weight, conv_state, l2norm_head_dim=0):
    if conv_state is not None and x.shape[1] <= CONV_STEP_MAX_TOKENS:
        y, state = causal_conv1d_step(x, weight, conv_state)  # decode: one launch, outputs contiguous
        return _reference.l2norm_heads(y, l2norm_head_dim), state
    return causal_conv1d_prefill(x, weight, conv_state, l2norm_head_dim=l2norm_head_dim)


@_causal_conv1d_op.register_fake
def _(x, weight, conv_state, l2norm_head_dim=0):
    batch, _, channels = x.shape
    state = torch.empty(batch, channels, weight.shape[-1] - 1, dtype=x.dtype, device=x.device)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), state


# --------------------------------------------------------------------------------------------------------------
# Causal conv1d over a few tokens after a cached window (decode, verify). fla's path pads the cached window to
# fla's [B, C, K] state (two launches), runs its conv and its final-state kernels, and slices the new window out
# (one more copy): five launches per projection for one token, three projections per KDA layer. Here one program
# per (channel block, sequence) reads the window straight from the cached state and the new inputs and writes the
# outputs and the new window: one launch.

CONV_STEP_MAX_TOKENS = 16  # above this the tokens are a prefill chunk: fla's parallel kernel


@triton.jit
def _causal_conv1d_step_kernel(x_ptr, s_ptr, w_ptr, y_ptr, ns_ptr, T, C, sx_b, sx_t, sx_c, ss_b, ss_c, ss_k,
                               K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    # position p of the sequence [cached window (K - 1) | x (T)] is state column p for p < K - 1, else token
    # p - (K - 1); the cached window is rounded to x's dtype first, as the reference concatenates in x's dtype
    b = tl.program_id(1).to(tl.int64)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    j = tl.arange(0, K_PAD)
    w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=cmask[:, None] & (j < K)[None, :], other=0.0)
    w = w.to(tl.float32)
    for t in range(0, T + 1):
        # t < T: the taps of output t (positions t .. t + K - 1); t == T: the new window (positions T .. T + K - 2)
        width = K if t < T else K - 1
        p = t + j
        in_state = (p < K - 1)[None, :]
        valid = cmask[:, None] & (j < width)[None, :]
        cached = tl.load(s_ptr + b * ss_b + c[:, None] * ss_c + p[None, :] * ss_k, mask=valid & in_state, other=0.0)
        fresh = tl.load(x_ptr + b * sx_b + (p - (K - 1))[None, :] * sx_t + c[:, None] * sx_c, mask=valid & ~in_state,
                        other=0.0)
        window = tl.where(in_state, cached.to(y_ptr.dtype.element_ty), fresh)
        if t < T:
            acc = tl.sum(window.to(tl.float32) * w, axis=1)  # f32 taps, as F.conv1d on the f32 window
            y = acc * tl.sigmoid(acc)
            tl.store(y_ptr + (b * T + t) * C + c, y.to(y_ptr.dtype.element_ty), mask=cmask)
        else:
            tl.store(ns_ptr + (b * C + c[:, None]) * (K - 1) + j[None, :], window, mask=valid)


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor):
    """The reference `causal_conv1d` for a few tokens after a cached window: x [B, T, C] (any strides), weight
    [C, 1, K], conv_state [B, C, K-1] -> (y [B, T, C] in x.dtype, new conv_state [B, C, K-1] in x.dtype), one
    launch; f32 taps and SiLU. Forward only (the custom op `kimik3::causal_conv1d` calls it on CUDA)."""
    batch, tokens, channels = x.shape
    kernel_size = weight.shape[-1]
    if conv_state.shape != (batch, channels, kernel_size - 1):
        raise ValueError(f"causal_conv1d_step: conv_state {tuple(conv_state.shape)} does not match x "
                         f"{tuple(x.shape)} and a kernel of {kernel_size}")
    y = torch.empty(batch, tokens, channels, dtype=x.dtype, device=x.device)
    new_state = torch.empty(batch, channels, kernel_size - 1, dtype=x.dtype, device=x.device)
    w = weight.reshape(channels, kernel_size).contiguous()
    if batch and channels:
        block = 256
        with torch.cuda.device(x.device):  # Triton launches on the current device
            _causal_conv1d_step_kernel[(triton.cdiv(channels, block), batch)](
                x, conv_state, w, y, new_state, tokens, channels, *x.stride(), *conv_state.stride(),
                K=kernel_size, K_PAD=triton.next_power_of_2(kernel_size), BLOCK_C=block, num_warps=4,
            )
    return y, new_state


# --------------------------------------------------------------------------------------------------------------
# Causal conv1d over a prefill chunk: one program per (token block, channel block, sequence) reads its K shifted input
# tiles (the K - 1 rows before the block from x or the cached window) and writes the outputs. fla's kernel moved
# ~2.2 TB/s on the 8K prefill's [8192, 12288] projections (docs/benchmarks.md, Row gather and prefill conv).

CONV_PREFILL_BLOCKS = (16, 128, 4)  # BLOCK_T, BLOCK_C, num_warps


@triton.jit
def _causal_conv1d_prefill_kernel(x_ptr, s_ptr, w_ptr, y_ptr, T, C, sx_b, sx_t, ss_b, ss_c, ss_k,
                                  HAS_STATE: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                                  BLOCK_C: tl.constexpr, L2NORM: tl.constexpr):
    # input position p = t - (K - 1) + j of output t's tap j is token p for p >= 0, else column p + K - 1 of the
    # cached window (rounded to x's dtype, as the reference concatenates in x's dtype; zeros without a window)
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    live = t < T
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        p = t - (K - 1) + j
        fresh = live & (p >= 0)
        tap = tl.load(x_ptr + b * sx_b + p.to(tl.int64)[:, None] * sx_t + c[None, :],
                      mask=fresh[:, None] & cmask[None, :], other=0.0)
        if HAS_STATE:
            cached = live & (p < 0)
            old = tl.load(s_ptr + b * ss_b + c[None, :] * ss_c + (p + K - 1)[:, None] * ss_k,
                          mask=cached[:, None] & cmask[None, :], other=0.0)
            tap = tl.where(cached[:, None], old.to(y_ptr.dtype.element_ty), tap)
        w = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0).to(tl.float32)
        acc += tap.to(tl.float32) * w[None, :]
    y = acc * tl.sigmoid(acc)
    if L2NORM:
        # a tile row is one head (BLOCK_C == head_dim): fla's l2norm of the output as it would have been stored
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = y * (1 / tl.sqrt(tl.sum(y * y, axis=1) + 1e-6))[:, None]
    tl.store(y_ptr + (b * T + t.to(tl.int64))[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & cmask[None, :])


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                          blocks=CONV_PREFILL_BLOCKS, l2norm_head_dim: int = 0):
    """The reference `causal_conv1d` over a prefill chunk: x [B, T, C], weight [C, 1, K], conv_state [B, C, K-1] or
    None -> (y [B, T, C] in x.dtype, contiguous; new conv_state [B, C, K-1] in x.dtype); f32 taps and SiLU. Forward
    only (the custom op `kimik3::causal_conv1d` calls it on CUDA). `l2norm_head_dim` > 0: y L2-normalised per head in
    the same pass (tiles one head wide); a head width that is not a power of two up to 256 normalises afterwards."""
    batch, tokens, channels = x.shape
    kernel_size = weight.shape[-1]
    if conv_state is not None and conv_state.shape != (batch, channels, kernel_size - 1):
        raise ValueError(f"causal_conv1d_prefill: conv_state {tuple(conv_state.shape)} does not match x "
                         f"{tuple(x.shape)} and a kernel of {kernel_size}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(batch, tokens, channels, dtype=x.dtype, device=x.device)
    w = weight.reshape(channels, kernel_size).contiguous()
    state = conv_state if conv_state is not None else w  # any tensor: not read without HAS_STATE
    if l2norm_head_dim and channels % l2norm_head_dim:
        raise ValueError(f"causal_conv1d_prefill: {channels} channels are not whole heads of {l2norm_head_dim}")
    in_tiles = l2norm_head_dim in (16, 32, 64, 128, 256)
    if batch and tokens and channels:
        block_t, block_c, warps = blocks
        if l2norm_head_dim and in_tiles:
            block_c = l2norm_head_dim
        with torch.cuda.device(x.device):
            _causal_conv1d_prefill_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c), batch)](
                x, state, w, y, tokens, channels, x.stride(0), x.stride(1),
                *(conv_state.stride() if conv_state is not None else (0, 0, 0)), HAS_STATE=conv_state is not None,
                K=kernel_size, BLOCK_T=block_t, BLOCK_C=block_c, L2NORM=bool(l2norm_head_dim and in_tiles),
                num_warps=warps)
    if l2norm_head_dim and not in_tiles:
        y = _reference.l2norm_heads(y, l2norm_head_dim).contiguous()
    # the new window: the last K - 1 positions of [cached window | x], in x's dtype
    keep = kernel_size - 1
    if tokens >= keep:  # a fresh tensor even where the transposed slice is contiguous (custom op outputs never alias)
        new_state = x.new_empty(batch, channels, keep).copy_(x[:, tokens - keep:].transpose(1, 2))
    else:
        previous = (conv_state.to(x.dtype) if conv_state is not None
                    else x.new_zeros(batch, channels, keep))
        new_state = torch.cat([previous[..., tokens:], x.transpose(1, 2)], dim=-1).contiguous()
    return y, new_state
