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
"""Rewinding to an earlier token with the KDA layers, whose recurrent state cannot be cut like the MLA latents.

`KimiK3Rewind` is the growing `KimiK3Cache`'s component (`cache.rewind`). The cache passes it what the KDA layers hand
over through their step handles (`KimiK3KDAStep.record`, `.snapshot`) and asks it for the states of an earlier token
in `crop`; the model runs the tokens it leaves pending (`cache.replay()`). It holds (docs/design.md, Rewinding):

* Rewind records (speculative decoding): while past recording is on, every short forward records, per KDA layer,
  the state it started from and the per-token inputs of the recurrence (the pre-conv q/k/v projections and the
  post-conv q, k, v, the decay g and beta). Rewinding inside the recorded span rebuilds the conv windows from the
  pre-conv inputs and replays the recurrence from the recorded state up to the kept token, at once: no projection
  and no earlier token is recomputed, and nothing of the model runs.
* Snapshots (prefix reuse): a prefill hands over the KDA states at multiples of `snapshot_interval` tokens (a
  512-token block for the prefix store), written by the chunked form itself as it passes them (optionally kept on
  another device). Under a byte budget they are kept sparse by `kept_snapshot_blocks`: every block end in a dense
  window before the cache's end, geometrically thinner further back.
* The token ids (and padding mask) the cache has seen. Rewinding anywhere else restores the nearest snapshot at or
  below the target and leaves the tokens from there to the target pending: the next forward of the model runs them
  first (`replay`), the same computation as a prefill of those tokens.

`KimiK3StaticRewind` is the static cache's component (`cache.rewind`, once `enable_rewind` ran), for one speculative
round: the same record in fixed-address buffers, written and replayed with device-side indices, so that a round is one CUDA graph.

It computes with the ops (conv windows, the recurrence) and never refers to the model or to the cache.
"""

import contextlib

import torch

from .dispatch_kimi_k3 import kda_recurrence
from .ops_kimi_k3 import conv_windows_after

# The report's serving granularity: prompts are hashed in 512-token blocks, and a KDA state snapshot is kept every
# few dozen blocks (about 50 snapshots over a 1M-token context).
KDA_BLOCK_SIZE = 512
DEFAULT_SNAPSHOT_BLOCKS = 40
DEFAULT_SNAPSHOT_INTERVAL = KDA_BLOCK_SIZE * DEFAULT_SNAPSHOT_BLOCKS
# Forwards longer than this are not recorded for a rewind (a verify block is a handful of tokens; a prefill's
# per-token inputs would cost far more than its snapshots)
DEFAULT_MAX_REWIND_TOKENS = 128


def _snapshot_copy(tensor: torch.Tensor, device) -> torch.Tensor:
    # A copy: the live tensors may be written in place later (static buffers, fast kernels)
    return tensor.detach().to(device, copy=True) if device is not None else tensor.detach().clone()


class KimiK3KDARewindRecord:
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

    @property
    def num_tokens(self) -> int:
        return sum(step[0].shape[1] for step in self.pre_conv)

    def nbytes_per_token(self) -> int:
        """Recorded bytes per token (all recorded tensors share the token axis, dim 1)."""
        tokens = self.num_tokens
        if tokens == 0:
            return 0
        held = sum(t.nbytes for step in (*self.pre_conv, *self.recurrence_inputs) for t in step)
        return held // tokens

    def state_after(self, num_tokens: int, conv_kernel_size: int, chunk_size: int):
        """(conv windows, recurrent state) after the first `num_tokens` recorded tokens."""
        if num_tokens == 0:
            return self.base_conv_states, self.base_state
        pre_conv = [torch.cat(parts, dim=1)[:, :num_tokens] for parts in zip(*self.pre_conv)]
        q, k, v, g, beta = (torch.cat(parts, dim=1)[:, :num_tokens] for parts in zip(*self.recurrence_inputs))
        conv_states = conv_windows_after(pre_conv, self.base_conv_states, conv_kernel_size)
        _, state = kda_recurrence(q, k, v, g, beta, self.base_state, True, chunk_size, decode_step=num_tokens == 1)
        return conv_states, state


