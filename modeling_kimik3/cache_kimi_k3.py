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


class KimiK3Cache(Cache):
    """Hybrid cache for Kimi K3. `generate()` creates it; it can also be built by hand: `KimiK3Cache(config)`."""

    is_compileable = False

    def __init__(self, config, **kwargs):
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        super().__init__(layers=[])
        self.config = text_config
        self.layer_types = list(text_config.layer_types)
        num_layers = len(self.layer_types)
        self.latents: list[torch.Tensor | None] = [None] * num_layers
        self.conv_states: list[tuple[torch.Tensor, ...] | None] = [None] * num_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers
        self._seen_tokens = 0

    def __len__(self) -> int:
        return len(self.layer_types)

    def __repr__(self) -> str:
        return f"KimiK3Cache(layers={len(self)}, seen_tokens={self._seen_tokens}, bytes={self.live_bytes()})"

    # ------------------------------------------------------------------------------------------------------------
    # Writers used by the model
    def update_latents(self, latents: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Append [B, T, kv_lora_rank + rope] latents of an MLA layer; returns all cached latents of that layer."""
        past = self.latents[layer_idx]
        full = latents if past is None else torch.cat([past, latents], dim=1)
        self.latents[layer_idx] = full
        return full

    def update_kda_state(self, layer_idx: int, conv_states: tuple[torch.Tensor, ...], recurrent_state: torch.Tensor):
        self.conv_states[layer_idx] = conv_states
        self.recurrent_states[layer_idx] = recurrent_state.float()

    def advance(self, num_tokens: int) -> None:
        """Called once per forward by the model, after every layer wrote its state."""
        self._seen_tokens += num_tokens

    # ------------------------------------------------------------------------------------------------------------
    # transformers Cache API
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self._seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seen_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._seen_tokens > 0

    @property
    def is_initialized(self) -> bool:
        return self._seen_tokens > 0

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
        for layer in range(len(self)):
            if self.latents[layer] is not None:
                yield self.latents[layer]
            if self.conv_states[layer] is not None:
                yield from self.conv_states[layer]
            if self.recurrent_states[layer] is not None:
                yield self.recurrent_states[layer]

    def _map_batch(self, fn) -> None:
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
