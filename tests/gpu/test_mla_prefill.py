"""Blockwise MLA prefill on CUDA: the flash-attention `attention_with_lse` against the reference, and the model's
chunked prefill (fast paths on) against its one-shot prefill."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from gpu_helpers import load_fast, load_ops, reference_only, rel_err  # noqa: E402

ops = load_ops()


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_with_lse_matches_reference(causal):
    q = torch.randn(1, 96, 512, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 96, 512, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 96, 512, 128, device="cuda", dtype=torch.bfloat16)
    fast = load_fast("attention_with_lse")
    out, lse = fast(q, k, v, 192**-0.5, causal)
    ref_out, ref_lse = ops.attention_with_lse(q, k, v, 192**-0.5, causal)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) < 1e-2
    assert (lse - ref_lse).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_chunked_prefill_matches_one_shot_on_cuda(dtype):
    """Prefill in two chunks through the cache (fla KDA/conv continuing their states, blockwise MLA over the cached
    latents) against one-shot prefill, both with every fast path on; both are measured against the f32 model run
    on the reference ops, and the chunked error may not exceed the one-shot error by more than bf16/TF32 noise."""
    import copy

    from kimik3.tiny import build_tiny_model

    gold_model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).cuda()
    gold_model.config.mla_prefill_block_size = 64
    model = copy.deepcopy(gold_model).to(dtype)
    ids = torch.randint(3, 128, (1, 300), device="cuda")
    with torch.no_grad():
        with reference_only():
            gold = gold_model(ids, use_cache=False).logits.float()
        full = model(ids, use_cache=False).logits.float()
        out = model(ids[:, :100], use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        rest = model(ids[:, 100:], cache=cache).logits
    chunked = torch.cat([out.logits, rest], 1).float()
    one_shot_err, chunked_err = rel_err(full, gold), rel_err(chunked, gold)
    assert chunked_err < 1.5 * one_shot_err + (2e-3 if dtype == torch.float32 else 1e-2), (one_shot_err, chunked_err)
