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
`config.layer_types`, in a growing (`KimiK3Cache`) and a static (`KimiK3StaticCache`) variant, and a paged one for a
server's running batch (`KimiK3PagedCache`: rows come and go between forwards).

* `KimiK3LatentLayer` (MLA): `kv_lora_rank + qk_rope_head_dim` values per token (the normalised latent followed by
  the shared, unrotated k_pe), never expanded K/V. Appended per forward; `KimiK3StaticLatentLayer` preallocates
  `max_cache_len` tokens and writes in place; `KimiK3PagedLatentLayer` is a pool of fixed-size pages that the paged
  cache's block tables index (one table per row, the same for every MLA layer).
* `KimiK3KDAStateLayer` (KDA): the last `K - 1` pre-conv inputs of q, k and v and the [H, Dk, Dv] f32 state.
  Replaced per forward; `KimiK3StaticKDAStateLayer` copies into buffers that keep their addresses.

The layer objects are our own rather than transformers' `CacheLayerMixin` / `LinearAttentionCacheLayerMixin`,
whose API moved between 5.17 and 5.24 and which hold K/V, not latents. The model reaches the storage only through
the cache: an MLA layer through `update_latents`, a KDA layer through its step handle `KimiK3KDAStep` (the state it
starts from, and hand-overs for the record, the snapshots and the state after the forward); the token bookkeeping (a
Python count, or a device-side position and key-validity mask) lives in the cache, since every layer of one forward
writes the same positions.

The cache stores; it computes nothing. Rewinding to an earlier token, which a recurrent state cannot do by itself,
is the cache's component `cache.rewind` (rewind_kimi_k3.py): in the growing cache `KimiK3Rewind` (records, snapshots,
the token ids of replays), reached through transformers' `crop` and our `copy_prefix`; in the static cache
`KimiK3StaticRewind`, inside one speculative round (`begin_round`, `rewind_round`).
"""

import torch
from transformers.cache_utils import Cache

from .rewind_kimi_k3 import DEFAULT_MAX_REWIND_TOKENS, KimiK3KDARewindRecord, KimiK3Rewind, KimiK3StaticRewind


def _static_address(tensor: torch.Tensor) -> torch.Tensor:
    # CUDA graphs replay on fixed addresses; tell dynamo these buffers keep theirs
    try:
        torch._dynamo.mark_static_address(tensor)
    except Exception:  # noqa: BLE001 - older torch or no dynamo: only a missed optimisation
        pass
    return tensor


# ----------------------------------------------------------------------------------------------------------------
# Per-layer storage


def layer_tensors(layer) -> list[torch.Tensor]:
    """The tensors a cache layer holds now (none before its first write)."""
    if layer.is_linear:
        return [] if layer.recurrent_state is None else [*layer.conv_states, layer.recurrent_state]
    if isinstance(layer, KimiK3PagedLatentLayer):
        return [] if layer.pages is None else [layer.pages]
    return [] if layer.latents is None else [layer.latents]


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
        return {"mla_kv": 0 if self.latents is None else self.latents.nbytes}

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
        """The decode tokens at device-side positions ([T], no host read); returns the whole buffer."""
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
            "kda_state": 0 if self.recurrent_state is None else self.recurrent_state.nbytes,
            "kda_conv": 0 if self.conv_states is None else sum(state.nbytes for state in self.conv_states),
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
# A KDA layer's handle on the cache for one forward


class KimiK3KDAStep:
    """What a KDA layer asks of the cache during one forward (`KimiK3KDAStep(cache, layer_idx, num_tokens)`): the state
    it starts from, how to run (`decode_step`: the recurrent form; `recording`: this forward is kept for rewinding),
    and three hand-overs: `record` (the per-token inputs a rewind replays), `snapshot` (the state at an offset the
    cache asked for in `snapshot_offsets`) and `write` (the state after the forward). Whether and how a record or a
    snapshot is kept (the growing cache's `KimiK3Rewind`, the static cache's round buffers, nothing without a
    cache) is the cache's business, behind these calls."""

    def __init__(self, cache: "KimiK3Cache | None", layer_idx: int, num_tokens: int):
        self._cache, self._layer_idx = cache, layer_idx
        if cache is None:
            self.conv_states, self.recurrent_state = None, None
            self.keeps_state, self.recording, self.snapshot_offsets = False, False, []
            self.decode_step = num_tokens == 1
            return
        layer = cache.layers[layer_idx]
        self.conv_states, self.recurrent_state = layer.conv_states, layer.recurrent_state
        self.keeps_state = True
        self.recording = cache.records_step()
        self.snapshot_offsets = cache.snapshot_offsets()
        # A fixed-shape step (one token, or a static verify of T tokens) runs the recurrent form: T tokens of it
        # compute what T one-token decode steps compute, so speculative greedy decoding is plain greedy decoding
        self.decode_step = num_tokens == 1 or cache.is_fixed_shape_step(num_tokens)

    def record(self, pre_conv: tuple[torch.Tensor, ...], recurrence_inputs: tuple[torch.Tensor, ...]) -> None:
        """This forward's pre-conv q/k/v ([B, T, C]) and recurrence inputs (q, k, v, g, beta), kept while
        `recording` (a speculative draft or verify step), so that a rewind re-runs neither a projection nor the
        prefix."""
        if self.recording:
            self._cache.record_kda(self._layer_idx, self.conv_states, self.recurrent_state, pre_conv,
                                   recurrence_inputs)

    def snapshot(self, offset: int, pre_conv: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor) -> None:
        """The recurrent state after `offset` (one of `snapshot_offsets`) tokens of this forward."""
        self._cache.snapshot_kda(self._layer_idx, offset, pre_conv, self.conv_states, recurrent_state)

    def write(self, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor) -> None:
        """The conv windows and state after this forward's tokens."""
        if self._cache is not None:
            self._cache.update_kda_state(conv_states, recurrent_state, self._layer_idx)


# ----------------------------------------------------------------------------------------------------------------
# The cache


