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

The model's remote code declares every op once (`FAST_OPS` in `modeling_kimik3/dispatch_kimi_k3.py`: its pure-PyTorch
reference and when a fast twin may replace it: CUDA tensors, 16-bit dtypes, no autograd, under torch.compile) and
decides there; a twin never decides again what its declaration says. This package only provides the twins: `load(name)` returns the fast implementation of op `name`, with
the reference's signature and contract, or None when its optional dependencies (fla-core, Triton, torch grouped_mm)
do not import. `KERNELS_API_VERSION` is the interface version, the installed remote code's own
(`dispatch_kimi_k3.KERNELS_API_VERSION`, read from there: one number, one changelog); a model folder's copy of the remote
code uses these twins only when it matches the version that copy was written against.

One file per mechanism (`MECHANISMS`), each holding its kernels, its custom ops with their fakes, its launch rules
and its twins, registered by name where they are defined (`_base.twin`); `_base` is the ground floor they share and
imports nothing else of the package. Every file imports on any machine (Triton and fla are imported where a kernel
launches or a twin loads), so the twins that launch their own kernels and run in the decode step (situ_glu,
block_attn_res_mix, fused_recurrent_kda, causal_conv1d, mla_decode, the bf16 experts' few-rows grouped matmul, the
packed-MXFP4 matmul and dequantisation) register their `torch.library` custom ops `torch.ops.kimik3.*` with fake
implementations on a CPU machine too; a compiled decode step keeps them inside its one graph.

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

__all__ = ["KERNELS_API_VERSION", "MECHANISMS", "OP_NAMES", "available_ops", "load"]

import importlib
from pathlib import Path

# This module is the package `kimik3.kernels`; its files are the design card's top-level `kernels/` folder, which has
# no `__init__.py` on purpose: Python started in the checkout puts the checkout first on sys.path, and a `kernels/`
# package there would stand in for PyPI's `kernels`, which transformers imports when a model loads (docs/design.md,
# "Import names"). A folder without `__init__.py` is only a namespace portion, so the installed `kernels` wins there.
# Installed from a wheel the files lie in `kimik3/kernels/` beside this module; in an editable install or a checkout
# they lie in `kernels/` beside the `kimik3/` folder.
_HERE = Path(__file__).resolve().parent
__path__ = [str(next((d for d in (_HERE / "kernels", _HERE.parent / "kernels") if (d / "_base.py").is_file()),
                     _HERE / "kernels"))]

# the files of this package that register fast twins, in the order `OP_NAMES` lists their ops
MECHANISMS = ("kda", "conv", "mla", "attn_res", "situ", "norms", "moe", "mxfp4")

_cache: dict = {}
_errors: dict = {}


def _twins() -> dict:
    """{op name: its registered `_base.Twin`}: every mechanism file imported (once), each registering its own."""
    for mechanism in MECHANISMS:
        importlib.import_module(f"{__name__}.{mechanism}")
    return importlib.import_module(f"{__name__}._base").TWINS


def load(name: str):
    """The fast implementation of op `name`, or None when its dependencies do not import or the name is unknown
    (a newer model code asking for an op this install lacks keeps its reference). Imported once, then cached."""
    if name not in _cache:
        twins = _twins()
        if name not in twins:
            return None
        try:
            _cache[name] = twins[name].load()
        except Exception as exc:  # ImportError, or a broken install: the model keeps the reference
            _cache[name] = None
            _errors[name] = f"{type(exc).__name__}: {exc}"
    return _cache[name]


def __getattr__(name: str):
    """`OP_NAMES`: the ops with a registered twin. `KERNELS_API_VERSION`: the interface these twins implement is the
    one the installed package's remote code declares (`load(name)` and the contracts of the references they stand in
    for), read from its one definition. Both read when asked, not at import, which imports nothing of the model's
    code (the mechanism files import its references)."""
    if name == "OP_NAMES":
        return tuple(_twins())
    if name == "KERNELS_API_VERSION":
        from kimik3.modeling.dispatch_kimi_k3 import KERNELS_API_VERSION

        return KERNELS_API_VERSION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available_ops() -> dict:
    """{name: True or the reason the fast implementation is unavailable}. Imports the optional dependencies."""
    return {name: (True if load(name) is not None else _errors.get(name, "unavailable")) for name in _twins()}
