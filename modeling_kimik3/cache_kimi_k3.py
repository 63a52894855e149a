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
"""The hybrid Kimi K3 cache: compressed MLA latents + KDA conv windows and f32 recurrent states.

Laid out like transformers' caches: a `Cache` holding one layer object per model layer, built from
`config.layer_types`, in a dynamic and a static variant.

* `KimiK3LatentLayer` (MLA): `kv_lora_rank + qk_rope_head_dim` values per token (the normalised latent followed by
  the shared, unrotated k_pe), never expanded K/V. Appended per forward; `KimiK3StaticLatentLayer` preallocates
  `max_cache_len` tokens and writes in place.
* `KimiK3KDAStateLayer` (KDA): the last `K - 1` pre-conv inputs of q, k and v and the [H, Dk, Dv] f32 state.
  Replaced per forward; `KimiK3StaticKDAStateLayer` copies into buffers that keep their addresses.

The layer objects are our own rather than transformers' `CacheLayerMixin` / `LinearAttentionCacheLayerMixin`,
whose API moved between 5.17 and 5.24 and which hold K/V, not latents. The model reaches the storage only through
the cache's accessors (`update_latents`, `kda_state`, `update_kda_state`, `has_previous_state`), and the token
bookkeeping (a Python count, or a device-side position and key-validity mask) lives in the cache, since every layer
of one forward writes the same positions.

Going back to an earlier token (`crop`), which a recurrent state cannot do by itself, works two ways (dynamic cache):

* Rollback records (speculative decoding): while past recording is on, every short forward records, per KDA layer,
  the state it started from and the per-token inputs of the recurrence (the pre-conv q/k/v projections and the
  post-conv q, k, v, the decay g and beta). Cropping inside the recorded span restores the conv windows from the
  pre-conv inputs and replays the recurrence from the recorded state up to the kept token: no projection and no
  earlier token is recomputed.
* Snapshots (prefix reuse): a prefill stores the KDA states at every multiple of `snapshot_interval` tokens
  (optionally on another device, under a byte budget). Cropping anywhere else restores the nearest snapshot at or
  below the target, cuts the MLA latents there and runs the model on the recorded token ids in between: the same
  computation as a prefill of those tokens.
"""

import weakref

import torch
from transformers.cache_utils import Cache

from .dispatch_kimi_k3 import kda_recurrence
from .ops_kimi_k3 import conv_windows_after

# The report's serving granularity: prompts are hashed in 512-token blocks, and a KDA state snapshot is kept every
# few dozen blocks (about 50 snapshots over a 1M-token context).
KDA_BLOCK_SIZE = 512
DEFAULT_SNAPSHOT_BLOCKS = 40
DEFAULT_SNAPSHOT_INTERVAL = KDA_BLOCK_SIZE * DEFAULT_SNAPSHOT_BLOCKS
# Forwards longer than this are not recorded for rollback (a verify block is a handful of tokens; a prefill's
# per-token inputs would cost far more than its snapshots)
DEFAULT_MAX_ROLLBACK_TOKENS = 128


def _static_address(tensor: torch.Tensor) -> torch.Tensor:
    # CUDA graphs replay on fixed addresses; tell dynamo these buffers keep theirs
    try:
        torch._dynamo.mark_static_address(tensor)
    except Exception:  # noqa: BLE001 - older torch or no dynamo: only a missed optimisation
        pass
    return tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# ----------------------------------------------------------------------------------------------------------------
# Per-layer storage


class KimiK3LatentLayer:
    """MLA layer of a growing cache: [B, T, kv_lora_rank + rope] latents, appended along the token axis."""

    is_linear = False
    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self):
        self.latents: torch.Tensor | None = None

    def update(self, latents: torch.Tensor) -> torch.Tensor:
        self.latents = latents if self.latents is None else torch.cat([self.latents, latents], dim=1)
        return self.latents

    def crop(self, max_length: int) -> None:
        if self.latents is not None:
            self.latents = self.latents[:, :max_length]

    def map_batch(self, fn) -> None:
        if self.latents is not None:
            self.latents = fn(self.latents)

    @property
    def batch_size(self) -> int:
        return 0 if self.latents is None else self.latents.shape[0]

    def live_bytes(self) -> dict[str, int]:
        return {"mla_kv": 0 if self.latents is None else _nbytes(self.latents)}

    def reset(self) -> None:
        self.latents = None


