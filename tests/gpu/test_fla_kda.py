"""fla-core fast paths (chunk_kda, fused_recurrent_kda, causal_conv1d) against the pure-PyTorch references of
ops_kimi_k3, forward and (where training uses them) backward."""

import importlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
pytest.importorskip("fla")
pytest.importorskip("triton")

from gpu_helpers import (  # noqa: E402
    load_dispatch, load_fast, load_ops, max_rel, rel_err, tiny_prefill_errors_fast_and_reference_kda,
)

ops = load_ops()
dispatch = load_dispatch()

DEV = "cuda"
H, K = 4, 128  # K3 head_dim 128 (the shape fla's kernels are tuned for), fewer heads


def _kda_inputs(batch, seq_len, requires_grad=False, lower_bound=-5.0):
    q = torch.randn(batch, seq_len, H, K, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(batch, seq_len, H, K, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(batch, seq_len, H, K, device=DEV, dtype=torch.bfloat16)
    raw = torch.randn(batch, seq_len, H, K, device=DEV, dtype=torch.bfloat16)
    a_log = torch.zeros(128, device=DEV)  # release layout: [128] zero-padded
    a_log[:H] = torch.randn(H, device=DEV) * 0.5
    dt_bias = torch.randn(H * K, device=DEV) * 0.5
    beta = torch.sigmoid(torch.randn(batch, seq_len, H, device=DEV))
    h0 = torch.randn(batch, H, K, K, device=DEV) * 0.1
    g = ops.kda_gate(raw, a_log, dt_bias, lower_bound)
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, raw=raw, a_log=a_log, dt_bias=dt_bias)
    if requires_grad:
        for name in ("q", "k", "v", "g", "beta", "h0"):
            tensors[name] = tensors[name].detach().requires_grad_(True)
    return tensors


@pytest.mark.parametrize("seq_len", [1, 5])
def test_fused_recurrent_kda(seq_len):
    t = _kda_inputs(3, seq_len)
    fast = load_fast("fused_recurrent_kda")
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    h0_before = t["h0"].clone()
    o, s = fast(*args, initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = ops.fused_recurrent_kda(
        *args, initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert max_rel(o, o_ref) < 1e-2
    assert rel_err(s, s_ref) < 1e-4
    # the caller's state is not modified in place
    assert torch.equal(t["h0"], h0_before)


def test_fused_recurrent_is_forward_only_in_dispatch():
    q = torch.randn(1, 1, H, K, device=DEV, requires_grad=True)
    assert dispatch.fast_or_reference("fused_recurrent_kda", q) is ops.fused_recurrent_kda
    with torch.no_grad():
        assert dispatch.fast_or_reference("fused_recurrent_kda", q) is load_fast("fused_recurrent_kda")


@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_forward_backward(with_state):
    channels, width = 384, 4
    x = torch.randn(2, 37, channels, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(channels, 1, width, device=DEV) * 0.5).requires_grad_(True)
    state = torch.randn(2, channels, width - 1, device=DEV, dtype=torch.bfloat16) if with_state else None
    fast = load_fast("causal_conv1d")
    y, new_state = fast(x, weight, state)
    y_ref, new_state_ref = ops.causal_conv1d(x, weight, state)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    assert max_rel(y, y_ref) < 1e-2
    assert torch.equal(new_state, new_state_ref)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, weight), dy)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, weight), dy)
    assert rel_err(gx, gx_ref) < 1e-2 and rel_err(gw, gw_ref) < 1e-2


