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
"""Pure-PyTorch reference ops of Kimi K3: the maths of the model, and the truth its fast twins are checked against.

Every op that may run fast is declared once, at its reference, with `@fast_op(...)` (dispatch_kimi_k3.py): the
conditions under which the installed `kimik3.kernels` may replace it. The model asks `fast_or_reference(name,
*tensors)` there and calls what it gets; both have the same signature and contract. Names and signatures mirror
fla-core where a kernel exists (`chunk_kda`, `fused_recurrent_kda`). Comments name the sections of
docs/architecture.md they follow.
"""

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .dispatch_kimi_k3 import capturing, fast_op, fast_or_reference


def f32_island(fn):
    """Run `fn` with autocast off: its f32 arithmetic is part of the spec (docs/architecture.md, dtype islands), and a
    bf16 autocast region around the model must not downcast its matmuls."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device_type=device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------------------------------------------
# Kimi Delta Attention (2, 3)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # fla's l2norm: eps is added to the sum of squares, inside the sqrt (docs/architecture.md, Kimi Delta Attention)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@fast_op(forward_only=True)
@f32_island
def kda_gate(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log-decay g (f32, <= 0). z: [..., H, D] decay logits; A_log: [H]; dt_bias: [H*D].

    K3 (`lower_bound` set): g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias)), in (lb, 0).
    Kimi Linear (`lower_bound` None): g = -exp(A_log[h]) * softplus(z + dt_bias).
    """
    num_heads, head_dim = z.shape[-2], z.shape[-1]
    z = z.float() + dt_bias.float().view(num_heads, head_dim)
    a = A_log.float()[:num_heads].view(num_heads, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(z)
    return lower_bound * torch.sigmoid(a * z)


@fast_op(traceable_forward=True)
@f32_island
def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None, l2norm_head_dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU, computed in f32 and returned in x's dtype (fla ShortConvolution).

    x: [B, T, C] pre-conv projections; weight: [C, 1, K]; conv_state: [B, C, K-1] previous pre-conv inputs or None
    (zeros, a new sequence). Returns (y [B, T, C], new conv_state [B, C, K-1] in x's dtype).

    With `l2norm_head_dim` > 0, y is also L2-normalised per head of that width: `l2norm` in f32 of the output as
    rounded to x's dtype, rounded again. That is fla's own q/k normalisation in its chunked KDA (which rounds the
    normalised q/k to their dtype), moved into the conv; the model asks for it only where fla's chunked form then
    runs (`use_qk_l2norm_in_kernel=False`), never on the reference path, whose KDA normalises in f32 itself.
    """
    kernel_size = weight.shape[-1]
    x_t = x.transpose(1, 2)
    if conv_state is None:
        conv_state = x_t.new_zeros(x_t.shape[0], x_t.shape[1], kernel_size - 1)
    window = torch.cat([conv_state.to(x_t.dtype), x_t], dim=-1)
    y = F.conv1d(window.float(), weight.float(), groups=x_t.shape[1])
    y = l2norm_heads(F.silu(y).to(x.dtype).transpose(1, 2), l2norm_head_dim)
    return y, window[..., window.shape[-1] - (kernel_size - 1):]


def l2norm_heads(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`l2norm` over each `head_dim` channels of y [..., C] in f32, rounded to y's dtype; head_dim 0: y itself (the
    conv contract's `l2norm_head_dim` 0, no norm)."""
    if not head_dim:
        return y
    if y.shape[-1] % head_dim:
        raise ValueError(f"l2norm over heads of {head_dim}: {y.shape[-1]} channels are not whole heads")
    heads = y.float().unflatten(-1, (-1, head_dim))
    return l2norm(heads).flatten(-2).to(y.dtype)


def conv_windows_after(pre_conv: tuple[torch.Tensor, ...], base_windows: tuple[torch.Tensor, ...] | None,
                       kernel_size: int) -> tuple[torch.Tensor, ...]:
    """The q/k/v conv windows (the last K - 1 pre-conv inputs, as the cache stores them) after the tokens of
    `pre_conv` ([B, T, C] each), continuing `base_windows` (None: the start of the sequence)."""
    windows = []
    for index, x in enumerate(pre_conv):
        x_t = x.transpose(1, 2)
        base = (x_t.new_zeros(*x_t.shape[:2], kernel_size - 1) if base_windows is None
                else base_windows[index].to(x_t.dtype))
        window = torch.cat([base, x_t], dim=-1)
        windows.append(window[..., window.shape[-1] - (kernel_size - 1):])
    return tuple(windows)


def _prepare_qk(q, k, scale, use_qk_l2norm_in_kernel):
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k


@fast_op(forward_only=True, traceable_forward=True)
@f32_island
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (decode form). q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    state [B, H, K, V] in f32. Output in v's dtype. S <- diag(a) S; S <- S + beta k (v - S^T k)^T; o = S^T q."""
    dtype = v.dtype
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm_in_kernel)
    v, g, beta = v.float(), g.float(), beta.float()
    batch, seq_len, num_heads, k_dim = k.shape
    state = (
        q.new_zeros(batch, num_heads, k_dim, v.shape[-1]) if initial_state is None else initial_state.float()
    )
    outputs = []
    for t in range(seq_len):
        state = state * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t)) * beta[:, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return out.to(dtype), (state if output_final_state else None)


def _chunk_kda_step(q, k, v, g, beta, state, causal_incl, causal_strict, eye):
    """One chunk of the WY/UT chunked form (3). Shapes [B, H, C, *]; f32; every exponent is <= 0."""
    G = g.cumsum(dim=-2)
    # decay[i, j, c] = exp(G_i - G_j) for j <= i (masked before exp, so no overflow for any gate)
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal_incl[..., None], float("-inf"))
    decay = diff.exp()
    A_kk = torch.einsum("bhic,bhjc,bhijc->bhij", k, k, decay).masked_fill(~causal_strict, 0.0)
    A_qk = torch.einsum("bhic,bhjc,bhijc->bhij", q, k, decay)
    lhs = eye + beta.unsqueeze(-1) * A_kk
    rhs = beta.unsqueeze(-1) * torch.cat([k * G.exp(), v], dim=-1)
    wu = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    w, u = wu.split([k.shape[-1], v.shape[-1]], dim=-1)
    v_new = u - w @ state
    out = (q * G.exp()) @ state + A_qk @ v_new
    g_last = G[..., -1:, :]
    state = state * g_last.transpose(-1, -2).exp() + (k * (g_last - G).exp()).transpose(-1, -2) @ v_new
    return out, state