class KimiK3Cache(Cache):
    """Growing hybrid cache for Kimi K3. `generate()` creates it; it can also be built by hand: `KimiK3Cache(config)`.
    It can go back to any earlier token (`crop`, `copy_prefix`) through its rewind component (`self.rewind`).

    The static variant, which `generate(..., cache_implementation="static")` uses and can compile, is
    `KimiK3StaticCache(config, max_cache_len=N)`.
    """

    is_static = False

    def __init__(self, config, snapshot_interval: int | None = None,
                 snapshot_device: str | torch.device | None = None, max_snapshot_bytes: int | None = None,
                 max_rewind_tokens: int = DEFAULT_MAX_REWIND_TOKENS, **kwargs):
        """`snapshot_interval`: keep the KDA states at multiples of this many tokens, written by the prefill as it
        passes them (None: no snapshots; `KDA_BLOCK_SIZE` for prefix-store hits at every block, the report's sparse
        spacing is `DEFAULT_SNAPSHOT_INTERVAL`). `snapshot_device`: where snapshots live (e.g. "cpu" to offload;
        default: next to the live state). `max_snapshot_bytes`: upper bound on their memory (at least one snapshot
        of one sequence, `snapshot_bytes(config, dtype_bytes=4)`); under it the snapshots are kept sparse by
        `rewind_kimi_k3.kept_snapshot_blocks` (every multiple in a dense window before the cache's end, thinner
        geometrically further back). `max_rewind_tokens`: the longest span that past recording (speculative
        decoding) keeps for a rewind."""
        if kwargs.get("max_cache_len") is not None:
            raise TypeError(
                f"KimiK3Cache(max_cache_len={kwargs['max_cache_len']!r}): the growing cache has no length bound; a "
                "preallocated cache of N tokens is KimiK3StaticCache(config, max_cache_len=N)"
            )
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        super().__init__(layers=[self._new_layer(layer_type) for layer_type in text_config.layer_types])
        self._text_config = text_config  # what the layers hold follows from it (the model checks a cache against it)
        self._seen_tokens = 0
        self.rewind = KimiK3Rewind(
            self.kda_layer_indices, text_config.linear_conv_kernel_size, text_config.kda_chunk_size,
            snapshot_bytes(text_config, dtype_bytes=4),  # conv windows at most f32
            snapshot_interval=snapshot_interval, snapshot_device=snapshot_device,
            max_snapshot_bytes=max_snapshot_bytes, max_rewind_tokens=max_rewind_tokens,
        )

    def _new_layer(self, layer_type: str) -> KimiK3LatentLayer | KimiK3KDAStateLayer:
        return KimiK3KDAStateLayer() if layer_type == "linear_attention" else KimiK3LatentLayer()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layers={len(self)}, seen_tokens={self.get_seq_length()}, "
                f"bytes={self.live_bytes()})")

    @property
    def max_cache_len(self) -> int | None:
        return None

    @property
    def kda_layer_indices(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.is_linear]

    # ------------------------------------------------------------------------------------------------------------
    # Accessors the model calls, in forward order
    def is_fixed_shape_step(self, num_tokens: int) -> bool:
        """Whether this forward is a one-token decode step with fixed shapes and addresses, whose attention mask
        is the cache's own (static cache only)."""
        return False

    def begin_step(self, batch_size: int, num_tokens: int, token_mask: torch.Tensor | None,
                   device: torch.device, input_ids: torch.Tensor | None = None) -> None:
        """Before the layers run: the rewind component learns where this forward starts and keeps its token ids
        (and padding) for replays; a forward from embeddings leaves the tokens so far unreplayable."""
        past_len = self._seen_tokens
        self.rewind.begin_step(past_len, batch_size, num_tokens)
        self.rewind.keep_tokens(input_ids, token_mask, past_len)

    @property
    def pending_tokens(self) -> int:
        """Tokens the cache stands for but has not computed yet: a crop went back to a snapshot below its target,
        and the model's next forward runs them first (`replay`)."""
        return self.rewind.pending_tokens

    def replay(self):
        """Context manager around the forward that runs the pending tokens: yields their ids and the attention mask
        of the stored and pending tokens (None without padding)."""
        return self.rewind.replay()

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the cache stands for earlier tokens (every forward writes every layer)."""
        return self.get_seq_length() > 0

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

    def records_step(self) -> bool:
        """Whether the KDA layers hand over this forward's inputs for a rewind (`KimiK3KDAStep.record`)."""
        return self.rewind.records_step()

    def snapshot_offsets(self) -> list[int]:
        """Offsets inside this forward (1..num_tokens) at which the KDA layers hand over their state."""
        return self.rewind.snapshot_offsets()

    def record_kda(self, layer_idx: int, conv_states, recurrent_state, pre_conv, recurrence_inputs) -> None:
        self.rewind.record_step(layer_idx, conv_states, recurrent_state, pre_conv, recurrence_inputs)

    def snapshot_kda(self, layer_idx: int, offset: int, pre_conv, conv_states, recurrent_state) -> None:
        self.rewind.save_snapshot(layer_idx, offset, pre_conv, conv_states, recurrent_state)

    def advance(self, num_tokens: int) -> None:
        """Called once per forward by the model, after every layer wrote its state."""
        self._seen_tokens += num_tokens
        self.rewind.end_step()

    # ------------------------------------------------------------------------------------------------------------
    # transformers Cache API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        raise NotImplementedError(
            "KimiK3Cache holds MLA latents and KDA states, not key/value tensors: use update_latents(latents, "
            "layer_idx) or update_kda_state(conv_states, recurrent_state, layer_idx)"
        )

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The tokens the cache stands for: those stored, and those a crop left for the next forward to run."""
        return self._seen_tokens + self.rewind.pending_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.get_max_length()

    @property
    def is_initialized(self) -> bool:
        return self.has_previous_state()

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
        if self.rewind is not None:
            self.rewind.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    # ------------------------------------------------------------------------------------------------------------
    # Rewinding to an earlier token (the rewind component decides how)
    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Record short forwards (speculative verify steps, draft steps) so that `crop(-n)` can roll them back.
        `recurrent_states_to_keep` (transformers 5.25's candidate generators pass their draft length) is how far
        back a crop will go; the record keeps each recorded token's recurrence inputs, not a state per token, so
        any crop inside the recorded span is exact (up to `max_rewind_tokens`), and the number is kept only to
        report it back (`get_recurrent_states_to_keep`)."""
        self.rewind.activate_past_recording()
        self.recurrent_states_to_keep = recurrent_states_to_keep or 0

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return self.rewind.record_past

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return getattr(self, "recurrent_states_to_keep", 0) if self.is_recording_past() else 0

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (negative: remove that many; 0 removes nothing, as transformers'
        `crop(-0)` means; `reset()` empties the cache). Works for every length:

        * inside the span recorded since past recording was activated, the KDA layers replay their recorded
          recurrence inputs from the recorded start state, here and now (no projection recomputed);
        * otherwise the nearest snapshot at or below the target (position 0: the empty state) is restored and the
          MLA latents are cut there; the tokens from there to the target stay pending, and the model's next forward
          runs them before its own inputs (`get_seq_length()` already counts them).
        """
        max_length = int(max_length)  # transformers 5.17 passes a 0-d tensor
        length = self.get_seq_length()
        target = length + max_length if max_length <= 0 else max_length
        if target >= length:
            self.rewind.forget_record()  # the live state is the new base of any later rewind
            return
        target = max(target, 0)  # removing more than is cached empties it (nothing cached: a no-op)
        devices = {i: self.layers[i].recurrent_state.device for i in self.kda_layer_indices
                   if self.layers[i].recurrent_state is not None}
        kept, kda_states = self.rewind.states_at(target, devices)
        for layer_idx, (conv_states, state) in kda_states.items():
            layer = self.layers[layer_idx]
            if state is None:
                layer.reset()
            else:
                layer.update(conv_states, state)
        for layer in self.layers:
            if not layer.is_linear:
                layer.crop(kept)
        self._seen_tokens = kept

    def copy_prefix(self, num_tokens: int) -> "KimiK3Cache":
        """A new growing cache holding the first `num_tokens` tokens of this one (this cache is not changed):
        the MLA latents up to there and the KDA states from the snapshot there (or from the nearest one below, the
        tokens in between pending for its first forward). Tensors that neither cache writes in place are shared."""
        if not 0 < num_tokens <= self.get_seq_length():
            raise ValueError(f"KimiK3Cache.copy_prefix({num_tokens}): the cache holds {self.get_seq_length()} tokens")
        copy = self._shallow_copy()
        copy.crop(num_tokens)
        return copy

    def _shallow_copy(self) -> "KimiK3Cache":
        # a new growing cache over this one's tensors: layers and snapshot table of its own, no rewind record
        copy = KimiK3Cache.__new__(KimiK3Cache)
        copy.__dict__.update(self.__dict__)
        copy.layers = []
        for layer in self.layers:
            clone = type(layer).__new__(type(layer))
            clone.__dict__.update(layer.__dict__)
            copy.layers.append(clone)
        copy.rewind = self.rewind.copy()
        return copy

    def select_rows(self, rows: list[int]) -> "KimiK3Cache":
        """A new growing cache holding the rows `rows` of this one, in that order: their MLA latents, KDA states and
        conv windows, snapshots and token ids (this cache is not changed; nothing pending here, no rewind record).
        A server reads prompts of one length in one batch and takes each out when its prompt ends."""
        if self.pending_tokens:
            raise ValueError(f"KimiK3Cache.select_rows: {self.pending_tokens} tokens are pending (a crop's replay)")
        if not rows or any(not 0 <= row < self.batch_size for row in rows):
            raise ValueError(f"KimiK3Cache.select_rows({rows}): the cache holds {self.batch_size} rows")
        copy = self._shallow_copy()
        copy.batch_select_indices(torch.tensor(rows))
        return copy

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._seen_tokens = 0
        self.rewind.reset()

    # ------------------------------------------------------------------------------------------------------------
    # A batched prefill's rows as caches of their own (a server reads short prompts together: docs/design.md, Serving)
    def split(self, key_mask: torch.Tensor) -> list["KimiK3Cache"]:
        """The rows of a left-padded batch as caches of one row each, without their padding (`key_mask`, [B, T] as
        this cache's tokens: False on padding, True from each row's first token on)."""
        if key_mask.shape != (self.batch_size, self.get_seq_length()):
            raise ValueError(f"KimiK3Cache.split: a key mask of {tuple(key_mask.shape)} for a cache of "
                             f"{self.batch_size} rows and {self.get_seq_length()} tokens")
        rows = []
        for row, valid in enumerate(key_mask.sum(-1).tolist()):
            cache = KimiK3Cache(self._text_config)
            for layer, source in zip(cache.layers, self.layers):
                if layer.is_linear:
                    layer.update(tuple(w[row:row + 1] for w in source.conv_states),
                                 source.recurrent_state[row:row + 1])
                else:
                    layer.update(source.latents[row:row + 1, self.get_seq_length() - valid:])
            cache._seen_tokens = valid
            rows.append(cache)
        return rows

    # ------------------------------------------------------------------------------------------------------------
    # Memory report
    def live_bytes(self) -> dict[str, int]:
        """Bytes actually held, by kind: MLA latent KV, KDA recurrent state, KDA conv windows (the rewind
        component's snapshots and records: `rewind.snapshot_bytes_held()`, `rewind.record_bytes()`)."""
        report = {"mla_kv": 0, "kda_state": 0, "kda_conv": 0}
        for layer in self.layers:
            for kind, num_bytes in layer.live_bytes().items():
                report[kind] += num_bytes
        report["total"] = sum(report.values())
        return report


class KimiK3StaticCache(KimiK3Cache):
    """Static Kimi K3 cache (`KimiK3StaticCache(config, max_cache_len=N)`): MLA latents live in preallocated buffers
    written in place, KDA states and conv windows are updated in place, the write position is a device tensor and
    key validity a [B, buffer length] mask (max_cache_len rounded up to 64 tokens). A one-token decode step then has
    fixed shapes and addresses and never reads a Python counter, so `generate(..., cache_implementation="static")`
    can compile it (`torch.compile`, CUDA graphs). It cannot crop (`is_croppable` False); a speculative round rewinds
    inside itself (`enable_rewind`, `begin_round`, `rewind_round`: docs/design.md, Rewinding), with a fixed-shape
    verify step of `speculative_width` tokens, through its rewind component `KimiK3StaticRewind`."""

    is_static = True

    def __init__(self, config, max_cache_len: int, **kwargs):
        if kwargs.get("snapshot_interval") is not None:
            raise ValueError("KimiK3Cache: KDA state snapshots need the growing cache (no max_cache_len)")
        self._max_cache_len = max_cache_len
        super().__init__(config, **kwargs)
        self._has_past = False  # a Python flag, so that the decode step never reads the device-side position
        self.position: torch.Tensor | None = None  # number of cached tokens, on the device
        self.key_valid: torch.Tensor | None = None  # [B, buffer length], True where a real token is cached
        # Speculative rounds (enable_rewind): the verify width, a fixed-shape step besides one token, and the
        # round's record; `recording_round` (a Python flag: the compiled round reads no device value to know it) is
        # on from `begin_round` to `rewind_round`, so a forward outside a round records nothing
        self.speculative_width: int | None = None
        self.rewind: KimiK3StaticRewind | None = None
        self.recording_round = False
        self._round_start: torch.Tensor | None = None  # the position at the round's start, on the device

    def _new_layer(self, layer_type: str) -> KimiK3StaticLatentLayer | KimiK3StaticKDAStateLayer:
        if layer_type == "linear_attention":
            return KimiK3StaticKDAStateLayer()
        return KimiK3StaticLatentLayer(self.max_cache_len)

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    def is_fixed_shape_step(self, num_tokens: int) -> bool:
        """One decode token, or a speculative verify of `speculative_width` tokens, once the cache has a past."""
        return self._has_past and (num_tokens == 1 or num_tokens == self.speculative_width)

    def _step_positions(self, num_tokens: int) -> torch.Tensor:
        """The device-side positions a fixed-shape step writes: position .. position + T - 1."""
        if num_tokens == 1:
            return self.position
        return self.position + torch.arange(num_tokens, device=self.position.device)

    def begin_step(self, batch_size: int, num_tokens: int, token_mask: torch.Tensor | None,
                   device: torch.device, input_ids: torch.Tensor | None = None) -> None:
        """Mark the new positions valid (padding stays invalid). Eager for a prefill (any length, checked against
        `max_cache_len`), shape-static for a fixed-shape step (one decode token, a verify)."""
        if self.position is None:
            self.position = _static_address(torch.zeros(1, dtype=torch.long, device=device))
            self.key_valid = _static_address(torch.zeros(batch_size, static_buffer_len(self.max_cache_len),
                                                         dtype=torch.bool, device=device))
        if self.is_fixed_shape_step(num_tokens):
            self.key_valid.index_fill_(1, self._step_positions(num_tokens), True)
            return
        start = int(self.position.item())
        if start + num_tokens > self.max_cache_len:
            raise ValueError(
                f"KimiK3Cache: {start} cached + {num_tokens} new tokens exceed max_cache_len={self.max_cache_len}"
            )
        valid = torch.ones(batch_size, num_tokens, dtype=torch.bool, device=device) if token_mask is None else token_mask
        self.key_valid[:, start : start + num_tokens] = valid

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._has_past

    def key_valid_mask(self, num_tokens: int = 1) -> torch.Tensor:
        """[B, 1, T, buffer length] attention mask of a fixed-shape step over the whole buffer: the valid keys, and
        for a verify of T tokens each query's own and earlier positions."""
        if num_tokens == 1:
            return self.key_valid[:, None, None, :]
        keys = torch.arange(self.key_valid.shape[1], device=self.key_valid.device)
        causal = keys[None, :] <= self._step_positions(num_tokens)[:, None]
        return self.key_valid[:, None, None, :] & causal[None, None]

    def update_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """A fixed-shape step returns the whole buffer (valid where `key_valid` says so), a prefill its filled
        prefix."""
        layer = self.layers[layer_idx]
        if self.is_fixed_shape_step(latents.shape[1]):
            return layer.write_step(latents, self._step_positions(latents.shape[1]))
        return layer.write(latents, int(self.position.item()))

    def advance(self, num_tokens: int) -> None:
        self.position.add_(num_tokens)
        self._has_past = True
        if self.recording_round:
            self.rewind.advance(num_tokens)

    @property
    def pending_tokens(self) -> int:
        return 0  # it never goes back to a snapshot

    def records_step(self) -> bool:
        return self.recording_round

    def snapshot_offsets(self) -> list[int]:
        return []

    def record_kda(self, layer_idx: int, conv_states, recurrent_state, pre_conv, recurrence_inputs) -> None:
        # the round's base states were copied at `begin_round`; only the tokens' inputs go into the buffers
        self.rewind.record(layer_idx, pre_conv, recurrence_inputs)

    # ------------------------------------------------------------------------------------------------------------
    # Speculative rounds (docs/design.md, Rewinding): no host read, fixed shapes
    def _live_kda(self) -> dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        return {i: (self.layers[i].conv_states, self.layers[i].recurrent_state) for i in self.kda_layer_indices}

    def enable_rewind(self, width: int) -> None:
        """After the prefill: allocate the round's record for `width` tokens (the verify width: a round's draft
        steps and its verify each record at most that many) and make a verify of `width` tokens a fixed-shape
        step."""
        if not self._has_past:
            raise ValueError("KimiK3StaticCache.enable_rewind: the cache is empty (prefill the prompt first)")
        self.speculative_width = width
        self.rewind = KimiK3StaticRewind(width, self._live_kda(), _static_address)
        self._round_start = _static_address(self.position.clone())

    def begin_round(self) -> None:
        """The position and KDA states now are what `rewind_round` returns to, plus the tokens it keeps; the
        round's forwards (at most `speculative_width` tokens in all) record until then."""
        self.rewind.begin_round(self._live_kda())
        self._round_start.copy_(self.position)
        self.recording_round = True

    def rewind_round(self, keep: torch.Tensor) -> None:
        """Keep the first `keep` ([1] long, on the device) tokens of the round: the KDA states replayed from the
        round's record, the position moved back and the key-validity mask cleared after it (the latents past it
        are masked, and overwritten by the next step). The round ends: forwards record nothing until the next."""
        self.recording_round = False
        for layer_idx, (windows, state) in self.rewind.states_at(
                keep, self._text_config.linear_conv_kernel_size, self._text_config.kda_chunk_size).items():
            self.layers[layer_idx].update(windows, state)
        self.position.copy_(self._round_start + keep.to(self.position.device))
        keys = torch.arange(self.key_valid.shape[1], device=self.key_valid.device)
        self.key_valid &= (keys < self.position)[None, :]

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
        # Its one-token decode step is the compiled graph; rewind records and replays are the growing cache's
        return False

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Nothing to record: a static cache cannot be cropped (see docs/design.md, speculative decoding)."""

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        return False

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "KimiK3Cache.crop: not supported for a static cache (speculative decoding and prefix reuse use the "
            "growing cache: leave cache_implementation unset)"
        )

    def copy_prefix(self, num_tokens: int) -> "KimiK3Cache":
        raise NotImplementedError("KimiK3Cache.copy_prefix: not supported for a static cache")

    def select_rows(self, rows: list[int]) -> "KimiK3Cache":
        raise NotImplementedError("KimiK3Cache.select_rows: not supported for a static cache")

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._seen_tokens = 0
        self._has_past = False
        self.position = None
        self.key_valid = None
        self.speculative_width = None
        self.rewind = None
        self.recording_round = False
        self._round_start = None


# ----------------------------------------------------------------------------------------------------------------
# A server's running batch: MLA latents in pages (docs/design.md, Serving)


def check_block_size(block_size) -> int:
    """A page's size in tokens (`KimiK3PagedCache`'s `block_size`, the server's `--block-size`): a whole number
    >= 1, else a ValueError naming it."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"KimiK3PagedCache: block_size={block_size!r} (--block-size) must be a whole number of tokens "
                         ">= 1")
    return block_size


