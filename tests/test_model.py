"""Whole-model numerics against the independent spec reference, gradients, checkpointing, bf16, Kimi-Linear."""

import pytest
import torch

import spec_reference
from k3_test_utils import cache_of
from kimik3.tiny import build_tiny_model
from kimik3.configuration import kimi_linear_style_text_config_dict, tiny_text_config_dict
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM
from kimik3.training import enable_checkpointing

F32_ISLANDS = ("A_log", "dt_bias", "conv1d", "o_norm", "e_score_correction_bias")


def to_release_dtypes(model):
    """bf16 everywhere except the tensors the release stores in F32."""
    model = model.to(torch.bfloat16)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if any(key in name for key in F32_ISLANDS):
            tensor.data = tensor.data.float()
    return model


@pytest.mark.parametrize("layers, block", [(4, 2), (6, 4), (5, None)])
def test_logits_match_independent_spec_reference_fp32(layers, block):
    model = build_tiny_model(num_hidden_layers=layers, attn_res_block_size=block)
    ids = torch.randint(3, 128, (1, 19))
    with torch.no_grad():
        got = model(ids).logits[0]
        expected = spec_reference.forward(tiny_text_config_dict(num_hidden_layers=layers, attn_res_block_size=block),
                                          model.state_dict(), ids[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_logits_match_spec_reference_bf16_and_are_finite():
    model = to_release_dtypes(build_tiny_model(num_hidden_layers=4))
    assert model.model.layers[0].self_attn.q_conv1d.weight.dtype == torch.float32
    ids = torch.randint(3, 128, (2, 33))
    with torch.no_grad():
        logits = model(ids).logits
        expected = spec_reference.forward(tiny_text_config_dict(num_hidden_layers=4), model.state_dict(), ids[0])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    # bf16 rounding differs only in accumulation order (chunked vs per-token KDA, fused vs split matmuls)
    assert (logits[0].float() - expected.float()).abs().max() < 2e-2


def test_kimi_linear_style_config_runs_and_matches_reference():
    torch.manual_seed(1)
    cfg = kimi_linear_style_text_config_dict()
    model = KimiK3ForCausalLM(KimiK3TextConfig(**cfg)).eval()
    names = dict(model.named_parameters())
    assert "model.layers.0.self_attn.g_a_proj.weight" in names and not any("res_proj" in n for n in names)
    ids = torch.randint(3, 128, (1, 13))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[0], spec_reference.forward(cfg, model.state_dict(), ids[0]),
                                   atol=1e-5, rtol=1e-5)


def test_step_by_step_decode_equals_full_forward():
    model = build_tiny_model(num_hidden_layers=6)
    ids = torch.randint(3, 128, (2, 24))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :9], use_cache=True)
        cache, steps = cache_of(out), [out.logits]
        for t in range(9, 24):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
        # chunked prefill continuing a cache (multi-token, MLA expanded over cached latents)
        out = model(ids[:, :5], use_cache=True)
        chunked = [out.logits, model(ids[:, 5:17], cache=cache_of(out)).logits,
                   model(ids[:, 17:], cache=cache_of(out)).logits]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(chunked, 1), full, atol=1e-5, rtol=1e-5)


