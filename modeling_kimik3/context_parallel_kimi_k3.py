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
"""Context parallelism for Kimi K3: one long sequence split into contiguous segments, one per rank.

Only the two sequence mixers need other ranks' tokens; Block Attention Residuals, the MoE and every norm are
per-token and run on the local segment as they are.

* KDA, by state composition (docs/architecture.md, Chunked KDA). The recurrence is affine in the state,
  S_t = A_t S_{t-1} + beta_t k_t v_t^T with A_t = (I - beta_t k_t k_t^T) Diag(alpha_t), so a segment maps any
  incoming state S to T_seg S + F_seg, where
  the *transition* T_seg [H, K, K] is the ordered product of the per-chunk maps of the WY/UT form
  (`ops.kda_segment_transition`) and F_seg [H, K, V] the segment's final state from zero. Each rank runs its segment
  from a zero state (outputs O_0 and F_seg), all ranks exchange (T_seg, F_seg), and a prefix scan of those gives each
  rank its true incoming state S_in; because the outputs are affine in the state too, O = O_0 + KDA(S_in, V = 0) is
  the correction pass. Exact algebra: only the rounding of the sums differs from one process.
  The short conv reads the K - 1 pre-conv rows before the segment: a second fixed-size exchange (the rows' halo).
  Both exchanges are independent of the sequence length (`kda_exchange_bytes`).
* MLA, by all-gathering the compressed latents (kv_lora_rank + qk_rope_head_dim values per token, never the
  expanded K/V); each rank attends its queries over the keys up to its segment's end, the earlier segments as past
  blocks and its own as the causal diagonal block (the blockwise log-sum-exp prefill).

After a context-parallel forward with a cache, every rank holds the single-process cache of the whole sequence (all
latents; the last KDA state and conv windows, composed from the exchanged pieces), so decoding continues on any rank.

Usage (every rank, same full `input_ids`):

    cp = ContextParallel.for_sequence(input_ids.shape[1], group)
    out = model(input_ids=cp.shard(input_ids), context_parallel=cp)      # this rank's logits [B, T_r, V]

The exchanges are autograd functions (all-gather forward, all-reduce + own slice backward), so training forward and
backward run the same way; parameter gradients are then summed over the group (FSDP/DDP do that).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .ops_kimi_k3 import kda_segment_transition


class _GatherSegments(torch.autograd.Function):
    """All-gather of equally shaped tensors, stacked on a new leading rank axis. Backward: the gradient of every
    rank's copy of the stack is summed (all-reduce) and this rank takes its own slice."""

    @staticmethod
    def forward(ctx, tensor, group, rank, world_size):
        ctx.group, ctx.rank = group, rank
        gathered = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(gathered, tensor.contiguous(), group=group)
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _DependOn(torch.autograd.Function):
    """`tensor` unchanged, made to depend on `anchor` in the autograd graph (zero gradient). A rank that does not
    read an exchange's result (rank 0 has no incoming state) must still run that exchange's backward, whose
    all-reduce the other ranks wait for."""

    @staticmethod
    def forward(ctx, tensor, anchor):
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