def pages_for(num_tokens: int, block_size: int) -> int:
    """Pages of `block_size` tokens that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def own_pages(num_tokens: int, block_size: int, twin: bool = False) -> int:
    """Pages a row joining with `num_tokens` tokens takes of its own: all it needs, or for a twin (which holds its
    source's full pages, `KimiK3PagedCache.add_rows`) its partial last page alone (none when the tokens fill whole
    pages)."""
    return pages_for(num_tokens % block_size if twin else num_tokens, block_size)


class KimiK3PagedLatentLayer:
    """MLA layer of a paged cache: a pool of [pages, block_size, kv_lora_rank + rope] latents. Which pages hold a
    row's tokens is the cache's block table (the same for every MLA layer: each layer stores the same tokens); the
    layer only writes latents at flat slots (page * block_size + offset) and reads them back gathered. Page 0 is
    never handed out and stays zero: a row's padding in a gathered batch reads it."""

    is_linear = False
    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pages: torch.Tensor | None = None

    def allocate(self, num_pages: int, like: torch.Tensor) -> None:
        """A pool of `num_pages` pages (page 0 included) of `like`'s width, dtype and device; a larger pool keeps
        the pages already written (one copy of the pool: the growing pool's doubling)."""
        pool = like.new_zeros(num_pages, self.block_size, like.shape[-1])
        if self.pages is not None:
            pool[: self.pages.shape[0]] = self.pages
        self.pages = pool

    def write(self, slots: torch.Tensor, latents: torch.Tensor) -> None:
        """`latents` [N, R + P] into the flat `slots` [N]."""
        flat = self.pages.view(-1, self.pages.shape[-1])
        flat.index_copy_(0, slots.to(flat.device), latents.to(flat.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The latents at the flat `slots` [B, T] as [B, T, R + P] (the reference gather: one index_select)."""
        flat = self.pages.view(-1, self.pages.shape[-1])
        return flat.index_select(0, slots.to(flat.device).reshape(-1)).view(*slots.shape, flat.shape[-1])

    def page_bytes(self) -> int:
        return 0 if self.pages is None else self.pages[0].nbytes

    @property
    def batch_size(self) -> int:
        return 0  # rows are the cache's block tables, not an axis of the pool

    def live_bytes(self) -> dict[str, int]:
        return {"mla_kv": 0}  # the cache counts the pages its rows hold (`KimiK3PagedCache.live_bytes`)

    def reset(self) -> None:
        if self.pages is not None:
            self.pages.zero_()



class KimiK3SlotKDAStateLayer(KimiK3KDAStateLayer):
    """KDA layer of a paged cache: row i's conv windows and f32 state in slot i of buffers that keep their addresses
    ([slots, ...]: when rows outgrow them, new buffers of the next power of two of slots the rows need, at most
    `capacity` unless the rows need more; the row buckets of a fixed-shape step are powers of two too).
    Every forward rewrites the rows' slots in place; rows that leave are closed up (`keep`: the later rows move
    down), so the rows are always the first `rows` slots and a fixed-shape step over the first n slots
    (`KimiK3PagedStep`) reads and writes the same addresses at every step."""

    is_compileable = True

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.slots: tuple[torch.Tensor, ...] | None = None  # the conv windows of q, k and v, then the state
        self.rows = 0

    @property
    def conv_states(self) -> tuple[torch.Tensor, ...] | None:
        return None if not self.rows else tuple(slot[: self.rows] for slot in self.slots[:-1])

    @property
    def recurrent_state(self) -> torch.Tensor | None:
        return None if not self.rows else self.slots[-1][: self.rows]

    def update(self, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor) -> None:
        for slot, value in zip(self.slots, (*conv_states, recurrent_state)):
            slot[: value.shape[0]].copy_(value)

    def append(self, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor) -> None:
        """The rows of `conv_states` / `recurrent_state` ([k, ...] each) into the slots after the rows here."""
        values = (*conv_states, recurrent_state.float())
        count = values[-1].shape[0]
        if self.slots is None or self.rows + count > self.slots[-1].shape[0]:
            needed = self.rows + count
            wanted = 1 << (needed - 1).bit_length()
            slots = max(needed, wanted if self.capacity is None else min(wanted, self.capacity))
            slots = tuple(value.new_zeros(slots, *value.shape[1:]) for value in values)
            for new, old in zip(slots, self.slots or ()):
                new[: self.rows] = old[: self.rows]
            self.slots = tuple(_static_address(slot) for slot in slots)
        for slot, value in zip(self.slots, values):
            slot[self.rows : self.rows + count] = value
        self.rows += count

    def keep(self, kept: list[int]) -> None:
        """Only the rows `kept` (in order) stay, moved down to the first slots."""
        if kept != list(range(len(kept))):
            index = torch.tensor(kept, device=self.slots[-1].device)
            for slot in self.slots:
                slot[: len(kept)] = slot.index_select(0, index)
        self.rows = len(kept)

    def view(self, rows: int) -> "KimiK3SlotKDAStateLayer":
        """The first `rows` slots as a layer of their own (a fixed-shape step's rows, padding included)."""
        view = KimiK3SlotKDAStateLayer()
        view.slots, view.rows = self.slots, rows
        return view

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.slots or ()

    def map_batch(self, fn) -> None:
        raise NotImplementedError("KimiK3SlotKDAStateLayer: rows come and go with append / keep")

    @property
    def batch_size(self) -> int:
        return self.rows

    def reset(self) -> None:
        self.rows = 0  # the slots keep their addresses


class KimiK3PagedCache(KimiK3Cache):
    """The running batch of a server (docs/design.md, Serving): `KimiK3PagedCache(config, block_size=64,
    num_pages=N)`. MLA latents live in a pool of `num_pages` pages of `block_size` tokens per MLA layer, and each row
    has a block table (the pages holding its tokens, in order); KDA states and conv windows live in per-row slots
    of fixed-address buffers (`KimiK3SlotKDAStateLayer`: fixed-size, rewritten in place by every forward; a power of
    two of slots, more as rows come, at most `max_rows` where given). Between forwards rows come (`add_rows`: a
    one-row growing cache's latents written into pages once, its states into the next slot) and go (`remove_rows`:
    their pages freed, no other row's latents copied, the later rows' states moved down a slot). A forward gives
    every row the same number of new, real tokens: they are appended into each row's last page (a new page when it
    is full; `pages_needed` says how many a forward of T tokens takes), and each MLA layer reads its rows through
    their block tables, gathered and left-padded to the longest row (MLA has no positional encoding, so a row's
    padding changes nothing but the mask, `attention_mask`). Without
    `num_pages` the pool doubles when it runs out (one copy of the pool each time); with it, taking more pages than
    are free is an error: the caller frees pages first (the server preempts a sequence). It cannot crop, copy a
    prefix or reorder rows; a forward that verifies proposed tokens (`begin_verify`) is recorded so that each row
    keeps its own number of them (`keep_verified`).

    A decode step may also run at fixed shapes (`fixed_step`: the rows padded to a bucket, every row's keys to one
    length), which a CUDA graph can capture and replay (docs/design.md, Serving, Captured decode steps): the caller
    takes the step's pages (`reserve_pages(1)`), loads the rows' block tables into the step and, after the forward,
    calls `advance(1)`.

    Rows may share pages (`add_rows(..., twins=)`: the `n` sequences of one request, which hold the same prompt;
    `shared=`: a row joining with a prefix whose latents another row's full pages hold, both from one stored prompt).
    Every held page has a reference count, the rows whose block tables hold it; a page goes back to the free list
    only when its last holder leaves (`remove_rows`), and `pages_held` counts it once. Only full pages are shared: a
    row appends into its last page, so a partial last page is each row's own copy (copy-on-write taken at the join,
    where the rows are still equal), and a row's decode never writes a page another row reads."""

    def __init__(self, config, block_size: int = 64, num_pages: int | None = None, max_rows: int | None = None):
        check_block_size(block_size)
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"KimiK3PagedCache: num_pages={num_pages!r} must be a whole number >= 1 (None: a pool "
                             "that grows)")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(f"KimiK3PagedCache: max_rows={max_rows!r} must be a whole number >= 1 (None: slots for "
                             "the rows as they come)")
        self.block_size, self.num_pages, self.max_rows = block_size, num_pages, max_rows
        super().__init__(config)
        self.block_tables: list[list[int]] = []  # per row, the pages holding its tokens in order
        self.lengths: list[int] = []  # per row, the tokens it holds
        self.free: list[int] = []  # pages to hand out (page 0 never is)
        self.refs: dict[int, int] = {}  # per held page, the rows whose block tables hold it
        self.latent_bytes_copied = 0  # rows' latents written into pages by add_rows
        self.pool_bytes_copied = 0  # a growing pool's copies of itself
        self._pool_pages = 0  # pages in each layer's pool, page 0 included
        self._step_slots: dict | None = None  # this forward's (write, read) slots, by device
        self._verify: dict[int, KimiK3KDARewindRecord] | None = None  # a verify forward's record (`begin_verify`)

    def _new_layer(self, layer_type: str) -> KimiK3PagedLatentLayer | KimiK3SlotKDAStateLayer:
        if layer_type == "linear_attention":
            return KimiK3SlotKDAStateLayer(self.max_rows)
        return KimiK3PagedLatentLayer(self.block_size)

    @property
    def mla_layers(self) -> list[KimiK3PagedLatentLayer]:
        return [layer for layer in self.layers if not layer.is_linear]

    # ------------------------------------------------------------------------------------------------------------
    # Pages
    @property
    def free_pages(self) -> int:
        """Pages that can be handed out now (a growing pool: those before it grows)."""
        return len(self.free) if self._pool_pages else (self.num_pages or 0)

    @property
    def pages_held(self) -> int:
        """Pages some row holds, a page that rows share counted once."""
        return len(self.refs)

    def pages_needed(self, num_tokens: int = 1) -> int:
        """The new pages a forward of `num_tokens` tokens a row takes."""
        return sum(pages_for(length + num_tokens, self.block_size) - len(table)
                   for length, table in zip(self.lengths, self.block_tables))

    def _take(self, count: int) -> list[int]:
        if count > len(self.free):
            if self.num_pages is not None:
                raise ValueError(f"KimiK3PagedCache: {count} pages asked, {len(self.free)} free of {self.num_pages}: "
                                 "free pages first (remove_rows)")
            self._grow(max(2 * self._pool_pages, self._pool_pages + count - len(self.free)))
        taken, self.free = self.free[len(self.free) - count:], self.free[:len(self.free) - count]
        self.refs.update((page, 1) for page in taken)
        return taken

    def _release(self, table: list[int]) -> None:
        """A leaving row's references: each page of `table` goes back to the free list when no other row holds it."""
        for page in reversed(table):
            self.refs[page] -= 1
            if not self.refs[page]:
                del self.refs[page]
                self.free.append(page)

    def _grow(self, pool_pages: int, like: list[torch.Tensor] | None = None) -> None:
        """Every MLA layer's pool to `pool_pages` pages (`like`: a tensor per MLA layer giving the first pool its
        width, dtype and device, each layer's where that layer's latents are)."""
        for index, layer in enumerate(self.mla_layers):
            self.pool_bytes_copied += 0 if layer.pages is None else layer.pages.nbytes
            layer.allocate(pool_pages, layer.pages if like is None else like[index])
        # lowest pages handed out first (the list is taken from its end)
        self.free = list(range(pool_pages - 1, max(self._pool_pages, 1) - 1, -1)) + self.free
        self._pool_pages = pool_pages

    def _slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """The flat slots of a row's tokens start .. end - 1."""
        tokens = torch.arange(start, end)
        return torch.tensor(self.block_tables[row])[tokens // self.block_size] * self.block_size + \
            tokens % self.block_size

    # ------------------------------------------------------------------------------------------------------------
    # Rows coming and going between forwards
    def add_rows(self, caches: list[KimiK3Cache], twins: list[int | None] | None = None,
                 shared: list[tuple[int, int] | None] | None = None) -> None:
        """Append the rows of `caches` (growing caches of one row each, nothing pending): each row's MLA latents
        written into pages of its own (`pages_for(tokens, block_size)`), its KDA states and conv windows stacked
        after the rows here. The caches are not changed.

        `twins[i]` (None: a row of its own): the position j < i in `caches` of a cache holding the same tokens as
        cache i (the `n` sequences of one request after their shared prompt; the caller vouches that the tokens are
        the same, the lengths are checked). Row i then holds row j's full pages (a reference each) and writes only its
        last, partial page's tokens into a page of its own: that is the page both rows append to next.

        `shared[i]` (None: nothing shared): `(row, pages)`, a row already here whose first `pages` pages (full ones)
        cache i holds the same latents of (a prompt both took from one stored prompt: the caller vouches for the
        values). Row i then holds those pages (a reference each) and writes its tokens from `pages * block_size` on
        into pages of its own."""
        if not caches:
            return
        for cache in caches:
            if isinstance(cache, KimiK3PagedCache) or cache.is_static or cache.batch_size != 1 or \
                    cache.pending_tokens or not cache.get_seq_length():
                raise ValueError(f"KimiK3PagedCache.add_rows: each cache must be a growing one holding one row with "
                                 f"nothing pending, got {cache!r} (pending {cache.pending_tokens})")
        lengths = [cache.get_seq_length() for cache in caches]
        twins = [None] * len(caches) if twins is None else list(twins)
        if len(twins) != len(caches):
            raise ValueError(f"KimiK3PagedCache.add_rows: {len(twins)} twins for {len(caches)} caches (one entry "
                             "a cache: None, or the position of an earlier cache holding the same tokens)")
        for row, twin in enumerate(twins):
            if twin is not None and (isinstance(twin, bool) or not isinstance(twin, int) or not 0 <= twin < row or
                                     lengths[twin] != lengths[row]):
                raise ValueError(f"KimiK3PagedCache.add_rows: twins[{row}]={twin!r} must be None or the position of "
                                 f"an earlier cache of the same length ({lengths[row]} tokens; the lengths are "
                                 f"{lengths})")
        shared = [None] * len(caches) if shared is None else list(shared)
        if len(shared) != len(caches):
            raise ValueError(f"KimiK3PagedCache.add_rows: {len(shared)} shared entries for {len(caches)} caches (one "
                             "entry a cache: None, or (a row here, its full pages the cache holds))")
        for row, entry in enumerate(shared):
            if entry is None:
                continue
            if twins[row] is not None:
                raise ValueError(f"KimiK3PagedCache.add_rows: cache {row} is a twin and shares a row's pages too "
                                 f"(twins[{row}]={twins[row]}, shared[{row}]={entry!r}): one or the other")
            held, pages = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (held, pages)) or \
                    not 0 <= held < len(self.lengths) or not 0 <= pages <= self.lengths[held] // self.block_size or \
                    pages * self.block_size > lengths[row]:
                raise ValueError(f"KimiK3PagedCache.add_rows: shared[{row}]={entry!r} must be None or (row, pages): a "
                                 f"row here (0..{len(self.lengths) - 1}) and at most its full pages, within the "
                                 f"cache's {lengths[row]} tokens")
        # a twin takes a page only for its partial last page (none when its tokens fill whole pages), a row sharing
        # another's pages only for its tokens after them
        own = [own_pages(length, self.block_size, twin is not None) if entry is None else
               pages_for(length - entry[1] * self.block_size, self.block_size)
               for length, twin, entry in zip(lengths, twins, shared)]
        wanted = sum(own)
        if self.num_pages is not None and wanted > self.free_pages:
            raise ValueError(f"KimiK3PagedCache.add_rows: the rows take {wanted} pages of {self.block_size} tokens, "
                             f"{self.free_pages} are free of {self.num_pages}")
        if not self._pool_pages:  # the first rows: each layer's pool in their dtype, on their device
            self._grow(1 + (self.num_pages or max(wanted, 16)),
                       [source.latents for source in caches[0].layers if not source.is_linear])
        first = len(self.lengths)
        for cache, length, twin, entry, count in zip(caches, lengths, twins, shared, own):
            held = [] if twin is None else self.block_tables[first + twin][:length // self.block_size]
            if entry is not None:
                held = self.block_tables[entry[0]][:entry[1]]
            for page in held:
                self.refs[page] += 1
            start = len(held) * self.block_size  # the tokens from here on are written into the row's own pages
            self.block_tables.append(held + self._take(count))
            self.lengths.append(length)
            slots = self._slots(len(self.lengths) - 1, start, length)
            for layer, source in zip(self.layers, cache.layers):
                if not layer.is_linear:
                    layer.write(slots, source.latents[0, start:])
                    self.latent_bytes_copied += source.latents[0, start:].nbytes
        for index in self.kda_layer_indices:
            rows = [cache.layers[index] for cache in caches]
            self.layers[index].append(tuple(torch.cat(parts) for parts in zip(*(row.conv_states for row in rows))),
                                      torch.cat([row.recurrent_state for row in rows]))

    def remove_rows(self, rows: list[int]) -> None:
        """Drop the rows at `rows`: their pages go back to the free list (nothing is copied for the latents of the
        rows that stay; the KDA states of the rows after a gone one move down a slot)."""
        gone = set(rows)
        if not gone:
            return
        if not gone <= set(range(len(self.lengths))):
            raise ValueError(f"KimiK3PagedCache.remove_rows({sorted(gone)}): the cache holds {len(self.lengths)} rows")
        for row in sorted(gone):
            self._release(self.block_tables[row])
        kept = [row for row in range(len(self.lengths)) if row not in gone]
        self.block_tables = [self.block_tables[row] for row in kept]
        self.lengths = [self.lengths[row] for row in kept]
        for index in self.kda_layer_indices:
            self.layers[index].keep(kept)

    def attention_mask(self, num_tokens: int = 1) -> torch.Tensor:
        """[B, longest + num_tokens] long padding mask of a forward of `num_tokens` new tokens a row: 0 on each row's
        left padding, 1 on its tokens and the new ones."""
        longest = self.get_seq_length()
        device = next((layer.pages.device for layer in self.mla_layers if layer.pages is not None), None)
        positions = torch.arange(longest + num_tokens, device=device)
        starts = torch.tensor([longest - length for length in self.lengths], device=device)
        return (positions[None] >= starts[:, None]).long()

    # ------------------------------------------------------------------------------------------------------------
    # What the model calls, in forward order
    def begin_step(self, batch_size: int, num_tokens: int, token_mask: torch.Tensor | None,
                   device: torch.device, input_ids: torch.Tensor | None = None) -> None:
        """Pages for the new tokens (each row's last page, then new ones), and the slots every MLA layer writes and
        reads in this forward."""
        if batch_size != len(self.lengths):
            raise ValueError(f"KimiK3PagedCache: a forward of {batch_size} rows on a cache of {len(self.lengths)}")
        if token_mask is not None:
            raise ValueError("KimiK3PagedCache: every new token of a forward must be real (padding is the cache's: "
                             "pass attention_mask=cache.attention_mask(num_tokens))")
        self.reserve_pages(num_tokens)
        # every row's tokens right-aligned at the longest row's end; the new ones are the last num_tokens columns
        lengths = torch.tensor(self.lengths) + num_tokens
        longest = int(lengths.max())
        tables = torch.zeros(batch_size, max(len(table) for table in self.block_tables), dtype=torch.long)
        for row, table in enumerate(self.block_tables):
            tables[row, :len(table)] = torch.tensor(table)
        # the slots are computed where the pool is: only the tables (a page id per block) cross from the host
        pool = self.mla_layers[0].pages
        tables, lengths = tables.to(pool.device), lengths.to(pool.device)
        tokens = torch.arange(longest, device=pool.device)[None] - (longest - lengths)[:, None]  # < 0: padding
        padding = tokens < 0
        tokens = tokens.clamp(min=0)
        read = tables.gather(1, tokens // self.block_size) * self.block_size + tokens % self.block_size
        read = read.masked_fill(padding, 0)
        write = read[:, longest - num_tokens:].reshape(-1)
        # moved once per device the MLA layers sit on (a model spread over devices), not once per layer
        self._step_slots = {pool.device: (write, read)}

    def reserve_pages(self, num_tokens: int) -> None:
        """Every row's pages for a forward of `num_tokens` more tokens (its last page's room, then new pages)."""
        for row, length in enumerate(self.lengths):
            missing = pages_for(length + num_tokens, self.block_size) - len(self.block_tables[row])
            if missing > 0:
                self.block_tables[row] += self._take(missing)

    def update_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Write the [B, T, R + P] new latents into the rows' pages; returns every row's latents so far, gathered
        through its block table and left-padded to the longest row (the padding reads page 0: zeros)."""
        layer = self.layers[layer_idx]
        device = layer.pages.device
        if device not in self._step_slots:
            write, read = next(iter(self._step_slots.values()))
            self._step_slots[device] = (write.to(device), read.to(device))
        write, read = self._step_slots[device]
        layer.write(write, latents.reshape(-1, latents.shape[-1]))
        return layer.gather(read)

    def advance(self, num_tokens: int) -> None:
        self.lengths = [length + num_tokens for length in self.lengths]
        self._step_slots = None

    def records_step(self) -> bool:
        return self._verify is not None

    def snapshot_offsets(self) -> list[int]:
        return []

    # ------------------------------------------------------------------------------------------------------------
    # A verify forward: each row keeps its own number of the proposed tokens
    def begin_verify(self) -> None:
        """The next forward verifies proposed tokens (a speculative round): every KDA layer's rows' states and
        windows are copied as they are now (the forward rewrites the slots in place) and the forward's per-token
        inputs are recorded, so that `keep_verified` can take each row back to the tokens it keeps."""
        self._verify = {index: KimiK3KDARewindRecord(tuple(window.clone() for window in self.layers[index].conv_states),
                                                     self.layers[index].recurrent_state.clone())
                        for index in self.kda_layer_indices}

    def record_kda(self, layer_idx: int, conv_states, recurrent_state, pre_conv, recurrence_inputs) -> None:
        self._verify[layer_idx].append(pre_conv, recurrence_inputs)

    def keep_verified(self, kept: list[int]) -> None:
        """After a verify forward of T tokens a row: row r keeps its first `kept[r]` (1..T) of them. Its MLA latents
        past them are left where they are (no key reads them: its count ends before them) and the pages that held
        only those go back to the pool; its KDA state and windows are those after its kept tokens, replayed from the
        copies `begin_verify` took over the recorded inputs (the kernel a forward of that length would use)."""
        if self._verify is None:
            raise ValueError("KimiK3PagedCache.keep_verified: no verify forward was begun (begin_verify)")
        records = self._verify
        width = next(iter(records.values())).num_tokens if records else max(kept, default=0)
        if len(kept) != len(self.lengths) or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= width
                                                 for n in kept):
            raise ValueError(f"KimiK3PagedCache.keep_verified({kept}): one count a row ({len(self.lengths)} rows), "
                             f"each in 1..{width} (the verified tokens)")
        self._verify = None
        text = self._text_config
        for row, count in enumerate(kept):
            if count == width:
                continue
            self.lengths[row] -= width - count
            table = self.block_tables[row]
            needed = pages_for(self.lengths[row], self.block_size)
            self._release(table[needed:])
            self.block_tables[row] = table[:needed]
            for index, record in records.items():
                one = KimiK3KDARewindRecord(tuple(w[row:row + 1] for w in record.base_conv_states),
                                            record.base_state[row:row + 1])
                for pre_conv, inputs in zip(record.pre_conv, record.recurrence_inputs):
                    one.append(tuple(x[row:row + 1] for x in pre_conv), tuple(x[row:row + 1] for x in inputs))
                windows, state = one.state_after(count, text.linear_conv_kernel_size, text.kda_chunk_size)
                layer = self.layers[index]
                for slot, value in zip(layer.slots, (*windows, state)):
                    slot[row:row + 1].copy_(value)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The longest row's tokens (the others are left-padded to it)."""
        return max(self.lengths, default=0)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def live_bytes(self) -> dict[str, int]:
        """Bytes the rows hold: their pages in every MLA layer's pool, their KDA states and conv windows (the pool
        itself: `pool_bytes()`)."""
        report = {"mla_kv": self.pages_held * sum(layer.page_bytes() for layer in self.mla_layers),
                  "kda_state": 0, "kda_conv": 0}
        for index in self.kda_layer_indices:
            for kind, num_bytes in self.layers[index].live_bytes().items():
                report[kind] += num_bytes
        report["total"] = sum(report.values())
        return report

    def pool_bytes(self) -> int:
        """Bytes of every MLA layer's pool, held or free (page 0 included)."""
        return sum(0 if layer.pages is None else layer.pages.nbytes for layer in self.mla_layers)

    # ------------------------------------------------------------------------------------------------------------
    # A decode step at fixed shapes
    def buffers(self) -> list[torch.Tensor]:
        """The tensors a fixed-shape step reads and writes: every MLA layer's pool and every KDA layer's slots (a
        growing pool or more slots are new tensors: a step made before reads the old ones)."""
        return [tensor for layer in self.layers for tensor in
                (layer.buffers() if layer.is_linear else () if layer.pages is None else (layer.pages,))]

    def slots_held(self) -> int:
        """Rows the KDA layers' slots hold before they take more (the rows here before the first are allocated)."""
        return min((len(self.lengths) if layer.slots is None else layer.slots[-1].shape[0]
                    for layer in (self.layers[index] for index in self.kda_layer_indices)), default=len(self.lengths))

    def fixed_step(self, rows: int, pages: int) -> "KimiK3PagedStep":
        """A one-token decode step over the first `rows` rows (the rows here and padding after them, at most the
        slots held) whose keys are `pages` pages long a row (at least the longest row's pages after the step)."""
        return KimiK3PagedStep(self, rows, pages)

    def reset(self) -> None:
        """No rows; every page free (the pool stays allocated)."""
        for layer in self.layers:
            if layer.is_linear:
                layer.reset()
        self.free = list(range(self._pool_pages - 1, 0, -1))
        self.block_tables, self.lengths, self.refs, self._step_slots, self._verify = [], [], {}, None, None

    # ------------------------------------------------------------------------------------------------------------
    # What a paged batch does not do
    def _refuse(self, what: str):
        return NotImplementedError(f"KimiK3PagedCache.{what}: not supported for the paged batch of a server (rows "
                                   "come and go with add_rows / remove_rows; a verify forward's rows keep their "
                                   "tokens with begin_verify / keep_verified)")

    def crop(self, max_length: int) -> None:
        raise self._refuse("crop")

    def copy_prefix(self, num_tokens: int) -> "KimiK3Cache":
        raise self._refuse("copy_prefix")

    def select_rows(self, rows: list[int]) -> "KimiK3Cache":
        raise self._refuse("select_rows")

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        raise self._refuse("activate_past_recording")

    @property
    def is_croppable(self) -> bool:
        return False

    def _map_batch(self, fn) -> None:
        raise self._refuse("reorder_cache / batch_select_indices / batch_repeat_interleave")

    def split(self, key_mask):
        raise self._refuse("split")


class KimiK3PagedStep(KimiK3Cache):
    """A one-token decode step of a paged cache's rows at fixed shapes and addresses (`paged.fixed_step(rows,
    pages)`), so that a CUDA graph can capture it once and replay it at every step whose rows and longest row fall in
    the same bucket (docs/design.md, Serving, Captured decode steps).

    It reads the paged cache's own storage: every MLA layer's pool of pages and the first `rows` slots of every KDA
    layer (`KimiK3SlotKDAStateLayer.view`). The rows' block tables and token counts are the step's only inputs
    besides the token ids, one device buffer ([rows, pages + 1]: the tables, then the tokens each row holds after
    the step) that `load` fills from the host before each run; the slots a forward writes and reads, and which keys
    are real, are computed from it inside the step (`begin_step`). Every row's keys are `pages * block_size` long,
    its tokens first and masked keys after them (MLA has no positional encoding). A padding row (after the real
    rows) holds one token in page 0: its one key reads zeros, it writes zeros back there (page 0 stays zero), and
    its KDA slot holds whatever a row left there; nothing of it reaches a real row.

    The step keeps no count of its own: the caller took the pages first (`reserve_pages(1)`) and advances the paged
    cache after the forward (`advance(1)`), outside what a graph replays."""

    is_static = True

    def __init__(self, paged: KimiK3PagedCache, rows: int, pages: int):
        held = paged.slots_held()
        if not paged.batch_size or not paged.batch_size <= rows <= held:
            raise ValueError(f"KimiK3PagedStep: {rows} rows for a cache of {paged.batch_size} rows in {held} slots")
        needed = max((pages_for(length + 1, paged.block_size) for length in paged.lengths), default=1)
        if pages < needed:
            raise ValueError(f"KimiK3PagedStep: keys of {pages} pages a row; the longest row needs {needed}")
        Cache.__init__(self, layers=[layer.view(rows) if layer.is_linear else layer for layer in paged.layers])
        self._text_config, self.rewind = paged._text_config, None
        self.block_size, self.rows, self.pages = paged.block_size, rows, pages
        pool = paged.mla_layers[0].pages
        self.inputs = torch.zeros(rows, pages + 1, dtype=torch.long, device=pool.device)
        self._host = torch.zeros(rows, pages + 1, dtype=torch.long, pin_memory=pool.is_cuda)
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None  # this forward's (write, read) slots
        self._valid: torch.Tensor | None = None  # [rows, keys], True on each row's tokens

    def load(self, block_tables: list[list[int]], lengths: list[int]) -> None:
        """The real rows' block tables and tokens held after the step (the padding rows: one token in page 0)."""
        if len(block_tables) > self.rows or any(len(table) > self.pages for table in block_tables):
            raise ValueError(f"KimiK3PagedStep.load: {len(block_tables)} rows of up to "
                             f"{max(map(len, block_tables), default=0)} pages for a step of {self.rows} rows of "
                             f"{self.pages} pages (make the step for the rows' bucket: fixed_step)")
        host = self._host
        host.zero_()
        host[:, -1] = 1
        for row, (table, length) in enumerate(zip(block_tables, lengths)):
            host[row, : len(table)] = torch.tensor(table)
            host[row, -1] = length
        self.inputs.copy_(host, non_blocking=True)

    def is_fixed_shape_step(self, num_tokens: int) -> bool:
        return num_tokens == 1

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True

    def begin_step(self, batch_size: int, num_tokens: int, token_mask: torch.Tensor | None,
                   device: torch.device, input_ids: torch.Tensor | None = None) -> None:
        """The slots of this forward from the loaded tables, on the device (nothing read by the host)."""
        if (batch_size, num_tokens) != (self.rows, 1):
            raise ValueError(f"KimiK3PagedStep: a forward of {batch_size} rows x {num_tokens} tokens on a step of "
                             f"{self.rows} rows x 1 token")
        tables, lengths = self.inputs[:, :-1], self.inputs[:, -1]
        keys = torch.arange(self.pages * self.block_size, device=tables.device)
        valid = keys[None] < lengths[:, None]
        pages = tables.gather(1, (keys // self.block_size).expand(self.rows, -1))
        read = torch.where(valid, pages * self.block_size + keys % self.block_size, 0)
        write = read.gather(1, (lengths - 1)[:, None]).squeeze(1)  # a padding row: slot 0 (page 0)
        self._slots, self._valid = (write, read), valid

    def key_valid_mask(self, num_tokens: int = 1) -> torch.Tensor:
        return self._valid[:, None, None, :]

    def update_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Writes the rows' new latents into their pages (a padding row writes zeros into page 0); returns every
        row's keys, [rows, pages * block_size, R + P]."""
        layer = self.layers[layer_idx]
        write, read = (slots.to(layer.pages.device) for slots in self._slots)
        latents = latents.reshape(-1, latents.shape[-1])
        layer.write(write, torch.where((write != 0)[:, None], latents, 0))
        return layer.gather(read)

    def advance(self, num_tokens: int) -> None:
        pass  # the paged cache's count moves outside the replayed step

    @property
    def pending_tokens(self) -> int:
        return 0

    def records_step(self) -> bool:
        return False

    def snapshot_offsets(self) -> list[int]:
        return []

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.pages * self.block_size

    @property
    def batch_size(self) -> int:
        return self.rows

    @property
    def is_croppable(self) -> bool:
        return False


def paged_page_bytes(config, block_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of one page of `block_size` tokens in every MLA layer's pool (what one page of a row holds)."""
    return analytic_cache_bytes(config, check_block_size(block_size), dtype_bytes=dtype_bytes)["mla_kv"]


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


def snapshot_bytes(config, batch_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one set of KDA states, as a snapshot holds it: every KDA layer's f32 state and its three conv
    windows."""
    per_token_free = analytic_cache_bytes(config, 1, batch_size, dtype_bytes)
    return per_token_free["kda_state"] + per_token_free["kda_conv"]


__all__ = [
    "KimiK3Cache",
    "KimiK3PagedCache",
    "KimiK3PagedStep",
    "KimiK3StaticCache",
    "analytic_cache_bytes",
    "paged_page_bytes",
    "pages_for",
    "snapshot_bytes",
]