def test_causal_conv1d_decode_chain():
    """Prefill 5 tokens, then 3 single-token steps through the returned state == one pass over 8 tokens."""
    channels, width = 256, 4
    x = torch.randn(1, 8, channels, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(channels, 1, width, device=DEV)
    fast = load_fast("causal_conv1d")
    y_full, state_full = ops.causal_conv1d(x, weight)
    y, state = fast(x[:, :5], weight, None)
    outs = [y]
    for t in range(5, 8):
        y_t, state = fast(x[:, t : t + 1], weight, state)
        outs.append(y_t)
    assert max_rel(torch.cat(outs, dim=1), y_full) < 1e-2
    assert torch.equal(state, state_full)


@pytest.mark.parametrize("seq_len", [64, 200])
def test_chunk_kda_forward(seq_len):
    t = _kda_inputs(2, seq_len)
    fast = load_fast("chunk_kda")
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    o, s = fast(*args, initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = ops.chunk_kda(*args, initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == t["v"].dtype and o.shape == o_ref.shape
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert max_rel(o, o_ref) < 2e-2
    assert rel_err(o, o_ref) < 1e-2
    assert rel_err(s, s_ref) < 1e-2
    o2, s2 = fast(*args, use_qk_l2norm_in_kernel=True)
    assert s2 is None and rel_err(o2, ops.chunk_kda(*args, use_qk_l2norm_in_kernel=True)[0]) < 1e-2


@pytest.mark.parametrize("gate_in_kernel", [False, True])
def test_chunk_kda_backward(gate_in_kernel):
    """fla's backward against autograd through the reference. With `use_gate_in_kernel` (the fused-gate contract
    under autograd: the twin applies the reference gate, then fla's chunked form), A_log, dt_bias and the raw logits
    get the reference's gradients too (A_log's padding rows none)."""
    t = _kda_inputs(1, 130)
    names = ("q", "k", "v", "raw" if gate_in_kernel else "g", "beta", "h0")
    names += ("a_log", "dt_bias") if gate_in_kernel else ()
    inputs = [t[n].detach().clone().requires_grad_(True) for n in names]
    fast = load_fast("chunk_kda")

    def run(fn):
        gate = {}
        if gate_in_kernel:
            gate = dict(use_gate_in_kernel=True, A_log=inputs[6], dt_bias=inputs[7], lower_bound=-5.0)
        o, s = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                  **gate)
        loss = (o.float() * torch.linspace(-1, 1, o.shape[-1], device=DEV)).sum() + (s * 0.1).sum()
        return torch.autograd.grad(loss, inputs)

    grads, grads_ref = run(fast), run(ops.chunk_kda)
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert g.shape == g_ref.shape, name
        assert rel_err(g, g_ref) < 3e-2, (name, rel_err(g, g_ref))
    if gate_in_kernel:
        assert grads[6][H:].abs().max() == 0 and grads[6][:H].abs().max() > 0


@pytest.mark.parametrize("seq_len,lower_bound", [(64, -5.0), (200, -5.0), (1000, -5.0), (200, -7.0)])
def test_chunk_kda_gate_in_kernel_forward(seq_len, lower_bound):
    """The decay computed inside fla's chunk cumsum (its `safe_gate` path for K3's bound -5; -7 is outside fla's
    safe range and keeps the token-parallel diagonal tiles) against the reference applying `kda_gate` first. The
    release's zero-padded [128] A_log is passed as it is stored."""
    t = _kda_inputs(2, seq_len, lower_bound=lower_bound)
    fast = load_fast("chunk_kda")
    args = (t["q"], t["k"], t["v"], t["raw"], t["beta"])
    gate = dict(use_gate_in_kernel=True, A_log=t["a_log"], dt_bias=t["dt_bias"], lower_bound=lower_bound)
    o, s = fast(*args, initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True, **gate)
    o_ref, s_ref = ops.chunk_kda(*args, initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 **gate)
    assert o.dtype == t["v"].dtype and s.dtype == torch.float32 and o.shape == o_ref.shape
    assert max_rel(o, o_ref) < 2e-2
    assert rel_err(o, o_ref) < 1e-2
    assert rel_err(s, s_ref) < 1e-2
    # the reference's own contract: the gate inside equals the gate applied before
    precomputed = ops.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"],
                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o_ref, precomputed[0]) and torch.equal(s_ref, precomputed[1])
    # a head's decay read from another head's A_log is far outside these bounds
    gate["A_log"] = t["a_log"].clone()
    gate["A_log"][:H] = t["a_log"][:H].roll(1)
    o_wrong, _ = fast(*args, initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True, **gate)
    assert rel_err(o_wrong, o_ref) > 5e-2


@pytest.mark.parametrize("operands", [torch.float16, torch.float32])
@pytest.mark.parametrize("v_scale, state_scale", [(1.0, 1.0), (3e5, 1.0), (1.0, 1e6), (1e-25, 1e-25)])
def test_chunk_kda_operands_keep_fla_intermediates_finer_than_bf16(monkeypatch, operands, v_scale, state_scale):
    """`KDA_CHUNK_OPERANDS`: bf16 inputs handed to fla as fp16 (v and the state scaled by a power of two into fp16's
    range) or f32, so its intermediates are not rounded to bf16 between kernels. Against the reference on the same
    inputs in f32 they must remove at least half of the bf16 operands' error (which rounds w, u, the chunk states and
    Aqk/Akk to bf16) above the output's own bf16 rounding, and half of the final state's, at any magnitude of v and
    the state (fp16 overflows past 65504 and flushes below 6e-8 unscaled);
    the output stays bf16 and the final state f32; under autograd the setting is not applied (fla's bf16 backward,
    the training path)."""
    kda = importlib.import_module("kimik3.kernels.kda")
    t = _kda_inputs(2, 1000)
    fast = load_fast("chunk_kda")
    args = (t["q"], t["k"], (t["v"].float() * v_scale).bfloat16(), t["raw"], t["beta"])
    gate = dict(use_gate_in_kernel=True, A_log=t["a_log"], dt_bias=t["dt_bias"], lower_bound=-5.0)
    kw = dict(initial_state=t["h0"] * state_scale, output_final_state=True, use_qk_l2norm_in_kernel=True, **gate)
    o_ref, s_ref = ops.chunk_kda(*(a.float() for a in args), **kw)
    monkeypatch.setattr(kda, "KDA_CHUNK_OPERANDS", None)
    o_bf16, s_bf16 = fast(*args, **kw)
    monkeypatch.setattr(kda, "KDA_CHUNK_OPERANDS", operands)
    o_fine, s_fine = fast(*args, **kw)
    assert o_fine.dtype == torch.bfloat16 and s_fine.dtype == torch.float32
    assert bool(torch.isfinite(o_fine).all()) and bool(torch.isfinite(s_fine).all())
    # finer operands remove at least half of the error above the bf16 output's own rounding (the floor every
    # operand setting shares; the f32 state has none)
    floor = rel_err(o_ref.bfloat16(), o_ref)
    errors = (rel_err(o_fine, o_ref), rel_err(o_bf16, o_ref), floor)
    assert errors[0] - floor < 0.5 * (errors[1] - floor), errors
    assert rel_err(s_fine, s_ref) < 0.5 * rel_err(s_bf16, s_ref), (rel_err(s_fine, s_ref), rel_err(s_bf16, s_ref))
    outs = []
    for setting in (operands, None):
        monkeypatch.setattr(kda, "KDA_CHUNK_OPERANDS", setting)
        leaves = [a.detach().clone().requires_grad_(True) for a in args[:3]]
        outs.append(fast(*leaves, *args[3:], **kw)[0])
    assert torch.equal(outs[0], outs[1])


def test_model_prefill_with_the_gate_in_fla_matches_the_reference_kda(monkeypatch):
    """A bf16 tiny model's prefill with fla computing the bounded decay in its kernel (safe_gate) against the f32
    model on the reference ops, as close to it as the same bf16 model with chunk_kda on its reference (which applies
    kda_gate to the same logits, A_log, dt_bias and bound per layer): the fused path adds only bf16/TF32 noise."""
    fast_err, ref_err = tiny_prefill_errors_fast_and_reference_kda(monkeypatch)
    assert fast_err < 1.5 * ref_err + 1e-2, (fast_err, ref_err)
