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
"""Fast-path dispatch of Kimi K3: which implementation of an op runs, decided here and nowhere else.

Every op that may run fast is declared once, at its pure-PyTorch reference in ops_kimi_k3.py, with `@fast_op(...)`:
the declaration (`FastOp`) says under which conditions the fast twin of the installed `kimik3.kernels` may replace
it, and fills the op table `FAST_OPS`. The model asks `fast_or_reference(name, *tensors)` and calls what it gets
(both have the same signature and contract), or asks a named predicate of this file where a choice spans more than
one op (`conv_normalizes_qk`, `decay_in_chunk_kernel`, and `kda_recurrence`'s decode-or-chunked form). The one switch
`KIMIK3_REFERENCE_ONLY` forces references.

`kimik3.kernels` implements the interface `load(name)` (the twin of FAST_OPS[name], or None) at the version
`KERNELS_API_VERSION`; it is imported on the first call that may use a twin, never at import, and never for a
decision that the declarations already settle on the reference (CPU tensors, for one).

The ground floor of the remote code: this file imports nothing of the model's files, so every other one may import it.
"""

import contextlib
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

# The `kimik3.kernels` interface this file is written against: `load(name)` returns the fast twin of FAST_OPS[name]
# (or None), with the reference's signature and contract. Its one definition: the installed kimik3.kernels reports
# the installed package's copy of this number, and a model folder's copy of this file compares it with its own.
# 2: the twins of `traceable_forward` ops run as torch.library custom ops; 3: the mla_decode twin takes masks (an
# older install's refuses them) and runs as a custom op; 4: chunk_kda takes the raw decay logits and the gate's
# parameters (`use_gate_in_kernel`, `A_log`, `dt_bias`, `lower_bound`); 5: causal_conv1d takes `l2norm_head_dim`
KERNELS_API_VERSION = 5
# "1" (or "all"): every op runs its reference; a comma list of op names: those ops do; unset or "0": none.
REFERENCE_ONLY_ENV = "KIMIK3_REFERENCE_ONLY"


# --------------------------------------------------------------------------------------------------------------
# The declarations: one FastOp per op, made by `@fast_op` at its reference


@dataclass(frozen=True)
class FastOp:
    """Where the fast twin of `reference` may run instead of it."""

    reference: Callable
    cuda_only: bool = True  # a CUDA kernel: every tensor asked about must be on CUDA
    half_only: bool = False  # built on 16-bit-only kernels (flash attention, grouped GEMM): fp16/bf16 tensors only
    one_dtype: bool = False  # reads every tensor through one element type: all of one dtype
    # its kernel multiplies fp32 inputs in TF32: fp32 tensors get the reference unless the user allows TF32 matmuls
    # (torch.set_float32_matmul_precision "high"/"medium"), as PyTorch's own fp32 GEMMs do
    tf32_dots: bool = False
    forward_only: bool = False  # no backward: the reference while autograd records for any tensor asked about
    # made only of torch ops, so torch.compile traces it into the graph (autograd included)
    traceable: bool = False
    # launches its own kernels as torch.library custom ops (`torch.ops.kimik3.*`, with fake implementations, no
    # autograd formula): torch.compile keeps each as one node of the graph (a CUDA graph captures it) while no
    # gradient is recorded. Under compile the other ops, and these with autograd on, trace their references.
    traceable_forward: bool = False


# name -> FastOp, filled by the `@fast_op` declarations of ops_kimi_k3.py as it is imported. Under compile: the ops
# of the compiled (static-cache) decode step stay fast; chunk_kda and attention_with_lse run in prefill, and
# inductor fuses the norms' and the KDA gate's references itself.
FAST_OPS: dict[str, FastOp] = {}


def fast_op(name: str | None = None, **constraints) -> Callable:
    """Declare the decorated function as the reference of op `name` (default: the function's own name), whose fast
    twin may replace it under `constraints` (the fields of `FastOp`). Returns the reference unchanged. One
    declaration per op: a second reference under the same name is refused."""

    def declare(reference: Callable) -> Callable:
        op_name = name or reference.__name__
        declared = FAST_OPS.get(op_name)
        if declared is not None and _origin(declared.reference) != _origin(reference):
            raise ValueError(f"fast op {op_name!r} is declared twice: by {'.'.join(_origin(declared.reference))} and "
                             f"by {'.'.join(_origin(reference))}")
        FAST_OPS[op_name] = FastOp(reference, **constraints)
        return reference

    return declare


def _origin(fn: Callable) -> tuple[str, str]:
    # a module re-imported (importlib.reload) declares the same function again: that is no second declaration
    return fn.__module__, fn.__qualname__


# --------------------------------------------------------------------------------------------------------------
# The switch and the rules


