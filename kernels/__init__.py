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
"""Optional fast twins of Kimi K3's reference ops (`kimik3.kernels`).

The model's remote code declares every op once (`FAST_OPS` in `modeling_kimik3/ops_kimi_k3.py`: its pure-PyTorch
reference and when a fast twin may replace it: CUDA tensors, 16-bit dtypes, no autograd, under torch.compile) and
decides there. This package only provides the twins: `load(name)` returns the fast implementation of op `name`, with
the reference's signature and contract, or None when its optional dependencies (fla-core, Triton, torch grouped_mm)
do not import. `KERNELS_API_VERSION` is the interface version, the installed remote code's own
(`ops_kimi_k3.KERNELS_API_VERSION`, read from there: one number, one changelog); a model folder's copy of the remote
code uses these twins only when it matches the version that copy was written against.

The twins that launch their own kernels and run in the decode step (situ_glu, block_attn_res_mix,
fused_recurrent_kda, causal_conv1d, mla_decode, the bf16 experts' few-rows grouped matmul, the packed-MXFP4 matmul
and dequantisation) run them, when no gradient is recorded, as `torch.library` custom ops `torch.ops.kimik3.*` with fake
implementations (custom_ops.py, registered on any machine), so a compiled decode step keeps them inside its one graph.

| name | fast twin | autograd |
|---|---|---|
| chunk_kda | fla-core `fla.ops.kda.chunk_kda` (the raw decay logits: fla's in-kernel gate, safe_gate, no autograd) | yes (fla's) |
| fused_recurrent_kda | fla-core `fused_recurrent_kda` | no |
| causal_conv1d | no autograd: own Triton (decode step up to 16 tokens after a window, else prefill tiles, with each head's L2 norm where asked); else fla-core's | yes (fla) |
| attention_with_lse | PyTorch's cuDNN fused attention with its log-sum-exp (flash, V padded, where cuDNN refuses) | no |
| mla_decode | two cuBLAS bmm + one Triton scale/mask/f32-softmax pass (masks included) | no |
| block_attn_res_mix | own Triton forward | analytic PyTorch backward |
| attn_res_mix_norm | own Triton, one pass for one banked block + the prefix: residual add, AttnRes mix, the next RMSNorm (eager); more blocks: the add and the separate twins | no |
| situ_glu | own Triton | yes |
| rms_norm | own Triton, one pass (eager; compiled graphs fuse the reference) | no |
| gated_rms_norm | own Triton, one pass (eager; compiled graphs fuse the reference) | no |
| kda_gate | own Triton, one pass (K3's lower-bounded form; the softplus form runs the reference) | no |
| router_logits | the reference's SGEMM after a one-pass Triton upcast of the activations (same logits) | no |
| moe_experts | torch grouped_mm + Triton row gather (no autograd), SiTU and combine; decode: Triton few-rows grouped matmul | yes (grouped_mm) |
| moe_experts_mxfp4 | Triton grouped matmul dequantising packed tiles in registers; decode: Triton GEMV | activations only |
| mxfp4_dequant | own Triton (bit-exact) | no |
"""

__all__ = ["KERNELS_API_VERSION", "OP_NAMES", "available_ops", "load"]


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
    from . import moe, triton_ops  # noqa: F401  (needs Triton for the packed matmul)

    moe._grouped_mm_fn()
    return moe.moe_experts_mxfp4


def _load_mla_prefill():
    from . import mla_prefill

    return mla_prefill.attention_with_lse


def _load_mla():
    from . import mla, triton_ops  # noqa: F401  (the softmax between the GEMMs is a Triton kernel)

    return mla.mla_decode


_LOADERS = {
    "chunk_kda": _load_fla("chunk_kda"),
    "fused_recurrent_kda": _load_fla("fused_recurrent_kda"),
    "causal_conv1d": _load_fla("causal_conv1d"),
    "attention_with_lse": _load_mla_prefill,
    "mla_decode": _load_mla,
    "block_attn_res_mix": _load_triton("block_attn_res_mix"),
    "attn_res_mix_norm": _load_triton("attn_res_mix_norm"),
    "situ_glu": _load_triton("situ_glu"),
    "rms_norm": _load_triton("rms_norm"),
    "gated_rms_norm": _load_triton("gated_rms_norm"),
    "kda_gate": _load_triton("kda_gate"),
    "router_logits": _load_triton("router_logits"),
    "moe_experts": _load_moe,
    "moe_experts_mxfp4": _load_moe_mxfp4,
    "mxfp4_dequant": _load_triton("mxfp4_dequant"),
}
OP_NAMES = tuple(_LOADERS)

_cache: dict = {}
_errors: dict = {}


def load(name: str):
    """The fast implementation of op `name`, or None when its dependencies do not import or the name is unknown
    (a newer model code asking for an op this install lacks keeps its reference). Imported once, then cached."""
    if name not in _LOADERS:
        return None
    if name not in _cache:
        try:
            _cache[name] = _LOADERS[name]()
        except Exception as exc:  # ImportError, or a broken install: the model keeps the reference
            _cache[name] = None
            _errors[name] = f"{type(exc).__name__}: {exc}"
    return _cache[name]


def __getattr__(name: str):
    """`KERNELS_API_VERSION`: the interface these twins implement is the one the installed package's remote code
    declares (`load(name)` and the contracts of the references they stand in for). Read when asked, not at import:
    that module imports this package while it initialises, and finds the number already defined."""
    if name == "KERNELS_API_VERSION":
        from kimik3.modeling.dispatch_kimi_k3 import KERNELS_API_VERSION

        return KERNELS_API_VERSION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available_ops() -> dict:
    """{name: True or the reason the fast implementation is unavailable}. Imports the optional dependencies."""
    return {name: (True if load(name) is not None else _errors.get(name, "unavailable")) for name in OP_NAMES}
