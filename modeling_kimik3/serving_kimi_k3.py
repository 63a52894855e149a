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

Prefix reuse (docs/design.md, Rewinding: crop, prefix reuse, speculative decoding): a prompt is cut into 512-token
blocks; each block's hash is chained with its predecessor's, so one hash names a whole prefix. A stored prompt cache can
be reused up to the longest prefix the new prompt shares with it; the KDA states there come from the cache's snapshots
(written by its prefill at block ends, kept sparse under its byte budget) or from a replay of the tokens after the
nearest one below, the MLA latents are cut there. Among the stored prompts the lookup takes the one whose state is
restored nearest the end of the shared prefix (the fewest tokens to compute).
"""

import hashlib
from collections import OrderedDict

import torch

from .cache_kimi_k3 import KimiK3Cache, layer_tensors
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
    `cache.copy_prefix(n)`. For prefix-store hits at every block: `snapshot_interval=KDA_BLOCK_SIZE` with a
    `max_snapshot_bytes` budget (KimiK3Cache)."""
    text_config = model.config.get_text_config()
    cache = KimiK3Cache(text_config, snapshot_interval=snapshot_interval, snapshot_device=snapshot_device,
                        max_snapshot_bytes=max_snapshot_bytes)
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    return cache


class KimiK3PrefixStore:
    """Prompt caches keyed by chained block hashes of their token ids (batch-1 prompts).

    `insert(ids, cache)` stores a cache that holds exactly `ids`; `lookup(ids)` returns `(num_tokens, cache)`: a
    prefix of `ids` that a stored cache gives back (a whole stored prompt, or a block boundary inside one), as a new
    cache the caller may extend, or `(0, None)`. Of all stored prompts and their shared block boundaries it takes
    the one whose KDA state is restored nearest the end (a snapshot, the stored prompt's live state, or a replay from
    the nearest snapshot below: the fewest tokens to compute), then the longest; a cache filled from inputs_embeds
    (no ids to replay) serves only where a state is held. At most `len(ids) - 1` tokens are reused, so a forward
    always has a token to process. The returned cache's `rewind.pending_tokens` are those its first forward
    replays (`stats()["tokens_replayed"]` sums them). `max_bytes` bounds what the stored caches hold (least
    recently used out; the newest entry always stays).
    """

    def __init__(self, block_size: int = KDA_BLOCK_SIZE, max_bytes: int | None = None):
        if block_size <= 0:
            raise ValueError(f"KimiK3PrefixStore: block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[torch.Tensor, KimiK3Cache]] = OrderedDict()
        self._by_block: dict[bytes, set[bytes]] = {}  # chained block hash -> keys of the entries holding it
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        self.tokens_replayed = 0

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
        interval = cache.rewind.snapshot_interval
        if interval is not None and interval % self.block_size and self.block_size % interval:
            # Snapshots off the block grid are never a hit's exact state: every hit would replay from below
            raise ValueError(
                f"KimiK3PrefixStore.insert: the cache keeps KDA snapshots every {interval} tokens, which neither "
                f"divides nor is a multiple of the store's {self.block_size}-token blocks; build it with "
                f"snapshot_interval={self.block_size}"
            )
        key = hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest()
        self._entries[key] = (ids, cache)
        self._entries.move_to_end(key)
        for block_hash in block_hashes(ids, self.block_size):
            self._by_block.setdefault(block_hash, set()).add(key)
        self._evict()

    def lookup(self, token_ids, with_source: bool = False):
        """`(num_tokens, cache)` as the class says; with `with_source`, `(num_tokens, cache, stored)` where `stored` is
        the stored cache the hit copied from (None on a miss): the latents of `cache`'s tokens before its pending
        ones are `stored`'s, the same values (a server shares the pages of the row that holds them)."""
        ids = self._ids(token_ids)
        shared: dict[bytes, int] = {}  # entry -> the longest prefix of ids it can stand for
        # Whole stored prompts that the new one starts with (any length, not only block multiples)
        for key, (stored, _) in self._entries.items():
            if stored.numel() < ids.numel() and torch.equal(ids[: stored.numel()], stored):
                shared[key] = stored.numel()
        # Block boundaries inside stored prompts (an entry holding block i holds every block before it)
        for index, block_hash in enumerate(block_hashes(ids, self.block_size)):
            keys = self._by_block.get(block_hash)
            end = (index + 1) * self.block_size
            if not keys or end >= ids.numel():
                break
            for key in keys:
                if end > shared.get(key, 0) and torch.equal(ids[:end], self._entries[key][0][:end]):
                    shared[key] = end
        best, best_key = (-1, 0), None  # (restored at, tokens): the fewest to compute, then the longest
        for key, tokens in shared.items():
            restored = _restored_at(self._entries[key][1], tokens)
            if restored is not None and (restored, tokens) > best:
                best, best_key = (restored, tokens), key
        if best_key is None:
            self.misses += 1
            return (0, None, None) if with_source else (0, None)
        restored, tokens = best
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += tokens
        stored = self._entries[best_key][1]
        cache = stored.copy_prefix(tokens)
        self.tokens_replayed += cache.pending_tokens
        return (tokens, cache, stored) if with_source else (tokens, cache)

    def bytes_held(self) -> int:
        """MLA latents, live KDA states and snapshots of the stored caches (shared tensors counted once)."""
        seen, total = set(), 0
        for _, cache in self._entries.values():
            tensors = [t for layer in cache.layers for t in layer_tensors(layer)]
            tensors += [t for states in cache.rewind.snapshots.values() for conv, state in states.values()
                        for t in (*conv, state)]
            for tensor in tensors:
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
        return total

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                "tokens_reused": self.tokens_reused, "tokens_replayed": self.tokens_replayed,
                "bytes_held": self.bytes_held()}

    def _evict(self) -> None:
        while self.max_bytes is not None and len(self._entries) > 1 and self.bytes_held() > self.max_bytes:
            key, _ = self._entries.popitem(last=False)
            for block_hash in list(self._by_block):
                self._by_block[block_hash].discard(key)
                if not self._by_block[block_hash]:
                    del self._by_block[block_hash]


def _restored_at(cache: KimiK3Cache, tokens: int) -> int | None:
    """Where `cache.copy_prefix(tokens)` restores the KDA states from (the rest is replayed by its first forward),
    or None where it cannot (no token ids to replay)."""
    if tokens == cache.get_seq_length():
        return tokens - cache.pending_tokens  # the live state
    restored = cache.rewind.restore_position(tokens)
    return restored if restored == tokens or cache.rewind.replayable else None


__all__ = ["KimiK3PrefixStore", "block_hashes", "build_prompt_cache"]