def test_absorbed_decode_equals_expanded_attention():
    model = build_tiny_model(num_hidden_layers=4)
    mla = model.model.layers[3].self_attn
    query = torch.randn(2, mla.num_heads, 1, mla.qk_head_dim)
    latents = torch.randn(2, 9, mla.kv_lora_rank + mla.qk_rope_head_dim)
    with torch.no_grad():
        absorbed, _ = mla._absorbed_attention(query, latents, None)
        expanded, _ = mla._expanded_attention(query, latents, None)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_prefill_keys_are_head_views_of_token_major_storage():
    """Each head's key is [k_nope | the shared k_pe], handed to attention as a [B, H, T, D] view of token-major
    storage, the projection's own order (the head-major concatenation took twice as long on an H200:
    docs/benchmarks.md, MLA key assembly)."""
    model = build_tiny_model(num_hidden_layers=4)
    mla = model.model.layers[3].self_attn
    nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
    latents = torch.randn(2, 9, rank + mla.qk_rope_head_dim)
    with torch.no_grad():
        key, value = mla._expand_latents(latents)
        kv = mla.kv_b_proj(latents[..., :rank]).view(2, 9, mla.num_heads, -1).transpose(1, 2)
    assert key.shape == (2, mla.num_heads, 9, mla.qk_head_dim) and value.shape == (2, mla.num_heads, 9, mla.v_head_dim)
    assert key.transpose(1, 2).is_contiguous()
    assert torch.equal(key[..., :nope], kv[..., :nope]) and torch.equal(value, kv[..., nope:])
    assert torch.equal(key[..., nope:], latents[:, None, :, rank:].expand(-1, mla.num_heads, -1, -1))


def _grads(model, ids):
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_every_parameter_gets_a_gradient():
    model = build_tiny_model(num_hidden_layers=4).train()
    grads = _grads(model, torch.randint(3, 128, (2, 21)))
    # Layer 0's attention-side pseudo-query is never used (spec 5.2: that mix is skipped at layer 0): it is a
    # buffer under its release name, so it loads but no optimizer or DDP waits for its gradient.
    unused = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    assert unused <= set(dict(model.named_buffers())) and not unused & set(dict(model.named_parameters()))
    for name, param in model.named_parameters():
        assert name in grads, name
        assert grads[name].abs().sum() > 0, name
    assert "model.layers.1.mlp.experts.gate_up_proj" in grads and "model.output_attn_res_proj.weight" in grads
    assert not model.model.layers[1].mlp.gate.e_score_correction_bias.requires_grad


def test_gradient_checkpointing_gives_the_same_gradients():
    model = build_tiny_model(num_hidden_layers=4).train()
    ids = torch.randint(3, 128, (2, 21))
    plain = _grads(model, ids)
    enable_checkpointing(model, use_reentrant=False)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = _grads(model, ids)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


def test_bf16_training_step_is_finite():
    model = to_release_dtypes(build_tiny_model(num_hidden_layers=4)).train()
    loss = model(torch.randint(3, 128, (2, 40)), labels=torch.randint(3, 128, (2, 40))).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_logits_to_keep_and_hidden_states():
    model = build_tiny_model(num_hidden_layers=4)
    ids = torch.randint(3, 128, (1, 10))
    with torch.no_grad():
        full = model(ids, output_hidden_states=True)
        last = model(ids, logits_to_keep=1)
    torch.testing.assert_close(last.logits, full.logits[:, -1:])
    assert len(full.hidden_states) == 5
    # the embeddings first, then each layer's own output: the last is not the normed AttnRes mix the head reads
    torch.testing.assert_close(full.hidden_states[0], model.model.embed_tokens(ids))
    with torch.no_grad():
        base = model.model(ids)
    assert not torch.allclose(full.hidden_states[-1], base.last_hidden_state)
    assert all(not torch.equal(a, b) for a, b in zip(full.hidden_states, full.hidden_states[1:]))


