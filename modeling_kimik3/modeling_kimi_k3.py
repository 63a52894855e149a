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
"""PyTorch Kimi K3 text model: Kimi Delta Attention + gated NoPE-MLA, Block Attention Residuals, Stable LatentMoE.

Numerics follow docs/architecture.md (comments name its sections): bf16 weights and activations, f32 islands for the KDA
gate/beta/L2 norm/state/output norm, the router, SiTU, the MoE combine, AttnRes and every RMS statistic.
Pure PyTorch throughout; `kimik3.kernels` fast paths are used only when importable and the tensors are on CUDA.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import can_return_tuple, logging
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache_kimi_k3 import KimiK3Cache, KimiK3KDAStep, KimiK3StaticCache
from .compat_kimi_k3 import CACHE_ARGUMENTS, CACHE_FIELD, activation_checkpointing_on, cache_in, given_cache
from .configuration_kimi_k3 import KimiK3TextConfig, check_token_ids
from .context_parallel_kimi_k3 import ContextParallel
from .dispatch_kimi_k3 import (
    conv_normalizes_qk,
    decay_in_chunk_kernel,
    fast_or_reference,
    kda_decay,
    kda_recurrence,
    sdpa_backend_order,
)
from .experts_format_kimi_k3 import DENSE as DENSE_EXPERTS
from .experts_format_kimi_k3 import OFFER_ADAPTER_POINTS, experts_format
from .inputs_kimi_k3 import cache_type_error, check_labels, check_model_inputs, mask_hole_error, mask_holes
from .loading_kimi_k3 import load_pretrained
from .offload_kimi_k3 import check_savable
from .ops_kimi_k3 import routed_experts
from .parallel_kimi_k3 import local_shard
from .saving_kimi_k3 import register_auto_classes, save_folder
from .serving_kimi_k3 import KimiK3PrefixStore, build_prompt_cache  # noqa: F401 - a remote-code model's own copies


logger = logging.get_logger(__name__)

@contextlib.contextmanager
def _onloaded(*modules: nn.Module):
    """Weights of submodules read directly by their parent (the conv op, the absorbed decode, the AttnRes mix), loaded
    for the duration. Under a device_map with CPU/disk offload accelerate keeps an offloaded module's weights on the
    meta device except during that module's own forward; its hook loads and releases them around this block too."""
    hooked = [module for module in modules if getattr(module, "_hf_hook", None) is not None]
    for module in hooked:
        module._hf_hook.pre_forward(module)
    try:
        yield
    finally:
        for module in hooked:
            module._hf_hook.post_forward(module, None)


# ----------------------------------------------------------------------------------------------------------------
# Norms and activations


def applied_weight(module: nn.Module) -> torch.Tensor:
    """The weight `module` applies: its own, or for a PEFT LoRA wrapper its base weight plus the delta of each active
    adapter not merged into it (what the wrapper's forward adds, dropout aside). The absorbed MLA decode and the KDA
    short convs read a weight instead of calling the module: they ran the base weight alone and dropped an unmerged
    adapter that the prefill applied. Duck-typed on PEFT's layer API (`base_layer`, `get_delta_weight`), nothing
    imported."""
    base = getattr(module, "base_layer", None)
    if base is None or not hasattr(module, "get_delta_weight"):
        return module.weight
    weight = base.weight
    if getattr(module, "disable_adapters", False):
        return weight
    merged = set(getattr(module, "merged_adapters", ()))
    for name in module.active_adapters:
        if name not in getattr(module, "lora_A", {}) or name in merged:
            continue
        if getattr(module, "use_dora", {}).get(name):
            raise NotImplementedError(f"a DoRA adapter ({name!r}) on {type(base).__name__} whose weight Kimi K3 reads "
                                      "directly (MLA kv_b_proj in decode, the KDA short convs): merge it first "
                                      "(merge_and_unload) or use plain LoRA there")
        weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight


class KimiK3RMSNorm(nn.Module):
    """KimiRMSNorm (7): statistics in f32, cast back to the input dtype, then the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        norm = fast_or_reference("rms_norm", hidden_states, self.weight)
        return norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def glu_activation(config: KimiK3TextConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU for K3 (docs/architecture.md, Stable LatentMoE), SwiGLU for Kimi-Linear-style configs."""
    if config.hidden_act == "silu":
        return F.silu(gate) * up
    situ = fast_or_reference("situ_glu", gate)
    return situ(gate, up, config.activation_situ_beta, config.activation_situ_linear_beta)


class KimiK3MLP(nn.Module):
    """Dense GLU MLP: layer 0's FFN and the fused shared experts."""

    def __init__(self, config: KimiK3TextConfig, intermediate_size: int | None = None):
        super().__init__()
        self.config = config
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_activation(self.config, self.gate_proj(hidden_states), self.up_proj(hidden_states)))


# ----------------------------------------------------------------------------------------------------------------
# Kimi Delta Attention (2, 3)


