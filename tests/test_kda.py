"""KDA: chunked == recurrent == a naive per-token reference written from k3_math.md 2.2 (fp32, 1e-5)."""

import pytest
import torch

from kimik3.modeling.ops_kimi_k3 import causal_conv1d, chunk_kda, fused_recurrent_kda, kda_gate


def naive_kda(q, k, v, g, beta, state):
    """One head at a time, one token at a time, exactly the spec's equations (no vectorisation tricks)."""
    B, T, H, K = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    S = state.double().clone()
    for b in range(B):
        for h in range(H):
            for t in range(T):
                qt = q[b, t, h].double() / torch.sqrt((q[b, t, h].double() ** 2).sum() + 1e-6) / K**0.5
                kt = k[b, t, h].double() / torch.sqrt((k[b, t, h].double() ** 2).sum() + 1e-6)
                A = torch.diag(g[b, t, h].double().exp())
                S[b, h] = A @ S[b, h]
                S[b, h] = S[b, h] + beta[b, t, h].double() * torch.outer(kt, v[b, t, h].double() - S[b, h].T @ kt)
                out[b, t, h] = S[b, h].T @ qt
    return out, S


def _inputs(B, T, H, K, V, lower_bound=-5.0):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = kda_gate(torch.randn(B, T, H, K) * 2, torch.rand(H) * 2, torch.randn(H * K), lower_bound)
    beta = torch.rand(B, T, H)
    state = torch.randn(B, H, K, V) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T, chunk", [(1, 16), (15, 16), (16, 16), (17, 16), (50, 16), (37, 8), (130, 64)])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunked_equals_recurrent_equals_naive(T, chunk, lower_bound):
    q, k, v, g, beta, state = _inputs(2, T, 2, 8, 6, lower_bound)
    ref_out, ref_state = naive_kda(q, k, v, g, beta, state)
    rec_out, rec_state = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    chk_out, chk_state = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, chunk_size=chunk)
    torch.testing.assert_close(rec_out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chk_out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec_state.double(), ref_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chk_state.double(), ref_state, atol=1e-5, rtol=1e-5)
    assert chk_state.dtype == torch.float32


def test_gate_is_lower_bounded_sigmoid_not_softplus():
    z = torch.randn(3, 4, 2, 8) * 5
    A_log, dt_bias = torch.randn(2), torch.randn(16)
    g = kda_gate(z, A_log, dt_bias, -5.0)
    expected = -5.0 * torch.sigmoid(A_log.exp().view(2, 1) * (z + dt_bias.view(2, 8)))
    torch.testing.assert_close(g, expected)
    assert g.min() >= -5.0 and g.max() <= 0 and (g > -5.0).float().mean() > 0.5
    soft = kda_gate(z, A_log, dt_bias, None)
    assert not torch.allclose(g, soft)
    # A_log padded to 128 as released: only the first num_heads entries are read
    padded = torch.cat([A_log, torch.zeros(126)])
    torch.testing.assert_close(kda_gate(z, padded, dt_bias, -5.0), g)


def test_gate_in_kernel_is_the_gate_applied_first():
    """chunk_kda's `use_gate_in_kernel` contract (the model's prefill path): raw logits plus the gate's parameters
    give exactly what the precomputed decay gives, gradients included (A_log padded to 128 as released), and
    `kda_recurrence` applies the same gate before a decode step's recurrent form."""
    from kimik3.modeling.dispatch_kimi_k3 import kda_recurrence

    q, k, v, _, beta, state = _inputs(1, 37, 2, 8, 8)
    raw = torch.randn(1, 37, 2, 8) * 2
    A_log, dt_bias = torch.cat([torch.randn(2), torch.zeros(126)]).requires_grad_(), torch.randn(16).requires_grad_()
    fused = chunk_kda(q, k, v, raw, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      chunk_size=16, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    first = chunk_kda(q, k, v, kda_gate(raw, A_log, dt_bias, -5.0), beta, initial_state=state,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16)
    assert torch.equal(fused[0], first[0]) and torch.equal(fused[1], first[1])
    grads = [torch.autograd.grad(out[0].sum(), (A_log, dt_bias)) for out in (fused, first)]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert grads[0][0][2:].abs().max() == 0 and grads[0][0][:2].abs().min() > 0
    with torch.no_grad():
        gate = (A_log, dt_bias, -5.0)
        step = kda_recurrence(q[:, :1], k[:, :1], v[:, :1], raw[:, :1], beta[:, :1], state, True, 16, True, gate)
        want = fused_recurrent_kda(q[:, :1], k[:, :1], v[:, :1], kda_gate(raw[:, :1], *gate), beta[:, :1],
                                   initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.equal(step[0], want[0]) and torch.equal(step[1], want[1])
        chunked = kda_recurrence(q, k, v, raw, beta, state, True, 16, False, gate)
        assert torch.equal(chunked[0], first[0].detach()) and torch.equal(chunked[1], first[1].detach())


def test_chunked_split_equals_one_pass_and_chunk_state_is_carried():
    q, k, v, g, beta, _ = _inputs(1, 40, 2, 8, 8)
    full, full_state = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 chunk_size=16)
    first, state = chunk_kda(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], output_final_state=True,
                             use_qk_l2norm_in_kernel=True, chunk_size=16)
    second, state = chunk_kda(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], beta[:, 23:], initial_state=state,
                              output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, full_state, atol=1e-5, rtol=1e-5)