@fast_op(tf32_dots=True)  # fla's chunk kernel multiplies fp32 in TF32 (docs/design.md, References and fast paths)
@f32_island
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA for prefill and training, same contract as `fused_recurrent_kda`. With `use_gate_in_kernel`
    (fla's name), `g` holds the raw decay logits and the decay is `kda_gate(g, A_log, dt_bias, lower_bound)`: the
    fast twin then computes it inside its chunk cumsum instead of writing and re-reading it.

    Chunks are processed one after another and only the running state is carried, so live memory is
    O(B*H*chunk*(chunk*K + V)) per step and the output O(T): no T x T matrix and no stored per-chunk states. Under
    autograd, segments of about sqrt(T / chunk) chunks are recomputed in backward (`torch.utils.checkpoint`), so the
    saved tensors are the inputs plus one state per segment (O(sqrt(T)) states).
    """
    dtype = v.dtype
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm_in_kernel)
    v, g, beta = v.float(), g.float(), beta.float()
    batch, seq_len, num_heads, k_dim = k.shape
    state = (
        q.new_zeros(batch, num_heads, k_dim, v.shape[-1]) if initial_state is None else initial_state.float()
    )
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    beta = beta.transpose(1, 2)
    idx = torch.arange(chunk_size, device=q.device)
    causal_incl = idx[:, None] >= idx[None, :]
    causal_strict = idx[:, None] > idx[None, :]
    eye = torch.eye(chunk_size, device=q.device, dtype=q.dtype)

    def run_chunks(start, stop, state, q, k, v, g, beta):
        outs = []
        for s in range(start, stop, chunk_size):
            e = min(s + chunk_size, stop)
            n = e - s
            o, state = _chunk_kda_step(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g[:, :, s:e], beta[:, :, s:e], state,
                causal_incl[:n, :n], causal_strict[:n, :n], eye[:n, :n],
            )
            outs.append(o)
        return torch.cat(outs, dim=2), state

    needs_grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, g, beta, state)
    )
    # sqrt(#chunks) chunks per recompute segment: the saved states and the recompute workspace both stay O(sqrt(T))
    segment = chunk_size * max(16, math.isqrt(-(-seq_len // chunk_size)) + 1)
    outs = []
    for s in range(0, seq_len, segment):
        e = min(s + segment, seq_len)
        if needs_grad and seq_len > segment:
            o, state = torch.utils.checkpoint.checkpoint(
                run_chunks, s, e, state, q, k, v, g, beta, use_reentrant=False
            )
        else:
            o, state = run_chunks(s, e, state, q, k, v, g, beta)
        outs.append(o)
    out = torch.cat(outs, dim=2).transpose(1, 2) if outs else v.transpose(1, 2).new_zeros(v.transpose(1, 2).shape)
    return out.to(dtype), (state if output_final_state else None)


def _chunk_transition(k, g, beta, causal_strict, eye):
    """The K x K map one chunk applies to any incoming state (3): the chunk step with V = 0, where the pseudo-values
    are U - W S = -W S, so S_next = (Diag(Gamma_C) - (K * exp(G_C - G))^T W) S. Same W as `_chunk_kda_step`."""
    G = g.cumsum(dim=-2)
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal_strict[..., None], float("-inf"))
    A_kk = torch.einsum("bhic,bhjc,bhijc->bhij", k, k, diff.exp())
    lhs = eye + beta.unsqueeze(-1) * A_kk
    w = torch.linalg.solve_triangular(lhs, beta.unsqueeze(-1) * (k * G.exp()), upper=False, unitriangular=True)
    g_last = G[..., -1:, :]
    return torch.diag_embed(g_last.squeeze(-2).exp()) - (k * (g_last - G).exp()).transpose(-1, -2) @ w


@f32_island
def kda_segment_transition(
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The segment transition of KDA: the linear map [B, H, K, K] (f32) that a segment's tokens apply to any
    incoming state, so that for every initial state S (state layout [B, H, K, V], as `chunk_kda`)

        final_state(S) = transition @ S + final_state(0),

    exactly (the recurrence is affine in S: S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T).
    It is the ordered product of the per-chunk maps of the WY/UT chunk form (`_chunk_transition`); k, g: [B, T, H, K];
    beta: [B, T, H]. Context parallelism composes segments with it (context_parallel_kimi_k3.py)."""
    k = k.float()
    if use_qk_l2norm_in_kernel:
        k = l2norm(k)
    batch, seq_len, num_heads, k_dim = k.shape
    k, g, beta = k.transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)
    idx = torch.arange(chunk_size, device=k.device)
    causal_strict = idx[:, None] > idx[None, :]
    eye = torch.eye(chunk_size, device=k.device, dtype=k.dtype)
    transition = torch.eye(k_dim, device=k.device, dtype=k.dtype).expand(batch, num_heads, k_dim, k_dim)
    for s in range(0, seq_len, chunk_size):
        e = min(s + chunk_size, seq_len)
        n = e - s
        chunk = _chunk_transition(k[:, :, s:e], g[:, :, s:e], beta[:, :, s:e], causal_strict[:n, :n], eye[:n, :n])
        transition = chunk @ transition
    return transition.contiguous()


