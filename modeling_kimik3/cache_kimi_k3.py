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

Per MLA layer it holds `kv_lora_rank + qk_rope_head_dim` values per token (the normalised latent followed by the
shared, unrotated k_pe), never expanded K/V. Per KDA layer it holds the last `K - 1` pre-conv inputs of q, k and v
and the [H, Dk, Dv] f32 state. The class is a `transformers.Cache` so `generate()` (5.17 to the newest 5.x) treats
it as a cache, but it keeps its own per-layer storage instead of the library's layer classes, whose API moved
between those versions.
"""

import torch
from transformers.cache_utils import Cache


def _static_address(tensor: torch.Tensor) -> torch.Tensor:
    # CUDA graphs replay on fixed addresses; tell dynamo these buffers keep theirs
    try:
        torch._dynamo.mark_static_address(tensor)
    except Exception:  # noqa: BLE001 - older torch or no dynamo: only a missed optimisation
        pass
    return tensor


class KimiK3Cache(Cache):
    """Hybrid cache for Kimi K3. `generate()` creates it; it can also be built by hand: `KimiK3Cache(config)`.

    With `max_cache_len` it is static: MLA latents live in a preallocated [B, max_cache_len, R + P] buffer written in
    place, KDA states and conv windows are updated in place, the write position is a device tensor and key validity
    a [B, max_cache_len] mask. A one-token decode step then has fixed shapes and addresses and never reads a Python
    counter, so `generate(..., cache_implementation="static")` can compile it (`torch.compile`, CUDA graphs).
    """

    def __init__(self, config, max_cache_len: int | None = None, **kwargs):
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        super().__init__(layers=[])
        self.config = text_config
        self.layer_types = list(text_config.layer_types)
        num_layers = len(self.layer_types)
        self.latents: list[torch.Tensor | None] = [None] * num_layers
        self.conv_states: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers
        self._seen_tokens = 0
        self.has_past = False
        self._max_cache_len = max_cache_len
        self.is_static = max_cache_len is not None
        self.position: torch.Tensor | None = None  # static: number of cached tokens, on the device
        self.key_valid: torch.Tensor | None = None  # static: [B, max_cache_len], True where a real token is cached

    @property
    def is_compileable(self) -> bool:
        return self.is_static

    @property
    def max_cache_len(self) -> int | None:
        return self._max_cache_len

    # ------------------------------------------------------------------------------------------------------------
    # Static bookkeeping
    def begin_static_step(self, batch_size: int, num_tokens: int, token_mask: torch.Tensor | None,
                          device: torch.device) -> None:
        """Before the layers run: mark the new positions valid (padding stays invalid). Eager for a prefill (any
        length, checked against `max_cache_len`), shape-static for one decode token."""
        if self.position is None:
            self.position = _static_address(torch.zeros(1, dtype=torch.long, device=device))
            self.key_valid = _static_address(torch.zeros(batch_size, self.max_cache_len, dtype=torch.bool,
                                                         device=device))
        if num_tokens == 1 and self.has_past:
            self.key_valid.index_fill_(1, self.position, True)
            return
        start = int(self.position.item())
        if start + num_tokens > self.max_cache_len:
            raise ValueError(
                f"KimiK3Cache: {start} cached + {num_tokens} new tokens exceed max_cache_len={self.max_cache_len}"
            )
        valid = torch.ones(batch_size, num_tokens, dtype=torch.bool, device=device) if token_mask is None else token_mask
        self.key_valid[:, start : start + num_tokens] = valid

    def __len__(self) -> int:
        return len(self.layer_types)

    def __repr__(self) -> str:
        return f"KimiK3Cache(layers={len(self)}, seen_tokens={self.get_seq_length()}, bytes={self.live_bytes()})"

    # ------------------------------------------------------------------------------------------------------------
    # Writers used by the model
    def update_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Append [B, T, kv_lora_rank + rope] latents of an MLA layer; returns the cached latents of that layer
        (static decode: the whole buffer, valid where `key_valid` says so)."""
        if not self.is_static:
            past = self.latents[layer_idx]
            full = latents if past is None else torch.cat([past, latents], dim=1)
            self.latents[layer_idx] = full
            return full
        buffer = self.latents[layer_idx]
        if buffer is None:
            buffer = latents.new_zeros(latents.shape[0], self.max_cache_len, latents.shape[-1])
            self.latents[layer_idx] = buffer = _static_address(buffer)
        if latents.shape[1] == 1 and self.has_past:
            buffer.index_copy_(1, self.position, latents)
            return buffer
        start = int(self.position.item())
        buffer[:, start : start + latents.shape[1]] = latents
        return buffer[:, : start + latents.shape[1]]

    def update_kda_state(self, layer_idx: int, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor):
        if self.is_static and self.recurrent_states[layer_idx] is not None:
            self.recurrent_states[layer_idx].copy_(recurrent_state)
            for buffer, state in zip(self.conv_states[layer_idx], conv_states):
                buffer.copy_(state)
            return
        if self.is_static:
            conv_states = tuple(_static_address(s.clone()) for s in conv_states)
            recurrent_state = _static_address(recurrent_state.float().clone())
        self.conv_states[layer_idx] = conv_states
        self.recurrent_states[layer_idx] = recurrent_state.float()

    def advance(self, num_tokens: int) -> None:
        """Called once per forward by the model, after every layer wrote its state."""
        if self.is_static:
            self.position.add_(num_tokens)
        else:
            self._seen_tokens += num_tokens
        self.has_past = True

    # ------------------------------------------------------------------------------------------------------------
    # transformers Cache API
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        if self.is_static:
            return 0 if self.position is None else int(self.position.item())
        return self._seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if self.is_static:
            return self.max_cache_len, 0
        return self._seen_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.get_max_length()

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.has_past

    @property
    def is_initialized(self) -> bool:
        return self.has_past

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_linear(self) -> list[bool]:
        return [t == "linear_attention" for t in self.layer_types]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_croppable(self) -> bool:
        return all(t != "linear_attention" for t in self.layer_types)

    @property
    def batch_size(self) -> int:
        for tensor in self._tensors():
            return tensor.shape[0]
        return 0

    def _tensors(self):
        if self.key_valid is not None:
            yield self.key_valid
        for layer in range(len(self)):
            if self.latents[layer] is not None:
                yield self.latents[layer]
            if self.conv_states[layer] is not None:
                yield from self.conv_states[layer]
            if self.recurrent_states[layer] is not None:
                yield self.recurrent_states[layer]

    def _map_batch(self, fn) -> None:
        if self.key_valid is not None:
            self.key_valid = fn(self.key_valid)
        for layer in range(len(self)):
            if self.latents[layer] is not None:
                self.latents[layer] = fn(self.latents[layer])
            if self.conv_states[layer] is not None:
                self.conv_states[layer] = tuple(fn(s) for s in self.conv_states[layer])
            if self.recurrent_states[layer] is not None:
                self.recurrent_states[layer] = fn(self.recurrent_states[layer])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device)])

    def crop(self, max_length: int) -> None:
        """Drop cached tokens so that `max_length` remain (negative: remove that many), MLA layers only.

        A KDA state cannot be rolled back (it folds every token in), so cropping a cache with KDA layers raises.
        """
        if self.is_static:
            raise NotImplementedError("KimiK3Cache.crop: not supported for a static cache")
        kda = [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]
        if kda and self._seen_tokens > 0:
            raise NotImplementedError(
                f"KimiK3Cache.crop: KDA layers {kda[:4]}{'...' if len(kda) > 4 else ''} hold a recurrent state that "
                "cannot be rolled back to an earlier token; re-run the prefix instead (no state snapshots yet)."
            )
        if max_length < 0:
            max_length = self._seen_tokens + max_length
        if max_length >= self._seen_tokens:
            return
        for layer, latents in enumerate(self.latents):
            if latents is not None:
                self.latents[layer] = latents[:, :max_length]
        self._seen_tokens = max(max_length, 0)

    def reset(self) -> None:
        num_layers = len(self)
        self.latents = [None] * num_layers
        self.conv_states = [None] * num_layers
        self.recurrent_states = [None] * num_layers
        self._seen_tokens = 0
        self.has_past = False
        self.position = None
        self.key_valid = None

    # ------------------------------------------------------------------------------------------------------------
    # Memory report
    def live_bytes(self) -> dict[str, int]:
        """Bytes actually held, by kind: MLA latent KV, KDA recurrent state, KDA conv windows."""
        report = {"mla_kv": 0, "kda_state": 0, "kda_conv": 0}
        for layer in range(len(self)):
            if self.latents[layer] is not None:
                report["mla_kv"] += self.latents[layer].numel() * self.latents[layer].element_size()
            if self.conv_states[layer] is not None:
                report["kda_conv"] += sum(s.numel() * s.element_size() for s in self.conv_states[layer])
            if self.recurrent_states[layer] is not None:
                state = self.recurrent_states[layer]
                report["kda_state"] += state.numel() * state.element_size()
        report["total"] = sum(report.values())
        return report


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


__all__ = ["KimiK3Cache", "analytic_cache_bytes"]