def test_chunked_backward_matches_recurrent_with_segment_recompute():
    # 300 tokens with chunk 8: three recompute segments of 16 chunks under autograd.
    q, k, v, g, beta, state = _inputs(1, 300, 1, 4, 4)
    grads = []
    for fn, kw in ((fused_recurrent_kda, {}), (chunk_kda, {"chunk_size": 8})):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        out, _ = fn(*leaves, initial_state=state, use_qk_l2norm_in_kernel=True, **kw)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_causal_conv_state_continues_the_sequence():
    x = torch.randn(2, 11, 6)
    w = torch.randn(6, 1, 4)
    full, _ = causal_conv1d(x, w)
    first, state = causal_conv1d(x[:, :5], w)
    rest = []
    for t in range(5, 11):
        y, state = causal_conv1d(x[:, t:t + 1], w, state)
        rest.append(y)
    torch.testing.assert_close(torch.cat([first, *rest], 1), full)
    manual = torch.nn.functional.silu(sum(w[:, 0, i] * x[:, 10 - 3 + i] for i in range(4)))
    torch.testing.assert_close(full[:, 10], manual, atol=1e-6, rtol=1e-6)


def test_chunked_training_memory_saves_no_state_per_chunk():
    """Under autograd only one state per recompute segment is kept for backward, not one per chunk."""
    B, T, H, K, V, chunk = 1, 2048, 2, 8, 8, 16  # 128 chunks
    q, k, v, g, beta, state = _inputs(B, T, H, K, V)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    state_shaped = []

    def pack(tensor):
        if tuple(tensor.shape) == (B, H, K, V):
            state_shaped.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = chunk_kda(*leaves, initial_state=state, use_qk_l2norm_in_kernel=True, chunk_size=chunk)
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)
    assert len(state_shaped) <= 10, len(state_shaped)  # 8 segments of 16 chunks (+ the initial state)


def test_qk_normalised_in_the_conv_is_the_recurrence_normalising_them(monkeypatch):
    """The fold the model takes where fla runs after the fast conv (forced here on CPU): the conv L2-normalises q and
    k per head (`l2norm_head_dim`; not v), the chunked form skips its own normalisation, and in f32 the logits are
    exactly those of the unfolded path (the same f32 l2norm on the same values). A decode step keeps the recurrent
    form's own normalisation. Channels that are not whole heads are refused."""
    from kimik3.modeling import modeling_kimi_k3 as modeling
    from kimik3.modeling import dispatch_kimi_k3 as dispatch
    from kimik3.modeling import ops_kimi_k3 as ops
    from kimik3.tiny import build_tiny_model

    model = build_tiny_model(num_hidden_layers=4).eval()
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        seen_conv, seen_kda = [], []
        conv, recurrence = ops.causal_conv1d, dispatch.kda_recurrence
        monkeypatch.setattr(dispatch, "has_fast_twin", lambda name, *t: True)
        monkeypatch.setitem(dispatch.FAST_OPS, "causal_conv1d", dispatch.FastOp(
            lambda *a: seen_conv.append(a[3]) or conv(*a), traceable_forward=True))
        monkeypatch.setattr(modeling, "kda_recurrence",
                            lambda *a, **k: seen_kda.append(k.get("qk_normalized")) or recurrence(*a, **k))
        folded = model(ids, use_cache=False).logits
        assert torch.equal(folded, plain)
        n_kda = model.config.layer_types.count("linear_attention")
        head_dim = model.config.linear_head_dim
        assert seen_conv == [head_dim, head_dim, 0] * n_kda and seen_kda == [True] * n_kda
        out = model(ids[:, :10], use_cache=True)
        seen_kda.clear()
        model(ids[:, 10:], cache=out.cache if getattr(out, "cache", None) is not None else out.past_key_values)
        assert seen_kda == [False] * n_kda  # one token continuing a state: the recurrent form normalises
    x = torch.randn(1, 3, 10)
    with pytest.raises(ValueError, match="whole heads"):
        causal_conv1d(x, torch.randn(10, 1, 4), None, 4)