# eager only: under compile inductor fuses the reference's six ops into one kernel itself
@fast_op(half_only=True, one_dtype=True, forward_only=True)
def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm (7): statistics in f32, cast back to the input dtype, then times the weight (in the weight and
    input dtypes' promoted type: a bf16 weight times bf16 gives a bf16 product)."""
    input_dtype = hidden_states.dtype
    hidden = hidden_states.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(input_dtype)


@fast_op(forward_only=True)
@f32_island
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fla FusedRMSNormGated(activation='sigmoid'): RMS over the last dim, weight, sigmoid gate; all f32
    (docs/architecture.md, Kimi Delta Attention)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# MLA attention forms: one key block with its log-sum-exp (blockwise prefill over a long cache), absorbed decode


@fast_op(half_only=True, forward_only=True)
@f32_island
def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v for one key block. query [B, H, T, Dk], key [B, H, S, Dk], value [B, H, S, Dv];
    `causal` is for the diagonal block (T == S, same positions). Returns (out f32 [B, H, T, Dv], lse f32 [B, H, T]),
    so blocks can be merged exactly: out = sum_b exp(lse_b - lse) out_b with lse = logaddexp over blocks."""
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ value.float(), lse


@fast_op(forward_only=True, traceable_forward=True)
def mla_decode(
    q_lat: torch.Tensor,
    latent_cache: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed MLA attention over the shared latent cache (MQA, 4.3), for decode.

    q_lat [B, H, S, R+P]: q_nope absorbed through W_UK (R = kv_lora_rank) concatenated with q_pe (P);
    latent_cache [B, T, R+P]: normalised c_kv concatenated with k_pe. p = softmax(scale * q_lat . cache) in f32,
    rounded to q_lat's dtype; o_lat = p @ cache[..., :R]. `attention_mask` bool [B, 1 or H, S, T] (True = attend);
    None lets every query row see every cached row. Returns (o_lat [B, H, S, R], p [B, H, S, T]) in q_lat's dtype;
    a fast twin may return None for p.
    """
    # Every head reads the same cached rows, so the heads fold into the rows of one matmul per sequence: a broadcast
    # over heads would copy the cache once per head.
    batch, heads, q_len, width = q_lat.shape
    scores = torch.bmm(q_lat.reshape(batch, heads * q_len, width), latent_cache.transpose(1, 2))
    scores = scores.view(batch, heads, q_len, -1) * scale
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
    o_lat = torch.bmm(probs.view(batch, heads * q_len, -1), latent_cache[..., :kv_lora_rank])
    return o_lat.view(batch, heads, q_len, kv_lora_rank), probs


# --------------------------------------------------------------------------------------------------------------
# Block Attention Residuals (docs/architecture.md, Block Attention Residuals)


@fast_op(one_dtype=True, traceable_forward=True)
@f32_island
def block_attn_res_mix(
    candidates: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Softmax depth-mixture of raw candidates [b_0, ..., b_{n-1}, P], each [B, T, D].

    Scores use the weightless RMS-normalised candidates against w = norm_weight * proj_weight; the mixture is of
    the raw candidates. Everything in f32, result cast to the candidates' dtype.
    """
    values = torch.stack(candidates, dim=0).float()
    query = norm_weight.float() * proj_weight.float().reshape(-1)
    keys = values * torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)
    weights = torch.softmax(keys @ query, dim=0)
    return (weights.unsqueeze(-1) * values).sum(dim=0).to(candidates[-1].dtype)


# eager only, forward only (the prefill's and decode's eager layers): one pass instead of the add, the mix and the
# norm; its reference runs those three through their own fast paths (the mix's autograd, the compiled graphs)
@fast_op(half_only=True, one_dtype=True, forward_only=True)
def attn_res_mix_norm(
    blocks: list[torch.Tensor],
    prefix: torch.Tensor | None,
    delta: torch.Tensor | None,
    res_norm_weight: torch.Tensor,
    res_proj_weight: torch.Tensor,
    res_eps: float,
    out_norm_weight: torch.Tensor,
    out_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add, AttnRes mix and the RMSNorm after it (docs/architecture.md, Block Attention
    Residuals), as one op.

    new_prefix = prefix + delta (the one given when the other is None: that tensor itself), mix =
    block_attn_res_mix([*blocks, new_prefix], res_norm_weight, res_proj_weight, res_eps); returns
    (new_prefix, rms_norm(mix, out_norm_weight, out_eps)). The parts go through their own fast paths, so where the
    fused twin may not run (autograd, torch.compile, CPU) this is exactly the three separate ops.
    """
    if prefix is None and delta is None:
        raise ValueError("attn_res_mix_norm needs a prefix or a delta")
    new_prefix = delta if prefix is None else prefix if delta is None else prefix + delta
    candidates = [*blocks, new_prefix]
    mix = fast_or_reference("block_attn_res_mix", *candidates)(candidates, res_norm_weight, res_proj_weight, res_eps)
    normed = fast_or_reference("rms_norm", mix, out_norm_weight)(mix, out_norm_weight, out_eps)
    return new_prefix, normed


# --------------------------------------------------------------------------------------------------------------
# SiTU (docs/architecture.md, Stable LatentMoE)


@fast_op(traceable_forward=True)
@f32_island
def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU: [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(u/b2)] in f32, cast back to the input dtype.

    `beta` None means 1.0 (release default); `linear_beta` None leaves the up branch uncapped.
    """
    a, u = gate.float(), up.float()
    b1 = 1.0 if beta is None else float(beta)
    act = b1 * torch.tanh(a / b1) * torch.sigmoid(a)
    if linear_beta is not None:
        u = float(linear_beta) * torch.tanh(u / float(linear_beta))
    return (act * u).to(gate.dtype)


# --------------------------------------------------------------------------------------------------------------
# Router and routed experts (docs/architecture.md, Stable LatentMoE)


# eager only (the compiled decode step keeps tracing the reference, as measured)
@fast_op(half_only=True, forward_only=True)
def router_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """f32 router logits x @ W^T of both operands upcast (8.1: bf16 logits change the selected set for a few % of
    tokens), autocast off: an SGEMM. hidden_states [..., D], weight [E, D] -> [..., E] f32."""
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        return F.linear(hidden_states.float(), weight.float())


def routed_experts(
    hidden_states: torch.Tensor,
    top_indices: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """dtype( sum_e w_e * f32(dtype(E_e(x))) ) with E_e(x) = down_e @ act(gate_e x, up_e x), any GLU activation.

    hidden_states [N, Dl]; top_indices / top_weights [N, k]; gate_up_proj [E, 2I, Dl] (gate/w1 rows first),
    down_proj [E, Dl, I]. Eagerly it loops over the experts that are hit (one host sync: a reference; the CUDA fast
    path is sync-free); under torch.compile or a CUDA graph's capture it gathers each token's k experts instead, which
    runs without a sync.
    """
    if torch.compiler.is_compiling() or capturing():
        return _gathered_experts(hidden_states, top_indices, top_weights, gate_up_proj, down_proj, activation)
    num_tokens, top_k = top_indices.shape
    flat_experts = top_indices.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_experts, minlength=gate_up_proj.shape[0]).tolist()
    outputs = []
    for expert, tokens in enumerate(torch.split(hidden_states[token_of], counts)):
        if tokens.shape[0] == 0:
            continue
        gate, up = F.linear(tokens, gate_up_proj[expert].to(tokens.dtype)).chunk(2, dim=-1)
        outputs.append(F.linear(activation(gate, up), down_proj[expert].to(tokens.dtype)))
    weighted = torch.cat(outputs, dim=0).float() * top_weights.reshape(-1)[order].unsqueeze(-1).float()
    combined = torch.zeros(num_tokens, hidden_states.shape[-1], dtype=torch.float32, device=hidden_states.device)
    return combined.index_add(0, token_of, weighted).to(hidden_states.dtype)


def _gathered_experts(hidden_states, top_indices, top_weights, gate_up_proj, down_proj, activation):
    # few tokens (compiled decode): every token's k experts gathered and batch-multiplied
    gate, up = torch.einsum("nd,nkod->nko", hidden_states, gate_up_proj[top_indices]).chunk(2, dim=-1)
    routed = torch.einsum("nki,nkdi->nkd", activation(gate, up), down_proj[top_indices])
    combined = (routed.float() * top_weights.unsqueeze(-1).float()).sum(dim=1)
    return combined.to(hidden_states.dtype)


@fast_op(half_only=True, traceable=True)
def moe_experts(
    x: torch.Tensor,
    top_indices: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    beta: float | None = None,
    linear_beta: float | None = None,
) -> torch.Tensor:
    """K3's routed experts (SiTU-GLU) over fused 3-D weights in x.dtype: `routed_experts` with `situ_glu`.

    The SiTU is itself a fast op (`fast_or_reference("situ_glu", ..)`), as in every other GLU of the model."""

    def situ(gate, up):
        return fast_or_reference("situ_glu", gate)(gate, up, beta, linear_beta)

    return routed_experts(x, top_indices, top_weights, gate_up_proj, down_proj, situ)


# torch ops around the packed grouped matmul (a custom op)
@fast_op(half_only=True, traceable_forward=True)
def moe_experts_mxfp4(
    x: torch.Tensor,
    top_indices: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up_packed: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_packed: torch.Tensor,
    down_scale: torch.Tensor,
    beta: float | None = None,
    linear_beta: float | None = None,
) -> torch.Tensor:
    """`moe_experts` over packed MXFP4 experts (weight-only): the stacks are dequantised to x.dtype (exact), then go
    through `moe_experts`, itself a fast op (the grouped GEMMs also under torch.compile, where the packed kernel is
    not traced). gate_up_packed u8 [E, 2I, Dl/2], gate_up_scale u8 [E, 2I, Dl/32], down_packed u8 [E, Dl, I/2],
    down_scale u8 [E, Dl, I/32]."""
    gate_up = dequantize_mxfp4(gate_up_packed, gate_up_scale, x.dtype)
    down = dequantize_mxfp4(down_packed, down_scale, x.dtype)
    return fast_or_reference("moe_experts", x)(x, top_indices, top_weights, gate_up, down, beta, linear_beta)


# --------------------------------------------------------------------------------------------------------------
# MXFP4 (7): E2M1 codes, low nibble = even element, E8M0 scales with bias 127, groups of 32 along the input dim.

MXFP4_GROUP_SIZE = 32
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@fast_op("mxfp4_dequant", forward_only=True, traceable_forward=True)
def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed: uint8 [..., N, K/2]; scale: uint8 [..., N, K/32] -> [..., N, K] in `dtype` (exact for bf16/f32)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * MXFP4_GROUP_SIZE != k:
        raise ValueError(
            f"MXFP4 shapes do not match: packed {tuple(packed.shape)} (K={k}) needs scale "
            f"{tuple(packed.shape[:-1]) + (k // MXFP4_GROUP_SIZE,)}, got {tuple(scale.shape)}"
        )
    # one lookup per byte: row b of the table is (value of the low nibble, value of the high nibble)
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    pairs = torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=-1)
    values = pairs[packed.long()].reshape(*packed.shape[:-1], k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)
    return (values * _e8m0_to_float(scale).unsqueeze(-1)).reshape(*packed.shape[:-1], k).to(dtype)


def _e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    # 2^(scale - 127) assembled from its f32 bits: exact on every device, where CUDA's exp2 is off in the last bits
    # at the denormal 2^-127 (byte 0). Byte 255 gives inf, as compressed-tensors does (docs/architecture.md, The
    # release's files).
    exponent_bits = torch.where(scale == 0, 1 << 22, scale.to(torch.int32) << 23)
    return exponent_bits.view(torch.float32)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 (OCP scale rule: 2^(floor(log2(amax)) - 2)); returns (packed, scale) uint8.

    Values that are exactly representable (e.g. dequantised MXFP4 weights) round-trip bit for bit.
    """
    w = weight.float()
    k = w.shape[-1]
    if k % MXFP4_GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {MXFP4_GROUP_SIZE}, got {k}")
    groups = w.reshape(*w.shape[:-1], k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    # floor(log2(amax)) read off the float's exponent (frexp: amax = m * 2^e, m in [0.5, 1)), exact where log2 may
    # round up just below a power of two
    exp = torch.where(amax > 0, torch.frexp(amax).exponent - 3, -127).clamp(-127, 127)
    scale = (exp.squeeze(-1) + 127).to(torch.uint8)
    scaled = groups / _e8m0_to_float(scale).unsqueeze(-1)
    magnitudes = torch.tensor(_E2M1_VALUES[:8], device=w.device)
    dist = (scaled.abs().unsqueeze(-1) - magnitudes).abs()
    # ties go to the even code (round half to even on the E2M1 grid)
    idx = dist.argmin(dim=-1)
    best = dist.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    nxt = (idx + 1).clamp(max=7)
    tie = (dist.gather(-1, nxt.unsqueeze(-1)).squeeze(-1) == best) & (nxt != idx) & (idx % 2 == 1)
    idx = torch.where(tie, nxt, idx)
    codes = (idx + 8 * torch.signbit(scaled).long()).to(torch.uint8).reshape(*w.shape[:-1], k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale.contiguous()

