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
"""Packed MXFP4 experts' fast twins (`ops_kimi_k3.dequantize_mxfp4`, `moe_experts_mxfp4`): E2M1 codes with an E8M0
scale per 32 weights, decoded in registers.

* `mxfp4_dequant`: MXFP4 -> bf16/f32, bit-exact with the reference (the custom op `torch.ops.kimik3.mxfp4_dequant`).
* `mxfp4_grouped_matmul`: expert-grouped matmul over packed weights in 16-row tiles, dequantised tile by tile in
  registers (bf16 on Hopper from 32-bit words decoded straight to scaled bf16 pairs, else Triton's `tl.dot_scaled`
  or a byte decode); gradient for the activations only (the custom op `torch.ops.kimik3.mxfp4_grouped_matmul` without
  autograd).
* `mxfp4_grouped_gemm`: the same product for many rows per expert (prefill): large row blocks, each packed tile
  decoded from its words once per block (the custom op `torch.ops.kimik3.mxfp4_grouped_gemm` without autograd).
* `mxfp4_gemv`: the same product for 1-2 rows per expert (decode): one routed row per program, no `tl.dot`, the
  weights decoded and summed in registers (the custom op `torch.ops.kimik3.mxfp4_gemv` without autograd).
* `moe_experts_mxfp4`: the routed experts (moe.py's routing) on one of three paths by routed rows per expert, the
  launch rules `MXFP4_GEMV_ROWS_PER_EXPERT`, `MXFP4_TILE_ROWS_PER_EXPERT` and `MXFP4_GEMM_ROWS_PER_EXPERT`.
* `mxfp4_dequantised_matmul`: the same product through chunks of experts dequantised into a bounded transient copy
  (`MXFP4_DEQUANT_CHUNK_BYTES`) and grouped_mm: the many-rows path, and the gradient of every packed path.
"""

import os

import torch
from torch import Tensor

from kimik3.modeling import ops_kimi_k3 as _reference
from kimik3.modeling.ops_kimi_k3 import MXFP4_GROUP_SIZE

from ._base import custom_op, needs_grad, tl, triton, twin
from .moe import (
    _FEW_ROWS_BLOCK_M,
    _dot_precision,
    _expert_row_block,
    _expert_row_block_of,
    _grouped_matmul_reference,
    _grouped_mm_fn,
    _routed_experts,
    _row_block_grid,
)

# The packed MXFP4 experts' four paths, by routed rows per expert on average: up to MXFP4_GEMV_ROWS_PER_EXPERT the
# GEMV kernel (each routed row reads its expert's packed bytes), up to MXFP4_TILE_ROWS_PER_EXPERT the tile kernel
# (one decode of each tile per 16 rows of an expert), up to MXFP4_GEMM_ROWS_PER_EXPERT the packed grouped GEMM (each
# tile decoded once per row block of up to 256 rows), beyond that chunks of experts dequantised into a transient copy
# of at most MXFP4_DEQUANT_CHUNK_BYTES for grouped_mm, whose GEMMs outrun the packed GEMM once an expert has many
# rows. On the H200 (docs/benchmarks.md, Packed experts at a few rows per expert, and Packed MXFP4 prefill) one
# layer's two matmuls take 0.14 ms on the GEMV against the bf16 tiles' 0.28 ms at 1 row per expert, 0.99 against
# 1.00 ms at 2 (8 tokens x top-16 over 64 experts), though a second row re-reads its expert, and 1.95 against 1.05 ms
# at 4: the GEMV stops at 2. At 896 experts an 8K prefill (~146 rows per expert) takes 0.225 s on the packed GEMM
# against 0.268 s dequantised; a 32K one (~585) 0.870 s against 0.733 s, and 64 experts at 8K (2048) 0.176 s against
# 0.134 s. (Those are the byte GEMM's; the word GEMM that replaced it, 1.34-1.38x faster alone, may move the crossover:
# not yet measured.)
MXFP4_GEMV_ROWS_PER_EXPERT = 2
# where the word tiles run (bf16 on Hopper, MXFP4_WORD_TILES on) the GEMV stops at 1: on an H100 they take 606.0 us
# a layer at 2 rows per expert (8 tokens over 64 experts) against the GEMV's 973.9, and 332.1 against 264.9 at 1.1
# (2 tokens); docs/benchmarks.md, Packed MXFP4 GEMV
MXFP4_GEMV_ROWS_PER_EXPERT_BESIDE_WORD_TILES = 1
MXFP4_TILE_ROWS_PER_EXPERT = 16
MXFP4_GEMM_ROWS_PER_EXPERT = 256
MXFP4_DEQUANT_CHUNK_BYTES = 1 << 30


# --------------------------------------------------------------------------------------------------------------
# MXFP4 dequantisation


@triton.jit
def _e2m1_bits(code):
    # The 3 magnitude bits of an E2M1 code placed at the top of an f32's exponent/mantissa field make 2^-126 times
    # the E2M1 value (codes 0 and 1 land on the denormals 0 and 2^-127), so one exact multiply by a power of two
    # decodes every code. Fewer instructions per weight than branching on the exponent.
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    return _e2m1_bits(code) * 8.507059173023462e37  # 2^126: the E2M1 value