def _depend_on(tensor: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    if not (torch.is_grad_enabled() and anchor.requires_grad):
        return tensor
    return _DependOn.apply(tensor, anchor)


@dataclass
class ContextParallel:
    """One rank's view of a sequence split into contiguous segments over `group` (None: the default group).

    `lengths[r]` is rank r's number of tokens. `exchanged_bytes[layer_idx]` accumulates what this rank sends per layer
    (every exchange is an all-gather of one local tensor), for reporting and the length-independence test.
    """

    lengths: tuple[int, ...]
    group: object = None
    rank: int = 0
    exchanged_bytes: dict[int, int] = field(default_factory=dict)

    @classmethod
    def for_sequence(cls, seq_len: int, group=None) -> "ContextParallel":
        """Near-equal contiguous segments (the first ranks take one token more), this process's rank in `group`."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ContextParallel needs torch.distributed initialised (init_process_group) first")
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if seq_len < world_size:
            raise ValueError(f"context parallelism over {world_size} ranks needs at least {world_size} tokens, got "
                             f"{seq_len}")
        base, extra = divmod(seq_len, world_size)
        return cls(tuple(base + (r < extra) for r in range(world_size)), group, rank)

    @property
    def world_size(self) -> int:
        return len(self.lengths)

    @property
    def start(self) -> int:
        return sum(self.lengths[: self.rank])

    @property
    def end(self) -> int:
        return self.start + self.lengths[self.rank]

    @property
    def total_length(self) -> int:
        return sum(self.lengths)

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's segment of a full-sequence tensor (input_ids, labels, ...)."""
        if tensor.shape[dim] != self.total_length:
            raise ValueError(f"expected the full sequence of {self.total_length} tokens along dim {dim}, got shape "
                             f"{tuple(tensor.shape)}")
        return tensor.narrow(dim, self.start, self.lengths[self.rank])

    def gather(self, tensor: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """All ranks' `tensor` (same shape everywhere), stacked [world_size, ...]; differentiable; counted."""
        self.exchanged_bytes[layer_idx] = (self.exchanged_bytes.get(layer_idx, 0)
                                           + tensor.numel() * tensor.element_size())
        return _GatherSegments.apply(tensor, self.group, self.rank, self.world_size)

    def check_inputs(self, input_length: int, attention_mask, cache) -> None:
        """What a context-parallel forward supports: this rank's unpadded segment of one fresh prefill."""
        if input_length != self.lengths[self.rank]:
            raise ValueError(f"context parallel rank {self.rank} expects its segment of {self.lengths[self.rank]} "
                             f"tokens (ContextParallel.shard), got {input_length}")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("context parallelism takes unpadded sequences: drop the padding (or the attention_mask)")
        if cache is not None and (cache.has_previous_state() or cache.is_static):
            raise ValueError("context parallelism runs a fresh prefill: pass a new dynamic KimiK3Cache (or none); "
                             "decode continues on one rank from the cache it fills")

    # --------------------------------------------------------------------------------------------------------------
    # MLA

    def gather_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """[B, T_r, R + P] local latents -> [B, T, R + P] of the whole sequence (segments padded to the longest for
        the all-gather, then trimmed)."""
        longest = max(self.lengths)
        padded = torch.nn.functional.pad(latents, (0, 0, 0, longest - latents.shape[1]))
        gathered = self.gather(padded, layer_idx)
        return torch.cat([gathered[r, :, :n] for r, n in enumerate(self.lengths)], dim=1)

    # --------------------------------------------------------------------------------------------------------------
    # KDA

    def conv_windows(
        self, pre_conv: tuple[torch.Tensor, ...], window: int, layer_idx: int
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...]]:
        """The short conv's halo. pre_conv: this rank's (q, k, v) projections [B, T_r, C]. Returns (pre_conv, tied
        to the exchange on rank 0 for the backward; the `window` pre-conv rows before this segment, per tensor
        [B, C, window] as `causal_conv1d` takes them, or None on rank 0; the last `window` rows of the whole
        sequence, the cache's conv state). Segments shorter than the window are handled by composing the windows
        rank by rank."""
        tails = torch.stack([self._last_rows(x, window) for x in pre_conv])  # [3, B, window, C]
        gathered = self.gather(tails, layer_idx)
        running = torch.zeros_like(tails)
        incoming = None
        for r in range(self.world_size):
            if r == self.rank:
                incoming = running
            # the rows that end segment r: its own (zero-padded in front when it is short) after what came before
            take = min(self.lengths[r], window)
            running = torch.cat([running[:, :, take:], gathered[r][:, :, window - take:]], dim=2)
        as_state = lambda rows: tuple(rows[i].transpose(1, 2) for i in range(len(pre_conv)))  # noqa: E731
        if self.rank == 0:
            return (_depend_on(pre_conv[0], gathered), *pre_conv[1:]), None, as_state(running)
        return pre_conv, as_state(incoming), as_state(running)

    @staticmethod
    def _last_rows(x: torch.Tensor, window: int) -> torch.Tensor:
        rows = x[:, -window:]
        return torch.nn.functional.pad(rows, (0, 0, window - rows.shape[1], 0))

    def kda(self, kda_fn, q, k, v, g, beta, chunk_size: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KDA over this rank's segment with the true incoming state, by state composition. q, k, g [B, T_r, H, K],
        v [B, T_r, H, V], beta [B, T_r, H] as the model passes them to `chunk_kda` (l2norm in the kernel). Returns
        (outputs [B, T_r, H, V] in v's dtype, the f32 final state of the whole sequence [B, H, K, V])."""
        kwargs = {"use_qk_l2norm_in_kernel": True, "chunk_size": chunk_size}
        zero_out, zero_final = kda_fn(q, k, v, g, beta, output_final_state=True, **kwargs)
        transition = kda_segment_transition(k, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
        # one fixed-size exchange: [B, H, K, K + V] per rank
        pieces = self.gather(torch.cat([transition, zero_final.float()], dim=-1), layer_idx)
        k_dim = transition.shape[-1]
        state = torch.zeros_like(zero_final, dtype=torch.float32)
        incoming = None
        for r in range(self.world_size):
            if r == self.rank:
                incoming = state
            state = pieces[r, ..., :k_dim] @ state + pieces[r, ..., k_dim:]
        if self.rank == 0:
            return _depend_on(zero_out, pieces), state  # the incoming state is zero: nothing to correct
        correction, _ = kda_fn(q, k, torch.zeros_like(v), g, beta, initial_state=incoming, **kwargs)
        return (zero_out.float() + correction.float()).to(zero_out.dtype), state


def kda_exchange_bytes(config, batch_size: int = 1, activation_bytes: int = 2) -> int:
    """Bytes one rank sends per KDA layer in a context-parallel forward: the f32 transition and zero-start final
    state [B, H, K, K + V], and the conv halo, K - 1 pre-conv rows of q, k and v. Independent of the length."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, head_dim = text.linear_num_heads, text.linear_head_dim
    state = batch_size * heads * head_dim * 2 * head_dim * 4
    halo = 3 * batch_size * (text.linear_conv_kernel_size - 1) * heads * head_dim * activation_bytes
    return state + halo


def mla_exchange_bytes_per_token(config, activation_bytes: int = 2) -> int:
    """Bytes one rank sends per MLA layer and token: its compressed latents (kv_lora_rank + qk_rope_head_dim
    values), not the expanded keys and values."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.mla_cache_dim * activation_bytes


__all__ = ["ContextParallel", "kda_exchange_bytes", "mla_exchange_bytes_per_token"]