class KimiK3GatedRMSNorm(nn.Module):
    """Head-wise RMSNorm with a sigmoid output gate, all f32 (fla FusedRMSNormGated); weight kept f32."""

    def __init__(self, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        norm = fast_or_reference("gated_rms_norm", hidden_states, gate, self.weight)
        return norm(hidden_states, gate, self.weight, self.eps)


class KimiK3DeltaAttention(nn.Module):
    """KDA: short conv + SiLU on q/k/v, L2 norm, lower-bounded (or softplus) per-channel decay, delta rule on an
    f32 state, gated RMSNorm output with a full-rank (K3) or low-rank (Kimi Linear) gate."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.projection_size = self.num_heads * self.head_dim
        self.conv_size = config.linear_conv_kernel_size
        self.lower_bound = config.gate_lower_bound
        hidden = config.hidden_size

        self.q_proj = nn.Linear(hidden, self.projection_size, bias=False)
        self.k_proj = nn.Linear(hidden, self.projection_size, bias=False)
        self.v_proj = nn.Linear(hidden, self.projection_size, bias=False)
        self.q_conv1d = self._short_conv()
        self.k_conv1d = self._short_conv()
        self.v_conv1d = self._short_conv()
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.projection_size, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(self.projection_size, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, self.projection_size, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, self.projection_size, bias=False)
        self.o_norm = KimiK3GatedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.projection_size, hidden, bias=False)

    def _short_conv(self) -> nn.Conv1d:
        return nn.Conv1d(self.projection_size, self.projection_size, self.conv_size, groups=self.projection_size,
                         bias=False, dtype=torch.float32)

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        cache: KimiK3Cache | None = None,
        document_index: tuple[torch.Tensor, torch.Tensor] | None = None,
        context_parallel: ContextParallel | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if context_parallel is not None:
            return self._attend(hidden_states, None, cache, context_parallel)
        if document_index is not None:
            # Packed documents: regroup into one row per document (right-padded), so every state and conv window
            # starts from zero at a document boundary, then put the rows back in packed order.
            gather_index, doc_mask = document_index
            batch, seq_len, hidden = hidden_states.shape
            docs = hidden_states.reshape(batch * seq_len, hidden)[gather_index]
            out = self._attend(docs, doc_mask, None)
            return out[doc_mask].reshape(batch, seq_len, -1)
        return self._attend(hidden_states, token_mask, cache)

    def _attend(self, hidden_states, token_mask, cache, context_parallel: ContextParallel | None = None):
        batch, seq_len, _ = hidden_states.shape
        # -1 heads: under tensor parallelism the projections give this rank's heads only (and the per-head
        # parameters and the recurrent state follow), so the local head count comes from the tensors.
        heads_shape = (batch, seq_len, -1, self.head_dim)
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if token_mask is not None:
            # Padding must not reach a conv window: zero pre-conv inputs read exactly like "before the sequence".
            # Selected, not multiplied, so a NaN/Inf in a padded position cannot survive as NaN * 0.
            padded = ~token_mask.unsqueeze(-1)
            q, k, v = q.masked_fill(padded, 0.0), k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
        pre_conv = (q, k, v)

        step = KimiK3KDAStep(cache, self.layer_idx, seq_len)  # the state, and where what a rewind needs goes
        conv_states, recurrent_state = step.conv_states, step.recurrent_state
        if context_parallel is not None:
            # the K - 1 pre-conv rows before this rank's segment (context_parallel_kimi_k3.py)
            (q, k, v), conv_states, sequence_conv_states = context_parallel.conv_windows(
                (q, k, v), self.conv_size - 1, self.layer_idx
            )
        qk_normalized = conv_normalizes_qk(q, k, recurrent_state, decode_step=step.decode_step,
                                           recording=step.recording, context_parallel=context_parallel is not None)
        conv_fn = fast_or_reference("causal_conv1d", q)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        l2norm_head_dims = (self.head_dim, self.head_dim, 0) if qk_normalized else (0, 0, 0)
        with _onloaded(*convs):
            (q, q_state), (k, k_state), (v, v_state) = (
                conv_fn(x, local_shard(applied_weight(conv)), None if conv_states is None else state, norm)
                for x, conv, state, norm in zip((q, k, v), convs, conv_states or (None, None, None), l2norm_head_dims)
            )
        q, k, v = q.view(heads_shape), k.view(heads_shape), v.view(heads_shape)

        decay_logits = self.f_b_proj(self.f_a_proj(hidden_states)).view(heads_shape)
        A_log, dt_bias = local_shard(self.A_log), local_shard(self.dt_bias)
        if decay_in_chunk_kernel(decay_logits, A_log, dt_bias, lower_bound=self.lower_bound,
                                 padded=token_mask is not None, recording=step.recording,
                                 context_parallel=context_parallel is not None):
            g, decay_gate = decay_logits, (A_log, dt_bias, self.lower_bound)
        else:
            g, decay_gate = kda_decay(decay_logits, A_log, dt_bias, self.lower_bound), None
        beta = torch.sigmoid(self.b_proj(hidden_states).float())
        if token_mask is not None:
            # A padded step must be the identity on the state: the decay is not 1 on zero input, so set g = 0 and
            # beta = 0 there explicitly (selected, like q/k/v above).
            g = g.masked_fill(~token_mask[..., None, None], 0.0)
            beta = beta.masked_fill(~token_mask[..., None], 0.0)

        if context_parallel is not None:
            # state composition over the ranks' segments; the cache gets the whole sequence's state and windows
            core, final_state = context_parallel.kda(fast_or_reference("chunk_kda", q), q, k, v, g, beta,
                                                     self.config.kda_chunk_size, self.layer_idx)
            q_state, k_state, v_state = sequence_conv_states
        else:
            step.record(pre_conv, (q, k, v, g, beta))
            core, final_state = self._recurrence(q, k, v, g, beta, step, pre_conv, decay_gate, qk_normalized)
        step.write((q_state, k_state, v_state), final_state)

        if self.config.use_full_rank_gate:
            gate = self.g_proj(hidden_states)
        else:
            gate = self.g_b_proj(self.g_a_proj(hidden_states))
        core = self.o_norm(core, gate.view(heads_shape))
        return self.o_proj(core.reshape(batch, seq_len, -1))

    def _recurrence(self, q, k, v, g, beta, step, pre_conv, decay_gate=None, qk_normalized=False):
        """The delta rule over this forward's tokens. Where the cache asks for snapshots, the chunked form runs
        segment by segment, carrying the state exactly as it carries it between its own chunks, and hands the state
        at each offset to the step."""
        seq_len = q.shape[1]
        offsets = step.snapshot_offsets
        bounds = [0, *(o for o in offsets if 0 < o < seq_len), seq_len]
        outputs, state = [], step.recurrent_state
        for start, end in zip(bounds[:-1], bounds[1:]):
            out, state = kda_recurrence(
                q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end], state,
                step.keeps_state or end < seq_len, self.config.kda_chunk_size, decode_step=step.decode_step,
                gate=decay_gate, qk_normalized=qk_normalized,
            )
            outputs.append(out)
            if end in offsets:
                step.snapshot(end, pre_conv, state)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), state


# ----------------------------------------------------------------------------------------------------------------
# Gated MLA with NoPE (4)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None and query.shape[2] > 1:
        attention_mask = _causal_mask(query.shape[2], key.shape[2], query.device)[None, None]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
        else:
            attn_weights = attn_weights + attention_mask
    attn_weights = torch.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


def _causal_mask(query_len: int, key_len: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask (queries are the last `query_len` of `key_len` positions)."""
    q_pos = torch.arange(key_len - query_len, key_len, device=device)
    return torch.arange(key_len, device=device)[None, :] <= q_pos[:, None]


def _merge_attention_blocks(out, lse, block_out, block_lse):
    """Two key blocks' attention outputs (f32 [B, H, T, Dv]) and log-sum-exps (f32 [B, H, T]) as one:
    out = exp(lse - merged) out + exp(block_lse - merged) block_out, merged = logaddexp(lse, block_lse). The second
    weighting is fused into one addcmul: at a 32K-query chunk each output is 1.6 GB, and a temporary per side had the
    merge read or write that much seven times instead of five (docs/benchmarks.md, 1M-token prompt)."""
    merged = torch.logaddexp(lse, block_lse)
    return torch.addcmul(out * (lse - merged).exp().unsqueeze(-1), block_out,
                         (block_lse - merged).exp().unsqueeze(-1)), merged


class KimiK3MLAAttention(nn.Module):
    """Multi-head latent attention without positional encoding, with a sigmoid output gate (K3).

    Prefill expands the cached latents through kv_b_proj and runs the configured attention implementation;
    decode (one new token on a cache) runs the absorbed form on the latents directly (docs/architecture.md, Gated NoPE
    MLA).
    """

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1
        self.is_causal = True
        self.attention_dropout = config.attention_dropout
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.scaling = self.qk_head_dim**-0.5
        hidden = config.hidden_size

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiK3RMSNorm(self.q_lora_rank, eps=config.mla_rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.kv_lora_rank, eps=config.mla_rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(hidden, self.num_heads * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: KimiK3Cache | None = None,
        context_parallel: ContextParallel | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq_len, _ = hidden_states.shape
        if self.q_lora_rank is None:
            query = self.q_proj(hidden_states)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        # -1 heads: this rank's heads under tensor parallelism (q_b/kv_b/g colwise by head, o_proj rowwise)
        query = query.view(batch, seq_len, -1, self.qk_head_dim).transpose(1, 2)

        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        latents = torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)
        has_past = cache is not None and cache.has_previous_state(self.layer_idx)
        # one decode token, or a static cache's verify of T tokens (the absorbed form over the whole buffer, under
        # the cache's causal key mask)
        fixed_step = seq_len == 1 or (cache is not None and cache.is_fixed_shape_step(seq_len))
        if context_parallel is not None:
            # every rank's latents (576 values a token), never expanded K/V (context_parallel_kimi_k3.py)
            latents = context_parallel.gather_latents(latents, self.layer_idx)
        if cache is not None:
            latents = cache.update_latents(latents, self.layer_idx)

        if context_parallel is not None:
            # earlier ranks' segments are whole past blocks, this rank's segment the causal diagonal block
            attn_output = self._blockwise_prefill_attention(query, latents[:, : context_parallel.end])
            attn_weights = None
        elif fixed_step and has_past:
            attn_output, attn_weights = self._absorbed_attention(query, latents, attention_mask)
        elif has_past and attention_mask is None:
            attn_output, attn_weights = self._blockwise_prefill_attention(query, latents), None
        else:
            attn_output, attn_weights = self._expanded_attention(query, latents, attention_mask, **kwargs)

        attn_output = attn_output.reshape(batch, seq_len, -1)
        if self.config.mla_use_output_gate:
            attn_output = attn_output * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(attn_output), attn_weights

    def _kv_b_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        weight = local_shard(applied_weight(self.kv_b_proj)).view(-1, self.qk_nope_head_dim + self.v_head_dim,
                                                                  self.kv_lora_rank)
        return weight[:, : self.qk_nope_head_dim], weight[:, self.qk_nope_head_dim :]

    def _expanded_attention(self, query, latents, attention_mask, **kwargs):
        # NoPE: the "rope" part of the key is the unrotated k_pe, shared by all heads
        key, value = self._expand_latents(latents)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        with sdpa_backend_order(query, self.config._attn_implementation, masked=attention_mask is not None):
            return attention_interface(
                self,
                query,
                key,
                value,
                attention_mask,
                dropout=self.attention_dropout if self.training else 0.0,
                scaling=self.scaling,
                **kwargs,
            )

    def _expand_latents(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, kv_len, _ = latents.shape
        latent, k_pe = latents.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(batch, kv_len, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # Keys assembled token-major, as the projection wrote them, by two strided copies, and handed over as a
        # [B, H, T, D] view: torch.cat of the head-major strided / broadcast views took its generic path, twice the
        # time of these copies (0.77 against 0.38 ms a layer at 8K on an H200: docs/benchmarks.md, MLA key assembly)
        dtype = torch.promote_types(kv.dtype, k_pe.dtype)
        key = kv.new_empty(batch, kv_len, kv.shape[2], self.qk_head_dim, dtype=dtype)
        key[..., : self.qk_nope_head_dim] = k_nope
        key[..., self.qk_nope_head_dim :] = k_pe.unsqueeze(2)
        return key.transpose(1, 2), value.transpose(1, 2)

    def _blockwise_prefill_attention(self, query: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """A prefill chunk continuing a cache (no padding): cached latents are expanded one key block at a time and
        the blocks merged by log-sum-exp, so the workspace is O(chunk x block), with no [chunk, context] mask and no
        expanded copy of the whole context. Causal masking is only needed on the chunk's own (diagonal) block."""
        seq_len, kv_len = query.shape[2], latents.shape[1]
        past_len = kv_len - seq_len
        block = self.config.mla_prefill_key_block(seq_len)
        spans = [(s, min(s + block, past_len)) for s in range(0, past_len, block)] + [(past_len, kv_len)]
        attend = fast_or_reference("attention_with_lse", query)
        out = lse = None
        for start, end in spans:
            key, value = self._expand_latents(latents[:, start:end])
            block_out, block_lse = attend(query, key, value, self.scaling, start == past_len)
            out, lse = (block_out, block_lse) if out is None else _merge_attention_blocks(out, lse, block_out,
                                                                                          block_lse)
        return out.to(query.dtype).transpose(1, 2)

    def _absorbed_attention(self, query, latents, attention_mask):
        # score = (W_UK^T q_nope) . c + q_pe . k_pe ; out = W_UV (sum p c): the same numbers as the expanded form,
        # without expanding a single cached token (docs/architecture.md, Gated NoPE MLA). Softmax in f32.
        with _onloaded(self.kv_b_proj):
            w_uk, w_uv = self._kv_b_weight()
        q_nope, q_pe = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)
        q_all = torch.cat([q_latent, q_pe], dim=-1)
        decode = fast_or_reference("mla_decode", q_all, latents)
        o_latent, attn_weights = decode(q_all, latents, self.scaling, self.kv_lora_rank, attention_mask)
        attn_output = torch.einsum("bhtr,hvr->bthv", o_latent, w_uv)
        return attn_output, attn_weights


# ----------------------------------------------------------------------------------------------------------------
# Stable LatentMoE (6)


class KimiK3MoEGate(nn.Module):
    """Sigmoid router in f32 with a selection-only correction bias (docs/architecture.md, Stable LatentMoE)."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.quantile_balancing_observer = None

    def forward(
        self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = fast_or_reference("router_logits", hidden_states)(hidden_states, self.weight)
        scores = torch.sigmoid(router_logits)
        biased = scores + self.e_score_correction_bias.float()
        if self.config.num_expert_group > 1:
            biased = self._limit_to_groups(biased)
        balancing = self.training and self.config.quantile_balancing
        top_values, top_indices = torch.topk(biased, self.top_k + 1 if balancing else self.top_k, dim=-1,
                                             sorted=balancing)
        if balancing:
            top_indices = top_indices[:, : self.top_k]
            if self.quantile_balancing_observer is not None:
                self.quantile_balancing_observer(self, scores.detach(), top_values[:, -1].detach(), top_indices,
                                                 token_mask)
        top_weights = scores.gather(-1, top_indices)
        if self.config.moe_renormalize:
            top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, top_weights * self.config.routed_scaling_factor, top_indices

    def _limit_to_groups(self, biased: torch.Tensor) -> torch.Tensor:
        groups = self.config.num_expert_group
        grouped = biased.view(-1, groups, self.num_experts // groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.config.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(biased)


class KimiK3Experts(nn.Module):
    """Routed experts as fused 3-D stacks in the latent width: gate_up_proj [E, 2I, Dl] (gate rows first), down_proj
    [E, Dl, I], stored as `config.experts_format` says (experts_format_kimi_k3.py): dense tensors, or for example
    the release's packed MXFP4 (codes and scales, dequantised at forward time unless a fast path multiplies the
    packed tiles)."""

    STACKS = ("gate_up_proj", "down_proj")

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.intermediate_size = config.moe_intermediate_size
        self.latent_size = config.latent_size
        self.format = experts_format(config.experts_format)
        shapes = {"gate_up_proj": (self.num_experts, 2 * self.intermediate_size, self.latent_size),
                  "down_proj": (self.num_experts, self.latent_size, self.intermediate_size)}
        # A format whose tensors take no gradient (packed codes) holds them as parameters without gradient, as
        # transformers holds packed weights: its tensor- and expert-parallel styles shard parameters only
        # (docs/design.md, Parallelism), and its loader reads a rank's share of each
        for stack, shape in shapes.items():
            for suffix, tensor in zip(self.format.suffixes, self.format.empty(shape, torch.get_default_dtype())):
                self.register_parameter(stack + suffix, nn.Parameter(tensor, requires_grad=self.format.trainable))
        if not self.format.trainable and OFFER_ADAPTER_POINTS.get():
            self._offer_adapter_points(torch.get_default_dtype(), self.stacks()[0].device)
        # a LayerOffload when the load kept the experts in host memory (`experts_offload`), else None
        self.offload = None

    # PEFT's `target_parameters` finds the parameter to adapt by its name among a module's parameters and sizes the
    # adapter from its shape. Experts stored in a format without gradients (packed codes) offer the dense stacks'
    # names and shapes as adapter points: a zero of one element broadcast to the stack's shape (no memory), not a
    # weight (never saved or loaded). Under an unmerged adapter PEFT parametrizes a point to the adapter's update,
    # which `_routed` adds to the dense experts (docs/training.md, LoRA on packed experts). A parallel load offers
    # none: FSDP shards every parameter and cannot shard a broadcast one.

    def _offer_adapter_points(self, dtype: torch.dtype, device: torch.device) -> None:
        for stack in self.STACKS:
            shape = self.format.dense_shape(self.stored(stack))
            zero = torch.zeros((), dtype=dtype, device=device)
            self.register_parameter(stack, nn.Parameter(zero.expand(*shape), requires_grad=False))

    def place_adapter_points(self) -> None:
        """The adapter points beside the stored tensors: a load built the model on the meta device and read only
        weights."""
        points = self._adapter_points()
        device = self.stacks()[0].device
        if points and next(iter(points.values())).device != device:
            self._offer_adapter_points(next(iter(points.values())).dtype, device)

    def _adapter_points(self) -> dict:
        if self.format.trainable:
            return {}
        return {name: self._parameters[name] for name in self.STACKS if name in self._parameters}

    def _apply(self, fn, recurse=True):
        # an adapter point moved or cast as a tensor would become a full-size one: it is offered again where `fn` sends
        # a tensor of its dtype and device
        points = self._adapter_points()
        for name in points:
            del self._parameters[name]
        if self.offload is None:
            super()._apply(fn, recurse)
        else:
            # offloaded experts stay in host memory or the shards while the rest of the model moves
            # (offload_kimi_k3.py)
            self.offload.apply(self, fn)
        if points:
            point = next(iter(points.values()))
            # `fn` cannot copy out of the meta device (a model built there before its load): ask it from the host
            probe = torch.zeros((), dtype=point.dtype, device="cpu" if point.device.type == "meta" else point.device)
            moved = fn(probe)
            self._offer_adapter_points(moved.dtype, moved.device)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._adapter_points():
            destination.pop(prefix + name, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        points = self._adapter_points()
        for name in points:
            del self._parameters[name]
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._parameters.update(points)

    def adapter_updates(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The update (gate_up, down) an unmerged PEFT adapter makes through the adapter points, None without one."""
        if self.format.trainable or not nn.utils.parametrize.is_parametrized(self):
            return None
        return self.gate_up_proj, self.down_proj

    def stored(self, stack: str) -> tuple[torch.Tensor, ...]:
        """The tensors the format keeps for one stack (`gate_up_proj` or `down_proj`), in the format's order."""
        return tuple(getattr(self, stack + suffix) for suffix in self.format.suffixes)

    def stacks(self) -> tuple[torch.Tensor, ...]:
        """Every stored tensor [E, ...] in one order: gate_up's, then down's, each in the format's order (dense:
        gate_up_proj, down_proj; MXFP4: gate_up codes, scales, down codes, scales)."""
        return tuple(tensor for stack in self.STACKS for tensor in self.stored(stack))

    def stack_names(self) -> tuple[str, ...]:
        """The parameter names of `stacks()`, in its order."""
        return tuple(stack + suffix for stack in self.STACKS for suffix in self.format.suffixes)

    def dense_stacks(self, dtype: torch.dtype, updates=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) as dense tensors in `dtype` (the stored values decoded: exact for MXFP4 in bf16
        and f32), plus `updates` (an adapter's) when given."""
        dense = tuple(self.format.dense(self.stored(stack), dtype) for stack in self.STACKS)
        if updates is None:
            return dense
        return tuple(stack + update.to(dtype) for stack, update in zip(dense, updates))

    def fetch(self, top_indices: torch.Tensor, device: torch.device):
        """With the experts kept in host memory, starts moving the chosen ones to `device` and returns the move
        (`offload_kimi_k3.ExpertFetch`) for `forward`; None otherwise. The block calls it right after its router, so
        that the copies overlap what it computes before the routed experts."""
        if self.offload is None or self._streams(top_indices, device):
            return None
        return self._fetch_offloaded(top_indices, device)

    def _streams(self, top_indices: torch.Tensor, device: torch.device) -> bool:
        # experts in host memory computed on the CPU in the device's stream order: no read of the routes by the host
        # (offload_kimi_k3.LayerOffload.streams)
        situ = None if self.config.hidden_act == "silu" else self._situ_betas()
        return self.offload.streams(top_indices.shape[0], device, self.format, situ)

    # The host reads the routes in these three (offload_kimi_k3.py): a compiled decode step breaks its graph at each
    # call, so the pieces between the reads are its captured graphs (docs/design.md, Routed experts computed where
    # they live)
    @torch.compiler.disable
    def _fetch_offloaded(self, top_indices: torch.Tensor, device: torch.device):
        return self.offload.fetch(top_indices, self.stacks(), device)

    def forward(self, hidden_states: torch.Tensor, top_indices: torch.Tensor, top_weights: torch.Tensor,
                fetched=None):
        """hidden_states [N, Dl]; returns dtype( sum_e w_e * f32(dtype(expert_e(x))) ) (docs/architecture.md, Stable
        LatentMoE). `fetched`: this forward's `fetch`, when the caller started it.

        Under expert parallelism (this rank holds `num_experts` of `config.num_experts`) only the routes to local
        experts are computed, and the f32 partial sum is returned: the ranks' parts are added by the plan's
        all-reduce (or all-to-all combine) in f32, then rounded once, as on one device."""
        if self.num_experts < self.config.num_experts:
            return self._local_routes(hidden_states, top_indices, top_weights)
        return self._routed(hidden_states, top_indices, top_weights, fetched)

    def _local_routes(self, hidden_states, top_indices, top_weights):
        # Routes to other ranks' experts carry the sentinel id `num_experts` (weight 0). Each local route runs once
        # as a top-1 route of unit weight, so the expert output is the same bf16 value as on one device; the routing
        # weights are applied here, in f32 (docs/architecture.md, Stable LatentMoE). One host sync (the number of local
        # routes), like the eager loop.
        token_of, slot = (top_indices < self.num_experts).nonzero(as_tuple=True)
        partial = hidden_states.new_zeros(hidden_states.shape, dtype=torch.float32)
        if token_of.numel() == 0:
            return partial
        routes = top_indices[token_of, slot].unsqueeze(-1)
        expert_out = self._routed(hidden_states[token_of], routes, torch.ones_like(routes, dtype=top_weights.dtype))
        weighted = expert_out.float() * top_weights[token_of, slot].float().unsqueeze(-1)
        return partial.index_add(0, token_of, weighted)

    def _routed(self, hidden_states, top_indices, top_weights, fetched=None):
        stacks, fmt = self.stacks(), self.format
        updates = self.adapter_updates()
        if updates is not None:
            if self.offload is not None:
                raise NotImplementedError("a PEFT adapter on experts kept off the device (experts_offload): load "
                                          "without experts_offload to train or run an unmerged expert adapter")
            # the experts an unmerged adapter runs: the stored ones decoded plus its update, as a merged model's
            stacks, fmt = self.dense_stacks(updates[0].dtype, updates), DENSE_EXPERTS
        if self.offload is not None:
            if self._streams(top_indices, hidden_states.device):
                return self.offload.stream_routes(hidden_states, top_indices, top_weights, *self._host_share_args())
            return self._routed_offloaded(hidden_states, top_indices, top_weights, fetched)
        return self._run(hidden_states, top_indices, top_weights, stacks, fmt)

    @torch.compiler.disable
    def _routed_offloaded(self, hidden_states, top_indices, top_weights, fetched):
        # experts kept in host memory: the chosen ones, compacted on this device, or some computed on the CPU where
        # they are (offload_kimi_k3.py)
        fetched = fetched if fetched is not None else self._fetch_offloaded(top_indices, hidden_states.device)
        if fetched.host_ids:
            return self.offload.routed_split(hidden_states, top_indices, top_weights, fetched,
                                             *self._host_share_args())
        top_indices, stacks = fetched.wait()
        return self._run(hidden_states, top_indices, top_weights, stacks, self.format)

    @torch.compiler.disable
    def start_host_share(self, hidden_states: torch.Tensor, fetched) -> None:
        """Starts the CPU's share of `fetched` (its chosen experts computed on the CPU) over `hidden_states` on the
        cache's worker thread, where `fetch` chose some; `forward` then only adds the device's share. The block calls
        it before queueing its shared experts, so the CPU computes while the GPU does."""
        # (an adapter on offloaded experts is refused by `forward`: nothing is started for it)
        if fetched is not None and fetched.host_ids and not nn.utils.parametrize.is_parametrized(self):
            self.offload.start_host_share(hidden_states, fetched, *self._host_share_args())

    def prepare_stream(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a forward of `tokens` tokens computes the routes in the stream's order (offloaded experts); makes
        what it uses if so, so that a compiled decode step finds it made."""
        if self.offload is None:
            return False
        stacks, fmt, _, situ = self._host_share_args()
        return self.offload.prepare_stream(tokens, dtype, device, stacks, fmt, situ)

    def _host_share_args(self):
        # (host stacks, format, the module's op, SiTU betas or None): what the CPU's share runs
        fmt = self.format
        situ = None if self.config.hidden_act == "silu" else self._situ_betas()
        return self.stacks(), fmt, lambda x, i, w, s: self._run(x, i, w, s, fmt), situ

    def _situ_betas(self):
        return self.config.activation_situ_beta, self.config.activation_situ_linear_beta

    def _run(self, hidden_states, top_indices, top_weights, stacks, fmt):
        if self.config.hidden_act == "silu":
            # SwiGLU experts (Kimi-Linear-style configs): the fast experts are SiTU-only
            half, dtype = len(stacks) // 2, hidden_states.dtype
            gate_up, down = fmt.dense(stacks[:half], dtype), fmt.dense(stacks[half:], dtype)
            return routed_experts(hidden_states, top_indices, top_weights, gate_up, down,
                                  lambda gate, up: glu_activation(self.config, gate, up))
        return fmt.run(hidden_states, top_indices, top_weights, stacks, self._situ_betas())


class KimiK3SparseMoeBlock(nn.Module):
    """Stable LatentMoE: router and shared experts on the full width; routed experts in the latent width, combined
    in f32, RMS-normalised, projected back up (docs/architecture.md, Stable LatentMoE)."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.config = config
        self.gate = KimiK3MoEGate(config)
        self.experts = KimiK3Experts(config)
        self.is_latent = config.routed_expert_hidden_size is not None
        if self.is_latent:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, config.latent_size, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = KimiK3RMSNorm(config.latent_size, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(config.latent_size, config.hidden_size, bias=False)
        if config.num_shared_experts:
            self.shared_experts = KimiK3MLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, top_weights, top_indices = self.gate(flat, None if token_mask is None else token_mask.reshape(-1))
        # experts in host memory start crossing now; what does not need them (the latent down-projection, the shared
        # experts) runs while they do. The same ops as without the offload: only their order of launch differs
        # (a wrapped expert module, such as peft's ParamWrapper of a LoRA on the stacks, is called as it is)
        fetched = self.experts.fetch(top_indices, flat.device) if isinstance(self.experts, KimiK3Experts) else None
        routed = self.routed_expert_down_proj(flat) if self.is_latent else flat
        if fetched is not None:  # experts computed on the CPU start on its rows now, while the GPU goes on
            self.experts.start_host_share(routed, fetched)
        shared = self.shared_experts(flat) if self.config.num_shared_experts else None
        # f32 under expert parallelism (the ranks' partial sums), rounded once here; the three-argument call is the
        # one transformers' expert-parallel dispatch wraps (no offload there)
        routed = (self.experts(routed, top_indices, top_weights) if fetched is None
                  else self.experts(routed, top_indices, top_weights, fetched)).to(flat.dtype)
        if self.is_latent:
            if self.config.latent_moe_use_norm:
                routed = self.routed_expert_norm(routed)
            routed = self.routed_expert_up_proj(routed)
        if shared is not None:
            routed = routed + shared
        return routed.view(shape)


# ----------------------------------------------------------------------------------------------------------------
# Decoder layer with Block Attention Residuals (0, 5)


class KimiK3AttnResProjection(nn.Module):
    """The [1, D] projection of an AttnRes pseudo-query (`*_res_proj.weight`), read as a weight by the mix, never
    called on activations. Not an `nn.Linear`: PEFT's "all-linear" wraps every Linear and adds an adapter that the mix
    would never run (no gradient reaches it, yet `merge_and_unload` would add it). Its own class so `_init_weights`
    zeroes it as the report does (uniform depth mixing at the start of training)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size))
        # drawn as nn.Linear drew it (the class was one): a seed builds the same model as before, every later
        # module's random values included (_init_weights then zeroes this one)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}"


def attn_res_mix(candidates: list[torch.Tensor], norm: KimiK3RMSNorm, proj: KimiK3AttnResProjection
                 ) -> torch.Tensor:
    """Mix [b_0, ..., b_{n-1}, P] with the pseudo-query w = norm.weight * proj.weight (docs/architecture.md, Block
    Attention Residuals)."""
    # Under a device_map the banked blocks come from the layers that made them: bring them to P's device.
    candidates = [block.to(candidates[-1].device) for block in candidates]
    mix = fast_or_reference("block_attn_res_mix", *candidates)
    with _onloaded(norm, proj):
        return mix(candidates, norm.weight, proj.weight, norm.variance_epsilon)


def attn_res_mix_and_norm(blocks: list[torch.Tensor], prefix: torch.Tensor | None, delta: torch.Tensor | None,
                          norm: KimiK3RMSNorm, proj: KimiK3AttnResProjection, out_norm: KimiK3RMSNorm):
    """P = prefix + delta (either may be None), the mix of [b_0, ..., b_{n-1}, P] (docs/architecture.md, Block Attention
    Residuals) and `out_norm` of it, as one op: in eager inference with one banked block, one kernel instead of three
    (add, mix, norm) that each read and write [B, T, D], the mix never stored. Elsewhere its reference runs the three.
    Returns (P, out_norm(mix))."""
    device = (prefix if prefix is not None else delta).device
    blocks = [block.to(device) for block in blocks]  # banked on the layers that made them, as in `attn_res_mix`
    with _onloaded(norm, proj, out_norm):
        fused = fast_or_reference("attn_res_mix_norm", *blocks, prefix, delta, norm.weight, proj.weight,
                                  out_norm.weight)
        return fused(blocks, prefix, delta, norm.weight, proj.weight, norm.variance_epsilon, out_norm.weight,
                     out_norm.variance_epsilon)


class KimiK3DecoderLayer(GradientCheckpointingLayer):
    """One K3 layer. With Block AttnRes, `hidden_states` is the running block sum P and `banked_blocks` the banked
    block vectors (inputs only: the model loop banks, so a recomputed layer mutates nothing)."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        self.self_attn = KimiK3DeltaAttention(config, layer_idx) if self.is_linear else KimiK3MLAAttention(
            config, layer_idx
        )
        self.mlp = KimiK3SparseMoeBlock(config) if config.mlp_layer_types[layer_idx] == "sparse" else KimiK3MLP(config)
        self.input_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.use_attn_res = config.attn_res_block_size is not None
        self.starts_block = self.use_attn_res and layer_idx % config.attn_res_block_size == 0
        if self.use_attn_res:
            self.self_attention_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attention_res_proj = KimiK3AttnResProjection(config.hidden_size)
            self.mlp_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_res_proj = KimiK3AttnResProjection(config.hidden_size)
            if layer_idx == 0:
                # The release ships layer 0's attention-side pseudo-query, but the model never uses that mix
                # (docs/architecture.md, Block Attention Residuals). Kept under its release name as a buffer: it loads
                # and saves, and no optimizer or DDP (with find_unused_parameters=False) waits for a gradient that never
                # comes.
                for module in (self.self_attention_res_norm, self.self_attention_res_proj):
                    weight = module.weight
                    del module.weight
                    module.register_buffer("weight", weight.detach())

    def forward(
        self,
        hidden_states: torch.Tensor,
        *banked_blocks: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        cache: KimiK3Cache | None = None,
        document_index: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if not self.use_attn_res:
            residual = hidden_states
            hidden_states = self._attention(self.input_layernorm(hidden_states), attention_mask, token_mask, cache,
                                            document_index, **kwargs)
            hidden_states = residual + hidden_states
            return hidden_states + self._feed_forward(self.post_attention_layernorm(hidden_states), token_mask)

        prefix, blocks = hidden_states, list(banked_blocks)
        # Layer 0 has no banked block yet: its attention reads the embedding directly. Otherwise the mix and
        # input_layernorm run as one op (no residual add on this side).
        if blocks:
            _, attn_input = attn_res_mix_and_norm(blocks, prefix, None, self.self_attention_res_norm,
                                                  self.self_attention_res_proj, self.input_layernorm)
        else:
            attn_input = self.input_layernorm(prefix)
        if self.starts_block:
            blocks.append(prefix)
            prefix = None
        attn_output = self._attention(attn_input, attention_mask, token_mask, cache, document_index, **kwargs)
        # P + attn_output (P None: this layer starts a block), the mix and post_attention_layernorm as one op
        prefix, mlp_input = attn_res_mix_and_norm(blocks, prefix, attn_output, self.mlp_res_norm, self.mlp_res_proj,
                                                  self.post_attention_layernorm)
        return prefix + self._feed_forward(mlp_input, token_mask)

    def _feed_forward(self, hidden_states, token_mask):
        if isinstance(self.mlp, KimiK3SparseMoeBlock):
            # the router sees the padding mask so Quantile Balancing counts real tokens only
            return self.mlp(hidden_states, token_mask)
        return self.mlp(hidden_states)

    def _attention(self, hidden_states, attention_mask, token_mask, cache, document_index, **kwargs):
        if self.is_linear:
            return self.self_attn(hidden_states, token_mask=token_mask, cache=cache, document_index=document_index,
                                  context_parallel=kwargs.get("context_parallel"))
        return self.self_attn(hidden_states, attention_mask=attention_mask, cache=cache, **kwargs)[0]


# ----------------------------------------------------------------------------------------------------------------
# Models


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _skip_keys_device_placement = list(CACHE_ARGUMENTS)
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    # The KDA state can go back to any earlier token (rewind records, snapshots: KimiK3Cache.crop), so
    # transformers' assisted and prompt-lookup decoding may verify and reject draft tokens.
    _is_stateful = False
    _can_compile_fullgraph = True
    # The release stores these in F32; loading in bf16 must not round them (docs/architecture.md, dtype islands).
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm",
                                    "e_score_correction_bias"]
    _keys_to_ignore_on_load_unexpected = [r"vision_tower\.", r"mm_projector\."]

    @property
    def is_gradient_checkpointing(self) -> bool:
        # the name PEFT's get_peft_model reads, answered without the newer transformers' FutureWarning
        return activation_checkpointing_on(self)

    # output_hidden_states / output_attentions / output_router_logits, recorded by transformers' hooks. MLA layers
    # return their weights second (None under SDPA, then nothing is recorded); KDA layers have none.
    _can_record_outputs = {
        "hidden_states": OutputRecorder(KimiK3DecoderLayer, index=0),
        "attentions": OutputRecorder(KimiK3MLAAttention, index=1),
        "router_logits": OutputRecorder(KimiK3MoEGate, index=0),
    }

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, experts_format: str | None = None,
                        experts_offload: str | None = None, experts_cache_bytes: int | None = None, **kwargs):
        """Through the one door, loading_kimi_k3.load_pretrained: also the release layout as it is on disk;
        `experts_format="mxfp4"` keeps MXFP4 experts packed. Missing, unknown, misshapen or non-finite tensors are
        errors naming the release tensor; a local folder's files are checked first.

        `experts_offload="host"` keeps the routed experts in host memory, `"disk"` maps them from the folder's shards,
        with a device cache of at most `experts_cache_bytes` bytes of them, the model's `experts_cache`;
        `experts_compute="host"` or `"auto"` computes the chosen experts the cache lacks on the CPU where they are
        (docs/design.md, Routed experts off the device)."""
        return load_pretrained(cls, super().from_pretrained, pretrained_model_name_or_path, *args,
                               experts_format=experts_format, experts_offload=experts_offload,
                               experts_cache_bytes=experts_cache_bytes, **kwargs)

    def post_init(self):
        super().post_init()
        register_auto_classes(self)
        # save_pretrained reverses the conversions a load applied (a release-loaded model saves the release layout);
        # a model built from a config applied none and saves our layout. from_pretrained replaces this.
        self._weight_conversions = []

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.get_text_config().initializer_range
        if isinstance(module, KimiK3DeltaAttention):
            # fla initialisation: A in [1, 16], dt in [1e-3, 1e-1] stored as inverse softplus
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            for conv in (module.q_conv1d, module.k_conv1d, module.v_conv1d):
                bound = 1.0 / math.sqrt(conv.weight.shape[-1])
                conv.weight.uniform_(-bound, bound)
        elif isinstance(module, KimiK3GatedRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, KimiK3RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, KimiK3MoEGate):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, KimiK3Experts) and module.format.trainable:
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, KimiK3AttnResProjection):
            # The report initialises every pseudo-query to zero: uniform depth mixing at the start of training. The
            # draw before it is the one transformers made for it as an nn.Linear: the random values of every module
            # initialised after it stay what a seed gave before.
            module.weight.normal_(0.0, std)
            module.weight.zero_()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length) -> None:
        # generate() would build the library's DynamicCache/StaticCache, which hold K/V, not MLA latents. The cache
        # must exist before generate() decides whether to compile the decode step, so it cannot wait for forward.
        # Same signature in transformers 5.0 through 5.25.
        prompt_mask = model_kwargs.get("attention_mask")
        if isinstance(prompt_mask, torch.Tensor) and prompt_mask.dim() == 2 and prompt_mask.numel():
            # every cache: the new tokens follow the prompt's last position (a static cache's decode steps read no
            # mask, so the forward's own check would not see a right-padded prompt)
            continued = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], 1)], dim=1)
            if mask_holes(continued).any():
                raise mask_hole_error(continued, "the prompt and the first generated token")
        user_cache = model_kwargs.get(CACHE_FIELD)
        if user_cache is not None:
            if not isinstance(user_cache, KimiK3Cache):
                raise cache_type_error(user_cache, self.config.get_text_config())
            user_cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        implementation = generation_config.cache_implementation
        if implementation in (None, "dynamic", "hybrid"):
            model_kwargs[CACHE_FIELD] = KimiK3Cache(self.config)
        elif implementation == "static":
            model_kwargs[CACHE_FIELD] = KimiK3StaticCache(self.config, max_cache_len=max_cache_length)
        else:
            raise NotImplementedError(
                f"cache_implementation={implementation!r}: Kimi K3 uses its own hybrid cache (KimiK3Cache); use "
                "the default or 'static'."
            )
        if getattr(generation_config, "is_assistant", False):
            # A draft model's cache is cropped back to the accepted tokens after every verification
            model_kwargs[CACHE_FIELD].activate_past_recording()

    def _prepare_attention_mask_for_generation(self, inputs_tensor, generation_config, model_kwargs):
        """The mask generate() infers when none is given marks every pad id as padding, also one after the first real
        token (a generated token, or the id in the text): a hole K3 cannot compute and refuses. Inferred, only the
        leading pad ids (left padding, the only padding K3 continues exactly) are padding; a mask the user gives is
        taken as given."""
        mask = super()._prepare_attention_mask_for_generation(inputs_tensor, generation_config, model_kwargs)
        return (mask.cumsum(dim=-1) > 0).to(mask.dtype) if mask.dim() == 2 else mask

    def _validate_generated_length(self, generation_config, input_ids_length, *args, **kwargs):
        """Refused at the call, before the prefill: a generation that would run past max_position_embeddings (the
        length the model was trained to and the config promises; `max_length` counts the prompt,
        `max_new_tokens` is added to it), and special token ids outside the vocabulary."""
        for key in ("max_new_tokens", "max_length"):
            value = getattr(generation_config, key, None)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                # range() and the length checks took 2.5 as 3 steps and True as 1
                raise ValueError(f"generate({key}={value!r}): a whole number of tokens")
        for key in ("num_beams", "num_return_sequences", "prompt_lookup_num_tokens"):
            value = getattr(generation_config, key, None)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                # 0 beams divided by zero in the beam search, -1 made a tensor of negative size; 0 or -1 lookup
                # tokens failed in the candidate generator naming neither
                raise ValueError(f"generate({key}={value!r}): a positive whole number")
        super()._validate_generated_length(generation_config, input_ids_length, *args, **kwargs)
        text = self.config.get_text_config()
        limit = text.max_position_embeddings
        total = generation_config.max_length
        if generation_config.max_new_tokens is not None:
            # images given as one `<|media_pad|>` each lengthen the prompt the new tokens follow
            total += getattr(self, "_image_rows_added", 0)
        if total > limit:
            asked = (f"max_new_tokens={generation_config.max_new_tokens} after a prompt of {input_ids_length} tokens"
                     if generation_config.max_new_tokens is not None else f"max_length={generation_config.max_length}")
            raise ValueError(f"generate({asked}) would run to {total} tokens, past max_position_embeddings={limit}; "
                             f"ask for at most {max(0, limit - input_ids_length)} new tokens")
        check_token_ids(generation_config, self.get_input_embeddings().num_embeddings, "generation_config.")

    def create_masks_for_generate(self, config=None, attention_mask=None, **kwargs):
        """generate() asks for fixed-shape masks when the cache is static: the prefill keeps its 2-D padding mask
        (the cache records it), decode steps need none (the cache's key_valid mask is the mask)."""
        cache = cache_in(kwargs)
        if cache is not None and cache.has_previous_state():
            return None
        return attention_mask

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Also writes the code files the folder needs to load with trust_remote_code in a fresh process, and the full
        `auto_map`; a model loaded from our layout keeps it; the folder is written under a temporary name and renamed
        once complete, a sharded model gathered and written by rank 0 (saving_kimi_k3.save_folder)."""
        check_savable(self)
        save_folder(self, super().save_pretrained, save_directory, *args, **kwargs)


class KimiK3Model(KimiK3PreTrainedModel):
    # The base model of a folder saved with the head (AutoModel on a KimiK3ForCausalLM folder): the head is not part
    # of it and is left out, as transformers' base models leave out their heads
    _keys_to_ignore_on_load_unexpected = KimiK3PreTrainedModel._keys_to_ignore_on_load_unexpected + [r"^lm_head\."]

    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = KimiK3AttnResProjection(config.hidden_size)
        self.norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        # `<|media_pad|>` marks where an image goes: without pixel_values its embedding is not an image. A text config
        # may name it (`media_placeholder_token_id`); the composite model sets it from its own config.
        self.media_placeholder_token_id = getattr(config, "media_placeholder_token_id", None)
        self.post_init()

    # hidden_states[-1] stays the last layer's output: the final norm reads an AttnRes mix of all blocks, not it
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiK3Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        cache: KimiK3Cache | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        cache = given_cache(cache, past_key_values)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache, cache = False, None
        if use_cache and cache is None:
            cache = KimiK3Cache(self.config)
        if cache is not None and not isinstance(cache, KimiK3Cache):
            raise cache_type_error(cache, self.config)
        check_model_inputs(self, input_ids, inputs_embeds, attention_mask, cache)
        for key in ("output_hidden_states", "output_attentions", "output_router_logits"):
            kwargs.pop(key, None)  # recorded by capture_outputs
        if cache is not None and cache.pending_tokens:
            self._replay_pending(cache)
        context_parallel = kwargs.get("context_parallel")
        if context_parallel is not None:
            # this rank's segment of one sequence; the layers exchange states and latents with the other ranks
            context_parallel.check_inputs((input_ids if input_ids is not None else inputs_embeds).shape[1],
                                          attention_mask, cache)
            attention_mask = None

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, seq_len = inputs_embeds.shape[:2]

        if cache is not None and cache.is_fixed_shape_step(seq_len):
            # Static decode step: fixed shapes, no host synchronisation, no Python counter read (compilable).
            # The new tokens are real; which cached keys are real is the cache's key_valid mask.
            cache.begin_step(batch, seq_len, None, inputs_embeds.device)
            token_mask, document_index = None, None
            mla_mask = cache.key_valid_mask(seq_len)
        else:
            past_len = cache.get_seq_length() if cache is not None else 0
            document_ids = self._document_ids(position_ids, attention_mask, past_len, kwargs)
            if document_ids is not None and cache is not None and past_len > 0:
                raise ValueError("Packed sequences (restarting position_ids) cannot continue a cache")
            token_mask = self._token_mask(attention_mask, seq_len)
            if cache is not None:
                cache.begin_step(batch, seq_len, token_mask, inputs_embeds.device, input_ids)
            mla_mask = self._mla_mask(attention_mask, document_ids, batch, seq_len, past_len, inputs_embeds.device)
            document_index = self._document_index(document_ids) if document_ids is not None else None
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
            kwargs.pop(key, None)

        if token_mask is not None:
            # Padded positions hold whatever the pad embedding row or the caller put there, NaN included. Select zeros
            # there (as the release's multimodal merge does: docs/architecture.md, Image rows in the token sequence), so
            # every later op reads finite values and a padded key's exactly-zero attention weight times its value stays
            # exactly zero.
            inputs_embeds = inputs_embeds.masked_fill(~token_mask.unsqueeze(-1), 0.0)
        hidden_states, banked = inputs_embeds, ()
        for layer in self.layers[: self.config.num_hidden_layers]:
            layer_output = layer(
                hidden_states,
                *banked,
                attention_mask=mla_mask,
                token_mask=token_mask,
                cache=cache,
                document_index=document_index,
                **kwargs,
            )
            if layer.starts_block:
                banked = banked + (hidden_states,)
            hidden_states = layer_output
        if self.config.attn_res_block_size is not None:
            hidden_states = attn_res_mix([*banked, hidden_states], self.output_attn_res_norm,
                                         self.output_attn_res_proj)
        hidden_states = self.norm(hidden_states)
        if cache is not None:
            cache.advance(seq_len if context_parallel is None else context_parallel.total_length)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_FIELD: cache})

    def _replay_pending(self, cache: KimiK3Cache) -> None:
        """Run the tokens a crop left pending (it went back to a snapshot below its target: docs/design.md, Going
        back) before this forward's own inputs: a prefill of them, without gradients, through the same forward."""
        with cache.replay() as (input_ids, attention_mask), torch.no_grad():
            self(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True)

    @staticmethod
    def _token_mask(attention_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2:
            raise ValueError(
                f"Kimi K3 takes a 2-D padding attention_mask [batch, length]; got shape {tuple(attention_mask.shape)}"
            )
        mask = attention_mask[:, -seq_len:].bool()
        return None if bool(mask.all()) else mask

    @staticmethod
    def _document_ids(position_ids, attention_mask, past_len, kwargs) -> torch.Tensor | None:
        """Document index per token for packed rows (DataCollatorWithFlattening): a new document starts wherever
        position_ids restart at 0. Only for uncached forwards without a padding mask (left padding also repeats
        position 0)."""
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is not None and position_ids is None:
            total = int(cu_seqlens[-1])
            starts = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
            starts[cu_seqlens[:-1].long()] = 1
            return starts.cumsum(0).unsqueeze(0) - 1
        if position_ids is None or attention_mask is not None or past_len > 0 or position_ids.shape[-1] < 2:
            return None
        restarts = position_ids[:, 1:] == 0
        if not bool(restarts.any()):
            return None
        starts = torch.cat([torch.ones_like(position_ids[:, :1], dtype=torch.bool), restarts], dim=1)
        return starts.long().cumsum(dim=1) - 1

    @staticmethod
    def _document_index(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gather index [docs, longest], mask) to regroup packed tokens into one right-padded row per document."""
        batch, seq_len = document_ids.shape
        flat_ids = (document_ids + torch.arange(batch, device=document_ids.device)[:, None] * seq_len).reshape(-1)
        _, lengths = torch.unique_consecutive(flat_ids, return_counts=True)
        starts = torch.cumsum(lengths, 0) - lengths
        longest = int(lengths.max())
        offsets = torch.arange(longest, device=document_ids.device)
        mask = offsets[None, :] < lengths[:, None]
        index = (starts[:, None] + offsets[None, :]).clamp(max=batch * seq_len - 1)
        return index, mask

    def _mla_mask(self, attention_mask, document_ids, batch, seq_len, past_len, device) -> torch.Tensor | None:
        """4-D boolean mask [B, 1, T, past+T] (True = attend), or None when attention is plain causal (no padding, no
        packed documents): the MLA layer then applies causality itself (SDPA's is_causal for a fresh prefill, the
        diagonal block of the blockwise prefill over a cache, nothing to mask for one decode token)."""
        kv_len = past_len + seq_len
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        if not padded and document_ids is None:
            return None
        mask = _causal_mask(seq_len, kv_len, device)[None, None].expand(batch, 1, seq_len, kv_len)
        if padded:
            mask = mask & attention_mask[:, None, None, -kv_len:].bool()
        if document_ids is not None:
            mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
        # A padding query sees no key; let it see everything so softmax stays finite (its output is never used).
        return mask | ~mask.any(dim=-1, keepdim=True)


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KimiK3Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: KimiK3Cache | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=given_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            inputs = input_ids if input_ids is not None else inputs_embeds
            if inputs is not None and tuple(labels.shape) != tuple(inputs.shape[:2]):
                name = "input_ids" if input_ids is not None else "inputs_embeds"
                raise ValueError(f"labels have shape {tuple(labels.shape)} but {name} {tuple(inputs.shape)}: one "
                                 "label per input token ([batch, length]; the shift to next-token targets is done "
                                 "inside, -100 where no loss is wanted)")
            check_labels(labels, self.config.vocab_size, getattr(self.config, "ignore_index", -100))
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )


__all__ = [
    "KimiK3PreTrainedModel",
    "KimiK3Model",
    "KimiK3ForCausalLM",
]