@triton.jit
def _e8m0(sc):
    # 2^(sc - 127) exactly, built from its f32 bits: normal floats for sc >= 1, the denormal 2^-127 for sc == 0
    bits = tl.where(sc == 0, 0x00400000, sc << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_dequant_kernel(p_ptr, s_ptr, o_ptr, KH, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < KH
    byte = tl.load(p_ptr + row * KH + j, mask=m, other=0).to(tl.int32)
    sc = tl.load(s_ptr + row * (KH // 16) + j // 16, mask=m, other=127).to(tl.int32)
    factor = _e8m0(sc)
    lo = _e2m1(byte & 15) * factor
    hi = _e2m1(byte >> 4) * factor
    out = o_ptr + row * (2 * KH) + 2 * j
    tl.store(out, lo.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(out + 1, hi.to(o_ptr.dtype.element_ty), mask=m)


@twin("mxfp4_dequant", needs=("triton",))
def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Same contract as `ops_kimi_k3.dequantize_mxfp4` (bit-exact): packed u8 [..., N, K/2], scale u8 [..., N, K/32]
    -> [..., N, K] in dtype."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    kh = packed.shape[-1]
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * 16 != kh:
        raise ValueError(f"MXFP4 shapes do not match: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    return torch.ops.kimik3.mxfp4_dequant(packed, scale, dtype)  # one node under torch.compile


def _mxfp4_dequant_launch(packed, scale, dtype):
    kh = packed.shape[-1]
    p2 = packed.contiguous().view(-1, kh)
    s2 = scale.contiguous().view(-1, kh // 16)
    out = torch.empty(*packed.shape[:-1], 2 * kh, dtype=dtype, device=packed.device)
    if p2.shape[0] and kh:
        with torch.cuda.device(packed.device):  # Triton launches on the current device
            _mxfp4_dequant_kernel[(p2.shape[0], triton.cdiv(kh, 512))](p2, s2, out, kh, BLOCK=512, num_warps=4)
    return out


@custom_op("mxfp4_dequant")
def _mxfp4_dequant_op(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return _reference.dequantize_mxfp4(packed, scale, dtype).contiguous()


@_mxfp4_dequant_op.register_kernel("cuda")
def _(packed, scale, dtype):
    return _mxfp4_dequant_launch(packed, scale, dtype)


@_mxfp4_dequant_op.register_fake
def _(packed, scale, dtype):
    return torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], dtype=dtype, device=packed.device)


# --------------------------------------------------------------------------------------------------------------
# Grouped matmul over packed MXFP4 experts. Each weight tile is dequantised in registers inside the matmul loop, so
# HBM traffic is the routed experts' packed bytes (4.25 bits per weight) and never a dequantised copy. The even and
# odd input columns are two half-width dots (low nibble = even element), which needs no interleave.


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_KH": bkh}, num_warps=w, num_stages=st)
        for bn, bkh, w, st in ((64, 64, 4, 2), (64, 64, 4, 4), (128, 32, 4, 3), (128, 64, 8, 3), (32, 64, 2, 2),
                               (64, 128, 4, 3))
    ],
    key=["N", "KH", "E_PAD"],
)
@triton.jit
def _mxfp4_grouped_matmul_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KH, E, E_PAD: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr,
                                 PRECISION: tl.constexpr):
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, BLOCK_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * (2 * KH)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)  # rows of the [E*N, K/2] packed matrix
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, KH, BLOCK_KH):
            j = start + tl.arange(0, BLOCK_KH)
            jmask = j < KH
            xmask = rmask[:, None] & jmask[None, :]
            x_even = tl.load(x_rows + 2 * j[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_rows + 2 * j[None, :] + 1, mask=xmask, other=0.0)
            wmask = cmask[:, None] & jmask[None, :]
            byte = tl.load(p_ptr + w_rows[:, None] * KH + j[None, :], mask=wmask, other=0).to(tl.int32)
            sc = tl.load(s_ptr + w_rows[:, None] * (KH // 16) + j[None, :] // 16, mask=wmask, other=127).to(tl.int32)
            factor = _e8m0(sc)
            # exact in bf16/f32: an E2M1 value times a power of two
            w_even = (_e2m1(byte & 15) * factor).to(x_ptr.dtype.element_ty)
            w_odd = (_e2m1(byte >> 4) * factor).to(x_ptr.dtype.element_ty)
            acc = tl.dot(x_even, tl.trans(w_even), acc, input_precision=PRECISION)
            acc = tl.dot(x_odd, tl.trans(w_odd), acc, input_precision=PRECISION)
        out = o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# The same tiles in bf16 through Triton's microscaled dot: tl.dot_scaled takes the e2m1 codes and e8m0 scales as
# stored and upcasts them itself, x as the MMA's A operand (x [16 rows, K] against the codes [K/2, BLOCK_N]). On the
# H200 (docs/benchmarks.md, Packed experts at a few rows per expert) it reads the distinct experts' bytes at
# 0.96-1.08 TB/s against the byte-decoding kernel above at 0.74-0.95: 1053 against 1299 us for one layer's two
# matmuls at 16 tokens over 64 experts. tl.dot_scaled takes no f32 operand, so f32 (exact, IEEE dots) keeps the
# kernel above. (Measured and not kept: the weights as the wide operand, 15-20% slower; a kernel decoding whole
# words as the GEMV does, no faster than the byte decode.)


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_KH": bkh}, num_warps=w, num_stages=st)
             for bn, bkh, w, st in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                                    (64, 256, 4, 2), (128, 32, 4, 4))],
    key=["N", "KH", "E_PAD"],
)
@triton.jit
def _mxfp4_scaled_dot_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KH, E, E_PAD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr):
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, BLOCK_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)  # rows of the [E*N, K/2] packed matrix
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * (2 * KH)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, KH, BLOCK_KH):
            j = start + tl.arange(0, BLOCK_KH)
            k = 2 * start + tl.arange(0, 2 * BLOCK_KH)
            g = start // 16 + tl.arange(0, BLOCK_KH // 16)
            codes = tl.load(p_ptr + w_rows[:, None] * KH + j[None, :], mask=cmask[:, None] & (j < KH)[None, :],
                            other=0)
            sc = tl.load(s_ptr + w_rows[:, None] * (KH // 16) + g[None, :],
                         mask=cmask[:, None] & (g < KH // 16)[None, :], other=127)
            x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & (k < 2 * KH)[None, :], other=0.0)
            acc = tl.dot_scaled(x, None, "bf16", tl.trans(codes), sc, "e2m1", acc)
        out = o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# The tiles with the decoded weights on either MMA operand (W_IS_A: out^T = W x^T, the weights in registers): the
# accumulator's shape, one step's dot and the store of the [rows, cols] output, for each orientation.
@triton.jit
def _tile_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_IS_A: tl.constexpr):
    if W_IS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _tile_dot(x, w, acc, W_IS_A: tl.constexpr, PRECISION: tl.constexpr):
    if W_IS_A:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _store_tile(o_ptr, acc, rows, rmask, cols, cmask, N, W_IS_A: tl.constexpr):
    if W_IS_A:
        out = o_ptr + rows.to(tl.int64)[None, :] * N + cols[:, None]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=cmask[:, None] & rmask[None, :])
    else:
        out = o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _word_tile_rows(p_ptr, s_ptr, x_ptr, expert, rows, cols, N, KW):
    # a word tile's operand rows: the words [BLOCK_N, 1, 1] and scale bytes [BLOCK_N, 1] of the expert's output
    # columns `cols` (rows of the [E*N, K/8] word and [E*N, K/32] scale matrices), and x's `rows` [BLOCK_M, 1]
    w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)
    return (p_ptr + w_rows[:, None, None] * KW, s_ptr + w_rows[:, None] * (KW // 4),
            x_ptr + rows.to(tl.int64)[:, None] * (8 * KW))


# The same tiles from 32-bit words. bf16 (BF16_PAIRS, the default where the PTX decode runs): each word straight to
# four registers of two bf16 weights already times their group's scale (`_e2m1_word_bf16_scaled_ptx`, below).
# Otherwise (TF32, the interpreter, or BF16_PAIRS off) as the GEMV decodes it (`_e2m1_word_exact_ptx`: f16 pairs,
# exact conversions to f32), each code times its group's scale in f32. Either way one MMA runs over the step, whose
# k are in pair order: a word's codes 0 4 1 5 2 6 3 7, as a PTX pair holds them, and x's eight elements alike
# (`_codes_paired`), so no decoded pair is repacked. TF32: the f32 weights and x upcast to f32 meet in a TF32 MMA,
# exact for bf16 x (bf16 and every E2M1 value times a power of two fit TF32's 10 mantissa bits); otherwise the
# weights are bf16, exactly. W_IS_A (tuned) puts the decoded weights on the MMA's register operand. Fewer
# instructions a word than tl.dot_scaled's upcast, and faster from 2 routed rows per expert (docs/benchmarks.md,
# Packed MXFP4 GEMV; a word-tile kernel with the rows split into eight phases was measured slower and removed
# earlier).


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw, "W_IS_A": wa}, num_warps=w, num_stages=st)
             for bn, bkw, w, st in ((64, 8, 4, 3), (64, 16, 4, 3), (128, 8, 4, 3), (128, 16, 8, 3), (64, 16, 4, 2))
             for wa in (False, True)],
    key=["N", "KW", "E_PAD", "TF32", "BF16_PAIRS"],
)
@triton.jit
def _mxfp4_word_tiles_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KW, E, E_PAD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                             W_IS_A: tl.constexpr, TF32: tl.constexpr, PTX_DECODE: tl.constexpr,
                             BF16_PAIRS: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_KW // 4
    expert, row0, row_end = _expert_row_block(ends_ptr, E, E_PAD, BLOCK_M)
    if expert < E:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        p_rows, s_rows, x_rows = _word_tile_rows(p_ptr, s_ptr, x_ptr, expert, rows, cols, N, KW)
        acc = _tile_acc(BLOCK_M, BLOCK_N, W_IS_A)
        for g0 in range(0, KW // 4, GROUPS):
            c0, c1, c2, c3, c4, c5, c6, c7 = _scaled_word_codes(p_rows, s_rows, g0, cmask, KW, GROUPS, PTX_DECODE,
                                                                BF16_PAIRS)
            # the step's k in pair order (`_codes_paired`), x's as well
            w = tl.reshape(_codes_paired(c0, c1, c2, c3, c4, c5, c6, c7), (BLOCK_N, 8 * BLOCK_KW))
            k = 32 * g0 + tl.arange(0, 8 * BLOCK_KW)
            x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & (k < 8 * KW)[None, :], other=0.0)
            x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_KW, 2, 4)), (0, 1, 3, 2)),
                           (BLOCK_M, 8 * BLOCK_KW))
            if TF32:
                x = x.to(tl.float32)
            else:
                w = w.to(x_ptr.dtype.element_ty)
            acc = _tile_dot(x, w, acc, W_IS_A, "tf32" if TF32 else None)
        _store_tile(o_ptr, acc, rows, rmask, cols, cmask, N, W_IS_A)