class _RecordingFla:
    """Stands in for fla's chunk_kda on the CPU: records the operands it is handed and computes the reference on
    them in f32, returning the output in v's dtype as fla does (so an fp16 output out of range becomes inf here as it
    would there)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, chunk_size=64, safe_gate=False, **gate):
        self.calls.append({"dtypes": (q.dtype, k.dtype, v.dtype), "finite": all(
            bool(torch.isfinite(x).all()) for x in (q, k, v, initial_state) if x is not None),
            "amax": {name: float(x.detach().abs().max())
                     for name, x in (("q", q), ("k", k), ("v", v), ("state", initial_state)) if x is not None}})
        o, final = chunk_kda(q.float(), k.float(), v.float(), g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             chunk_size=chunk_size, **gate)
        return o.to(v.dtype), final


@pytest.fixture
def recording_fla(monkeypatch):
    import sys
    import types

    fake = _RecordingFla()
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("fla.ops.kda")
    module.chunk_kda = fake
    monkeypatch.setitem(sys.modules, "fla.ops.kda", module)
    return fake


@pytest.mark.parametrize("v_scale, state_scale, qk_scale, in_kernel_norm", [
    (1.0, 1.0, 1.0, False),       # the model's case: unit q, k from the conv's norm
    (1e6, 1.0, 1.0, False),       # v far past fp16's 65504
    (1e-30, 1e-30, 1.0, False),   # v and the state far below fp16's smallest subnormal
    (1.0, 1e7, 1.0, False),       # a state past fp16's range with small v
    (3.0, 1.0, 1e6, True),        # raw q, k past fp16's range, normalized in the kernel
    (0.0, 0.0, 1.0, True),        # all-zero values and state
])
def test_fast_chunk_kda_fp16_operands_hold_the_values_in_range(monkeypatch, recording_fla, v_scale, state_scale,
                                                                qk_scale, in_kernel_norm):
    """`KDA_CHUNK_OPERANDS = torch.float16`: fla gets fp16 q, k, v and a scaled f32 state, every value in fp16's
    range, and the output and the state it returns, unscaled, are the reference's on the bf16 inputs to the output's
    own rounding, whatever the magnitudes (fp16 holds bf16's significand but not its range)."""
    from kimik3.kernels import kda

    monkeypatch.setattr(kda, "KDA_CHUNK_OPERANDS", torch.float16)
    torch.manual_seed(0)
    q, k, v, g, beta, state = _inputs(2, 70, 2, 16, 8)
    if not in_kernel_norm:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    q, k, v = ((x * s).bfloat16() for x, s in ((q, qk_scale), (k, qk_scale), (v, v_scale)))
    state = state * state_scale
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=in_kernel_norm)
    o, final = kda.chunk_kda(q, k, v, g, beta, **kw)
    o_ref, final_ref = chunk_kda(q.float(), k.float(), v.float(), g, beta, **kw)
    call = recording_fla.calls[-1]
    assert call["dtypes"] == (torch.float16,) * 3 and call["finite"], call
    assert call["amax"]["v"] <= 2.0 ** kda.V_EXPONENT and call["amax"]["state"] <= 2.0 ** kda.STATE_EXPONENT, call
    assert max(call["amax"]["q"], call["amax"]["k"]) < 2.0 ** 15, call
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(final).all())
    size = max(float(o_ref.abs().max()), 1e-38)
    # bf16's own rounding of the output (2^-9 relative) and fp16's before it (2^-12)
    torch.testing.assert_close(o.float(), o_ref, rtol=2.0 ** -7, atol=2.0 ** -7 * size)
    torch.testing.assert_close(final, final_ref, rtol=1e-3, atol=1e-3 * max(float(final_ref.abs().max()), 1e-38))
    if v_scale == 0.0:
        assert not bool(o.any())


def test_fast_chunk_kda_operands_stay_as_given_under_autograd_and_for_f32(monkeypatch, recording_fla):
    """The operand setting is for inference: under autograd (training keeps fla's bf16 backward) and for f32
    inputs fla gets the operands as they come; an unknown setting is refused by name."""
    from kimik3.kernels import kda

    monkeypatch.setattr(kda, "KDA_CHUNK_OPERANDS", torch.float16)
    q, k, v, g, beta, state = _inputs(1, 20, 2, 8, 4)
    kda.chunk_kda(q.bfloat16().requires_grad_(True), k.bfloat16(), v.bfloat16(), g, beta, initial_state=state)
    kda.chunk_kda(q, k, v, g, beta, initial_state=state)
    assert [c["dtypes"] for c in recording_fla.calls] == [(torch.bfloat16,) * 3, (torch.float32,) * 3]
    monkeypatch.setattr(kda, "KDA_CHUNK_OPERANDS", torch.float64)
    with pytest.raises(ValueError, match="KDA_CHUNK_OPERANDS"):
        kda.chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, initial_state=state)