def _forced_references() -> frozenset:
    raw = os.environ.get(REFERENCE_ONLY_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return frozenset()
    if raw in ("1", "all", "true", "yes"):
        return frozenset(FAST_OPS)
    names = frozenset(x.strip() for x in raw.split(",") if x.strip())
    unknown = sorted(names - set(FAST_OPS))
    if unknown:
        raise ValueError(f"{REFERENCE_ONLY_ENV}={raw!r}: unknown op name(s) {unknown}; use 1 (every op) or a comma "
                         f"list of {sorted(FAST_OPS)}")
    return names


def capturing() -> bool:
    """Whether CUDA is capturing a graph on this thread's stream: like tracing under torch.compile, a host read of a
    tensor's value there would end it (the reference ops take their sync-free forms)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def fast_path_allowed(name: str, *tensors: torch.Tensor | None) -> bool:
    """Whether FAST_OPS[name]'s declaration lets its fast twin run on these tensors (None entries are skipped; at
    least one tensor is needed). The one place where the declarations are read."""
    op = FAST_OPS[name]
    if name in _forced_references():
        return False
    if torch.compiler.is_compiling() and not (op.traceable or op.traceable_forward and not torch.is_grad_enabled()):
        return False
    present = [t for t in tensors if t is not None]
    if not present or not all(isinstance(t, torch.Tensor) for t in present):
        return False
    if op.cuda_only and any(t.device.type != "cuda" for t in present):
        return False
    if op.half_only and any(t.dtype not in (torch.float16, torch.bfloat16) for t in present):
        return False
    if op.one_dtype and any(t.dtype != present[0].dtype for t in present):
        return False
    if op.tf32_dots and torch.get_float32_matmul_precision() == "highest" and any(
            t.dtype == torch.float32 for t in present):
        return False
    if op.forward_only and _records_autograd(*present):
        return False
    return True


def _records_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def fast_or_reference(name: str, *tensors: torch.Tensor | None) -> Callable:
    """The function to call for op `name` on these tensors: its fast twin from `kimik3.kernels` where
    `fast_path_allowed`, the package is installed (with a matching interface) and the twin loads (its optional
    dependencies import), else its reference. Both take the same arguments and keep the same contract."""
    reference = FAST_OPS[name].reference
    if not fast_path_allowed(name, *tensors):
        return reference
    kernels = installed_kernels()
    if kernels is None:
        return reference
    if not _traced_twins_loaded and not torch.compiler.is_compiling():
        _load_traced_twins(kernels)
    fast = kernels.load(name)
    return reference if fast is None else fast


def has_fast_twin(name: str, *tensors: torch.Tensor | None) -> bool:
    """Whether `fast_or_reference(name, *tensors)` gives the fast twin (for a choice that only pays on it)."""
    return fast_or_reference(name, *tensors) is not FAST_OPS[name].reference


def sdpa_backend_order(query: torch.Tensor, attn_implementation: str | None, masked: bool = False):
    """The context the expanded MLA attention runs SDPA in: cuDNN's fused attention first exactly where
    attention_with_lse's fast twin (the same cuDNN attention, over one key block) may run: on CUDA in 16 bits, without
    autograd, outside torch.compile and unless that op is forced to its reference. MLA's q/k and v head dims differ
    (192 and 128), which rules out flash, and the memory-efficient kernel is 4x slower than cuDNN on an H200
    (docs/benchmarks.md). A no-op with an attention mask (padding: measured on neither backend here), for other
    attention implementations, and on a torch without backend priorities."""
    if masked or attn_implementation != "sdpa" or not fast_path_allowed("attention_with_lse", query):
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        return sdpa_kernel(order, set_priority=True)
    except (ImportError, AttributeError, TypeError):
        return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------------------
# The installed kernels, imported on first need


_NOT_IMPORTED = object()
# the checked `kimik3.kernels` (None: not installed, broken or of another interface), or _NOT_IMPORTED before the
# first call that may use a twin
_KERNELS = _NOT_IMPORTED


def installed_kernels():
    """The installed `kimik3.kernels` if its interface is the one this file expects, else None (the references);
    imported on the first call, so importing the model imports nothing of the package. A model's eager prefill makes
    that call before its compiled decode step (an import inside a trace is a graph break)."""
    global _KERNELS
    if _KERNELS is _NOT_IMPORTED:
        _KERNELS = _import_kernels()
    return _KERNELS


def _import_kernels():
    """Not installed (a model folder run without the package) is the normal case and silent; an install that fails to
    import or has another interface version gets one warning (`installed_kernels` asks once)."""
    try:
        kernels = importlib.import_module("kimik3.kernels")
    except ImportError:
        return None
    except Exception as exc:  # a broken install must not stop the model: it still has its references
        logger.warning(f"kimik3.kernels failed to import ({type(exc).__name__}: {exc}); the model runs its "
                       "pure-PyTorch reference ops")
        return None
    version = getattr(kernels, "KERNELS_API_VERSION", None)
    if version != KERNELS_API_VERSION:
        logger.warning(
            f"the installed kimik3.kernels has interface version {version}, this model code expects "
            f"{KERNELS_API_VERSION}; the model runs its pure-PyTorch reference ops. Install the kimik3 version this "
            "model folder was saved with (or re-save the folder with the installed one) to use the fast kernels."
        )
        return None
    return kernels


_traced_twins_loaded = False


def _load_traced_twins(kernels) -> None:
    """Load, eagerly and once, every twin a compiled graph may ask for: a twin's first load imports its module, and
    an import inside a trace is a graph break (a compiled decode step's `fused_recurrent_kda` is first needed there,
    after an eager prefill that never asked for it)."""
    global _traced_twins_loaded
    _traced_twins_loaded = True
    for name, op in FAST_OPS.items():
        if op.traceable or op.traceable_forward:
            kernels.load(name)


# --------------------------------------------------------------------------------------------------------------
# The choices of the KDA layer (docs/architecture.md, Kimi Delta Attention): which kernels a forward of these tokens
# runs, and what may move between them


def _decode_form(decode_step: bool, state: torch.Tensor | None) -> bool:
    # a one-token forward that continues a state runs the recurrent (decode) form; anything else the chunked form
    return decode_step and state is not None


def conv_normalizes_qk(q: torch.Tensor, k: torch.Tensor, state: torch.Tensor | None, *, decode_step: bool,
                       recording: bool, context_parallel: bool) -> bool:
    """Whether the KDA layer's short conv L2-normalises q and k per head (`causal_conv1d`'s `l2norm_head_dim`), so
    that the chunked form skips its own normalisation (`use_qk_l2norm_in_kernel=False`). q, k: the pre-conv
    projections; state: the recurrent state this forward continues (None: a new sequence); `decode_step`: the
    forward is one token.

    Only where fla's chunked form runs after the fast conv: fla rounds q/k to their dtype after its own normalisation
    pass, which reads and writes both again, and the conv's epilogue gives the same rounding for free. Never on the
    reference path (its recurrence normalises in f32 itself), nor for a decode step (the recurrent form normalises
    inside its kernel), a step recorded for a rewind (the replay runs on un-normalised inputs), the context-parallel
    split (which composes the segments' states itself), or while autograd records through q or k (the conv twin with
    a backward, fla's, has no per-head norm)."""
    return (not context_parallel and not recording and not _decode_form(decode_step, state)
            and not _records_autograd(q, k)
            and has_fast_twin("causal_conv1d", q) and has_fast_twin("chunk_kda", q))


def decay_in_chunk_kernel(decay_logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                          lower_bound: float | None, padded: bool, recording: bool, context_parallel: bool) -> bool:
    """Whether the chunked form gets the raw decay logits and computes K3's bounded decay inside its chunk cumsum
    (`chunk_kda`'s `use_gate_in_kernel`; `kda_recurrence`'s `gate`): one pass over the logits instead of a gate pass
    writing f32 decays and a cumsum pass re-reading them.

    Only for the lower-bounded gate (`lower_bound` set: K3; fla's in-kernel gate has no softplus form) and only where
    nothing else needs the decay tensor: not with a padding mask (`padded`: it overwrites the decay per token), not
    for a step recorded for a rewind or the context-parallel split (both keep the decay), and not while autograd
    records through the logits or the gate's parameters (the in-kernel gate has no backward). A decode step then gets
    its decay from `kda_gate` (`kda_recurrence`)."""
    return (lower_bound is not None and not padded and not context_parallel and not recording
            and not _records_autograd(decay_logits, A_log, dt_bias))


def kda_decay(decay_logits, A_log, dt_bias, lower_bound):
    """The KDA log-decay g from its logits, through the gate's fast twin where it may run."""
    return fast_or_reference("kda_gate", decay_logits, A_log, dt_bias)(decay_logits, A_log, dt_bias, lower_bound)


def kda_recurrence(q, k, v, g, beta, initial_state, output_final_state: bool, chunk_size: int, decode_step: bool,
                   gate: tuple | None = None, qk_normalized: bool = False):
    """The delta rule over these tokens, with the kernel of the forward they belong to: a one-token forward
    (`decode_step`) that continues a state is a decode step (fused recurrent form), anything else the chunked form. A
    rewind replay and a forward split at snapshot positions pick by the same rule, so they compute what that forward
    computes. With `gate` = (A_log, dt_bias, lower_bound) (`decay_in_chunk_kernel`), `g` holds the raw decay logits:
    the chunked form computes the decay inside its kernel (`use_gate_in_kernel`), the recurrent form gets it from
    `kda_gate` first. `qk_normalized` (`conv_normalizes_qk`): q and k come L2-normalised from the conv, so the kernel
    skips its own."""
    if _decode_form(decode_step, initial_state):
        kda_fn, extra = fast_or_reference("fused_recurrent_kda", q), {}
        if gate is not None:
            g = kda_decay(g, *gate)
    else:
        kda_fn, extra = fast_or_reference("chunk_kda", q), {"chunk_size": chunk_size}
        if gate is not None:
            A_log, dt_bias, lower_bound = gate
            extra.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return kda_fn(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=not qk_normalized, **extra)