# A static cache's buffers hold a whole number of these many tokens (the extra rows stay invalid in the key mask):
# the decode step's GEMMs over the whole buffer then have 16-byte-aligned leading dimensions. With an odd length
# (e.g. 64K context + 49) cuBLAS falls back to its unaligned kernels, about 4x slower there (docs/benchmarks.md,
# MLA decode op and static buffers).
STATIC_BUFFER_TOKENS_MULTIPLE = 64


def static_buffer_len(max_cache_len: int) -> int:
    return -(-max_cache_len // STATIC_BUFFER_TOKENS_MULTIPLE) * STATIC_BUFFER_TOKENS_MULTIPLE


class KimiK3StaticLatentLayer(KimiK3LatentLayer):
    """MLA layer of a static cache: a preallocated [B, max_cache_len rounded up, R + P] buffer at a fixed address,
    written in place; the cache's key-validity mask says which rows hold real tokens."""

    is_compileable = True
    is_croppable = False

    def __init__(self, max_cache_len: int):
        super().__init__()
        self.max_cache_len = max_cache_len

    def _buffer(self, latents: torch.Tensor) -> torch.Tensor:
        if self.latents is None:
            buffer = latents.new_zeros(latents.shape[0], static_buffer_len(self.max_cache_len), latents.shape[-1])
            self.latents = _static_address(buffer)
        return self.latents

    def write(self, latents: torch.Tensor, start: int) -> torch.Tensor:
        """A prefill chunk at a host-known offset; returns the filled prefix."""
        end = start + latents.shape[1]
        buffer = self._buffer(latents)
        buffer[:, start:end] = latents
        return buffer[:, :end]

    def write_step(self, latents: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One decode token at a device-side position (no host read); returns the whole buffer."""
        buffer = self._buffer(latents)
        buffer.index_copy_(1, position.to(buffer.device), latents)  # the layer may sit on another device
        return buffer


class KimiK3KDAStateLayer:
    """KDA layer: the q/k/v conv windows (last K - 1 pre-conv inputs) and the f32 recurrent state, replaced after
    every forward."""

    is_linear = True
    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        self.conv_states: tuple[torch.Tensor, ...] | None = None
        self.recurrent_state: torch.Tensor | None = None

    def update(self, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor) -> None:
        self.conv_states = tuple(conv_states)
        self.recurrent_state = recurrent_state.float()

    def map_batch(self, fn) -> None:
        if self.conv_states is not None:
            self.conv_states = tuple(fn(state) for state in self.conv_states)
        if self.recurrent_state is not None:
            self.recurrent_state = fn(self.recurrent_state)

    @property
    def batch_size(self) -> int:
        return 0 if self.recurrent_state is None else self.recurrent_state.shape[0]

    def live_bytes(self) -> dict[str, int]:
        return {
            "kda_state": 0 if self.recurrent_state is None else _nbytes(self.recurrent_state),
            "kda_conv": 0 if self.conv_states is None else sum(_nbytes(state) for state in self.conv_states),
        }

    def reset(self) -> None:
        self.conv_states = None
        self.recurrent_state = None


class KimiK3StaticKDAStateLayer(KimiK3KDAStateLayer):
    """KDA layer of a static cache: the first write allocates static-address buffers, later ones copy into them."""

    is_compileable = True

    def update(self, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor) -> None:
        if self.recurrent_state is None:
            self.conv_states = tuple(_static_address(state.clone()) for state in conv_states)
            self.recurrent_state = _static_address(recurrent_state.float().clone())
            return
        self.recurrent_state.copy_(recurrent_state)
        for buffer, state in zip(self.conv_states, conv_states):
            buffer.copy_(state)


# ----------------------------------------------------------------------------------------------------------------
# Going back: rollback records and state snapshots


class KimiK3KDARollbackRecord:
    """What one KDA layer needs to roll back inside the recorded span: the state and conv windows it started from
    (references: a growing cache replaces, never overwrites, its tensors) and the per-token inputs of its conv and
    recurrence for the recorded tokens."""

    def __init__(self, conv_states: tuple[torch.Tensor, ...] | None, recurrent_state: torch.Tensor | None):
        self.base_conv_states = conv_states
        self.base_state = recurrent_state
        self.pre_conv: list[tuple[torch.Tensor, ...]] = []  # [B, T, C] q/k/v projections before the conv
        self.recurrence_inputs: list[tuple[torch.Tensor, ...]] = []  # q, k, v [B, T, H, D], g [B, T, H, D], beta

    def append(self, pre_conv: tuple[torch.Tensor, ...], recurrence_inputs: tuple[torch.Tensor, ...]) -> None:
        self.pre_conv.append(tuple(pre_conv))
        self.recurrence_inputs.append(tuple(recurrence_inputs))

    def nbytes_per_token(self) -> int:
        """Recorded bytes per token (all recorded tensors share the token axis, dim 1)."""
        tokens = sum(step[0].shape[1] for step in self.pre_conv)
        if tokens == 0:
            return 0
        held = sum(_nbytes(t) for step in (*self.pre_conv, *self.recurrence_inputs) for t in step)
        return held // tokens

    def replay(self, num_tokens: int, conv_kernel_size: int, chunk_size: int):
        """(conv windows, recurrent state) after the first `num_tokens` recorded tokens."""
        pre_conv = [torch.cat(parts, dim=1)[:, :num_tokens] for parts in zip(*self.pre_conv)]
        q, k, v, g, beta = (torch.cat(parts, dim=1)[:, :num_tokens] for parts in zip(*self.recurrence_inputs))
        conv_states = conv_windows_after(pre_conv, self.base_conv_states, conv_kernel_size)
        _, state = kda_recurrence(q, k, v, g, beta, self.base_state, True, chunk_size, decode_step=num_tokens == 1)
        return conv_states, state


def rollback_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Rollback record bytes per verified token, from the config: per KDA layer the pre-conv and post-conv q, k, v
    (activation dtype), the f32 decay g (H x D) and the f32 beta (H). Compare with one KDA state, H x D x D f32 per
    layer: the record is about D / (6 * dtype_bytes / 4 + 1) times smaller."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_kda = sum(t == "linear_attention" for t in text.layer_types)
    heads, head_dim = text.linear_num_heads, text.linear_head_dim
    per_layer = 6 * heads * head_dim * dtype_bytes + heads * head_dim * 4 + heads * 4
    return num_kda * per_layer


def snapshot_bytes(config, batch_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one KDA state snapshot: every KDA layer's f32 state and its three conv windows."""
    per_token_free = analytic_cache_bytes(config, 1, batch_size, dtype_bytes)
    return per_token_free["kda_state"] + per_token_free["kda_conv"]


def _snapshot_copy(tensor: torch.Tensor, device) -> torch.Tensor:
    # A copy: the live tensors may be written in place later (static buffers, fast kernels)
    return tensor.detach().to(device, copy=True) if device is not None else tensor.detach().clone()


# ----------------------------------------------------------------------------------------------------------------
# The cache


class KimiK3Cache(Cache):
    """Hybrid cache for Kimi K3. `generate()` creates it; it can also be built by hand: `KimiK3Cache(config)`.

    `KimiK3Cache(config, max_cache_len=N)` builds the static variant (`KimiK3StaticCache`), which
    `generate(..., cache_implementation="static")` uses and can compile.
    """

    is_static = False

    def __new__(cls, config=None, max_cache_len: int | None = None, **kwargs):
        # One constructor for both variants, as users, benchmarks and generate() call it
        if cls is KimiK3Cache and max_cache_len is not None:
            cls = KimiK3StaticCache
        return super().__new__(cls)

    def __init__(self, config, max_cache_len: int | None = None, snapshot_interval: int | None = None,
                 snapshot_device: str | torch.device | None = None, max_snapshot_bytes: int | None = None,
                 max_rollback_tokens: int = DEFAULT_MAX_ROLLBACK_TOKENS, **kwargs):
        """`snapshot_interval`: keep the KDA states at every multiple of this many tokens during a prefill (None:
        no snapshots; the report's spacing is `DEFAULT_SNAPSHOT_INTERVAL`). `snapshot_device`: where snapshots live
        (e.g. "cpu" to offload; default: next to the live state). `max_snapshot_bytes`: upper bound on their memory;
        past it every other snapshot is dropped and the interval doubles. `max_rollback_tokens`: the longest span
        that past recording (speculative decoding) keeps for rollback."""
        # `max_cache_len` has chosen the class in __new__
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        super().__init__(layers=[self._new_layer(layer_type) for layer_type in text_config.layer_types])
        self._seen_tokens = 0
        self._has_past = False
        for name, value in (("snapshot_interval", snapshot_interval), ("max_snapshot_bytes", max_snapshot_bytes),
                            ("max_rollback_tokens", max_rollback_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"KimiK3Cache: {name} must be a positive integer or None, got {value!r}")
        self.conv_kernel_size = text_config.linear_conv_kernel_size
        self._text_config = text_config  # snapshot sizes (snapshot_bytes)
        self.kda_chunk_size = text_config.kda_chunk_size
        self.snapshot_interval = snapshot_interval
        self.snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        self.max_snapshot_bytes = max_snapshot_bytes
        self.snapshots: dict[int, dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]]] = {}
        self.max_rollback_tokens = max_rollback_tokens
        self.record_past = False
        self._rollback: dict[int, KimiK3KDARollbackRecord] | None = None
        self._rollback_base = 0  # position the rollback records start from
        self._recording_step = False
        # Token ids (and padding mask) seen so far, for replays from a snapshot; None once embeddings came in
        self._token_ids: torch.Tensor | None = None
        self._token_valid: torch.Tensor | None = None
        self._replayable = True
        self._model_ref = None  # weak reference to the KimiK3Model that fills this cache (replays run it)
        self._step_start = 0
        self._pending_snapshots: list[int] = []
        self._replaying = False

    def _new_layer(self, layer_type: str) -> KimiK3LatentLayer | KimiK3KDAStateLayer:
        return KimiK3KDAStateLayer() if layer_type == "linear_attention" else KimiK3LatentLayer()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={len(self)}, seen_tokens={self.get_seq_length()}, "
                f"bytes={self.live_bytes()})")

    @property
    def max_cache_len(self) -> int | None:
        return None

    # ------------------------------------------------------------------------------------------------------------
    # Accessors the model calls, in forward order
    def is_fixed_shape_step(self, num_tokens: int) -> bool:
        """Whether this forward is a one-token decode step with fixed shapes and addresses, whose attention mask
        is the cache's own (static cache only)."""
        return False

    def begin_step(self, batch_size: int, num_tokens: int, token_mask: torch.Tensor | None,
                   device: torch.device) -> None:
        """Before the layers run: decide whether this forward is recorded for rollback and where it starts."""
        self._step_start = self._seen_tokens
        self._pending_snapshots = self._snapshot_offsets(num_tokens)
        if self.max_snapshot_bytes is not None:
            # Thin before the forward, so that even its own snapshots never exceed the bound
            per_snapshot = snapshot_bytes(self._text_config, batch_size, dtype_bytes=4)  # conv windows at most f32
            while self._pending_snapshots and (
                self.snapshot_bytes_held() + len(self._pending_snapshots) * per_snapshot > self.max_snapshot_bytes
            ):
                self._thin_snapshots()
                self._pending_snapshots = self._snapshot_offsets(num_tokens)
        self._recording_step = False
        if not self.record_past or self._replaying:
            return
        recorded = self._seen_tokens - self._rollback_base if self._rollback is not None else 0
        if self._rollback is not None and recorded + num_tokens > self.max_rollback_tokens:
            self._rollback = None  # too long a span: start over from here
        if num_tokens > self.max_rollback_tokens:
            return
        if self._rollback is None:
            self._rollback, self._rollback_base = {}, self._seen_tokens
        self._recording_step = True

    def bind_inputs(self, model, input_ids: torch.Tensor | None, token_mask: torch.Tensor | None,
                    batch_size: int, num_tokens: int) -> None:
        """Remember the model and this forward's token ids (and padding) so that `crop` can replay tokens from a
        snapshot. A forward from embeddings makes the tokens so far unreplayable."""
        self._model_ref = weakref.ref(model)
        if not self._replayable or input_ids is None:
            self._replayable, self._token_ids, self._token_valid = False, None, None
            return
        ids = input_ids.detach()
        self._token_ids = ids if self._token_ids is None else torch.cat([self._token_ids, ids], dim=1)
        if token_mask is not None or self._token_valid is not None:
            valid = torch.ones(batch_size, num_tokens, dtype=torch.bool, device=ids.device) if token_mask is None \
                else token_mask.to(ids.device)
            past = self._token_valid
            if past is None:
                past = torch.ones(batch_size, self._seen_tokens, dtype=torch.bool, device=ids.device)
            self._token_valid = torch.cat([past, valid], dim=1)

    def snapshot_offsets(self, num_tokens: int) -> list[int]:
        """Offsets inside the current forward (1..num_tokens) after which the KDA layers hand over a snapshot."""
        return self._pending_snapshots

    def _snapshot_offsets(self, num_tokens: int) -> list[int]:
        if self.snapshot_interval is None:
            return []
        start, interval = self._seen_tokens, self.snapshot_interval
        first = (start // interval + 1) * interval
        return [p - start for p in range(first, start + num_tokens + 1, interval) if p not in self.snapshots]

    @property
    def kda_layer_indices(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.is_linear]

    def save_snapshot(self, layer_idx: int, offset: int, conv_states: tuple[torch.Tensor, ...],
                      recurrent_state: torch.Tensor) -> None:
        """A KDA layer's conv windows and f32 state after `offset` tokens of the current forward."""
        device = self.snapshot_device
        position = self._step_start + offset
        self.snapshots.setdefault(position, {})[layer_idx] = (
            tuple(_snapshot_copy(state, device) for state in conv_states),
            _snapshot_copy(recurrent_state.float(), device),
        )

    def records_step(self) -> bool:
        """Whether the KDA layers record this forward's inputs for rollback."""
        return self._recording_step

    def record_kda_step(self, layer_idx: int, conv_states, recurrent_state, pre_conv, recurrence_inputs) -> None:
        """A KDA layer's state before this forward and its per-token inputs (see `KimiK3KDARollbackRecord`)."""
        record = self._rollback.get(layer_idx)
        if record is None:
            record = self._rollback[layer_idx] = KimiK3KDARollbackRecord(conv_states, recurrent_state)
        record.append(pre_conv, recurrence_inputs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether an earlier forward wrote this cache (every forward writes every layer)."""
        return self._has_past

    def update_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Add the [B, T, kv_lora_rank + rope] latents of an MLA layer; returns that layer's cached latents."""
        return self.layers[layer_idx].update(latents)

    def kda_state(self, layer_idx: int) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
        """(conv windows of q, k, v, f32 recurrent state) of a KDA layer; (None, None) before the first write."""
        layer = self.layers[layer_idx]
        return layer.conv_states, layer.recurrent_state

    def update_kda_state(self, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor,
                         layer_idx: int) -> None:
        self.layers[layer_idx].update(conv_states, recurrent_state)

    def advance(self, num_tokens: int) -> None:
        """Called once per forward by the model, after every layer wrote its state."""
        self._seen_tokens += num_tokens
        self._has_past = True
        self._recording_step = False
        self._bound_snapshots()

    # ------------------------------------------------------------------------------------------------------------
    # transformers Cache API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        raise NotImplementedError(
            "KimiK3Cache holds MLA latents and KDA states, not key/value tensors: use update_latents(latents, "
            "layer_idx) or update_kda_state(conv_states, recurrent_state, layer_idx)"
        )

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self._seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.get_max_length()

    @property
    def is_initialized(self) -> bool:
        return self._has_past

    @property
    def is_linear(self) -> list[bool]:
        return [layer.is_linear for layer in self.layers]

    @property
    def batch_size(self) -> int:
        """Rows held (0 before the first forward)."""
        return next((layer.batch_size for layer in self.layers if layer.batch_size), 0)

    def _map_batch(self, fn) -> None:
        for layer in self.layers:
            layer.map_batch(fn)
        self.snapshots = {position: {layer: (tuple(fn(c) for c in conv), fn(state))
                                     for layer, (conv, state) in states.items()}
                          for position, states in self.snapshots.items()}
        self._token_ids = None if self._token_ids is None else fn(self._token_ids)
        self._token_valid = None if self._token_valid is None else fn(self._token_valid)
        self._rollback = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    # ------------------------------------------------------------------------------------------------------------
    # Going back to an earlier token
    def activate_past_recording(self) -> None:
        """Record short forwards (speculative verify steps, draft steps) so that `crop` can roll them back."""
        self.record_past = True

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (negative: remove that many; 0 removes nothing, as transformers'
        `crop(-0)` means; `reset()` empties the cache). Works for every length:

        * inside the span recorded since past recording was activated, the KDA layers replay their recorded
          recurrence inputs from the recorded start state (no projection recomputed);
        * otherwise the nearest snapshot at or below the target (position 0: the empty state) is restored, the MLA
          latents are cut there and the model is run on the recorded token ids up to the target.
        """
        max_length = int(max_length)  # transformers 5.17 passes a 0-d tensor
        target = self._seen_tokens + max_length if max_length <= 0 else max_length
        if target >= self._seen_tokens:
            self._rollback = None  # the live state is the new base of any later rollback
            return
        target = max(target, 0)  # removing more than is cached empties it (nothing cached: a no-op)
        if self._rollback is not None and self._rollback_base <= target:
            self._roll_back_recorded(target)
        else:
            self._restore_and_replay(target)
        self._rollback = None

    def _cut(self, position: int) -> None:
        for layer in self.layers:
            if not layer.is_linear:
                layer.crop(position)
        self._seen_tokens = position
        self._has_past = position > 0
        if self._token_ids is not None:
            self._token_ids = self._token_ids[:, :position]
        if self._token_valid is not None:
            self._token_valid = self._token_valid[:, :position]
        self.snapshots = {p: states for p, states in self.snapshots.items() if p <= position}

    def _roll_back_recorded(self, target: int) -> None:
        kept = target - self._rollback_base
        for layer_idx, record in self._rollback.items():
            if kept == 0:
                conv_states, state = record.base_conv_states, record.base_state
            else:
                conv_states, state = record.replay(kept, self.conv_kernel_size, self.kda_chunk_size)
            self._set_kda_state(layer_idx, conv_states, state)
        self._cut(target)

    def _set_kda_state(self, layer_idx: int, conv_states, state) -> None:
        layer = self.layers[layer_idx]
        if state is None:
            layer.reset()
        else:
            layer.update(conv_states, state)

    def _restore_and_replay(self, target: int) -> None:
        complete = len(self.kda_layer_indices)  # a snapshot every KDA layer handed over
        start = max((p for p in self.snapshots if p <= target and len(self.snapshots[p]) == complete), default=0)
        model = self._model_ref() if self._model_ref is not None else None
        if start < target and (not self._replayable or self._token_ids is None or model is None):
            kda = self.kda_layer_indices
            reason = ("it was filled from inputs_embeds (no token ids to replay)" if not self._replayable
                      else "the model that filled it is gone")
            raise NotImplementedError(
                f"KimiK3Cache.crop({target}): KDA layers {kda[:4]}{'...' if len(kda) > 4 else ''} need a state at "
                f"token {target}; the nearest snapshot is at {start} and {reason}. Take snapshots at that position "
                "(snapshot_interval) or keep the cache's token ids."
            )
        replay_ids = None if start == target else self._token_ids[:, start:target]
        replay_valid = None if self._token_valid is None else self._token_valid[:, :target]
        for layer_idx in self.kda_layer_indices:
            conv_states, state = self.snapshots[start][layer_idx] if start > 0 else (None, None)
            if state is not None:
                device = self.layers[layer_idx].recurrent_state.device
                conv_states, state = tuple(c.to(device, copy=True) for c in conv_states), state.to(device, copy=True)
            self._set_kda_state(layer_idx, conv_states, state)
        self._cut(start)
        if replay_ids is None:
            return
        # The same computation as a prefill of these tokens (the forward records them again and snapshots nothing
        # new: every snapshot position in between is absent by construction)
        self._replaying = True
        try:
            with torch.no_grad():
                model(input_ids=replay_ids, attention_mask=None if replay_valid is None else replay_valid.long(),
                      cache=self, use_cache=True)
        finally:
            self._replaying = False

    def copy_prefix(self, num_tokens: int) -> "KimiK3Cache":
        """A new growing cache holding the first `num_tokens` tokens of this one (this cache is not changed):
        the MLA latents up to there and the KDA states from the snapshot there (or replayed from the nearest one
        below). Tensors that neither cache writes in place are shared."""
        if self.is_static:
            raise NotImplementedError("KimiK3Cache.copy_prefix: not supported for a static cache")
        if not 0 < num_tokens <= self._seen_tokens:
            raise ValueError(f"KimiK3Cache.copy_prefix({num_tokens}): the cache holds {self._seen_tokens} tokens")
        copy = KimiK3Cache.__new__(KimiK3Cache)
        copy.__dict__.update(self.__dict__)
        copy.layers = []
        for layer in self.layers:
            clone = type(layer).__new__(type(layer))
            clone.__dict__.update(layer.__dict__)
            copy.layers.append(clone)
        copy.snapshots = dict(self.snapshots)
        copy._rollback, copy.record_past = None, False
        copy.crop(num_tokens)
        return copy

    def _thin_snapshots(self) -> None:
        """Double the interval and drop the snapshots that are off it: coverage stays even."""
        self.snapshot_interval *= 2
        self.snapshots = {p: states for p, states in self.snapshots.items() if p % self.snapshot_interval == 0}

    def _bound_snapshots(self) -> None:
        """Keep the snapshots under `max_snapshot_bytes`: drop every other one and double the interval."""
        if self.max_snapshot_bytes is None:
            return
        while self.snapshots and self.snapshot_bytes_held() > self.max_snapshot_bytes:
            self._thin_snapshots()

    def snapshot_bytes_held(self) -> int:
        return sum(_nbytes(t) for states in self.snapshots.values() for conv, state in states.values()
                   for t in (*conv, state))

    def rollback_bytes(self) -> dict[str, int]:
        """Bytes the rollback records hold: `per_token` (recorded inputs per recorded token, all KDA layers),
        `tokens` recorded, and `base_states` (the start states, shared with what the live cache held then)."""
        if not self._rollback:
            return {"per_token": 0, "tokens": 0, "base_states": 0}
        base = sum(_nbytes(t) for r in self._rollback.values() if r.base_state is not None
                   for t in (*r.base_conv_states, r.base_state))
        return {"per_token": sum(r.nbytes_per_token() for r in self._rollback.values()),
                "tokens": self._seen_tokens - self._rollback_base, "base_states": base}

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._seen_tokens = 0
        self._has_past = False
        self.snapshots = {}
        self._rollback = None
        self._token_ids, self._token_valid, self._replayable = None, None, True

    # ------------------------------------------------------------------------------------------------------------
    # Memory report
    def live_bytes(self) -> dict[str, int]:
        """Bytes actually held, by kind: MLA latent KV, KDA recurrent state, KDA conv windows."""
        report = {"mla_kv": 0, "kda_state": 0, "kda_conv": 0}
        for layer in self.layers:
            for kind, num_bytes in layer.live_bytes().items():
                report[kind] += num_bytes
        report["total"] = sum(report.values())
        return report


class KimiK3StaticCache(KimiK3Cache):
    """Static Kimi K3 cache (`KimiK3Cache(config, max_cache_len=N)`): MLA latents live in preallocated buffers
    written in place, KDA states and conv windows are updated in place, the write position is a device tensor and
    key validity a [B, buffer length] mask (max_cache_len rounded up to 64 tokens). A one-token decode step then has
    fixed shapes and addresses and never reads a Python counter, so `generate(..., cache_implementation="static")`
    can compile it (`torch.compile`, CUDA graphs)."""

    is_static = True

    def __init__(self, config, max_cache_len: int, **kwargs):
        if kwargs.get("snapshot_interval") is not None:
            raise ValueError("KimiK3Cache: KDA state snapshots need the growing cache (no max_cache_len)")
        self._max_cache_len = max_cache_len
        super().__init__(config, **kwargs)
        self.position: torch.Tensor | None = None  # number of cached tokens, on the device
        self.key_valid: torch.Tensor | None = None  # [B, buffer length], True where a real token is cached

    def _new_layer(self, layer_type: str) -> KimiK3StaticLatentLayer | KimiK3StaticKDAStateLayer:
        if layer_type == "linear_attention":
            return KimiK3StaticKDAStateLayer()
        return KimiK3StaticLatentLayer(self.max_cache_len)

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    def is_fixed_shape_step(self, num_tokens: int) -> bool:
        return num_tokens == 1 and self._has_past

    def begin_step(self, batch_size: int, num_tokens: int, token_mask: torch.Tensor | None,
                   device: torch.device) -> None:
        """Mark the new positions valid (padding stays invalid). Eager for a prefill (any length, checked against
        `max_cache_len`), shape-static for one decode token."""
        if self.position is None:
            self.position = _static_address(torch.zeros(1, dtype=torch.long, device=device))
            self.key_valid = _static_address(torch.zeros(batch_size, static_buffer_len(self.max_cache_len),
                                                         dtype=torch.bool, device=device))
        if self.is_fixed_shape_step(num_tokens):
            self.key_valid.index_fill_(1, self.position, True)
            return
        start = int(self.position.item())
        if start + num_tokens > self.max_cache_len:
            raise ValueError(
                f"KimiK3Cache: {start} cached + {num_tokens} new tokens exceed max_cache_len={self.max_cache_len}"
            )
        valid = torch.ones(batch_size, num_tokens, dtype=torch.bool, device=device) if token_mask is None else token_mask
        self.key_valid[:, start : start + num_tokens] = valid

    def key_valid_mask(self) -> torch.Tensor:
        """[B, 1, 1, buffer length] attention mask of a fixed-shape decode step over the whole buffer."""
        return self.key_valid[:, None, None, :]

    def update_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Static decode returns the whole buffer (valid where `key_valid` says so), a prefill its filled prefix."""
        layer = self.layers[layer_idx]
        if self.is_fixed_shape_step(latents.shape[1]):
            return layer.write_step(latents, self.position)
        return layer.write(latents, int(self.position.item()))

    def advance(self, num_tokens: int) -> None:
        self.position.add_(num_tokens)
        self._has_past = True

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return 0 if self.position is None else int(self.position.item())

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.max_cache_len, 0

    def _map_batch(self, fn) -> None:
        if self.key_valid is not None:
            self.key_valid = fn(self.key_valid)
        super()._map_batch(fn)

    @property
    def is_croppable(self) -> bool:
        # Its one-token decode step is the compiled graph; rollback records and replays are the growing cache's
        return False

    def activate_past_recording(self) -> None:
        """Nothing to record: a static cache cannot be cropped (see docs/design.md, speculative decoding)."""

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "KimiK3Cache.crop: not supported for a static cache (speculative decoding and prefix reuse use the "
            "growing cache: leave cache_implementation unset)"
        )

    def reset(self) -> None:
        super().reset()
        self.position = None
        self.key_valid = None