def rewind_record_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """Rewind record bytes per verified token, from the config: per KDA layer the pre-conv and post-conv q, k, v
    (activation dtype), the f32 decay g (H x D) and the f32 beta (H). Compare with one KDA state, H x D x D f32 per
    layer: the record is about D / (6 * dtype_bytes / 4 + 1) times smaller."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_kda = sum(t == "linear_attention" for t in text.layer_types)
    heads, head_dim = text.linear_num_heads, text.linear_head_dim
    per_layer = 6 * heads * head_dim * dtype_bytes + heads * head_dim * 4 + heads * 4
    return num_kda * per_layer


def kept_snapshot_blocks(num_blocks: int, dense_blocks: int) -> list[int]:
    """The snapshot policy (docs/design.md, Rewinding): which block ends 1..num_blocks a cache of `num_blocks`
    whole blocks keeps, with a dense window of `dense_blocks` (w >= 1) blocks. Block i, at distance d = num_blocks - i
    from the end, is kept when i is a multiple of 2**level(d), level(d) = floor(log2(d // w + 1)): every block end
    for d < w, every 2nd for the next 2w blocks, every 4th for the next 4w, ... (w per level: about
    w * log2(2 * num_blocks / w) snapshots). The guarantee: a restore at block i replays no block if d < w, else
    fewer than 2**(level(d) + 1) blocks. Monotone: a block kept at some length is kept at every shorter length from
    i on, and with a narrower window it is kept with a wider one, so growing the cache or narrowing the window only
    ever drops snapshots, never needs one it dropped."""
    kept, level, near = [], 0, 0  # level L covers the distances [near, far) = [w (2**L - 1), w (2**(L+1) - 1))
    while near < num_blocks:
        far = near + (dense_blocks << level)
        step = 1 << level
        low, high = max(num_blocks - far + 1, 1), num_blocks - near  # block indices at those distances
        kept.extend(range(-(-low // step) * step, high + 1, step))
        near, level = far, level + 1
    return sorted(kept)


def _check_option(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"KimiK3Cache: {name} must be a positive integer or None, got {value!r}")


class KimiK3Rewind:
    """The growing cache's rewind: KDA snapshots, rewind records and the token ids for replays.

    `kda_layers`: the KDA layer indices (a snapshot is complete when each of them handed its state over).
    `snapshot_bytes_per_row`: one snapshot's bytes for one sequence (conv windows counted at f32, the most they
    hold), to keep `max_snapshot_bytes` before a forward takes its own snapshots. The other options are those of
    `KimiK3Cache`.
    """

    def __init__(self, kda_layers: list[int], conv_kernel_size: int, chunk_size: int, snapshot_bytes_per_row: int,
                 snapshot_interval: int | None = None, snapshot_device: str | torch.device | None = None,
                 max_snapshot_bytes: int | None = None, max_rewind_tokens: int = DEFAULT_MAX_REWIND_TOKENS):
        for name, value in (("snapshot_interval", snapshot_interval), ("max_snapshot_bytes", max_snapshot_bytes),
                            ("max_rewind_tokens", max_rewind_tokens)):
            _check_option(name, value)
        if max_snapshot_bytes is not None and max_snapshot_bytes < snapshot_bytes_per_row:
            raise ValueError(
                f"KimiK3Cache: max_snapshot_bytes={max_snapshot_bytes} holds no KDA state snapshot: one is "
                f"{snapshot_bytes_per_row} bytes for one sequence (every KDA layer's f32 state and conv windows)"
            )
        self.kda_layers = list(kda_layers)
        self.conv_kernel_size = conv_kernel_size
        self.chunk_size = chunk_size
        self.snapshot_bytes_per_row = snapshot_bytes_per_row
        self.snapshot_interval = snapshot_interval
        self.snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        self.max_snapshot_bytes = max_snapshot_bytes
        self.max_rewind_tokens = max_rewind_tokens
        # position -> {KDA layer -> (conv windows, f32 state)}
        self.snapshots: dict[int, dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]]] = {}
        # The policy's dense window in blocks (None: not narrowed yet); only ever narrows (see kept_snapshot_blocks)
        self.dense_blocks: int | None = None
        self._planned: tuple[int, int] | None = None  # (blocks, batch size) the kept set was last planned for
        self.replayed_tokens = 0  # tokens the model ran from `replay` (pending tokens after rewinding)
        self.record_past = False
        self._record: dict[int, KimiK3KDARewindRecord] | None = None
        self._record_base = 0  # position the rewind records start from
        # Token ids (and padding mask) of every token the cache stands for; None once embeddings came in
        self._token_ids: torch.Tensor | None = None
        self._token_valid: torch.Tensor | None = None
        self._replayable = True
        self._pending_start: int | None = None  # tokens from here on are to be run by the next forward
        # The current forward
        self._step_start = 0
        self._step_snapshots: list[int] = []
        self._recording_step = False
        self._replaying = False

    # ------------------------------------------------------------------------------------------------------------
    # Each forward: the cache opens and closes it, the model hands over its token ids
    def begin_step(self, position: int, batch_size: int, num_tokens: int) -> None:
        """Before the layers run (`position` tokens cached): where this forward's snapshots fall, and whether it is
        recorded for a rewind."""
        self._step_start = position
        # Plan the kept set for the length this forward reaches: drop what it no longer keeps before the layers
        # run, and take only the kept ones the forward passes, so even its own snapshots never exceed the budget
        wanted = self._plan(position + num_tokens, batch_size)
        self._step_snapshots = [p - position for p in wanted if position < p <= position + num_tokens
                                and p not in self.snapshots]
        self._recording_step = False
        if not self.record_past or self._replaying:
            return
        recorded = position - self._record_base if self._record is not None else 0
        if self._record is not None and recorded + num_tokens > self.max_rewind_tokens:
            self._record = None  # too long a span: start over from here
        if num_tokens > self.max_rewind_tokens:
            return
        if self._record is None:
            self._record, self._record_base = {}, position
        self._recording_step = True

    def keep_tokens(self, input_ids: torch.Tensor | None, token_mask: torch.Tensor | None, past_len: int) -> None:
        """This forward's token ids (and padding) after the `past_len` cached ones, for replays from a snapshot. A
        forward from embeddings makes the tokens so far unreplayable."""
        if not self._replayable or input_ids is None:
            self._replayable, self._token_ids, self._token_valid = False, None, None
            return
        ids = input_ids.detach()
        batch_size, num_tokens = ids.shape
        self._token_ids = ids if self._token_ids is None else torch.cat([self._token_ids, ids], dim=1)
        if token_mask is not None or self._token_valid is not None:
            valid = torch.ones(batch_size, num_tokens, dtype=torch.bool, device=ids.device) if token_mask is None \
                else token_mask.to(ids.device)
            past = self._token_valid
            if past is None:
                past = torch.ones(batch_size, past_len, dtype=torch.bool, device=ids.device)
            self._token_valid = torch.cat([past, valid], dim=1)

    def end_step(self) -> None:
        """After every layer wrote its state."""
        self._recording_step = False
        self._bound_snapshots()

    # ------------------------------------------------------------------------------------------------------------
    # What the KDA layers hand over
    def records_step(self) -> bool:
        """Whether the KDA layers record this forward's inputs for a rewind."""
        return self._recording_step

    def record_step(self, layer_idx: int, conv_states, recurrent_state, pre_conv, recurrence_inputs) -> None:
        """A KDA layer's state before this forward and its per-token inputs (see `KimiK3KDARewindRecord`)."""
        record = self._record.get(layer_idx)
        if record is None:
            record = self._record[layer_idx] = KimiK3KDARewindRecord(conv_states, recurrent_state)
        record.append(pre_conv, recurrence_inputs)

    def snapshot_offsets(self) -> list[int]:
        """Offsets inside the current forward (1..num_tokens) after which the KDA layers hand over a snapshot."""
        return self._step_snapshots

    def save_snapshot(self, layer_idx: int, offset: int, pre_conv: tuple[torch.Tensor, ...],
                      conv_states: tuple[torch.Tensor, ...] | None, recurrent_state: torch.Tensor) -> None:
        """A KDA layer's state after `offset` tokens of the current forward, with its pre-conv q/k/v inputs of the
        forward ([B, T, C]) and the conv windows it started from: the snapshot keeps the windows after `offset`."""
        windows = conv_windows_after(tuple(x[:, :offset] for x in pre_conv), conv_states, self.conv_kernel_size)
        device = self.snapshot_device
        self.snapshots.setdefault(self._step_start + offset, {})[layer_idx] = (
            tuple(_snapshot_copy(window, device) for window in windows),
            _snapshot_copy(recurrent_state.float(), device),
        )

    def _capacity(self, batch_size: int) -> int | None:
        """Whole snapshots of `batch_size` rows that `max_snapshot_bytes` holds (None: unbounded)."""
        if self.max_snapshot_bytes is None:
            return None
        return self.max_snapshot_bytes // (self.snapshot_bytes_per_row * max(batch_size, 1))

    def _plan(self, end: int, batch_size: int) -> list[int]:
        """The snapshot positions the policy keeps once the cache holds `end` tokens of `batch_size` rows; held
        snapshots off it are dropped now. Unbounded: every multiple of the interval. Bounded to C snapshots: the
        widest window w (never wider than before) with len(kept_snapshot_blocks(n, w)) <= C; past even w = 1, the
        C most recent of those."""
        if self.snapshot_interval is None:
            return []
        interval = self.snapshot_interval
        blocks = end // interval
        capacity = self._capacity(batch_size)
        if capacity is None or blocks <= capacity and self.dense_blocks is None:
            return [i * interval for i in range(1, blocks + 1)]
        if self._planned == (blocks, batch_size):
            return sorted(self.snapshots)  # nothing new since the last plan (e.g. decode steps inside a block)
        widest = capacity if self.dense_blocks is None else min(self.dense_blocks, capacity)
        low, high = 1, max(widest, 1)
        while low < high:  # the widest window that fits (the kept count grows with the window)
            middle = (low + high + 1) // 2
            low, high = (middle, high) if len(kept_snapshot_blocks(blocks, middle)) <= capacity else (low, middle - 1)
        self.dense_blocks = low
        kept = kept_snapshot_blocks(blocks, low)
        kept = kept[max(len(kept) - capacity, 0):] if capacity else []  # w = 1 still too many: oldest go first
        wanted = {i * interval for i in kept}
        self.snapshots = {p: states for p, states in self.snapshots.items() if p in wanted}
        self._planned = (blocks, batch_size)
        return sorted(wanted)

    # ------------------------------------------------------------------------------------------------------------
    # Rewinding
    def activate_past_recording(self) -> None:
        self.record_past = True

    def forget_record(self) -> None:
        """The live state becomes the base of any later rewind."""
        self._record = None

    def states_at(self, target: int, devices: dict) -> tuple[int, dict]:
        """The rewind to `target` tokens (fewer than the cache stands for): `(kept, states)`, the position the
        cache keeps and the (conv windows, state) of each KDA layer there ((None, None): empty). Inside the recorded
        span `kept` is the target (the recorded recurrence replayed); otherwise it is the nearest complete snapshot
        at or below the target (copied onto `devices[layer]`), and the tokens up to the target stay pending for the
        next forward (`replay`)."""
        if self._record is not None and self._record_base <= target:
            return self._replay_record(target)
        return self._restore_snapshot(target, devices)

    def _replay_record(self, target: int) -> tuple[int, dict]:
        kept_tokens = target - self._record_base
        states = {layer_idx: record.state_after(kept_tokens, self.conv_kernel_size, self.chunk_size)
                  for layer_idx, record in self._record.items()}
        self._cut(target, target)
        return target, states

    def restore_position(self, target: int) -> int:
        """Where rewinding to `target` (by a snapshot) starts: the nearest complete snapshot at or below it (0: the
        empty state; the target itself without KDA layers). The tokens from there to the target are replayed."""
        if not self.kda_layers:
            return target  # nothing recurrent: the cut latents are the whole state
        complete = len(self.kda_layers)  # a snapshot every KDA layer handed over
        return max((p for p in self.snapshots if p <= target and len(self.snapshots[p]) == complete), default=0)

    @property
    def replayable(self) -> bool:
        """Whether the token ids of every cached token are kept (not filled from inputs_embeds)."""
        return self._replayable and self._token_ids is not None

    def _restore_snapshot(self, target: int, devices: dict) -> tuple[int, dict]:
        start = self.restore_position(target)
        if start < target and not self.replayable:
            kda = self.kda_layers
            raise NotImplementedError(
                f"KimiK3Cache.crop({target}): KDA layers {kda[:4]}{'...' if len(kda) > 4 else ''} need a state at "
                f"token {target}; the nearest snapshot is at {start} and it was filled from inputs_embeds (no token "
                "ids to replay). Take snapshots at that position (snapshot_interval) or fill it from input_ids."
            )
        states = {}
        for layer_idx in self.kda_layers:
            conv_states, state = self.snapshots[start][layer_idx] if start > 0 else (None, None)
            if state is not None:
                device = devices[layer_idx]
                conv_states, state = tuple(c.to(device, copy=True) for c in conv_states), state.to(device, copy=True)
            states[layer_idx] = conv_states, state
        self._cut(start, target)
        return start, states

    def _cut(self, kept: int, target: int) -> None:
        """Keep the snapshots up to `kept` and the token ids up to `target` (pending from `kept` on)."""
        self._record, self._planned = None, None
        self.snapshots = {p: states for p, states in self.snapshots.items() if p <= kept}
        if self._token_ids is not None:
            self._token_ids = self._token_ids[:, :target]
        if self._token_valid is not None:
            self._token_valid = self._token_valid[:, :target]
        self._pending_start = kept if kept < target else None

    @property
    def pending_tokens(self) -> int:
        """Tokens the cache stands for but has not computed yet (left by rewinding to a snapshot)."""
        return 0 if self._pending_start is None else self._token_ids.shape[1] - self._pending_start

    @contextlib.contextmanager
    def replay(self):
        """While the model runs the pending tokens: yields their ids and the attention mask of the stored and pending
        tokens (None without padding). Nothing of it is recorded for a rewind, and its own token ids come back
        through `keep_tokens`."""
        start = self._pending_start
        input_ids = self._token_ids[:, start:]
        attention_mask = None if self._token_valid is None else self._token_valid.long()
        self._token_ids = self._token_ids[:, :start]
        self._token_valid = None if self._token_valid is None else self._token_valid[:, :start]
        self._pending_start, self._replaying = None, True
        self.replayed_tokens += input_ids.shape[1]
        try:
            yield input_ids, attention_mask
        finally:
            self._replaying = False

    # ------------------------------------------------------------------------------------------------------------
    # Following the cache
    def copy(self) -> "KimiK3Rewind":
        """For a new cache sharing this one's tensors: its own snapshot table, no rewind record, not recording."""
        copy = KimiK3Rewind.__new__(KimiK3Rewind)
        copy.__dict__.update(self.__dict__)
        copy.snapshots = dict(self.snapshots)
        copy._record, copy.record_past, copy.replayed_tokens = None, False, 0
        return copy

    def map_batch(self, fn) -> None:
        """The cache's rows were reordered, repeated or selected: so are the snapshots and the token ids (pending
        ones included); the rewind record is dropped."""
        self.snapshots = {position: {layer: (tuple(fn(c) for c in conv), fn(state))
                                     for layer, (conv, state) in states.items()}
                          for position, states in self.snapshots.items()}
        self._token_ids = None if self._token_ids is None else fn(self._token_ids)
        self._token_valid = None if self._token_valid is None else fn(self._token_valid)
        self._record = None
        self._planned = None  # bytes per snapshot changed with the rows: the next forward plans again
        self._bound_snapshots()

    def reset(self) -> None:
        self.snapshots = {}
        self.dense_blocks, self._planned, self.replayed_tokens = None, None, 0
        self._record = None
        self._token_ids, self._token_valid, self._replayable = None, None, True
        self._pending_start = None

    # ------------------------------------------------------------------------------------------------------------
    # Snapshot budget and byte reports
    def _bound_snapshots(self) -> None:
        """Never above `max_snapshot_bytes`, even where the plan could not see it coming (rows repeated by a batch
        reorder, conv windows wider than counted): the oldest snapshots go first."""
        if self.max_snapshot_bytes is None:
            return
        while self.snapshots and self.snapshot_bytes_held() > self.max_snapshot_bytes:
            del self.snapshots[min(self.snapshots)]

    def snapshot_bytes_held(self) -> int:
        return sum(t.nbytes for states in self.snapshots.values() for conv, state in states.values()
                   for t in (*conv, state))

    def record_bytes(self) -> dict[str, int]:
        """Bytes the rewind records hold: `per_token` (recorded inputs per recorded token, all KDA layers),
        `tokens` recorded, and `base_states` (the start states, shared with what the live cache held then)."""
        if not self._record:
            return {"per_token": 0, "tokens": 0, "base_states": 0}
        base = sum(t.nbytes for r in self._record.values() if r.base_state is not None
                   for t in (*r.base_conv_states, r.base_state))
        return {"per_token": sum(r.nbytes_per_token() for r in self._record.values()),
                "tokens": next(iter(self._record.values())).num_tokens, "base_states": base}


def _window_at(base: torch.Tensor, inputs: torch.Tensor, keep: torch.Tensor, size: int) -> torch.Tensor:
    """The conv window [B, C, size] ending at token `keep` of a round: columns keep .. keep + size - 1 of
    [base window (size columns), the round's pre-conv inputs [B, width, C] transposed], `keep` in 1..width (the
    round's kept count, a min over its proposals). Each column is read from the side it lies in, through an index
    clamped into that side for the side it is not read from, so no gather reads outside its tensor (the form that
    passed the compiled round's GPU test, docs/benchmarks.md, GPU tests)."""
    column = keep.to(base.device) + torch.arange(size, device=base.device)
    from_base = base.index_select(-1, column.clamp(max=size - 1))
    from_inputs = inputs.index_select(1, (column - size).clamp(0, inputs.shape[1] - 1)).transpose(1, 2)
    return torch.where(column < size, from_base, from_inputs.to(base.dtype))


class KimiK3StaticRewind:
    """The static cache's rewind inside one speculative round (docs/design.md, Rewinding): fixed-address
    buffers, written and read with device-side indices only, so that a round (draft steps, the verify, the
    acceptance and this rewind) has fixed shapes and can be captured as one CUDA graph.

    `begin_round` copies every KDA layer's state and conv windows (the round's base) and restarts the record; each
    recorded forward writes its tokens' pre-conv q/k/v and recurrence inputs q, k, v, g, beta at the record's
    device-side slot (`record`, then `advance`); `states_at(keep)` rebuilds the state after the first `keep` recorded
    tokens ([1] long, on the device) by replaying the recurrence over all `width` slots from the base with g = 0
    and beta = 0 from token `keep` on (the identity update: exactly the state after `keep` tokens, with the shapes
    of every round), and gathers the conv windows ending at token `keep` from [base window, pre-conv inputs].

    `live`: per KDA layer the cache's (conv windows, f32 state) buffers, which give the record's shapes and dtypes;
    `heads_dims`: (H, Dk, Dv)."""

    def __init__(self, width: int, live: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]], mark_static):
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"KimiK3StaticCache: a speculative round of {width!r} tokens (a whole number >= 1)")
        self.width = width
        self.slot = mark_static(torch.zeros(1, dtype=torch.long, device=next(iter(live.values()))[1].device))
        self.base: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self.records: dict[int, tuple[torch.Tensor, ...]] = {}
        for layer_idx, (windows, state) in live.items():
            batch, heads, k_dim, v_dim = state.shape
            self.base[layer_idx] = (tuple(mark_static(w.clone()) for w in windows), mark_static(state.clone()))
            act = windows[0].dtype
            shapes = [(w.shape[1], act) for w in windows]  # pre-conv q, k, v [B, W, C]
            shapes += [((heads, k_dim), act), ((heads, k_dim), act), ((heads, v_dim), act),
                       ((heads, k_dim), torch.float32), ((heads,), torch.float32)]  # q, k, v, g, beta
            self.records[layer_idx] = tuple(
                mark_static(state.new_zeros(batch, width, *((shape,) if isinstance(shape, int) else shape),
                                            dtype=dtype))
                for shape, dtype in shapes)

    def begin_round(self, live) -> None:
        """The live states and windows become the round's base; the record restarts at slot 0."""
        self.slot.zero_()
        for layer_idx, (windows, state) in live.items():
            base_windows, base_state = self.base[layer_idx]
            base_state.copy_(state)
            for buffer, window in zip(base_windows, windows):
                buffer.copy_(window)

    def record(self, layer_idx: int, pre_conv: tuple[torch.Tensor, ...], recurrence_inputs: tuple[torch.Tensor, ...]):
        """This forward's tokens (dim 1 of every tensor) at the record's slots slot .. slot + T - 1."""
        tokens = pre_conv[0].shape[1]
        slots = self.slot + torch.arange(tokens, device=self.slot.device)
        for buffer, value in zip(self.records[layer_idx], (*pre_conv, *recurrence_inputs)):
            buffer.index_copy_(1, slots.to(buffer.device), value.to(buffer.dtype))

    def advance(self, num_tokens: int) -> None:
        self.slot.add_(num_tokens)

    def states_at(self, keep: torch.Tensor, conv_kernel_size: int, chunk_size: int):
        """{KDA layer: (conv windows, f32 state)} after the first `keep` recorded tokens of the round."""
        out = {}
        index = torch.arange(self.width, device=keep.device)
        for layer_idx, record in self.records.items():
            (base_windows, base_state), (*pre_conv, q, k, v, g, beta) = self.base[layer_idx], record
            kept = (index < keep.to(index.device)).to(g.device)
            g = g.masked_fill(~kept[None, :, None, None], 0.0)
            beta = beta.masked_fill(~kept[None, :, None], 0.0)
            _, state = kda_recurrence(q, k, v, g, beta, base_state, True, chunk_size, decode_step=True)
            windows = tuple(_window_at(base, x, keep, conv_kernel_size - 1) for base, x in zip(base_windows, pre_conv))
            out[layer_idx] = (windows, state)
        return out

    def map_batch(self, fn) -> None:
        """The cache's rows were reordered, repeated or selected: so are the round's base and record."""
        self.base = {layer_idx: (tuple(fn(w) for w in windows), fn(state))
                     for layer_idx, (windows, state) in self.base.items()}
        self.records = {layer_idx: tuple(fn(t) for t in record) for layer_idx, record in self.records.items()}

    def nbytes(self) -> int:
        return sum(t.nbytes for record in self.records.values() for t in record) + sum(
            t.nbytes for windows, state in self.base.values() for t in (*windows, state))


__all__ = [
    "DEFAULT_SNAPSHOT_INTERVAL",
    "KDA_BLOCK_SIZE",
    "KimiK3Rewind",
    "KimiK3StaticRewind",
    "kept_snapshot_blocks",
    "rewind_record_bytes_per_token",
]
