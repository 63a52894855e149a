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
"""Adapters from the `ops_kimi_k3` contracts to fla-core 0.6.0 (`pip install fla-core`; used as a dependency).

Importing this module imports fla (and so Triton); it fails with ImportError when fla is missing.

* `chunk_kda`, `fused_recurrent_kda`: same signature/contract as the references: q, k, g [B, T, H, K],
  v [B, T, H, V], beta [B, T, H] (post-sigmoid), g the log-space decay already computed (fla's
  `use_gate_in_kernel=False`), state [B, H, K, V] f32 -> (o in v.dtype, final state f32 or None). `chunk_kda`
  also takes the raw decay logits as `g` with `use_gate_in_kernel=True`, `A_log`, `dt_bias` and `lower_bound` (fla's
  fused gate + chunk cumsum; K3's bounded gate on fla's `safe_gate` path) where no gradient is recorded; under
  autograd the reference gate runs first and fla's chunked form takes the decay as before.
  `chunk_kda` has autograd (fla's); `fused_recurrent_kda` is forward-only (declared so in FAST_OPS: the model
  keeps the reference when a gradient is needed). The reference's `chunk_size` is a memory knob of its own chunked
  loop; fla's kernels are tuned for 64-token chunks and always use them.
* `causal_conv1d`: same contract as the reference (x [B, T, C], weight [C, 1, K], conv_state [B, C, K-1] of previous
  pre-conv inputs or None -> (SiLU(conv) in x.dtype, new conv_state [B, C, K-1]); `l2norm_head_dim` > 0: y also
  L2-normalised per head, in the prefill kernel's tiles). fla keeps a [B, C, K] state
  whose last K-1 columns are the previous inputs; the adapter pads / slices. Autograd through fla's Triton
  backward.

`fused_recurrent_kda` and `causal_conv1d` run as `torch.ops.kimik3.*` custom ops (custom_ops.py) when no gradient
is recorded, so torch.compile (the static-cache decode step) keeps each as one graph node; the conv op's CUDA
implementation is then the own Triton kernels (triton_ops: the decode step and the prefill tiles), fla's conv runs
where autograd records.
"""

import torch
import torch.nn.functional as F
from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d
from fla.ops.kda import chunk_kda as _fla_chunk_kda
from fla.ops.kda import fused_recurrent_kda as _fla_fused_recurrent_kda

from kimik3.modeling import ops_kimi_k3 as _reference

from . import custom_ops


def _state(initial_state):
    if initial_state is None:
        return None
    return initial_state.float().contiguous()


def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    chunk_size=None,  # the reference's memory knob, passed by the model to either twin; fla always chunks by 64
    use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
):
    gate = {}
    if use_gate_in_kernel and custom_ops.needs_grad(q, k, v, g, beta, A_log, dt_bias, initial_state):
        # training: the decay from the reference gate (its autograd), then fla's chunked form on it, the path the
        # GPU backward tests hold; fla's fused gate backward is not used
        g = _reference.kda_gate(g, A_log, dt_bias, lower_bound)
    elif use_gate_in_kernel:
        # fla's gate kernel reads A_log[h] for the heads present, so the release's zero-padded [128] A_log is passed
        # as its first H entries. K3's lower-bounded gate (-5 <= lb < 0) runs fla's safe_gate path: the decay bound
        # keeps the diagonal tiles' exponentials in f32 range, so they go through tensor-core dots
        # (docs/architecture.md, Chunked KDA; the official code's setting)
        gate = dict(use_gate_in_kernel=True, A_log=A_log[: g.shape[-2]], dt_bias=dt_bias, lower_bound=lower_bound,
                    safe_gate=lower_bound is not None and -5 <= lower_bound < 0)
    o, final = _fla_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=_state(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=64, **gate,
    )
    return o.to(v.dtype), (final if output_final_state else None)


def fused_recurrent_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
):
    if not custom_ops.needs_grad(q, k, v, g, beta, initial_state):
        o, final = torch.ops.kimik3.fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       use_qk_l2norm_in_kernel)
        return o, (final if output_final_state else None)
    o, final = _fla_fused_recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=_state(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return o.to(v.dtype), (final if output_final_state else None)


def causal_conv1d(x, weight, conv_state=None, l2norm_head_dim=0):
    if custom_ops.needs_grad(x, weight, conv_state):
        y, state = _causal_conv1d_eager(x, weight, conv_state)
        return _reference.l2norm_heads(y, l2norm_head_dim), state
    return torch.ops.kimik3.causal_conv1d(x, weight, conv_state, l2norm_head_dim)


def _causal_conv1d_eager(x, weight, conv_state):
    channels, kernel_size = weight.shape[0], weight.shape[-1]
    w = weight.reshape(channels, kernel_size)
    init = None
    if conv_state is not None:
        init = F.pad(conv_state.to(x.dtype), (1, 0)).contiguous()  # [B, C, K]: column 0 is never read
    y, final = _fla_causal_conv1d(
        x, w, None, None, initial_state=init, output_final_state=True, activation="silu", backend="triton"
    )
    return y, final[..., 1:]