def analytic_cache_bytes(config, num_tokens: int, batch_size: int = 1, dtype_bytes: int = 2) -> dict[str, int]:
    """What `KimiK3Cache.live_bytes()` holds after `num_tokens` tokens, from the config alone.

    MLA: latent + k_pe per token per MLA layer, in the activation dtype. KDA: an [H, Dk, Dk] f32 state and three
    conv windows of K - 1 pre-conv inputs (activation dtype) per layer, independent of `num_tokens`.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_mla = sum(t == "full_attention" for t in text.layer_types)
    num_kda = len(text.layer_types) - num_mla
    heads, head_dim = text.linear_num_heads, text.linear_head_dim
    report = {
        "mla_kv": num_mla * num_tokens * text.mla_cache_dim * dtype_bytes * batch_size,
        "kda_state": num_kda * heads * head_dim * head_dim * 4 * batch_size if num_tokens else 0,
        "kda_conv": num_kda * 3 * heads * head_dim * (text.linear_conv_kernel_size - 1) * dtype_bytes * batch_size
        if num_tokens
        else 0,
    }
    report["total"] = sum(report.values())
    return report


__all__ = [
    "DEFAULT_SNAPSHOT_INTERVAL",
    "KDA_BLOCK_SIZE",
    "KimiK3Cache",
    "KimiK3StaticCache",
    "analytic_cache_bytes",
    "rollback_bytes_per_token",
    "snapshot_bytes",
]
