"""CPU tests of `kimik3.kernels`: the dispatcher never hands a fast path to CPU tensors (even when fla/Triton
import), the switches work, and the references in kimik3.kernels.reference agree with independent formulas."""

import importlib

import pytest
import torch

kernels = importlib.import_module("kimik3.kernels")
reference = importlib.import_module("kimik3.kernels.reference")
ops = importlib.import_module("kimik3.modeling.ops_kimi_k3")


@pytest.fixture
def fake_fast_ops(monkeypatch):
    """Pretend every fast implementation imported fine (as when fla is installed on a CPU box)."""
    sentinel = {name: (lambda *a, _n=name, **k: _n) for name in kernels.OP_NAMES}
    monkeypatch.setattr(kernels, "_cache", dict(sentinel))
    monkeypatch.delenv("KIMIK3_DISABLE_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "_enabled", True)
    return sentinel


def test_op_names_contract():
    for name in ("chunk_kda", "fused_recurrent_kda", "causal_conv1d", "block_attn_res_mix", "situ_glu",
                 "moe_experts", "mla_decode", "mxfp4_dequant"):
        assert name in kernels.OP_NAMES


def test_cpu_tensors_never_get_a_fast_path(fake_fast_ops):
    x = torch.randn(2, 3)
    for name in kernels.OP_NAMES:
        assert kernels.get_fast_op(name, x) is None
        assert kernels.get_fast_op(name, x, None, x) is None
    meta = torch.empty(2, 3, device="meta")
    assert kernels.get_fast_op("situ_glu", meta) is None


def test_no_tensor_unknown_name_and_switches(fake_fast_ops, monkeypatch):
    assert kernels.get_fast_op("situ_glu") is None
    assert kernels.get_fast_op("situ_glu", None) is None
    assert kernels.get_fast_op("no_such_op", torch.randn(1)) is None
    with kernels.reference_ops():
        assert kernels._enabled is False
    assert kernels._enabled is True
    kernels.set_enabled(False)
    try:
        assert kernels._enabled is False
    finally:
        kernels.set_enabled(True)
    monkeypatch.setenv("KIMIK3_DISABLE_KERNELS", "situ_glu, moe_experts")
    assert kernels._env_disabled() == {"situ_glu", "moe_experts"}
    monkeypatch.setenv("KIMIK3_DISABLE_KERNELS", "1")
    assert kernels._env_disabled() == set(kernels.OP_NAMES)
    monkeypatch.setenv("KIMIK3_DISABLE_KERNELS", "0")
    assert kernels._env_disabled() == set()


def test_positive_path_with_device_check_patched(fake_fast_ops, monkeypatch):
    """With the device test satisfied, the cached implementation is returned, except forward-only ops under grad."""

    class FakeCuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    x = torch.randn(2, 3).as_subclass(FakeCuda)
    assert kernels.get_fast_op("situ_glu", x)() == "situ_glu"
    assert kernels.get_fast_op("situ_glu", x, torch.randn(2)) is None  # one real CPU tensor
    y = torch.randn(2, 3, requires_grad=True).as_subclass(FakeCuda)
    assert kernels.get_fast_op("fused_recurrent_kda", y) is None
    with torch.no_grad():
        assert kernels.get_fast_op("fused_recurrent_kda", y)() == "fused_recurrent_kda"
    assert kernels.get_fast_op("chunk_kda", y)() == "chunk_kda"


def test_available_ops_reports_reasons():
    status = kernels.available_ops()
    assert set(status) == set(kernels.OP_NAMES)
    for name, value in status.items():
        assert value is True or isinstance(value, str), name


# ---------------------------------------------------------------------------------------------- references


def test_references_are_the_models_own():
    # one reference per op: the GPU tests compare the fast paths against exactly what the model runs without CUDA
    assert reference.situ_glu is ops.situ_glu
    assert reference.mxfp4_dequant is ops.dequantize_mxfp4
    assert reference._moe_experts is ops.moe_experts


def test_reference_moe_experts_matches_dense_per_token_loop():
    n, k, e, width, inter = 11, 3, 6, 16, 8
    x = torch.randn(n, width, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k)
    gate_up = torch.randn(e, 2 * inter, width).to(torch.bfloat16) * 0.3
    down = torch.randn(e, width, inter).to(torch.bfloat16) * 0.3
    out = reference.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    expected = torch.zeros(n, width)
    for t in range(n):
        for j in range(k):
            ex = int(idx[t, j])
            h = x[t : t + 1] @ gate_up[ex].t()
            act = ops.situ_glu(h[:, :inter], h[:, inter:], 4.0, 25.0)
            expected[t] += w[t, j] * (act @ down[ex].t()).float()[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16), rtol=1e-2, atol=1e-2)