def _mxfp4_matmul_operands(xs, packed, scale, group_ends):
    """Checked, contiguous operands of the packed matmuls and their [M, N] output (unwritten)."""
    num_rows, k = xs.shape
    num_experts, n, kh = packed.shape
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    # K a whole number of scale groups, as the reference's dequantisation asks: K = 48 with one scale a row agrees
    # with K // 32, while the kernels would read part of a second group (or drop it)
    if (kh * 2 != k or k % MXFP4_GROUP_SIZE or scale.shape != (num_experts, n, k // MXFP4_GROUP_SIZE)
            or group_ends.shape != (num_experts,)):
        raise ValueError(f"MXFP4 grouped matmul shapes do not match: x {tuple(xs.shape)}, packed "
                         f"{tuple(packed.shape)}, scale {tuple(scale.shape)}, group_ends {tuple(group_ends.shape)}")
    out = torch.empty(num_rows, n, dtype=xs.dtype, device=xs.device)
    return xs.contiguous(), packed.contiguous(), scale.contiguous(), group_ends.to(torch.int32).contiguous(), out


def _packed_words(packed: torch.Tensor) -> torch.Tensor:
    """Contiguous packed bytes [E, N, K/2] as int32 words [E, N, K/8]: K/2 bytes a row, a multiple of 16, so whole
    little-endian words (a view, unless the bytes start off a word)."""
    return (packed if packed.storage_offset() % 4 == 0 else packed.clone()).view(torch.int32)


MXFP4_SCALED_DOT = True  # bf16 tiles through tl.dot_scaled (off: the byte-decoding kernel, for side-by-side runs)
# bf16 tiles from decoded words (ahead of MXFP4_SCALED_DOT): "bf16" or "tf32", the MMA's type, or None (off). On an
# H100 (docs/benchmarks.md, Packed MXFP4 GEMV) bf16 word tiles take 606.0 us a layer at 8 tokens over 64 experts
# against tl.dot_scaled's 919.8 and the GEMV's 973.9, 695.8 against 1055.1 at 16; TF32 684.0 and 782.4
MXFP4_WORD_TILES = "bf16"
# bf16 word tiles decode each word straight to scaled bf16 pairs (`_e2m1_word_bf16_scaled_ptx`; off: through f32 and
# the f32 scale multiply, for side-by-side runs): 40.4 instructions a word for the tuned tile against 57.0, and on an
# H100 598.1 us a layer at 8 tokens against 644.2, 7% faster from 8 to 32 (docs/benchmarks.md, Packed MXFP4 GEMV)
MXFP4_WORD_TILES_BF16_PAIRS = True


def _tile_kernel(xs: torch.Tensor) -> str:
    """Which 16-row tile kernel runs for rows like xs: "words" (the word tiles), "scaled_dot" (`tl.dot_scaled`) or
    "bytes" (the byte-decoding kernel). The first two were measured on Hopper only, and their bf16 MMA (or TF32 over
    bf16 x) is exact for bf16 x only, so f32 and other GPUs keep the byte kernel's dots (IEEE for f32)."""
    hopper_bf16 = (xs.dtype == torch.bfloat16 and xs.device.type == "cuda" and torch.version.hip is None
                   and torch.cuda.get_device_capability(xs.device)[0] == 9)
    if hopper_bf16 and MXFP4_WORD_TILES:
        return "words"
    if hopper_bf16 and MXFP4_SCALED_DOT and hasattr(tl, "dot_scaled"):
        return "scaled_dot"
    return "bytes"


def _mxfp4_grouped_matmul_fwd(xs, packed, scale, group_ends):
    xs, packed, scale, ends, out = _mxfp4_matmul_operands(xs, packed, scale, group_ends)
    (num_rows, n), (num_experts, _, kh) = out.shape, packed.shape
    if num_rows == 0 or n == 0:
        return out
    grid = _row_block_grid(num_rows, num_experts, n)
    kernel = _tile_kernel(xs)
    if kernel == "words":
        words = _packed_words(packed)
        tf32, ptx = MXFP4_WORD_TILES == "tf32", _ptx_decode(xs.device)
        with torch.cuda.device(xs.device):
            _mxfp4_word_tiles_kernel[grid](xs, words, scale, out, ends, n, kh // 4, num_experts,
                                           E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=_FEW_ROWS_BLOCK_M,
                                           TF32=tf32, PTX_DECODE=ptx,
                                           BF16_PAIRS=bool(MXFP4_WORD_TILES_BF16_PAIRS and ptx and not tf32))
        return out
    if kernel == "scaled_dot":
        with torch.cuda.device(xs.device):
            _mxfp4_scaled_dot_kernel[grid](xs, packed, scale, out, ends, n, kh, num_experts,
                                           E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=_FEW_ROWS_BLOCK_M)
        return out
    with torch.cuda.device(xs.device):  # Triton launches on the current device
        _mxfp4_grouped_matmul_kernel[grid](xs, packed, scale, out, ends, n, kh, num_experts,
                                           E_PAD=triton.next_power_of_2(num_experts),
                                           BLOCK_M=_FEW_ROWS_BLOCK_M, PRECISION=_dot_precision(xs.dtype))
    return out


class _MXFP4GroupedMatmul(torch.autograd.Function):
    """Gradient for x only (the packed weights are frozen): dx = dout @ W per group, through chunks of experts
    dequantised into a bounded transient copy and grouped_mm (`mxfp4_dequantised_matmul`). `launch` is the forward
    kernel's launcher (tiles, GEMV, GEMM or the dequantised chunks)."""

    @staticmethod
    def forward(ctx, xs, packed, scale, group_ends, launch):
        ctx.save_for_backward(packed, scale, group_ends)
        return launch(xs, packed, scale, group_ends)

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, group_ends = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return _dequantised_chunks(grad_out, packed, scale, group_ends, transposed=False), None, None, None, None


def dequantised_chunk_experts(n: int, k: int, itemsize: int) -> int:
    """Experts one chunk of the dequantised path holds: copies of an [n, k] expert at `itemsize` bytes a value, as
    many as fit MXFP4_DEQUANT_CHUNK_BYTES, one at least."""
    return max(1, MXFP4_DEQUANT_CHUNK_BYTES // (n * k * itemsize))


def _dequantised_chunks(xs, packed, scale, group_ends, transposed=True):
    """Each group of rows times its expert dequantised to xs.dtype (transposed: as the forward, [M, K] -> [M, N];
    else the gradient's product, [M, N] -> [M, K]), the experts taken in chunks whose copy stays within
    MXFP4_DEQUANT_CHUNK_BYTES (one expert at least). One host read of the group ends per call (prefill and training,
    never a compiled decode step)."""
    num_experts, n, kh = packed.shape
    ends = group_ends.to(torch.int32)
    grouped_mm = _grouped_mm_fn()
    chunk = dequantised_chunk_experts(n, 2 * kh, xs.element_size())
    out = xs.new_empty(xs.shape[0], n if transposed else 2 * kh)
    bounds = [0, *ends.tolist()]
    for first in range(0, num_experts, chunk):
        last = min(num_experts, first + chunk)
        row0, row1 = bounds[first], bounds[last]
        if row1 == row0:
            continue
        weight = mxfp4_dequant(packed[first:last], scale[first:last], xs.dtype)
        out[row0:row1] = grouped_mm(xs[row0:row1], weight.transpose(-2, -1) if transposed else weight,
                                    offs=ends[first:last] - row0)
    if bounds[-1] < xs.shape[0]:
        out[bounds[-1]:] = 0  # rows past the last group belong to no expert
    return out


def mxfp4_dequantised_matmul(xs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                             group_ends: torch.Tensor) -> torch.Tensor:
    """`mxfp4_grouped_matmul` (same arguments) for many rows per expert: chunks of experts dequantised into a
    transient xs.dtype copy of at most MXFP4_DEQUANT_CHUNK_BYTES, then grouped_mm (f32 accumulation); gradient for
    xs only."""
    if needs_grad(xs):
        return _MXFP4GroupedMatmul.apply(xs, packed, scale, group_ends, _dequantised_chunks)
    return _dequantised_chunks(xs, packed, scale, group_ends)


def mxfp4_grouped_matmul(xs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                         group_ends: torch.Tensor) -> torch.Tensor:
    """xs [M, K], its rows grouped by expert (group e is rows group_ends[e-1]:group_ends[e]); packed u8 [E, N, K/2],
    scale u8 [E, N, K/32] -> [M, N] in xs.dtype: each group times its dequantised expert transposed, f32
    accumulation, as `grouped_mm(xs, dequant(packed).transpose(-2, -1), offs=group_ends)`.

    Built for few rows per expert: every block of 16 rows dequantises its expert's tiles again."""
    # the custom op has no autograd formula: it runs while no gradient is recorded, the autograd Function otherwise
    if needs_grad(xs):
        return _MXFP4GroupedMatmul.apply(xs, packed, scale, group_ends, _mxfp4_grouped_matmul_fwd)
    return torch.ops.kimik3.mxfp4_grouped_matmul(xs, packed, scale, group_ends)  # one node under compile


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM over packed MXFP4 experts for many rows per expert (prefill). At 896 experts an 8K prefill routes
# ~146 rows to each expert: dequantising the stack first writes and reads a 59 GB bf16 copy per layer (more than the
# GEMMs' own time, and the peak memory of two MoE layers), so here each packed weight tile is decoded in registers
# and used by every row of a row block. The programs run in groups of GROUP_M row blocks over all column blocks, so
# a weight tile is read from HBM about once and reused from L2 by the row blocks of its expert, and a row block's
# rows stay in L2 across the column blocks.
#
# Two kernels share that schedule: the word GEMM (the default, below) and the byte GEMM first written, kept for
# side-by-side runs (MXFP4_GEMM_WORDS off). The byte GEMM takes the rows split into their even and odd columns (two
# contiguous [M, K/2] halves, one copy per call): the low nibble of byte j is column 2j and the high nibble column
# 2j+1, so each half meets one nibble's [BLOCK_N, BLOCK_KH] tile in a plain dot with no interleave in registers.
# W_IS_A puts the decoded weights on the MMA's register operand (out^T = W x^T, the rows on the MMA's narrow N side,
# so row blocks of 32-64 waste little on the last partial block of an expert); otherwise x is the A operand and the
# weights go through shared memory.


@triton.jit
def _gemm_program_block(ends_ptr, M, N, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUP_M: tl.constexpr):
    # program_id(0)'s (expert, first row, end of the expert's rows, column block): row blocks taken GROUP_M at a time
    # over all column blocks. The row blocks counted are an upper bound (each has a row, at most one per expert is
    # partial); those past the last real block get expert == E and return at once
    num_m = tl.minimum(M, tl.cdiv(M, BLOCK_M) + E)
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    expert, row0, row_end = _expert_row_block_of(pid_m, ends_ptr, E, E_PAD, BLOCK_M)
    return expert, row0, row_end, pid_n


@triton.jit
def _gemm_tile_rows_cols(row0, row_end, pid_n, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # a GEMM program's output rows (from row0, those before row_end its expert's) and columns (column block pid_n,
    # those before N real), each with its mask
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    return rows, rmask, cols, cmask


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_KH": bkh, "GROUP_M": 8}, num_warps=w, num_stages=st)
        for bm, bn, bkh, w, st in ((64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (256, 128, 32, 8, 2),
                                   (256, 128, 32, 8, 3), (128, 256, 32, 8, 2), (256, 64, 32, 4, 3))
    ],
    key=["N", "KH", "E_PAD", "W_IS_A", "SCALE_BCAST"],
)
@triton.jit
def _mxfp4_grouped_gemm_kernel(xe_ptr, xo_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, M, N, KH, E, E_PAD: tl.constexpr,
                               W_IS_A: tl.constexpr, SCALE_BCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr,
                               BLOCK_KH: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    expert, row0, row_end, pid_n = _gemm_program_block(ends_ptr, M, N, E, E_PAD, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < E:
        rows, rmask, cols, cmask = _gemm_tile_rows_cols(row0, row_end, pid_n, N, BLOCK_M, BLOCK_N)
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)  # rows of the [E*N, K/2] packed matrix
        xe_rows = xe_ptr + rows.to(tl.int64)[:, None] * KH
        xo_rows = xo_ptr + rows.to(tl.int64)[:, None] * KH
        acc = _tile_acc(BLOCK_M, BLOCK_N, W_IS_A)
        for start in range(0, KH, BLOCK_KH):
            j = start + tl.arange(0, BLOCK_KH)
            jmask = j < KH
            xmask = rmask[:, None] & jmask[None, :]
            x_even = tl.load(xe_rows + j[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(xo_rows + j[None, :], mask=xmask, other=0.0)
            wmask = cmask[:, None] & jmask[None, :]
            byte = tl.load(p_ptr + w_rows[:, None] * KH + j[None, :], mask=wmask, other=0).to(tl.int32)
            if SCALE_BCAST:  # one load per scale group, spread over its 16 bytes in registers
                g = start // 16 + tl.arange(0, BLOCK_KH // 16)
                sc = tl.load(s_ptr + w_rows[:, None] * (KH // 16) + g[None, :],
                             mask=cmask[:, None] & (g < KH // 16)[None, :], other=127).to(tl.int32)
                factor = tl.reshape(tl.broadcast_to(_e8m0(sc)[:, :, None], (BLOCK_N, BLOCK_KH // 16, 16)),
                                    (BLOCK_N, BLOCK_KH))
            else:
                sc = tl.load(s_ptr + w_rows[:, None] * (KH // 16) + j[None, :] // 16, mask=wmask,
                             other=127).to(tl.int32)
                factor = _e8m0(sc)
            # exact in bf16/f32: an E2M1 value times a power of two
            w_even = (_e2m1(byte & 15) * factor).to(xe_ptr.dtype.element_ty)
            w_odd = (_e2m1(byte >> 4) * factor).to(xe_ptr.dtype.element_ty)
            acc = _tile_dot(x_even, w_even, acc, W_IS_A, PRECISION)
            acc = _tile_dot(x_odd, w_odd, acc, W_IS_A, PRECISION)
        _store_tile(o_ptr, acc, rows, rmask, cols, cmask, N, W_IS_A)


MXFP4_GEMM_W_IS_A = False  # which MMA operand the decoded weights are (module note above); measured, see docs
MXFP4_GEMM_SCALE_BCAST = True  # scales loaded once per group and broadcast (else one gathered load per byte)


# The same GEMM from 32-bit words, as the word tiles decode them (`_scaled_word_codes`): a word's eight codes joined
# in k order (`_codes_in_order`), so x is read as it is, unsplit, and one MMA takes each step. The decoded weights
# are the MMA's register operand (out^T = W x^T), where bf16 x on Hopper decodes each word straight to scaled bf16
# pairs (BF16_PAIRS; in the shared-memory operand Triton 3.6 does not compile them); elsewhere (f32, fp16, other
# GPUs, the interpreter) the f32 decode and one multiply by the group's scale, exact. On an H100 (docs/benchmarks.md,
# Packed MXFP4 prefill) one 896-expert layer at 8K tokens runs at 286 / 287 TFLOP/s (gate_up / down) with the bf16
# pairs, 278 through f32, against the byte GEMM's 213 / 207 and cuBLAS's grouped GEMM over a bf16 copy at 356 / 351;
# and it needs no even/odd copy of the rows (0.875 GiB at 8K for gate_up).
@triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_KW": bkw, "GROUP_M": 8}, num_warps=w, num_stages=st)
             for bm, bn, bkw, w, st in ((128, 128, 8, 8, 3), (128, 128, 16, 8, 3), (128, 256, 8, 8, 3),
                                        (256, 128, 8, 8, 3), (64, 128, 16, 4, 3), (128, 128, 8, 4, 4))],
    key=["N", "KW", "E_PAD", "BF16_PAIRS"],
)
@triton.jit
def _mxfp4_word_gemm_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, M, N, KW, E, E_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                            GROUP_M: tl.constexpr, PTX_DECODE: tl.constexpr, PRECISION: tl.constexpr,
                            BF16_PAIRS: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_KW // 4
    expert, row0, row_end, pid_n = _gemm_program_block(ends_ptr, M, N, E, E_PAD, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < E:
        rows, rmask, cols, cmask = _gemm_tile_rows_cols(row0, row_end, pid_n, N, BLOCK_M, BLOCK_N)
        p_rows, s_rows, x_rows = _word_tile_rows(p_ptr, s_ptr, x_ptr, expert, rows, cols, N, KW)
        acc = _tile_acc(BLOCK_M, BLOCK_N, True)
        for g0 in range(0, KW // 4, GROUPS):
            c0, c1, c2, c3, c4, c5, c6, c7 = _scaled_word_codes(p_rows, s_rows, g0, cmask, KW, GROUPS, PTX_DECODE,
                                                                BF16_PAIRS)
            w = tl.reshape(_codes_in_order(c0, c1, c2, c3, c4, c5, c6, c7),
                           (BLOCK_N, 8 * BLOCK_KW)).to(x_ptr.dtype.element_ty)
            k = 32 * g0 + tl.arange(0, 8 * BLOCK_KW)
            x = tl.load(x_rows + k[None, :], mask=rmask[:, None] & (k < 8 * KW)[None, :], other=0.0)
            acc = _tile_dot(x, w, acc, True, PRECISION)
        _store_tile(o_ptr, acc, rows, rmask, cols, cmask, N, True)


MXFP4_GEMM_WORDS = True  # the prefill GEMM decodes words (off: the byte-decoding GEMM, for side-by-side runs)


def _gemm_bf16_pairs(xs: torch.Tensor) -> bool:
    """Whether the word GEMM decodes to scaled bf16 pairs for rows like xs: bf16 on Hopper with the PTX decode, as
    the word tiles (measured there only; `_tile_kernel`)."""
    return (xs.dtype == torch.bfloat16 and _ptx_decode(xs.device)
            and torch.cuda.get_device_capability(xs.device)[0] == 9)


def _mxfp4_grouped_gemm_fwd(xs, packed, scale, group_ends):
    xs, packed, scale, ends, out = _mxfp4_matmul_operands(xs, packed, scale, group_ends)
    (num_rows, n), (num_experts, _, kh) = out.shape, packed.shape
    if num_rows == 0 or n == 0:
        return out

    def grid(meta):
        num_m = min(num_rows, triton.cdiv(num_rows, meta["BLOCK_M"]) + num_experts)
        return (num_m * triton.cdiv(n, meta["BLOCK_N"]),)

    if MXFP4_GEMM_WORDS:
        with torch.cuda.device(xs.device):  # Triton launches on the current device
            _mxfp4_word_gemm_kernel[grid](xs, _packed_words(packed), scale, out, ends, num_rows, n, kh // 4,
                                          num_experts, E_PAD=triton.next_power_of_2(num_experts),
                                          PTX_DECODE=_ptx_decode(xs.device), PRECISION=_dot_precision(xs.dtype),
                                          BF16_PAIRS=_gemm_bf16_pairs(xs))
        return out
    halves = xs.view(num_rows, kh, 2)
    x_even, x_odd = halves[..., 0].contiguous(), halves[..., 1].contiguous()
    with torch.cuda.device(xs.device):
        _mxfp4_grouped_gemm_kernel[grid](x_even, x_odd, packed, scale, out, ends, num_rows, n, kh, num_experts,
                                         E_PAD=triton.next_power_of_2(num_experts), W_IS_A=MXFP4_GEMM_W_IS_A,
                                         SCALE_BCAST=MXFP4_GEMM_SCALE_BCAST,
                                         PRECISION=_dot_precision(xs.dtype))
    return out


def mxfp4_grouped_gemm(xs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                       group_ends: torch.Tensor) -> torch.Tensor:
    """`mxfp4_grouped_matmul` (same arguments, same numbers: f32 accumulation, one rounding to xs.dtype) for many
    rows per expert (prefill): row blocks of 64-256 rows, each packed tile decoded from its words once per row block,
    no dequantised copy of the stack. Without autograd recording it runs as the custom op
    `torch.ops.kimik3.mxfp4_grouped_gemm`; gradient for xs only."""
    if needs_grad(xs):
        return _MXFP4GroupedMatmul.apply(xs, packed, scale, group_ends, _mxfp4_grouped_gemm_fwd)
    return torch.ops.kimik3.mxfp4_grouped_gemm(xs, packed, scale, group_ends)  # one node under compile


# --------------------------------------------------------------------------------------------------------------
# Packed MXFP4 GEMV for one or two routed rows per expert (decode). A tl.dot tile has at least 16 rows, so with a
# row or two per expert the tile kernel above wastes most of every dot and moves each decoded weight through shared
# memory first; here a program multiplies one routed row by a BLOCK_N slice of its expert's output columns on the
# CUDA cores: the packed bytes stream in along K as 32-bit words (4 words per scale group), each word's eight codes
# are decoded to f32 in registers, and the sum over K is a tl.sum. Rows of one expert each read its weights; up to
# two rows per expert that still beats the tile kernel, which decodes each tile once for 16 rows (measured on the
# H200: MXFP4_GEMV_ROWS_PER_EXPERT, above).
#
# What bounds it (benchmarks/diagnostics/diagnose_mxfp4_gemv.py, docs/benchmarks.md, Packed MXFP4 GEMV): loading the
# words alone runs at 3.0-3.7 TB/s, loading and decoding them at 2.2-3.1, and x fetched as eight strided scalars per
# word dragged the whole kernel to 1.4; x is therefore one 16-byte load per word. On NVIDIA GPUs a word is decoded two
# codes per 32-bit operation: a code's magnitude bits placed at bits 9-11 of an f16 (exponent low bits + top mantissa
# bit) and its sign at bit 15 make the f16 2^-14 times the E2M1 value, denormal codes included, so four shift/mask
# steps decode the word into four f16 pairs and eight exact conversions give f32 (1.5 -> 2.0 TB/s against the
# portable decode). The portable decode (the interpreter, other backends) builds the same 2^-14-scaled values one
# code at a time; both are exact, and the 2^14 goes back into the group's scale.

_E2M1_F16_PAIRS_PTX_TEXT = """
{
.reg .b32 m, s, p;
.reg .b16 lo, hi;
shl.b32 m, $8, 9; and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 12; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $0, lo; cvt.f32.f16 $4, hi;
shl.b32 m, $8, 5; and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 8; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $1, lo; cvt.f32.f16 $5, hi;
shl.b32 m, $8, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 4; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $2, lo; cvt.f32.f16 $6, hi;
shr.b32 m, $8, 3; and.b32 m, m, 0x0E000E00; and.b32 s, $8, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $3, lo; cvt.f32.f16 $7, hi;
}
"""
_E2M1_F16_PAIRS_PTX = tl.constexpr(_E2M1_F16_PAIRS_PTX_TEXT)  # a constexpr: jit functions read no other globals


# The same decode times 2^14 in f16 before the conversions (exact: E2M1 values are normal f16 numbers, and f16
# multiplies keep subnormal inputs), so each f32 is the E2M1 value itself: the word tiles multiply it by the group's
# scale alone, which stays finite for every scale byte whose weights are (2^14 times the scale does not, from byte
# 241 on).
_E2M1_F16_PAIRS_EXACT_PTX = tl.constexpr(
    _E2M1_F16_PAIRS_PTX_TEXT.replace(".reg .b32 m, s, p;", ".reg .b32 m, s, p, k;")
    .replace(".reg .b16 lo, hi;", ".reg .b16 lo, hi;\nmov.b32 k, 0x74007400;")
    .replace("or.b32 p, m, s;", "or.b32 p, m, s; mul.rn.f16x2 p, p, k;"))


@triton.jit
def _e2m1_word_asm(word, PAIRS_PTX: tl.constexpr):
    # the eight codes of a little-endian word (nibble i = element i) as f32 through PAIRS_PTX, two per f16 pair: pair
    # p holds nibbles p and p + 4, i.e. the 16-bit halves of the word shifted alike
    c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
        PAIRS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [word], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    return (c0.to(tl.float32, bitcast=True), c1.to(tl.float32, bitcast=True), c2.to(tl.float32, bitcast=True),
            c3.to(tl.float32, bitcast=True), c4.to(tl.float32, bitcast=True), c5.to(tl.float32, bitcast=True),
            c6.to(tl.float32, bitcast=True), c7.to(tl.float32, bitcast=True))


@triton.jit
def _e2m1_word_ptx(word):
    # the eight codes times 2^-14
    return _e2m1_word_asm(word, _E2M1_F16_PAIRS_PTX)


@triton.jit
def _e2m1_word_exact_ptx(word):
    # the eight codes as their E2M1 values
    return _e2m1_word_asm(word, _E2M1_F16_PAIRS_EXACT_PTX)


@triton.jit
def _e2m1_word_exact(word):
    return (_e2m1(word), _e2m1(word >> 4), _e2m1(word >> 8), _e2m1(word >> 12), _e2m1(word >> 16), _e2m1(word >> 20),
            _e2m1(word >> 24), _e2m1(word >> 28))


# bf16 pairs straight from the word (the word tiles' bf16 MMA): a code's magnitude bits at bits 6-8 of a bf16
# (exponent low bits + top mantissa bit) and its sign at bit 15 make the bf16 2^-126 times the E2M1 value (codes 0
# and 1 on the denormals 0 and 2^-127); one multiply by 2^126 and one by the group's scale (both exact: bf16 multiplies
# keep subnormals) give the scaled weights, two codes per instruction. Pair p holds nibbles p and p + 4.
_E2M1_BF16_PAIRS_SCALED_PTX = tl.constexpr("""
{
.reg .b32 m, s, p, k;
mov.b32 k, 0x7E807E80;
shl.b32 m, $8, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, $8, 12; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mul.rn.bf16x2 p, p, k; mul.rn.bf16x2 p, p, $9; mov.b32 {$0, $4}, p;
shl.b32 m, $8, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, $8, 8; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mul.rn.bf16x2 p, p, k; mul.rn.bf16x2 p, p, $9; mov.b32 {$1, $5}, p;
shr.b32 m, $8, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, $8, 4; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mul.rn.bf16x2 p, p, k; mul.rn.bf16x2 p, p, $9; mov.b32 {$2, $6}, p;
shr.b32 m, $8, 6; and.b32 m, m, 0x01C001C0; and.b32 s, $8, 0x80008000; or.b32 p, m, s;
mul.rn.bf16x2 p, p, k; mul.rn.bf16x2 p, p, $9; mov.b32 {$3, $7}, p;
}
""")


@triton.jit
def _e2m1_word_bf16_scaled_ptx(word, scale_pair):
    # the eight codes of a word times the group's scale, as bf16; scale_pair: the scale as a bf16 pair
    return tl.inline_asm_elementwise(_E2M1_BF16_PAIRS_SCALED_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [word, scale_pair],
                                     dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _e8m0_bf16_pair(sc):
    # 2^(sc - 127) as two bf16 in one int32: normal for sc >= 1, the denormal 2^-127 for sc == 0
    half = tl.where(sc == 0, 0x0040, sc << 7)
    return half | (half << 16)


@triton.jit
def _scaled_word_codes(p_rows, s_rows, g0, cmask, KW, GROUPS: tl.constexpr, PTX_DECODE: tl.constexpr,
                       BF16_PAIRS: tl.constexpr):
    # one K step of a word tile: the words of scale groups g0 .. g0 + GROUPS - 1 of the rows p_rows ([BLOCK_N,
    # GROUPS, 4], whole groups masked), each code times its group's scale: code i of every word, eight tensors,
    # bf16 straight from the word (BF16_PAIRS) or f32
    g = g0 + tl.arange(0, GROUPS)
    gmask = g < KW // 4
    q = g[:, None] * 4 + tl.arange(0, 4)[None, :]  # word index along the row: [GROUPS, 4]
    wmask = cmask[:, None] & gmask[None, :]
    word = tl.load(p_rows + q[None, :, :], mask=wmask[:, :, None], other=0)
    sc = tl.load(s_rows + g[None, :], mask=wmask, other=127).to(tl.int32)
    if BF16_PAIRS:
        c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_bf16_scaled_ptx(word, _e8m0_bf16_pair(sc)[:, :, None])
    else:
        if PTX_DECODE:
            c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_exact_ptx(word)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_exact(word)
        f = _e8m0(sc)[:, :, None]  # exact: an E2M1 value times a power of two
        c0, c1, c2, c3, c4, c5, c6, c7 = c0 * f, c1 * f, c2 * f, c3 * f, c4 * f, c5 * f, c6 * f, c7 * f
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _codes_in_order(c0, c1, c2, c3, c4, c5, c6, c7):
    # a word's eight codes along a new last dimension in element order: join puts its pair last, so the last join is
    # the fastest index (code i = 4a + 2b + c)
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@triton.jit
def _codes_paired(c0, c1, c2, c3, c4, c5, c6, c7):
    # a word's eight codes along a new last dimension in pair order, codes 0 4 1 5 2 6 3 7: each pair of a PTX
    # decode (codes p and p + 4, one 32-bit register) adjacent, where an MMA operand wants two adjacent k in one
    # register, so the tiles pass the decoded pairs on without repacking them; x takes the same order of its eight
    # elements (position 2i + j holds element 4j + i)
    return tl.join(tl.join(tl.join(c0, c2), tl.join(c1, c3)), tl.join(tl.join(c4, c6), tl.join(c5, c7)))


@triton.jit
def _e2m1_scaled(code):
    return _e2m1_bits(code) * 5.192296858534828e33  # 2^112: the E2M1 value times 2^-14, the PTX decode's scale


@triton.jit
def _e2m1_word(word):
    return (_e2m1_scaled(word), _e2m1_scaled(word >> 4), _e2m1_scaled(word >> 8), _e2m1_scaled(word >> 12),
            _e2m1_scaled(word >> 16), _e2m1_scaled(word >> 20), _e2m1_scaled(word >> 24), _e2m1_scaled(word >> 28))


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_KW": bkw}, num_warps=w, num_stages=st)
        for bn, bkw, w, st in ((8, 128, 4, 2), (16, 64, 2, 2), (16, 64, 4, 2), (16, 128, 4, 2), (16, 256, 8, 2),
                               (32, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2))
    ],
    # ROW_CLASS (routed rows per expert, 1 or 2) only keys the tuning: the tile that is best at one row per expert
    # is not the best at two, and a tuning keyed on the shapes alone keeps the first one it meets
    # (docs/benchmarks.md, Packed MXFP4 GEMV)
    key=["N", "KW", "ROW_CLASS", "PTX_DECODE"],
)
@triton.jit
def _mxfp4_gemv_kernel(x_ptr, p_ptr, s_ptr, o_ptr, ends_ptr, N, KW, E, ROW_CLASS, E_PAD: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, PTX_DECODE: tl.constexpr):
    # p_ptr: the packed bytes as int32 words, KW = K/8 per row; one E8M0 scale per 4 words (K % 32 == 0), so the
    # tile is [BLOCK_N rows, GROUPS scale groups, 4 words] and only whole groups are masked
    GROUPS: tl.constexpr = BLOCK_KW // 4
    # row program_id(0) and its expert: the tile kernels' row-block search with blocks of one row
    expert, row, _ = _expert_row_block(ends_ptr, E, E_PAD, 1)
    if expert < E:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_rows = expert.to(tl.int64) * N + cols.to(tl.int64)  # rows of the [E*N, K/8] word matrix
        p_rows = p_ptr + w_rows[:, None, None] * KW
        s_rows = s_ptr + w_rows[:, None] * (KW // 4)
        x_row = x_ptr + row.to(tl.int64) * (8 * KW)
        g_idx = tl.arange(0, GROUPS)
        q_idx = tl.arange(0, 4)
        # one partial sum per (column, scale group) slot; reduced over the groups once at the end
        acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        for g0 in range(0, KW // 4, GROUPS):
            g = g0 + g_idx
            gmask = g < KW // 4
            q = g[:, None] * 4 + q_idx[None, :]  # word index along the row: [GROUPS, 4]
            wmask = cmask[:, None] & gmask[None, :]
            word = tl.load(p_rows + q[None, :, :], mask=wmask[:, :, None], other=0)
            if PTX_DECODE:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word_ptx(word)
            else:
                c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word(word)
            # [BLOCK_N, GROUPS, 4 words, 8 codes]: code i of word q multiplies element 8q + i of x, loaded as one
            # 16-byte vector per word (eight strided loads per word cost more than the decode: docs/benchmarks.md,
            # Packed MXFP4 GEMV). Products of 2^-14-scaled E2M1 values with 16-bit x are exact in f32; the group's
            # power-of-two scale (times 2^14) multiplies its 32-term sum
            codes = tl.reshape(_codes_in_order(c0, c1, c2, c3, c4, c5, c6, c7), (BLOCK_N, GROUPS, 4, 8))
            xv = tl.load(x_row + 8 * q[:, :, None] + tl.arange(0, 8)[None, None, :], mask=gmask[:, None, None],
                         other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(codes * xv[None, :, :, :], axis=3), axis=2)
            factor = _e8m0(tl.load(s_rows + g[None, :], mask=wmask, other=127).to(tl.int32))
            acc += (part * 16384.0) * factor
        out = tl.sum(acc, axis=1)
        tl.store(o_ptr + row.to(tl.int64) * N + cols, out.to(o_ptr.dtype.element_ty), mask=cmask)


MXFP4_PTX_DECODE = True  # the f16-pair decode where it can run (off: the portable decode, for side-by-side runs)


def _ptx_decode(device: torch.device) -> bool:
    # the f16-pair decode is NVIDIA PTX: not for ROCm, not for the interpreter (CPU debugging)
    return (MXFP4_PTX_DECODE and device.type == "cuda" and torch.version.hip is None
            and os.environ.get("TRITON_INTERPRET") != "1")


def _mxfp4_gemv_fwd(xs, packed, scale, group_ends):
    xs, packed, scale, ends, out = _mxfp4_matmul_operands(xs, packed, scale, group_ends)
    (num_rows, n), (num_experts, _, kh) = out.shape, packed.shape
    if num_rows == 0 or n == 0:
        return out
    words = _packed_words(packed)

    def grid(meta):
        return (num_rows, triton.cdiv(n, meta["BLOCK_N"]))

    with torch.cuda.device(xs.device):  # Triton launches on the current device
        _mxfp4_gemv_kernel[grid](xs, words, scale, out, ends, n, kh // 4, num_experts,
                                 min(MXFP4_GEMV_ROWS_PER_EXPERT, triton.cdiv(num_rows, num_experts)),
                                 E_PAD=triton.next_power_of_2(num_experts), PTX_DECODE=_ptx_decode(xs.device))
    return out


def mxfp4_gemv(xs: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               group_ends: torch.Tensor) -> torch.Tensor:
    """`mxfp4_grouped_matmul` (same arguments, same numbers: f32 accumulation, one rounding to xs.dtype) as a GEMV
    for one or two rows per expert: each routed row reads its expert's packed bytes once, with no 16-row tile.
    Rows past group_ends[-1] are left unwritten. Without autograd recording it runs as the custom op
    `torch.ops.kimik3.mxfp4_gemv` (one node under torch.compile); gradient for xs only."""
    # the custom op has no autograd formula: it runs while no gradient is recorded, the autograd Function otherwise
    if needs_grad(xs):
        return _MXFP4GroupedMatmul.apply(xs, packed, scale, group_ends, _mxfp4_gemv_fwd)
    return torch.ops.kimik3.mxfp4_gemv(xs, packed, scale, group_ends)  # one node under compile


# --------------------------------------------------------------------------------------------------------------
# The custom ops of the three packed matmuls: one reference (every kernel computes it), one fake


def _mxfp4_grouped_matmul_reference(xs, packed, scale, group_ends):
    """Each group times its dequantised expert, f32 accumulation (the numbers of the packed Triton kernels)."""
    return _grouped_matmul_reference(xs, _reference.dequantize_mxfp4(packed, scale, torch.float32), group_ends)


def _mxfp4_grouped_matmul_fake(xs, packed, scale, group_ends):
    return torch.empty(xs.shape[0], packed.shape[1], dtype=xs.dtype, device=xs.device)


def _packed_matmul_op(name: str, launch_name: str, doc: str):
    """The custom op `torch.ops.kimik3.<name>` of one packed matmul kernel: xs [M, K] grouped by expert, packed
    [E, N, K/2], scale [E, N, K/32], group_ends [E] -> [M, N]; every kernel computes the one reference. The CUDA
    kernel is this module's launcher `launch_name`, looked up at each call (a launcher replaced on the module, as the
    GPU tests' call counters do, is the one that runs)."""

    def reference(xs: Tensor, packed: Tensor, scale: Tensor, group_ends: Tensor) -> Tensor:
        return _mxfp4_grouped_matmul_reference(xs, packed, scale, group_ends)

    def cuda_launch(xs, packed, scale, group_ends):
        return globals()[launch_name](xs, packed, scale, group_ends)

    reference.__doc__ = doc
    op = custom_op(name)(reference)
    op.register_kernel("cuda")(cuda_launch)
    op.register_fake(_mxfp4_grouped_matmul_fake)
    return op


_packed_matmul_op("mxfp4_grouped_matmul", "_mxfp4_grouped_matmul_fwd", "CUDA: the tile kernel (16-row tiles).")
_packed_matmul_op("mxfp4_gemv", "_mxfp4_gemv_fwd", "For one or two rows per expert; CUDA: the GEMV kernel (one "
                  "program per routed row).")
_packed_matmul_op("mxfp4_grouped_gemm", "_mxfp4_grouped_gemm_fwd", "For many rows per expert; CUDA: the prefill GEMM "
                  "(packed tiles decoded once per row block).")


# --------------------------------------------------------------------------------------------------------------
# Packed experts: the routing of moe.py around the packed matmuls

def mxfp4_experts_path(num_routed_rows: int, num_experts: int, word_tiles: bool = False) -> str:
    """How the packed experts run for this many routed rows (tokens x top-k): "gemv", "tiles", "gemm" or
    "dequantised" (module constants above); `word_tiles`: the tiles are the word-decoding kernel. A static condition
    on shapes, dtype and device, so a compiled decode step picks its path at trace time."""
    gemv_rows = MXFP4_GEMV_ROWS_PER_EXPERT_BESIDE_WORD_TILES if word_tiles else MXFP4_GEMV_ROWS_PER_EXPERT
    # MXFP4_GEMV_ROWS_PER_EXPERT = 0 turns the GEMV off beside either tile kernel (the GPU tests' switch)
    if num_routed_rows <= min(gemv_rows, MXFP4_GEMV_ROWS_PER_EXPERT) * num_experts:
        return "gemv"
    if num_routed_rows <= MXFP4_TILE_ROWS_PER_EXPERT * num_experts:
        return "tiles"
    if num_routed_rows <= MXFP4_GEMM_ROWS_PER_EXPERT * num_experts:
        return "gemm"
    return "dequantised"


@twin("moe_experts_mxfp4", needs=("triton",), check=_grouped_mm_fn)
def moe_experts_mxfp4(
    x, topk_indices, topk_weights, gate_up_packed, gate_up_scale, down_packed, down_scale, beta=None,
    linear_beta=None,
):
    """Same contract as `ops_kimi_k3.moe_experts_mxfp4`; x and the routing weights get gradients, the
    packed weights are frozen.

    With few routed rows per expert (decode, small batches; `mxfp4_experts_path`), both expert matmuls read the
    packed weights and decode them in registers: HBM traffic is the routed experts' packed bytes. At one row
    per expert that is the Triton GEMV (one program per routed row), up to 16 the Triton grouped matmul (16-row
    tiles). With more rows (prefill), the packed grouped GEMM (row blocks of up to 256 rows, each tile decoded once
    per block), and with many rows per expert chunks of dequantised experts through grouped_mm (never the whole
    stack at once; docs/benchmarks.md, Packed MXFP4 prefill)."""
    num_experts = gate_up_packed.shape[0]
    word_tiles = x.is_cuda and _tile_kernel(x) == "words"
    path = mxfp4_experts_path(x.shape[0] * topk_indices.shape[-1], num_experts, word_tiles)
    matmul = {"gemv": mxfp4_gemv, "tiles": mxfp4_grouped_matmul, "gemm": mxfp4_grouped_gemm,
              "dequantised": mxfp4_dequantised_matmul}[path]
    return _routed_experts(
        x, topk_indices, topk_weights, num_experts, gate_up_packed.shape[1] // 2,
        lambda xs, offs: matmul(xs, gate_up_packed, gate_up_scale, offs),
        lambda act, offs: matmul(act, down_packed, down_scale, offs),
        beta, linear_beta,
    )
