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
"""Optional fast paths of Kimi K3 (`kimik3.kernels`).

The model asks `get_fast_op(name, *tensors)` and gets a callable with the same signature and semantics as the
pure-PyTorch reference of that name, or None, in which case it runs the reference. A fast op is returned only when

* its implementation imports (fla-core, Triton, torch grouped_mm: each is optional),
* every tensor passed to `get_fast_op` (None entries are skipped, at least one tensor is needed) is a CUDA tensor,
* for the forward-only ops (`fused_recurrent_kda*`, `mxfp4_dequant`), no gradient is being recorded for them,
* the fast paths are enabled: `set_enabled(False)`, the `reference_ops()` context manager, or the environment
  variable `KIMIK3_DISABLE_KERNELS` ("1"/"all", or a comma list of op names) turn them off.

Ops (reference -> fast implementation; "fwd+bwd" = usable in training):

| name | reference | fast path |
|---|---|---|
| chunk_kda | ops_kimi_k3.chunk_kda | fla-core `fla.ops.kda.chunk_kda` (fwd+bwd) |
| chunk_kda_fused_gate | chunk_kda(.., kda_gate(g, A_log, dt_bias, lb), ..) | fla chunk_kda, in-kernel gate, safe_gate (fwd+bwd) |
| fused_recurrent_kda | ops_kimi_k3.fused_recurrent_kda | fla-core `fused_recurrent_kda` (fwd only) |
| fused_recurrent_kda_fused_gate | fused_recurrent_kda(.., kda_gate(..), ..) | fla, in-kernel gate (fwd only) |
| causal_conv1d | ops_kimi_k3.causal_conv1d | fla-core Triton causal_conv1d (fwd+bwd) |
| block_attn_res_mix | ops_kimi_k3.block_attn_res_mix | own Triton forward, analytic PyTorch backward |
| situ_glu | ops_kimi_k3.situ_glu | own Triton, fwd+bwd |
| moe_experts | kernels.reference.moe_experts | torch grouped_mm + Triton SiTU + Triton combine (fwd+bwd)* |
| moe_experts_mxfp4 | kernels.reference.moe_experts_mxfp4 | Triton grouped matmul dequantising packed tiles in registers |
| mla_decode | kernels.reference.mla_decode | two cuBLAS bmm (f32 scores) + f32 softmax |
| mxfp4_dequant | ops_kimi_k3.dequantize_mxfp4 (= kernels.reference.mxfp4_dequant) | own Triton (bit-exact) |
| attention_with_lse | ops_kimi_k3.attention_with_lse | PyTorch flash attention op with its log-sum-exp (fwd only) |

* Under torch.compile the model still takes `moe_experts` (it is made of torch ops); its SiTU and combine are then
  left to the compiler. Every other fast op launches its own kernels and is replaced by its reference there.
"""

import contextlib
import os

import torch


__all__ = ["OP_NAMES", "available_ops", "get_fast_op", "reference_ops", "set_enabled"]


def _load_fla(attr):
    def load():
        from . import fla_ops

        return getattr(fla_ops, attr)

    return load


def _load_triton(attr):
    def load():
        from . import triton_ops

        return getattr(triton_ops, attr)

    return load


def _load_moe():
    from . import moe

    moe._grouped_mm_fn()  # raises ImportError without grouped_mm
    return moe.moe_experts


def _load_moe_mxfp4():
    from . import moe, triton_ops  # noqa: F401  (needs Triton for the dequantisation)

    moe._grouped_mm_fn()
    return moe.moe_experts_mxfp4


def _load_mla_prefill():
    from . import mla_prefill

    return mla_prefill.attention_with_lse


def _load_mla():
    from . import mla

    return mla.mla_decode


_LOADERS = {
    "chunk_kda": _load_fla("chunk_kda"),
    "chunk_kda_fused_gate": _load_fla("chunk_kda_fused_gate"),
    "fused_recurrent_kda": _load_fla("fused_recurrent_kda"),
    "fused_recurrent_kda_fused_gate": _load_fla("fused_recurrent_kda_fused_gate"),
    "causal_conv1d": _load_fla("causal_conv1d"),
    "block_attn_res_mix": _load_triton("block_attn_res_mix"),
    "situ_glu": _load_triton("situ_glu"),
    "moe_experts": _load_moe,
    "moe_experts_mxfp4": _load_moe_mxfp4,
    "mla_decode": _load_mla,
    "attention_with_lse": _load_mla_prefill,
    "mxfp4_dequant": _load_triton("mxfp4_dequant"),
}
OP_NAMES = tuple(_LOADERS)
_FORWARD_ONLY = frozenset(
    {"fused_recurrent_kda", "fused_recurrent_kda_fused_gate", "mxfp4_dequant", "attention_with_lse"}
)

_cache: dict = {}
_errors: dict = {}
_enabled = True


def _env_disabled() -> frozenset:
    raw = os.environ.get("KIMIK3_DISABLE_KERNELS", "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return frozenset()
    if raw in ("1", "all", "true", "yes"):
        return frozenset(OP_NAMES)
    return frozenset(x.strip() for x in raw.split(",") if x.strip())


def set_enabled(enabled: bool) -> None:
    """Globally turn the fast paths on or off (off: `get_fast_op` always returns None)."""
    global _enabled
    _enabled = bool(enabled)


@contextlib.contextmanager
def reference_ops():
    """Within this block every `get_fast_op` call returns None (the model runs its pure-PyTorch references)."""
    global _enabled
    previous = _enabled
    _enabled = False
    try:
        yield
    finally:
        _enabled = previous


def _load(name):
    if name not in _cache:
        try:
            _cache[name] = _LOADERS[name]()
        except Exception as exc:  # ImportError, or a broken install: fall back to the reference
            _cache[name] = None
            _errors[name] = f"{type(exc).__name__}: {exc}"
    return _cache[name]


def available_ops() -> dict:
    """{name: True or the reason the fast implementation is unavailable}. Imports the optional dependencies."""
    return {name: (True if _load(name) is not None else _errors.get(name, "unavailable")) for name in OP_NAMES}


def get_fast_op(name: str, *tensors):
    """The fast implementation of `name` if it is importable and every given tensor is on CUDA, else None.

    Unknown names return None (the caller keeps its reference)."""
    if not _enabled or name not in _LOADERS or name in _env_disabled():
        return None
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    for t in present:
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            return None
    if name in _FORWARD_ONLY and torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return None
    return _load(name)