def test_grouped_mm_moe_matches_reference_on_cpu():
    """The fast MoE's routing/sort/offset/combine logic, run through torch's CPU grouped_mm when it exists."""
    moe = importlib.import_module(kernels.__name__ + ".moe")
    n, k, e, width, inter = 21, 4, 8, 64, 32
    x = torch.randn(n, width, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k)
    gate_up = (torch.randn(e, 2 * inter, width) * 0.2).to(torch.bfloat16)
    down = (torch.randn(e, width, inter) * 0.2).to(torch.bfloat16)
    try:
        out = moe.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    except (RuntimeError, NotImplementedError, ImportError) as exc:
        pytest.skip(f"grouped_mm unavailable on this CPU torch: {exc}")
    torch.testing.assert_close(out, reference.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0), rtol=0, atol=0)


def test_reference_mla_decode_matches_expanded_attention():
    batch, heads, seq_len, rank, rope, nope, vdim = 2, 3, 10, 16, 8, 12, 6
    c = torch.randn(batch, seq_len, rank)
    k_pe = torch.randn(batch, seq_len, rope)
    w_uk = torch.randn(heads, nope, rank) * 0.3
    w_uv = torch.randn(heads, vdim, rank) * 0.3
    q_nope, q_pe = torch.randn(batch, heads, 1, nope), torch.randn(batch, heads, 1, rope)
    scale = (nope + rope) ** -0.5
    # expanded: k = [W_UK c, k_pe], v = W_UV c
    k_full = torch.cat([torch.einsum("hnr,btr->bhtn", w_uk, c), k_pe[:, None].expand(-1, heads, -1, -1)], -1)
    v_full = torch.einsum("hvr,btr->bhtv", w_uv, c)
    q_full = torch.cat([q_nope, q_pe], -1)
    expected = torch.softmax(q_full @ k_full.transpose(-1, -2) * scale, -1) @ v_full
    q_lat = torch.cat([torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk), q_pe], -1)
    o_lat = reference.mla_decode(q_lat, torch.cat([c, k_pe], -1), scale, rank)
    got = torch.einsum("bhsr,hvr->bhsv", o_lat, w_uv)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # seq_lens masks the tail; kv_lora_rank defaults to (R+P) - 64
    lens = torch.tensor([10, 4])
    o_masked = reference.mla_decode(q_lat, torch.cat([c, k_pe], -1), scale, rank, lens)
    o_short = reference.mla_decode(q_lat[1:], torch.cat([c, k_pe], -1)[1:, :4], scale, rank)
    torch.testing.assert_close(o_masked[1:], o_short)
    wide = torch.randn(1, 2, 1, 576)
    assert reference.mla_decode(wide, torch.randn(1, 5, 576), 0.1).shape == (1, 2, 1, 512)


def test_reference_mxfp4_matches_ops():
    w = torch.randn(4, 64, 96)
    packed, scale = ops.quantize_mxfp4(w)
    scale[0, 0, 0] = 0
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(reference.mxfp4_dequant(packed, scale, dtype), ops.dequantize_mxfp4(packed, scale, dtype))


def test_flash_attention_with_lse_adapter_matches_reference_on_cpu_op():
    """The CUDA fast path's adapter logic (V padding, LSE shape), exercised with the CPU flavour of the same op."""
    from kimik3.kernels.mla_prefill import attention_with_lse as flash_lse
    from kimik3.modeling.ops_kimi_k3 import attention_with_lse

    q, k, v = torch.randn(2, 3, 6, 24), torch.randn(2, 3, 6, 24), torch.randn(2, 3, 6, 16)
    for causal in (False, True):
        out, lse = flash_lse(q, k, v, 0.2, causal)
        ref_out, ref_lse = attention_with_lse(q, k, v, 0.2, causal)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert kernels.get_fast_op("attention_with_lse", q) is None  # CPU tensors: never the fast path
