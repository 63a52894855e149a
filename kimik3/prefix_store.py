"""The block-hash prefix store and prompt-cache helpers (they live in the remote-code module
`serving_kimi_k3.py`, so a model folder loaded with trust_remote_code has them too)."""

from kimik3.modeling.serving_kimi_k3 import KimiK3PrefixStore, block_hashes, build_prompt_cache

__all__ = ["KimiK3PrefixStore", "block_hashes", "build_prompt_cache"]
