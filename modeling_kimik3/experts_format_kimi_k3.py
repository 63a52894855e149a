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
"""How the routed experts are stored: one object per value of the config key `experts_format` (docs/design.md,
Expert formats).

A format says what a fused expert stack (`gate_up_proj [E, 2I, Dl]`, `down_proj [E, Dl, I]`) is in memory and on
disk: the tensors it keeps (our names: the stack's name plus each suffix) and the release's per-expert tensors of one
part, how to make empty ones, the dense values they hold, how dense values become them, the op that runs the experts
over them, their bytes, the sizes it needs, and the values a load refuses. The model, the loaders, the offload and
the LoRA helpers ask the format; none of them tests which format it is. The MXFP4 maths (E2M1 codes, E8M0 scales,
groups of 32, the rounding) is ops_kimi_k3's `dequantize_mxfp4` / `quantize_mxfp4`, used here and nowhere restated.
"""

from __future__ import annotations

import contextvars
import functools

import torch

from .dispatch_kimi_k3 import fast_or_reference
from .ops_kimi_k3 import MXFP4_GROUP_SIZE, _E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4


# E8M0 byte 255 decodes to 2^128 (inf): never a real scale.
E8M0_INF = 255


class ExpertsFormat:
    """One way of storing the routed experts. Subclasses set the class attributes and the methods; `register` makes a
    format known to the config, the load option and the model."""

    name: str
    # our tensors of one fused stack: `stack + suffix`, in this order (what `KimiK3Experts.stacks` returns)
    suffixes: tuple[str, ...]
    # the release's tensors of one expert's part (`experts.{e}.{w1,w2,w3}.` + suffix), in the same order
    release_suffixes: tuple[str, ...]
    # the FAST_OPS name of the routed experts over these tensors: op(x, top_indices, top_weights, *stacks, *betas);
    # a format without an op of its own overrides `run` (decode, then DENSE's)
    op: str
    # whether its tensors take gradients (else frozen, and PEFT reaches the experts through adapter points)
    trainable: bool
    # how messages name the form ("the routed experts are stored ..."), a memory plan, a model card's table and its
    # conversion provenance; the card's extra Hub tag, if any
    description: str
    summary: str
    card_text: str
    provenance_text: str
    card_tag: str | None = None
    # tensor parallel (`tp_plan="auto"`): the transformers parallel style of each stack's tensors (every suffix
    # alike); both stacks split along the experts' intermediate width. None: the format does not shard by tensor.
    tp_styles: dict[str, str] | None = None

    def run(self, x: torch.Tensor, top_indices: torch.Tensor, top_weights: torch.Tensor, stacks, betas):
        """The routed experts' SiTU-GLU output over `stacks` (gate_up's tensors, then down's, in this format's order):
        the format's op, fast where a twin applies (ops_kimi_k3.moe_experts for the maths)."""
        return fast_or_reference(self.op, x)(x, top_indices, top_weights, *stacks, *betas)

    def run_on_host(self, x: torch.Tensor, offsets: list[int], stacks, experts: list[int], situ_betas):
        """The SiTU-GLU experts `experts` (ids into the layer's host stacks [E, ...], this format's order) over rows
        of x on the CPU (rows offsets[i] .. offsets[i+1] to experts[i]), each row's output before its routing weight,
        by a CPU kernel over the stored bytes; None where the format has none (the caller runs the reference:
        host_experts_kimi_k3.host_routes)."""
        return None

    def host_kernels(self):
        """The module of the format's CPU kernels over its stored bytes, None where it has none or they cannot be
        built: `run_on_host` calls it, and host_experts_kimi_k3.StreamedRoutes takes its host step (`ExpertTable`,
        `HostRouteStep`, `register_step`, `host_routes_in_stream`)."""
        return None

    def empty(self, shape: tuple[int, int, int], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """New tensors of a stack of dense shape [E, rows, K] (their values are the load's to write)."""
        raise NotImplementedError

    def dense(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        """The dense values [E, rows, K] of one stack's tensors, in `dtype`."""
        raise NotImplementedError

    def dense_shape(self, tensors) -> tuple[int, ...]:
        """The shape of the dense values of one stack's tensors (no values read)."""
        raise NotImplementedError

    def from_dense(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Dense values [..., rows, K] as this format's tensors (a rounding where the format is coarser)."""
        raise NotImplementedError

    def bytes_per_weight(self, dtype_bytes: int) -> float:
        """Bytes one weight of a stack takes, with `dtype_bytes` the model's dtype's size."""
        raise NotImplementedError

    def size_problem(self, sizes: dict[str, int]) -> str | None:
        """Why the expert sizes (`moe_intermediate_size`, `latent_size`) cannot be stored this way, or None."""
        return None

    def first_overflow(self, tensors, dtype: torch.dtype):
        """The first group of stored values that is not finite in `dtype` once decoded, as (index, scale byte, code),
        or None: a load refuses it (the format's values are decoded at every forward)."""
        return None


class DenseExperts(ExpertsFormat):
    """Plain tensors of the model's dtype: the release's MXFP4 experts dequantised exactly at load."""

    name = "dense"
    suffixes = ("",)
    release_suffixes = ("weight",)
    op = "moe_experts"
    trainable = True
    description = "dense"
    summary = "dense bf16"
    card_text = "unpacked (the model's dtype)"
    provenance_text = "bf16 (exactly dequantised from the release's MXFP4)"
    tp_styles = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}

    def empty(self, shape, dtype):
        return (torch.empty(shape, dtype=dtype),)

    def dense(self, tensors, dtype):
        (weight,) = tensors
        return weight.to(dtype)

    def dense_shape(self, tensors):
        return tuple(tensors[0].shape)

    def from_dense(self, weight):
        return (weight,)

    def bytes_per_weight(self, dtype_bytes):
        return float(dtype_bytes)


class Mxfp4Experts(ExpertsFormat):
    """The release's format, kept packed: uint8 E2M1 codes (two per byte) [E, rows, K/2] and one E8M0 scale byte per
    group of 32 values along K [E, rows, K/32]; weight-only, dequantised to the compute dtype at every forward unless
    a fast kernel multiplies the packed tiles."""

    name = "mxfp4"
    suffixes = ("_packed", "_scale")
    release_suffixes = ("weight_packed", "weight_scale")
    op = "moe_experts_mxfp4"
    trainable = False
    description = "packed (MXFP4)"
    summary = "MXFP4 (4.25 bits per value: 4-bit codes + one E8M0 scale byte per 32)"
    card_text = "MXFP4 (packed, dequantised on the fly)"
    provenance_text = "MXFP4 (kept packed)"
    # down_proj's input dim is the split one: whole 32-value groups per rank, codes and scales alike
    # (parallel_kimi_k3.py registers the style)
    tp_styles = {"gate_up_proj": "packed_colwise", "down_proj": "kimi_k3_mxfp4_rowwise"}
    card_tag = "mxfp4"
    group_size = MXFP4_GROUP_SIZE

    def empty(self, shape, dtype):
        *lead, k = shape
        codes = torch.zeros(*lead, k // 2, dtype=torch.uint8)
        scales = torch.full((*lead, k // MXFP4_GROUP_SIZE), 127, dtype=torch.uint8)  # 2^0
        return codes, scales

    def dense(self, tensors, dtype):
        codes, scales = tensors
        return dequantize_mxfp4(codes, scales, dtype)

    def dense_shape(self, tensors):
        codes = tensors[0]
        return (*codes.shape[:-1], 2 * codes.shape[-1])

    def from_dense(self, weight):
        return quantize_mxfp4(weight)

    def bytes_per_weight(self, dtype_bytes):
        return 0.5 + 1 / MXFP4_GROUP_SIZE

    def run_on_host(self, x, offsets, stacks, experts, situ_betas):
        mxfp4_host = self.host_kernels()
        if mxfp4_host is None or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        gate_codes, gate_scales, down_codes, down_scales = stacks
        return mxfp4_host.host_experts(x, offsets, [(gate_codes[e], gate_scales[e]) for e in experts],
                                       [(down_codes[e], down_scales[e]) for e in experts], *situ_betas)

    def host_kernels(self):
        # kimik3.kernels.mxfp4_host: the packed bytes multiplied where they are (no dequantised copy); absent from a
        # folder's copy of the code without the package, or unbuildable (no C compiler): the reference runs
        try:
            from kimik3.kernels import mxfp4_host
        except ImportError:
            return None
        return mxfp4_host if mxfp4_host.library() is not None else None

    def size_problem(self, sizes):
        for key, value in sizes.items():
            if value % MXFP4_GROUP_SIZE:
                return f"mxfp4 needs {key} to be a multiple of {MXFP4_GROUP_SIZE}"
        return None

    def first_overflow(self, tensors, dtype):
        return mxfp4_overflow(*tensors, dtype)


@functools.lru_cache(maxsize=None)
def _first_overflowing_byte(limit: float) -> int:
    """The smallest E8M0 byte whose group can decode past `limit` (the largest code, 6.0, times 2^(byte - 127))."""
    byte = 0
    while byte < E8M0_INF and 6.0 * 2.0 ** (byte - 127) <= limit:
        byte += 1
    return byte


def mxfp4_overflow(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """The first MXFP4 group that decodes to a non-finite value in `dtype`: (index into `scale`, its byte, the signed
    code that overflows), or None. A valid scale byte can still overflow: 0xFE with code 6.0 is 1.5 x 2^129, inf in
    bf16 and f32 (the decode multiplies in f32), and fp16 overflows from byte 0x8D on. Only groups whose byte is high
    enough for the largest code to overflow are decoded here, so a finite checkpoint costs one comparison per scale
    byte. packed u8 [..., N, K/2], scale u8 [..., N, K/32]."""
    limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    low = _first_overflowing_byte(limit)
    if scale.numel() == 0 or int(scale.max()) < low:  # a reduction, no mask: the usual case
        return None
    risky = scale >= low
    where = risky.nonzero()
    groups = packed.reshape(*scale.shape, MXFP4_GROUP_SIZE // 2)[risky]  # [n, 16] bytes, two codes each
    codes = torch.stack([groups & 0xF, groups >> 4], dim=-1).reshape(groups.shape[0], -1).long()
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float64, device=codes.device)
    values = table[codes]  # [n, 32] signed code values
    largest = values.abs().argmax(dim=-1, keepdim=True)
    code = values.gather(-1, largest).squeeze(-1)
    bytes_ = scale[risky].long()
    over = (code.abs() * torch.pow(2.0, (bytes_ - 127).double()) > limit) | (bytes_ == E8M0_INF)
    if not bool(over.any()):
        return None
    first = int(over.nonzero()[0, 0])
    return [int(i) for i in where[first]], int(bytes_[first]), float(code[first])


# Whether experts modules built now offer adapter points (KimiK3Experts; a format whose tensors take no gradient):
# off during a parallel load, where FSDP shards every parameter and cannot shard a broadcast one
OFFER_ADAPTER_POINTS = contextvars.ContextVar("kimik3_offer_adapter_points", default=True)


def is_experts_module(module) -> bool:
    """Whether `module` holds routed experts in a format (KimiK3Experts, of this copy of the code or another)."""
    # by its attributes: a folder's code (trust_remote_code) is another module, whose classes isinstance would miss
    fmt = getattr(module, "format", None)
    return all(hasattr(fmt, attribute) for attribute in ("suffixes", "trainable", "dense")) and hasattr(module, "stored")


EXPERTS_FORMATS: dict[str, ExpertsFormat] = {}


def register(fmt: ExpertsFormat) -> ExpertsFormat:
    """Makes `fmt` a value of `experts_format` (the config key, the load option); returns it."""
    EXPERTS_FORMATS[fmt.name] = fmt
    return fmt


DENSE = register(DenseExperts())
MXFP4 = register(Mxfp4Experts())
# What the release stores (its experts, `kimik3 memory --plan`, export); our configs and conversions default to dense
RELEASE = MXFP4
DEFAULT = DENSE


def experts_format(name, what: str = "experts_format", default: ExpertsFormat | None = None) -> ExpertsFormat:
    """The format called `name`; for a name no format has, `default` if given (a record written by another version
    of the code), else a ValueError naming `what` and the formats there are."""
    fmt = EXPERTS_FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None and default is not None:
        return default
    if fmt is None:
        allowed = " or ".join(repr(n) for n in EXPERTS_FORMATS)
        raise ValueError(f"{what}={name!r}: choose {allowed} (dense: bf16 experts; mxfp4: packed MXFP4 experts)")
    return fmt


__all__ = ["DENSE", "DEFAULT", "E8M0_INF", "EXPERTS_FORMATS", "ExpertsFormat", "MXFP4", "OFFER_ADAPTER_POINTS", "RELEASE",
           "experts_format", "is_experts_module", "mxfp4_overflow", "register"]
