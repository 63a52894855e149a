"""MLA prefill on CUDA: the fused `attention_with_lse` (cuDNN, and flash where cuDNN refuses) against the
reference, cuDNN on the prefill's strided keys, the first chunk's SDPA backend, and the model's chunked prefill (fast
paths on) against its one-shot prefill."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from gpu_helpers import load_fast, load_ops, reference_only, rel_err  # noqa: E402

ops = load_ops()


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("causal,q_len,k_len", [(False, 512, 512), (True, 512, 512), (True, 300, 300),
                                                (False, 77, 1000), (False, 1, 129)])
def test_attention_with_lse_matches_reference(causal, q_len, k_len, backend, monkeypatch):
    """Both backends of the fast twin, on the model's layouts (the query a transposed view of [B, T, H, D] storage,
    the value a slice of the expanded key/value projection) and at lengths that are no multiple of a tile (a chunk
    of any length continues a cache of any length)."""
    from kimik3.kernels import mla

    if backend == "flash":  # as if cuDNN had refused
        monkeypatch.setattr(mla, "_CUDNN_REFUSED", {(torch.device("cuda", torch.cuda.current_device()),
                                                             torch.bfloat16, 192, 128)})
    q = torch.randn(1, q_len, 96, 192, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 96, k_len, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, k_len, 96, 256, device="cuda", dtype=torch.bfloat16).transpose(1, 2)[..., 128:]
    assert mla.attention_backend(q, v) == backend
    calls = []
    original = getattr(mla, f"_{backend}")
    monkeypatch.setattr(mla, f"_{backend}", lambda *a: calls.append(1) or original(*a))
    fast = load_fast("attention_with_lse")
    out, lse = fast(q, k, v, 192**-0.5, causal)
    ref_out, ref_lse = ops.attention_with_lse(q, k, v, 192**-0.5, causal)
    assert calls, f"the {backend} op did not run"
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == lse.dtype == torch.float32
    assert rel_err(out, ref_out) < 1e-2
    assert (lse - ref_lse).abs().max() < 2e-2


def test_cudnn_attention_reads_the_strided_prefill_keys():
    """The expanded prefill's keys are [B, H, T, D] views of token-major storage (a head stride of D, a token stride of
    H*D): cuDNN's fused attention gives the same bits on them as on contiguous copies, and both match f32 attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kimik3.tiny import build_tiny_model

    model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).cuda().bfloat16()
    mla = next(layer.self_attn for layer in model.model.layers if not layer.is_linear)
    latents = torch.randn(2, 1000, mla.kv_lora_rank + mla.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(2, 1000, mla.num_heads, mla.qk_head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    with torch.no_grad():
        key, value = mla._expand_latents(latents)
        assert key.stride()[1:] == (mla.qk_head_dim, mla.num_heads * mla.qk_head_dim, 1)
        attend = torch.nn.functional.scaled_dot_product_attention
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            strided = attend(query, key, value, is_causal=True, scale=mla.scaling)
            contiguous = attend(query.contiguous(), key.contiguous(), value.contiguous(), is_causal=True,
                                scale=mla.scaling)
        exact = attend(query.float(), key.float(), value.float(), is_causal=True, scale=mla.scaling)
    assert torch.equal(strided, contiguous)
    assert rel_err(strided, exact) < 1e-2


def test_expanded_prefill_attention_prefers_cudnn(monkeypatch):
    """The first prefill chunk (no cache) goes through the attention interface; on CUDA without autograd the model
    asks SDPA for cuDNN first (MLA's unequal head dims rule out flash, and PyTorch's default order may take the
    memory-efficient kernel, 4x slower on an H200). Checked on the profiler's op names. Its bf16 logits are measured
    against the f32 reference-op model, as are those of the same bf16 model with the order switched off (SDPA's own
    choice): cuDNN may not add more than bf16 noise."""
    from torch.profiler import ProfilerActivity, profile

    from kimik3.modeling import dispatch_kimi_k3
    from kimik3.tiny import build_tiny_model

    model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).cuda()
    ids = torch.randint(3, 128, (1, 256), device="cuda")
    with torch.no_grad():
        with reference_only():
            gold = model.float()(ids, use_cache=False).logits.float()
        model = model.bfloat16()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logits = model(ids, use_cache=False).logits.float()
        names = {e.key for e in prof.key_averages()}
        monkeypatch.setattr(dispatch_kimi_k3, "_forced_references", lambda: frozenset({"attention_with_lse"}))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            default_logits = model(ids, use_cache=False).logits.float()
        default_names = {e.key for e in prof.key_averages()}
    assert any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)
    assert not any("efficient_attention" in n for n in names)
    cudnn_err, default_err = rel_err(logits, gold), rel_err(default_logits, gold)
    assert cudnn_err < 1.5 * default_err + 1e-2, (cudnn_err, default_err,
                                                  sorted(n for n in default_names if "attention" in n))


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
