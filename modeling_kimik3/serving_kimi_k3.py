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
"""Serving helpers around `generate()`: prompt caches with KDA state snapshots and a block-hash prefix store (the
draft model for speculative decoding, sliced from the target, is the package's `kimik3.draft`).

Prefix reuse (docs/design.md, Going back: crop, prefix reuse, speculative decoding): a prompt is cut into 512-token
blocks; each block's hash is chained with its predecessor's, so one hash names a whole prefix. A stored prompt cache can
be reused up to the longest prefix the new prompt shares with it; the KDA states there come from the cache's snapshots
(or a replay from the nearest one below), the MLA latents are cut there.
"""

import hashlib
from collections import OrderedDict

import torch

from .cache_kimi_k3 import KimiK3Cache
from .rewind_kimi_k3 import DEFAULT_SNAPSHOT_INTERVAL, KDA_BLOCK_SIZE


def block_hashes(token_ids, block_size: int = KDA_BLOCK_SIZE) -> list[bytes]:
    """Chained hashes of the full `block_size`-token blocks of a 1-D token sequence: hash i covers tokens
    [0, (i + 1) * block_size), so equal hashes mean equal prefixes (up to a 128-bit collision)."""
    ids = torch.as_tensor(token_ids).reshape(-1).to("cpu", torch.int64)
    hashes, previous = [], b""
    for start in range(0, ids.numel() - block_size + 1, block_size):
        digest = hashlib.blake2b(previous + ids[start : start + block_size].numpy().tobytes(), digest_size=16)
        previous = digest.digest()
        hashes.append(previous)
    return hashes


@torch.no_grad()
def build_prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       snapshot_interval: int | None = DEFAULT_SNAPSHOT_INTERVAL,
                       snapshot_device: str | torch.device | None = None,
                       max_snapshot_bytes: int | None = None) -> KimiK3Cache:
    """Prefill `input_ids` once into a cache with KDA state snapshots, for reuse by many continuations:
    `generate(prefix + suffix, cache=copy.deepcopy(cache))` (`past_key_values=` before transformers 5.24), or
    `cache.copy_prefix(n)`."""
    text_config = model.config.get_text_config()
    cache = KimiK3Cache(text_config, snapshot_interval=snapshot_interval, snapshot_device=snapshot_device,
                        max_snapshot_bytes=max_snapshot_bytes)
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    return cache


class KimiK3PrefixStore:
    """Prompt caches keyed by chained block hashes of their token ids (batch-1 prompts).

    `insert(ids, cache)` stores a cache that holds exactly `ids`; `lookup(ids)` returns `(num_tokens, cache)`: the
    longest prefix of `ids` that a stored cache can give back (a whole stored prompt, or a block boundary inside
    one), as a new cache the caller may extend, or `(0, None)`. At most `len(ids) - 1` tokens are reused, so a
    forward always has a token to process. `max_bytes` bounds what the stored caches hold (least recently used out).
    """

    def __init__(self, block_size: int = KDA_BLOCK_SIZE, max_bytes: int | None = None):
        if block_size <= 0:
            raise ValueError(f"KimiK3PrefixStore: block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, KimiK3Cache]] = OrderedDict()
        self._by_block: dict[bytes, bytes] = {}  # chained block hash -> key of the newest entry holding it
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0

    @staticmethod
    def _ids(token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids).to("cpu", torch.int64)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"KimiK3PrefixStore: one prompt at a time (1-D or [1, T] token ids), got {tuple(ids.shape)}")
        return ids

    def insert(self, token_ids, cache: KimiK3Cache) -> None:
        ids = self._ids(token_ids)
        if not isinstance(cache, KimiK3Cache) or cache.is_static:
            raise TypeError("KimiK3PrefixStore.insert: needs a growing KimiK3Cache")
        if cache.get_seq_length() != ids.numel() or cache.batch_size != 1:
            raise ValueError(
                f"KimiK3PrefixStore.insert: the cache holds {cache.get_seq_length()} tokens of {cache.batch_size} "
                f"sequence(s) but {ids.numel()} token ids of one prompt were given"
            )
        key = hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest()
        self._entries[key] = (ids, cache)
        self._entries.move_to_end(key)
        for block_hash in block_hashes(ids, self.block_size):
            self._by_block[block_hash] = key
        self._evict()

    def lookup(self, token_ids) -> tuple[int, KimiK3Cache | None]:
        ids = self._ids(token_ids)
        best_tokens, best_key = 0, None
        # Whole stored prompts that the new one starts with (any length, not only block multiples)
        for key, (stored, _) in self._entries.items():
            if best_tokens < stored.numel() < ids.numel() and torch.equal(ids[: stored.numel()], stored):
                best_tokens, best_key = stored.numel(), key
        # Block boundaries inside stored prompts
        for index, block_hash in enumerate(block_hashes(ids, self.block_size)):
            key = self._by_block.get(block_hash)
            if key is None:
                break
            end = (index + 1) * self.block_size
            stored = self._entries[key][0]
            if end > best_tokens and end < ids.numel() and torch.equal(ids[:end], stored[:end]):
                best_tokens, best_key = end, key
        if best_key is None:
            self.misses += 1
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best_tokens
        return best_tokens, self._entries[best_key][1].copy_prefix(best_tokens)

    def bytes_held(self) -> int:
        """MLA latents, live KDA states and snapshots of the stored caches (shared tensors counted once)."""
        seen, total = set(), 0
        for _, cache in self._entries.values():
            tensors = [t for layer in cache.layers for t in _layer_tensors(layer)]
            tensors += [t for states in cache.rewind.snapshots.values() for conv, state in states.values()
                        for t in (*conv, state)]
            for tensor in tensors:
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
        return total

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                "tokens_reused": self.tokens_reused, "bytes_held": self.bytes_held()}

    def _evict(self) -> None:
        while self.max_bytes is not None and len(self._entries) > 1 and self.bytes_held() > self.max_bytes:
            key, _ = self._entries.popitem(last=False)
            self._by_block = {h: k for h, k in self._by_block.items() if k != key}


def _layer_tensors(layer) -> list[torch.Tensor]:
    if layer.is_linear:
        return [] if layer.recurrent_state is None else [*layer.conv_states, layer.recurrent_state]
    return [] if layer.latents is None else [layer.latents]


__all__ = ["KimiK3PrefixStore", "block_hashes", "build_prompt_cache"]