def test_release_f32_tensors_stay_f32_when_loading_in_bf16(tmp_path):
    from kimik3.remote_code import save_with_code

    save_with_code(build_tiny_model(num_hidden_layers=4), tmp_path)
    model = KimiK3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    dtypes = {n: t.dtype for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    for name, dtype in dtypes.items():
        expected = torch.float32 if any(k in name for k in F32_ISLANDS) else torch.bfloat16
        assert dtype == expected, name


def test_init_weights_sets_every_custom_parameter_on_load(tmp_path):
    """Missing tensors come back from meta through `_init_weights`, not as uninitialised memory."""
    from safetensors.torch import load_file, save_file

    from kimik3.remote_code import save_with_code

    save_with_code(build_tiny_model(num_hidden_layers=4), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    dropped = [n for n in tensors if n.endswith(("A_log", "dt_bias", "e_score_correction_bias", "gate_up_proj",
                                                    "res_proj.weight", "o_norm.weight", "conv1d.weight"))]
    save_file({n: t for n, t in tensors.items() if n not in dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    model = KimiK3ForCausalLM.from_pretrained(tmp_path)
    state = model.state_dict()
    for name in dropped:
        value = state[name]
        assert torch.isfinite(value).all(), name
        if name.endswith("A_log"):
            assert ((value.exp() >= 1.0) & (value.exp() <= 16.0)).all()
        elif name.endswith("dt_bias"):
            dt = torch.nn.functional.softplus(value)
            assert ((dt > 0.9e-4) & (dt < 0.11)).all()
        elif name.endswith(("e_score_correction_bias", "res_proj.weight")):
            assert torch.equal(value, torch.zeros_like(value))
        elif name.endswith("o_norm.weight"):
            assert torch.equal(value, torch.ones_like(value))
        elif name.endswith("gate_up_proj"):
            assert 0.01 < value.std() < 0.03
        elif name.endswith("conv1d.weight"):
            assert value.abs().max() <= 0.5 and value.std() > 0


def test_blockwise_chunked_prefill_over_many_key_blocks_equals_full_forward(monkeypatch):
    """Chunked prefill continuing a cache merges key blocks by log-sum-exp; with 3-token blocks (raised to twice the
    chunk's queries) every chunk spans several blocks, and the result must be the one-shot forward."""
    import dataclasses

    import kimik3.modeling.dispatch_kimi_k3 as dispatch

    model = build_tiny_model(num_hidden_layers=4)
    model.config.mla_prefill_block_size = 3
    ids = torch.randint(3, 128, (2, 26))
    calls = []
    op = dispatch.FAST_OPS["attention_with_lse"]
    spy = dataclasses.replace(op, reference=lambda *a: calls.append(a[1].shape[2]) or op.reference(*a))
    monkeypatch.setitem(dispatch.FAST_OPS, "attention_with_lse", spy)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :16], use_cache=True)
        cache, pieces = cache_of(out), [out.logits]
        for start, end in ((16, 18), (18, 19), (19, 26)):
            pieces.append(model(ids[:, start:end], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
    # one MLA layer; chunks of 2, 1 (absorbed decode, no blocks) and 7 tokens over 16, -, 19 cached tokens: key
    # blocks of max(3, 2 x chunk) (4 and 14) plus the chunk's own diagonal block
    assert calls == [4, 4, 4, 4, 2] + [14, 5, 7]


def test_router_observer_sees_the_padding_mask():
    """Quantile Balancing must count real tokens only: the gate hands the padding mask to its observer."""
    model = build_tiny_model(num_hidden_layers=4).train()
    model.config.quantile_balancing = True
    seen = []
    for module in model.modules():
        if type(module).__name__ == "KimiK3MoEGate":
            module.quantile_balancing_observer = lambda gate, scores, cutoff, routed, mask: seen.append(
                (scores.shape[0], None if mask is None else int(mask.sum()), cutoff.shape[0], routed.shape))
    ids = torch.randint(3, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    model(ids, attention_mask=mask)
    assert seen == [(18, 14, 18, (18, model.config.num_experts_per_token))] * 3


def test_output_attentions_and_router_logits():
    model = build_tiny_model(num_hidden_layers=6)
    model.config._attn_implementation = "eager"
    ids = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        out = model(ids, output_attentions=True, output_router_logits=True)
        plain = model(ids)
    config = model.config
    assert len(out.attentions) == len(config.mla_layer_indices)
    for weights in out.attentions:
        assert weights.shape == (2, config.num_attention_heads, 7, 7)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, config.num_attention_heads, 7))
        assert weights.triu(1).abs().max() == 0  # causal
    assert len(out.router_logits) == config.mlp_layer_types.count("sparse")
    assert all(r.shape == (14, config.num_experts) and r.dtype == torch.float32 for r in out.router_logits)
    assert plain.attentions is None and plain.router_logits is None
    torch.testing.assert_close(out.logits, plain.logits)
