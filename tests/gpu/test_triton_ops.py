"""Own fast paths (router upcast / Triton SiTU / RMSNorms / KDA gate / AttnRes / MXFP4 tiles and GEMV / MoE
combine and row gather / few-rows grouped matmul / conv step and prefill, grouped_mm experts, MLA decode op) against
the pure-PyTorch references of ops_kimi_k3, forward and backward where training uses them."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
pytest.importorskip("triton")

from gpu_helpers import (  # noqa: E402
    load_dispatch, load_fast, load_kernels, load_ops, max_rel, reference_only, rel_err,
    tiny_prefill_errors_fast_and_reference_kda,
)
from k3_test_utils import TopLevelOps, grouped_product_f64  # noqa: E402

kernels = load_kernels()
ops = load_ops()
dispatch = load_dispatch()

DEV = "cuda"


# ---------------------------------------------------------------------------------------------------------- SiTU


# beta1 = 4 and 2 take the sigmoid's exp from the gate tanh's (squared / as is), others compute their own
@pytest.mark.parametrize("betas", [(4.0, 25.0), (None, None), (4.0, None), (2.0, 7.0)])
def test_situ_glu_forward_backward(betas):
    h = (torch.randn(300, 2 * 3072, device=DEV) * 8).to(torch.bfloat16).requires_grad_(True)
    gate, up = h[:, :3072], h[:, 3072:]  # strided halves of a fused gate_up output, as in the experts
    fast = load_fast("situ_glu")
    y, y_ref = fast(gate, up, *betas), ops.situ_glu(gate, up, *betas)
    assert y.dtype == torch.bfloat16 and y.shape == y_ref.shape
    # both round the same f32 value to bf16: at most one bf16 ulp apart
    assert max_rel(y, y_ref) < 1e-2
    assert rel_err(y, y_ref) < 2e-3
    dy = torch.randn_like(y)
    (g,), (g_ref,) = torch.autograd.grad(y, [h], dy), torch.autograd.grad(y_ref, [h], dy)
    assert g.dtype == torch.bfloat16
    assert rel_err(g, g_ref) < 5e-3


def test_situ_glu_small_and_large_arguments():
    a = torch.tensor([0.0, 1e-6, -3e-4, 0.05, 0.0626, -0.07, 2.0, -30.0, 200.0], device=DEV)
    u = torch.tensor([1.0, -2.0, 1e-5, 0.3, 80.0, -300.0, 0.01, 1.0, 5.0], device=DEV)
    fast = load_fast("situ_glu")
    for betas in ((4.0, 25.0), (None, None), (2.0, None)):
        y, y_ref = fast(a, u, *betas), ops.situ_glu(a, u, *betas)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [7168, 3584, 1536, 512, 1000])
def test_rms_norm_rounds_where_the_reference_does(width, dtype):
    base = torch.randn(2, 301, width + 64, device=DEV) * 4
    base[0, 3] *= 1e-3  # a row of small values: the eps matters
    x = base[..., 32:32 + width].to(dtype)  # strided rows, as a sliced projection output
    w = (1 + 0.3 * torch.randn(width, device=DEV)).to(dtype)
    got, want = load_fast("rms_norm")(x, w, 1e-6), ops.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    # f32 statistics summed in another order: the one rounding to 16 bits may land one ulp off, rarely
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((got.float() - want.float()).abs() <= 2 * ulp + 1e-30).all()
    assert (got == want).float().mean().item() > 0.995
    # the normalised row is rounded before the weight (the reference's order): a product rounded once differs
    once = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    assert (got == want).float().mean().item() > (once == want).float().mean().item()


@pytest.mark.parametrize("head_dim", [128, 100])
def test_gated_rms_norm_against_the_f32_reference(head_dim):
    x = (torch.randn(3, 517, 16, head_dim, device=DEV) * 2).to(torch.bfloat16)
    x[1, 5] *= 1e-4
    gate = (torch.randn(3, 517, 2 * 16 * head_dim, device=DEV) * 4).to(torch.bfloat16)
    gate = gate[..., :16 * head_dim].view(3, 517, 16, head_dim)  # strided, as a slice of a wider projection
    w = 1 + 0.3 * torch.randn(head_dim, device=DEV)  # f32, as the model keeps it
    got, want = load_fast("gated_rms_norm")(x, gate, w, 1e-5), ops.gated_rms_norm(x, gate, w, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-30)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got == want).float().mean().item() > 0.99
    # one rounding at the end: a gate applied after rounding the normalised rows to bf16 would be further off
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w).to(torch.bfloat16)
    twice = (normed.float() * torch.sigmoid(gate.float())).to(torch.bfloat16)
    assert (got == want).float().mean().item() > (twice == want).float().mean().item()


# ---------------------------------------------------------------------------------------------------------- KDA gate


@pytest.mark.parametrize("heads,head_dim", [(32, 128), (6, 100)])
def test_kda_gate_against_the_reference(heads, head_dim):
    logits = (torch.randn(2, 777, 2 * heads * head_dim, device=DEV) * 4).to(torch.bfloat16)
    z = logits[..., :heads * head_dim].view(2, 777, heads, head_dim)  # strided, as a slice of a wider output
    A_log = torch.randn(heads + 3, device=DEV)  # padded past the heads, as the release stores it
    dt_bias = torch.randn(heads * head_dim, device=DEV)
    fast = load_fast("kda_gate")
    got, want = fast(z, A_log, dt_bias, -5.0), ops.kda_gate(z, A_log, dt_bias, -5.0)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # f32 throughout: a few ulp (the sigmoid's exp through exp2 loses relative accuracy only in its far tail, where
    # g is below 1e-9); a wrong head of A_log or channel of dt_bias is far outside this
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-12)
    assert not torch.allclose(fast(z, A_log.roll(1), dt_bias, -5.0), want, rtol=1e-3, atol=1e-6)
    assert torch.equal(fast(z, A_log, dt_bias, None), ops.kda_gate(z, A_log, dt_bias, None))  # softplus: reference


# ---------------------------------------------------------------------------------------------------------- AttnRes


@pytest.mark.parametrize("num_candidates", [1, 2, 9])
def test_block_attn_res_mix_forward_backward(num_candidates):
    d = 7168
    cands = [
        (torch.randn(2, 33, d, device=DEV) * (1 + i)).to(torch.bfloat16).requires_grad_(True)
        for i in range(num_candidates)
    ]
    norm_weight = (1 + 0.1 * torch.randn(d, device=DEV)).to(torch.bfloat16).requires_grad_(True)
    proj_weight = (0.05 * torch.randn(1, d, device=DEV)).to(torch.bfloat16).requires_grad_(True)
    fast = load_fast("block_attn_res_mix")
    y = fast(cands, norm_weight, proj_weight, 1e-5)
    y_ref = ops.block_attn_res_mix(cands, norm_weight, proj_weight, 1e-5)
    assert y.dtype == torch.bfloat16 and y.shape == y_ref.shape
    assert max_rel(y, y_ref) < 1e-2
    assert rel_err(y, y_ref) < 3e-3
    dy = torch.randn_like(y)
    params = cands + [norm_weight, proj_weight]
    grads, grads_ref = torch.autograd.grad(y, params, dy), torch.autograd.grad(y_ref, params, dy)
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape
        assert rel_err(g, g_ref) < 1e-2, (i, rel_err(g, g_ref))


def _mix_norm_inputs(shape, num_blocks, given):
    """bf16 blocks, prefix and/or delta with row 1 of the prefix side huge (x1e4) and row 2 zero everywhere (the
    mix is zero there: the norm's eps), and the layer's weights (res norm, res proj, eps, out norm, eps)."""
    d = shape[-1]
    blocks = [(torch.randn(shape, device=DEV) * (1 + i)).to(torch.bfloat16) for i in range(num_blocks)]
    prefix = (torch.randn(shape, device=DEV) * 3).to(torch.bfloat16) if "prefix" in given else None
    delta = torch.randn(shape, device=DEV).to(torch.bfloat16) if "delta" in given else None
    for t in [*blocks, prefix, delta]:
        if t is not None:
            t.view(-1, d)[2] = 0
    for t in (prefix, delta):
        if t is not None:
            t.view(-1, d)[1] *= 1e4
    res_norm = (1 + 0.1 * torch.randn(d, device=DEV)).to(torch.bfloat16)
    res_proj = (0.05 * torch.randn(1, d, device=DEV)).to(torch.bfloat16)
    out_norm = (1 + 0.3 * torch.randn(d, device=DEV)).to(torch.bfloat16)
    return blocks, prefix, delta, (res_norm, res_proj, 1e-5, out_norm, 1e-6)


def max_abs(t):
    return t.float().abs().max().item()


@pytest.mark.parametrize("given", ["prefix and delta", "prefix", "delta"])
@pytest.mark.parametrize("num_candidates", [1, 2, 4, 9])
@pytest.mark.parametrize("shape", [(2, 33, 7168), (3, 7, 100), (5, 1030), (4, 64), (3, 9000)])
def test_attn_res_mix_norm_against_the_reference(shape, num_candidates, given):
    blocks, prefix, delta, weights = _mix_norm_inputs(shape, num_candidates - 1, given)
    new_prefix, normed = load_fast("attn_res_mix_norm")(blocks, prefix, delta, *weights)
    # the reference as the model runs it without the fused twin: the add, then the AttnRes and RMSNorm twins
    want_prefix, want = ops.attn_res_mix_norm(blocks, prefix, delta, *weights)
    assert torch.equal(new_prefix, want_prefix) and (new_prefix is want_prefix) == (given != "prefix and delta")
    assert normed.dtype == torch.bfloat16 and normed.shape == want.shape
    # up to 2 candidates of at most 8192 the rows are held on chip and summed in another order than the separate
    # twins' (more: the separate twins themselves, bit for bit); the f32 sums' order moves a rounding to bf16 one
    # ulp, rarely, and where candidates nearly cancel an ulp of the candidates, not of the result
    ulp = torch.finfo(torch.bfloat16).eps
    assert ((normed.float() - want.float()).abs() <= 2 * ulp * want.float().abs() + ulp * max_abs(want)).all()
    assert (normed == want).float().mean().item() > 0.99
    if num_candidates > 2 or shape[-1] > 8192:
        assert torch.equal(normed, want)
    d = shape[-1]
    assert (normed.view(-1, d)[2] == 0).all()  # a zero row normalises to zeros (eps), no NaN
    assert torch.isfinite(normed).all()
    # the pure-PyTorch reference sums the scores in another order: the softmax weights move by f32 rounding, the mix
    # may round one ulp apart, more than an ulp of the result where candidates cancel: the AttnRes test's bounds
    with reference_only():
        ref_prefix, ref = ops.attn_res_mix_norm(blocks, prefix, delta, *weights)
    assert torch.equal(new_prefix, ref_prefix)
    assert max_rel(normed, ref) < 1e-2 and rel_err(normed, ref) < 3e-3
    assert (normed == ref).float().mean().item() > 0.99


def test_attn_res_mix_norm_refuses_what_it_cannot_compute():
    fast = load_fast("attn_res_mix_norm")
    x = torch.randn(2, 4, 64, device=DEV).to(torch.bfloat16)
    w, proj = torch.ones(64, device=DEV, dtype=torch.bfloat16), torch.ones(1, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs a prefix or a delta"):
        fast([x], None, None, w, proj, 1e-5, w, 1e-6)
    with pytest.raises(ValueError, match=r"0\.\.15 blocks, got 16"):
        fast([x] * 16, x, None, w, proj, 1e-5, w, 1e-6)
    with pytest.raises(ValueError, match="share shape, dtype and device"):
        fast([x[:, :3]], x, None, w, proj, 1e-5, w, 1e-6)
    with pytest.raises(ValueError, match="share shape, dtype and device"):
        fast([x], x, x.half(), w, proj, 1e-5, w, 1e-6)
    with pytest.raises(ValueError, match="out-norm weight"):
        fast([x], x, None, w, proj, 1e-5, w.float(), 1e-6)
    # what the twin refuses the declaration keeps on the reference: an f32 norm weight (legal for the module),
    # autograd, f32 rows
    fused = kernels.load("attn_res_mix_norm")
    assert dispatch.fast_or_reference("attn_res_mix_norm", x, x, None, w, proj, w) is fused
    assert dispatch.fast_or_reference("attn_res_mix_norm", x, x, None, w, proj, w.float()) is ops.attn_res_mix_norm
    assert dispatch.fast_or_reference("attn_res_mix_norm", x.float(), None, x.float(), w.float(), proj.float(),
                                      w.float()) is ops.attn_res_mix_norm
    assert dispatch.fast_or_reference("attn_res_mix_norm", x, x.clone().requires_grad_(True), w, proj,
                                      w) is ops.attn_res_mix_norm


def test_model_logits_with_and_without_the_fused_attn_res_op(monkeypatch):
    """A tiny bf16 model on CUDA runs the fused twin in every layer's two mixes (its first attention side excepted)
    and gives the logits it gives with the three separate ops (KIMIK3_REFERENCE_ONLY=attn_res_mix_norm)."""
    from kimik3.tiny import build_tiny_model

    model = build_tiny_model(num_hidden_layers=4).to(DEV, torch.bfloat16)
    ids = torch.randint(3, 128, (2, 37), device=DEV)
    fast = load_fast("attn_res_mix_norm")
    calls = []
    monkeypatch.setitem(kernels._cache, "attn_res_mix_norm", lambda *a: calls.append(1) or fast(*a))
    monkeypatch.delenv("KIMIK3_REFERENCE_ONLY", raising=False)
    with torch.no_grad():
        fused = model(ids).logits.float()
        assert len(calls) == 2 * 4 - 1
        monkeypatch.setenv("KIMIK3_REFERENCE_ONLY", "attn_res_mix_norm")
        separate = model(ids).logits.float()
    assert len(calls) == 2 * 4 - 1
    # the same new prefixes and mixes; a norm output one ulp apart in a rare element, carried through the layers
    assert rel_err(fused, separate) < 2e-3, rel_err(fused, separate)
    assert (fused.argmax(-1) == separate.argmax(-1)).float().mean().item() > 0.99


# ---------------------------------------------------------------------------------------------------------- MXFP4


def _mxfp4_inputs():
    packed = torch.randint(0, 256, (3, 96, 512), dtype=torch.uint8, device=DEV)
    scale = torch.randint(100, 140, (3, 96, 32), dtype=torch.uint8, device=DEV)
    scale[0, 0, :4] = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)
    return packed, scale


def test_mxfp4_dequant_bf16_bit_exact():
    packed, scale = _mxfp4_inputs()
    fast = load_fast("mxfp4_dequant")
    out = fast(packed, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 96, 1024)
    assert torch.equal(out, ops.dequantize_mxfp4(packed, scale, torch.bfloat16))
    torch.testing.assert_close(out.cpu(), ops.dequantize_mxfp4(packed.cpu(), scale.cpu(), torch.bfloat16),
                               rtol=0, atol=0)


def test_mxfp4_dequant_f32_bit_exact():
    # byte 0 makes denormals (2^-127 x code): the Triton kernel and the reference on CUDA must both equal the CPU
    packed, scale = _mxfp4_inputs()
    out = load_fast("mxfp4_dequant")(packed, scale, torch.float32)
    ref = ops.dequantize_mxfp4(packed.cpu(), scale.cpu(), torch.float32)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)
    torch.testing.assert_close(ops.dequantize_mxfp4(packed, scale, torch.float32).cpu(), ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------- router


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,experts", [((2, 2048, 7168), 64), ((1, 7168), 896), ((3, 5, 100), 70), ((0, 7168), 64)])
def test_router_logits_equal_the_reference(shape, experts, dtype):
    """The same SGEMM on the same f32 operands: bit-identical logits (the upcast is exact), also for a strided view
    and for non-finite and subnormal activations; one decode row, no rows, a ragged width."""
    x = torch.randn(*shape[:-1], 2 * shape[-1], device=DEV).to(dtype)[..., ::2]
    if x.numel():
        x[(0,) * (x.dim() - 1)][:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40]).to(dtype)
    w = (torch.randn(experts, shape[-1], device=DEV) * 0.02).to(dtype)
    y, y_ref = load_fast("router_logits")(x, w), ops.router_logits(x, w)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape == (*shape[:-1], experts)
    assert torch.equal(y.isnan(), y_ref.isnan()) and torch.equal(y.nan_to_num(), y_ref.nan_to_num())


# ---------------------------------------------------------------------------------------------------------- MoE


def _moe_inputs(num_tokens, num_experts=16, top_k=4, width=256, inter=128, requires_grad=False):
    x = torch.randn(num_tokens, width, device=DEV).to(torch.bfloat16)
    scores = torch.rand(num_tokens, num_experts, device=DEV)
    weights, indices = scores.topk(top_k, dim=-1, sorted=False)
    gate_up = (torch.randn(num_experts, 2 * inter, width, device=DEV) * width**-0.5).to(torch.bfloat16)
    down = (torch.randn(num_experts, width, inter, device=DEV) * inter**-0.5).to(torch.bfloat16)
    if requires_grad:
        x, weights, gate_up, down = (t.requires_grad_(True) for t in (x, weights, gate_up, down))
    return x, indices, weights, gate_up, down


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_moe_experts_forward(num_tokens):
    x, idx, w, gate_up, down = _moe_inputs(num_tokens)
    fast = load_fast("moe_experts")
    y = fast(x, idx, w, gate_up, down, 4.0, 25.0)
    with reference_only():
        y_ref = ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    assert max_rel(y, y_ref) < 2e-2
    assert rel_err(y, y_ref) < 5e-3


def test_moe_experts_unused_experts_and_no_sync():
    # every token on expert 3 and 5 only: empty groups must be handled
    x, _, w, gate_up, down = _moe_inputs(10, top_k=2)
    idx = torch.tensor([[3, 5]] * 10, device=DEV)
    fast = load_fast("moe_experts")
    y = fast(x, idx, w, gate_up, down, 4.0, 25.0)
    with reference_only():
        y_ref = ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    assert rel_err(y, y_ref) < 5e-3
    # the fast path never synchronises with the host (CUDA-graph capturable)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast(x, idx, w, gate_up, down, 4.0, 25.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_moe_experts_backward():
    x, idx, w, gate_up, down = _moe_inputs(64, requires_grad=True)
    fast = load_fast("moe_experts")
    dy = torch.randn(64, 256, device=DEV).to(torch.bfloat16)
    y = fast(x, idx, w, gate_up, down, 4.0, 25.0)
    with reference_only():
        y_ref = ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    params = (x, w, gate_up, down)
    grads = torch.autograd.grad(y, params, dy)
    grads_ref = torch.autograd.grad(y_ref, params, dy)
    for name, g, g_ref in zip(("x", "weights", "gate_up", "down"), grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
        assert rel_err(g, g_ref) < 2e-2, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("num_tokens", [1, 20, 300])
def test_moe_experts_mxfp4_forward_backward(num_tokens):
    x, idx, w, gate_up, down = _moe_inputs(num_tokens, requires_grad=True)
    packed = [ops.quantize_mxfp4(t.detach()) for t in (gate_up, down)]
    args = (packed[0][0], packed[0][1], packed[1][0], packed[1][1], 4.0, 25.0)
    fast = load_fast("moe_experts_mxfp4")
    y = fast(x, idx, w, *args)
    with reference_only():
        y_ref = ops.moe_experts_mxfp4(x, idx, w, *args)
    assert y.dtype == x.dtype and y.shape == y_ref.shape
    assert rel_err(y, y_ref) < 5e-3 and max_rel(y, y_ref) < 2e-2
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), dy)
    grads_ref = torch.autograd.grad(y_ref, (x, w), dy)
    for name, g, g_ref in zip(("x", "weights"), grads, grads_ref):
        assert rel_err(g, g_ref) < 2e-2, (name, rel_err(g, g_ref))


def _packed_grouped_case(counts, n, dtype):
    """(counts, group ends, packed, scale, the f32 dequantised experts, rows) of 6 packed experts [n, 512] with the
    E8M0 scales 0, 1, 200 and 127 in expert 0's first group, and counts[e] rows of x for expert e."""
    counts = torch.tensor(counts, device=DEV)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    packed, scale = ops.quantize_mxfp4(torch.randn(6, n, 512, device=DEV) * 0.05)
    scale[0, :4, 0] = torch.tensor([0, 1, 200, 127], dtype=torch.uint8)
    weight = ops.dequantize_mxfp4(packed, scale, torch.float32)
    xs = torch.randn(int(counts.sum()), 512, device=DEV).to(dtype)
    return counts, ends, packed, scale, weight, xs


# the tile kernels by (MXFP4_SCALED_DOT, MXFP4_WORD_TILES, MXFP4_WORD_TILES_BF16_PAIRS); f32 runs the
# byte-decoding kernel under each
TILE_KERNELS = {"scaled dot": (True, None, True), "bytes": (False, None, True), "words bf16": (True, "bf16", True),
                "words bf16 via f32": (True, "bf16", False), "words tf32": (True, "tf32", True)}


def _set_tile_kernel(monkeypatch, kernel):
    from kimik3.kernels import mxfp4

    names = ("MXFP4_SCALED_DOT", "MXFP4_WORD_TILES", "MXFP4_WORD_TILES_BF16_PAIRS")
    for name, value in zip(names, TILE_KERNELS[kernel]):
        monkeypatch.setattr(mxfp4, name, value)


@pytest.mark.parametrize("kernel", list(TILE_KERNELS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("counts", [[3, 0, 40, 1, 0, 7], [0, 0, 1, 0, 0, 0], [200, 0, 0, 0, 0, 513]])
def test_mxfp4_grouped_matmul_matches_grouped_mm_of_dequantised(counts, dtype, tol, kernel, monkeypatch):
    # the packed tiles dequantised inside the matmul = the dequantised experts times x, group by group; f32 uses
    # IEEE dots (no TF32); bf16 through tl.dot_scaled, the byte-decoding kernel or the word tiles
    from kimik3.kernels.mxfp4 import mxfp4_grouped_matmul

    _set_tile_kernel(monkeypatch, kernel)

    counts, ends, packed, scale, weight, xs = _packed_grouped_case(counts, 192, dtype)
    out = mxfp4_grouped_matmul(xs, packed, scale, ends)
    assert out.dtype == dtype and out.shape == (xs.shape[0], 192)
    starts = (ends - counts).tolist()
    ref = torch.cat([xs[a:b].double() @ weight[e].double().T for e, (a, b) in enumerate(zip(starts, ends.tolist()))])
    assert rel_err(out, ref) < tol, rel_err(out, ref)


# the prefill GEMMs: the word GEMM (the default: bf16 pairs for bf16 on Hopper), the same through its f32 decode (as
# on other GPUs), and the byte GEMM with the decoded weights on either MMA operand
GEMM_KERNELS = ["words", "words via f32", "bytes", "bytes, W_IS_A"]


def _set_gemm_kernel(monkeypatch, kernel):
    from kimik3.kernels import mxfp4

    monkeypatch.setattr(mxfp4, "MXFP4_GEMM_WORDS", kernel.startswith("words"))
    monkeypatch.setattr(mxfp4, "MXFP4_GEMM_W_IS_A", kernel == "bytes, W_IS_A")
    if kernel == "words via f32":
        monkeypatch.setattr(mxfp4, "_gemm_bf16_pairs", lambda xs: False)


@pytest.mark.parametrize("kernel", GEMM_KERNELS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("counts", [[3, 0, 40, 1, 0, 7], [0, 0, 1, 0, 0, 0], [200, 0, 0, 0, 0, 513],
                                    [129, 64, 0, 65, 300, 2]])
def test_mxfp4_grouped_gemm_matches_float64(counts, dtype, tol, kernel, monkeypatch):
    # the prefill GEMM (row blocks of 64-256 over all column blocks): groups ending inside, at and one past a row
    # block, empty groups, scales 0/1/200/127, N not a multiple of a column block; each GEMM kernel
    from kimik3.kernels import mxfp4

    _set_gemm_kernel(monkeypatch, kernel)
    if kernel == "words" and dtype == torch.bfloat16:  # the kernel the Hopper bf16 prefill runs
        assert mxfp4._gemm_bf16_pairs(torch.empty(0, dtype=dtype, device=DEV)) == (
            torch.cuda.get_device_capability()[0] == 9)
    counts, ends, packed, scale, weight, xs = _packed_grouped_case(counts, 200, dtype)
    out = mxfp4.mxfp4_grouped_gemm(xs, packed, scale, ends)
    assert out.dtype == dtype and out.shape == (xs.shape[0], 200)
    ref = grouped_product_f64(xs, weight, ends)
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    assert max_rel(out, ref) < 5 * tol, max_rel(out, ref)
    xs.requires_grad_(True)
    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(mxfp4.mxfp4_grouped_gemm(xs, packed, scale, ends), xs, dy)
    starts = (ends - counts).tolist()
    dx_ref = torch.cat([dy[a:b].double() @ weight[e].double() for e, (a, b) in enumerate(zip(starts, ends.tolist()))])
    assert rel_err(dx, dx_ref) < tol, rel_err(dx, dx_ref)


# --------------------------------------------------------------------------------------- few-rows grouped matmul


def _routed_counts(num_tokens, num_experts=64, top_k=16):
    """Rows per expert of `num_tokens` tokens routed to top_k of num_experts (decode: 16 or 128 routed rows)."""
    indices = torch.rand(num_tokens, num_experts, device=DEV).topk(top_k, dim=-1).indices
    return torch.bincount(indices.reshape(-1), minlength=num_experts)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("case", ["empty and single rows", "one row only", "rows past a block",
                                  "gate_up 1 token", "gate_up 8 tokens", "down 1 token", "down 8 tokens"])
def test_grouped_matmul_few_rows_matches_float64(case, dtype, tol):
    # decode shapes of the H200 benchmark model: 64 experts, top-16, gate_up 3584 -> 6144 and down 3072 -> 3584
    from kimik3.kernels.moe import grouped_matmul_few_rows

    shape, counts = {
        "empty and single rows": ((6, 192, 512), torch.tensor([3, 0, 1, 1, 0, 7])),
        "one row only": ((6, 192, 520), torch.tensor([0, 0, 1, 0, 0, 0])),  # K not a multiple of any BLOCK_K
        "rows past a block": ((3, 100, 256), torch.tensor([17, 0, 40])),  # several 16-row blocks of one expert
        "gate_up 1 token": ((64, 6144, 3584), _routed_counts(1)),
        "gate_up 8 tokens": ((64, 6144, 3584), _routed_counts(8)),
        "down 1 token": ((64, 3584, 3072), _routed_counts(1)),
        "down 8 tokens": ((64, 3584, 3072), _routed_counts(8)),
    }[case]
    num_experts, n, k = shape
    ends = torch.cumsum(counts.to(DEV), 0).to(torch.int32)
    weight = (torch.randn(num_experts, n, k, device=DEV) * k**-0.5).to(dtype)
    xs = torch.randn(int(counts.sum()), k, device=DEV).to(dtype)
    out = grouped_matmul_few_rows(xs, weight, ends)
    assert out.dtype == dtype and out.shape == (xs.shape[0], n)
    ref = grouped_product_f64(xs, weight, ends)
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    assert max_rel(out, ref) < 5 * tol, max_rel(out, ref)
    # the custom op the model calls runs this kernel on CUDA
    assert torch.equal(torch.ops.kimik3.grouped_matmul_few_rows(xs, weight, ends), out)


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_moe_experts_few_rows_path_matches_grouped_mm_path(num_tokens, monkeypatch):
    from kimik3.kernels import moe

    x, idx, w, gate_up, down = _moe_inputs(num_tokens, num_experts=64, top_k=16, width=1024, inter=512)
    fast = load_fast("moe_experts")
    with torch.no_grad(), TopLevelOps() as called:
        y = fast(x, idx, w, gate_up, down, 4.0, 25.0)
    assert "kimik3.grouped_matmul_few_rows" in called.names and "aten._grouped_mm" not in called.names
    monkeypatch.setattr(moe, "FEW_ROWS_PER_EXPERT", 0)  # the grouped_mm path for the same inputs
    with torch.no_grad(), TopLevelOps() as called:
        y_grouped = fast(x, idx, w, gate_up, down, 4.0, 25.0)
    assert "kimik3.grouped_matmul_few_rows" not in called.names and "aten._grouped_mm" in called.names
    assert y.dtype == x.dtype and y.shape == y_grouped.shape
    # the two differ only in the f32 summation order inside the matmuls before each rounding to bf16
    assert max_rel(y, y_grouped) < 2e-2
    assert rel_err(y, y_grouped) < 5e-3
    with reference_only():
        y_ref = ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    assert rel_err(y, y_ref) < 5e-3


def _assert_one_graph_with_op(step, x, idx, w, op: str, absent: str):
    """step(x, idx, w) under torch.compile(fullgraph=True): one graph, no break, both expert matmuls the custom op
    `op` as nodes (not traced into), `absent` nowhere, and the compiled result equals the eager one within bf16
    rounding (also for other inputs of the same shapes: no recompilation)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def recording_inductor(gm, example_inputs):
        graphs.append(gm.code)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend=recording_inductor)
        y = compiled(x, idx, w)
        y_again = compiled(x.flip(0), idx.flip(0), w.flip(0))
        eager = step(x, idx, w)
    assert len(graphs) == 1 and sum(counters["graph_break"].values()) == 0
    assert graphs[0].count(f"torch.ops.kimik3.{op}") == 2, graphs[0]
    assert absent not in graphs[0]
    assert rel_err(y, eager) < 5e-3 and max_rel(y, eager) < 2e-2
    assert rel_err(y_again, y.flip(0)) < 5e-3
    torch._dynamo.reset()


def test_moe_experts_few_rows_op_stays_in_the_compiled_graph():
    """moe_experts at decode size compiles into one graph with the few-rows custom op as its two matmuls."""
    from kimik3.kernels import moe

    x, idx, w, gate_up, down = _moe_inputs(2, num_experts=64, top_k=16, width=1024, inter=512)
    _assert_one_graph_with_op(lambda x, idx, w: moe.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0), x, idx, w,
                              "grouped_matmul_few_rows", absent="grouped_mm")


# ------------------------------------------------------------------------------------------- packed MXFP4 GEMV


def _packed_product_f64(xs, packed, scale, group_ends):
    """Each group of rows times its dequantised expert in float64, and |xs| @ |W|^T (the scale of f32 rounding
    errors of each output's sum); only the routed experts are dequantised."""
    out = torch.zeros(xs.shape[0], packed.shape[1], dtype=torch.float64, device=xs.device)
    bound = torch.zeros_like(out)
    start = 0
    for expert, end in enumerate(group_ends.tolist()):
        if end > start:
            weight = ops.dequantize_mxfp4(packed[expert], scale[expert], torch.float32).double()
            out[start:end] = xs[start:end].double() @ weight.T
            bound[start:end] = xs[start:end].double().abs() @ weight.abs().T
        start = end
    return out, bound


def _gemv_operands(shape, counts, dtype):
    """(group ends, packed codes, E8M0 scales 2^-17..2^-6, routed rows) for experts x N x K = `shape` and `counts`
    routed rows per expert."""
    num_experts, n, k = shape
    ends = torch.cumsum(counts.to(DEV), 0).to(torch.int32)
    packed = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, device=DEV)
    scale = torch.randint(110, 122, (num_experts, n, k // 32), dtype=torch.uint8, device=DEV)
    return ends, packed, scale, torch.randn(int(counts.sum()), k, device=DEV).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("case", ["empty and single rows", "partial blocks", "gate_up 1 token", "gate_up 2 tokens",
                                  "gate_up 8 tokens", "down 1 token", "down 2 tokens"])
def test_mxfp4_gemv_matches_float64(case, dtype, tol):
    # the GEMV against float64 products of the dequantised experts: every output within f32 rounding of its sum
    # (f32 input: no TF32) or one bf16 rounding, measured against |x| @ |W|^T; decode shapes of the H200 benchmark
    # model (64 experts, top-16, gate_up 3584 -> 6144, down 3072 -> 3584; 1, 2 and 8 tokens: 0-2 rows per expert)
    from kimik3.kernels.mxfp4 import mxfp4_gemv

    shape, counts = {
        "empty and single rows": ((6, 192, 512), torch.tensor([1, 0, 2, 1, 0, 0])),
        "partial blocks": ((5, 100, 544), torch.tensor([0, 1, 0, 2, 1])),  # N and K/32 not multiples of any block
        "gate_up 1 token": ((64, 6144, 3584), _routed_counts(1)),
        "gate_up 2 tokens": ((64, 6144, 3584), _routed_counts(2)),
        "gate_up 8 tokens": ((64, 6144, 3584), _routed_counts(8)),
        "down 1 token": ((64, 3584, 3072), _routed_counts(1)),
        "down 2 tokens": ((64, 3584, 3072), _routed_counts(2)),
    }[case]
    ends, packed, scale, xs = _gemv_operands(shape, counts, dtype)
    first = int(torch.nonzero(counts)[0])  # a routed expert: a denormal, a tiny and a large group scale
    scale[first, :3, 0] = torch.tensor([0, 1, 140], dtype=torch.uint8)
    n = packed.shape[1]
    out = mxfp4_gemv(xs, packed, scale, ends)
    assert out.dtype == dtype and out.shape == (xs.shape[0], n)
    ref, bound = _packed_product_f64(xs, packed, scale, ends)
    err = ((out.double() - ref).abs() / bound.clamp_min(1e-30)).max().item()
    assert err < tol, err
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    # the custom op the model calls runs this kernel on CUDA; the tile kernel computes the same product
    assert torch.equal(torch.ops.kimik3.mxfp4_gemv(xs, packed, scale, ends), out)
    tiles = torch.ops.kimik3.mxfp4_grouped_matmul(xs, packed, scale, ends)
    assert ((tiles.double() - ref).abs() / bound.clamp_min(1e-30)).max().item() < tol


@pytest.mark.parametrize("kernel", ["gemv", *TILE_KERNELS, *(f"gemm {k}" for k in GEMM_KERNELS)])
@pytest.mark.parametrize("dtype,tol,floor", [(torch.float32, 1e-6, 2.0 ** -144), (torch.bfloat16, 4e-3, 2.0 ** -130)])
def test_mxfp4_kernels_every_finite_scale_byte(dtype, tol, floor, kernel, monkeypatch):
    # output column c of both experts has every scale group at E8M0 byte c: all 253 bytes whose weights are finite
    # in f32 (253 and 254 overflow for the larger codes, 255 is NaN in the format), denormal factors 0 and 1
    # included; x at 2^-12 keeps byte 252's sums finite. Each output within the f32 (or one bf16) rounding of its
    # sum plus a few denormal steps, against float64; 17 scale groups (K not a multiple of any step) and 253 columns
    # (no multiple of a column block), one and two rows per expert; the GEMV, every tile kernel and every GEMM
    from kimik3.kernels import mxfp4

    counts = torch.tensor([1, 2])
    ends, packed, scale, xs = _gemv_operands((2, 253, 544), counts, dtype)
    scale.copy_(torch.arange(253, dtype=torch.uint8, device=DEV)[None, :, None].expand_as(scale))
    xs = (xs.float() * 2.0 ** -12).to(dtype)
    if kernel == "gemv":
        out = mxfp4.mxfp4_gemv(xs, packed, scale, ends)
    elif kernel.startswith("gemm "):
        _set_gemm_kernel(monkeypatch, kernel[len("gemm "):])
        out = mxfp4.mxfp4_grouped_gemm(xs, packed, scale, ends)
    else:
        _set_tile_kernel(monkeypatch, kernel)
        out = mxfp4.mxfp4_grouped_matmul(xs, packed, scale, ends)
    ref, bound = _packed_product_f64(xs, packed, scale, ends)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    excess = (out.double() - ref).abs() - (tol * bound + floor)
    assert excess.max().item() <= 0, excess.argmax().item()


def _packed_moe_inputs(num_tokens):
    x, idx, w, gate_up, down = _moe_inputs(num_tokens, num_experts=64, top_k=16, width=1024, inter=512)
    packed = [ops.quantize_mxfp4(t) for t in (gate_up, down)]
    return x, idx, w, (packed[0][0], packed[0][1], packed[1][0], packed[1][1], 4.0, 25.0)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_moe_experts_mxfp4_gemv_path_matches_tile_path(num_tokens, monkeypatch):
    """At decode sizes `moe_experts_mxfp4` runs both matmuls as the GEMV op, without a host synchronisation, and
    equals the tile kernel's path for the same inputs within bf16 rounding (they differ only in the f32 summation
    order inside the matmuls); forcing the constant to 0 gives the tile path."""
    from kimik3.kernels import mxfp4

    x, idx, w, args = _packed_moe_inputs(num_tokens)
    fast = load_fast("moe_experts_mxfp4")
    gemv, tiles = "kimik3.mxfp4_gemv", "kimik3.mxfp4_grouped_matmul"
    with torch.no_grad(), TopLevelOps() as called:
        y = fast(x, idx, w, *args)
    assert gemv in called.names and tiles not in called.names
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # CUDA-graph capturable: no host sync on the GEMV path
    try:
        with torch.no_grad():
            fast(x, idx, w, *args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(mxfp4, "MXFP4_GEMV_ROWS_PER_EXPERT", 0)
    with torch.no_grad(), TopLevelOps() as called:
        y_tiles = fast(x, idx, w, *args)
    assert tiles in called.names and gemv not in called.names
    assert y.dtype == x.dtype and y.shape == y_tiles.shape
    assert max_rel(y, y_tiles) < 2e-2
    assert rel_err(y, y_tiles) < 5e-3
    with reference_only():
        y_ref = ops.moe_experts_mxfp4(x, idx, w, *args)
    assert rel_err(y, y_ref) < 5e-3


def test_moe_experts_mxfp4_gemv_op_stays_in_the_compiled_graph():
    """moe_experts_mxfp4 at 2 tokens (32 rows, 64 experts) compiles into one graph with the GEMV custom op as its two
    matmuls."""
    from kimik3.kernels import mxfp4

    x, idx, w, args = _packed_moe_inputs(2)
    _assert_one_graph_with_op(lambda x, idx, w: mxfp4.moe_experts_mxfp4(x, idx, w, *args), x, idx, w, "mxfp4_gemv",
                              absent="mxfp4_grouped_matmul")


# ---------------------------------------------------------------------------------------------------------- conv step


def _assert_conv_matches_float64(x, weight, state, y, new_state):
    """A conv kernel's outputs against the reference's math in float64 (window of zeros without a state): within one
    rounding to x's dtype, contiguous, the new window bit-equal to the reference's."""
    batch, _, channels = x.shape
    previous = state if state is not None else x.new_zeros(batch, channels, weight.shape[-1] - 1)
    window = torch.cat([previous, x.transpose(1, 2)], dim=-1).double()
    exact = torch.nn.functional.conv1d(window, weight.double(), groups=channels)
    exact = torch.nn.functional.silu(exact).transpose(1, 2)
    assert y.dtype == x.dtype and y.is_contiguous() and new_state.is_contiguous()
    ulp = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-20  # f32: the sum's rounding and the GPU's exp
    assert ((y.double() - exact).abs() <= ulp * exact.abs() + 1e-6 * exact.abs().max()).all()
    assert torch.equal(new_state, ops.causal_conv1d(x, weight, state)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens,channels,width", [(1, 1, 12288, 4), (3, 1, 300, 4), (2, 5, 520, 4),
                                                         (2, 16, 700, 4), (1, 3, 64, 2)])
def test_causal_conv1d_step_matches_float64(batch, tokens, channels, width, dtype):
    """The decode conv kernel on strided x and state (a projection's columns, a transposed window) against the
    reference's math in float64: outputs within one rounding to the dtype, the new window bit-equal."""
    from kimik3.kernels import conv

    x = torch.randn(batch, tokens, 2 * channels, device=DEV).to(dtype)[..., ::2]
    weight = torch.randn(channels, 1, width, device=DEV) * 0.5  # F32 in the release
    state = torch.randn(batch, width - 1, channels, device=DEV).to(dtype).transpose(1, 2)
    _assert_conv_matches_float64(x, weight, state, *conv.causal_conv1d_step(x, weight, state))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens,channels,width,window", [
    (1, 8192, 12288, 4, False), (2, 300, 520, 4, True), (1, 2, 700, 4, True), (2, 1, 300, 4, False),
    (3, 65, 129, 2, True), (1, 200, 64, 3, False)])
def test_causal_conv1d_prefill_matches_float64(batch, tokens, channels, width, window, dtype):
    """The prefill conv kernel (token x channel tiles; with and without a cached window, fewer tokens than the window,
    ragged blocks) on strided x and window against the reference's math in float64: outputs within one rounding to
    the dtype, the new window bit-equal to the reference's."""
    from kimik3.kernels import conv

    x = torch.randn(batch, tokens, 2 * channels, device=DEV).to(dtype)[..., ::2]
    weight = torch.randn(channels, 1, width, device=DEV) * 0.5
    state = torch.randn(batch, width - 1, channels, device=DEV).to(dtype).transpose(1, 2) if window else None
    _assert_conv_matches_float64(x, weight, state, *conv.causal_conv1d_prefill(x, weight, state))


def test_causal_conv1d_op_runs_the_step_kernel_for_few_tokens_after_a_window(monkeypatch):
    """Up to CONV_STEP_MAX_TOKENS after a window: the step kernel; more, or no window: the prefill kernel."""
    from kimik3.kernels import conv

    calls = []
    step, prefill = conv.causal_conv1d_step, conv.causal_conv1d_prefill
    monkeypatch.setattr(conv, "causal_conv1d_step", lambda *a: calls.append(("step", a[0].shape[1])) or step(*a))
    monkeypatch.setattr(conv, "causal_conv1d_prefill",
                        lambda *a, **k: calls.append(("prefill", a[0].shape[1])) or prefill(*a, **k))
    weight = torch.randn(256, 1, 4, device=DEV)
    state = torch.randn(2, 256, 3, device=DEV, dtype=torch.bfloat16)
    for tokens in (1, conv.CONV_STEP_MAX_TOKENS, conv.CONV_STEP_MAX_TOKENS + 1):
        x = torch.randn(2, tokens, 256, device=DEV, dtype=torch.bfloat16)
        y, new_state = torch.ops.kimik3.causal_conv1d(x, weight, state)
        y_ref, state_ref = ops.causal_conv1d(x, weight, state)
        assert max_rel(y, y_ref) < 1e-2 and torch.equal(new_state, state_ref)
    torch.ops.kimik3.causal_conv1d(x[:, :1], weight, None)  # no window: a sequence's first tokens
    assert calls == [("step", 1), ("step", conv.CONV_STEP_MAX_TOKENS),
                     ("prefill", conv.CONV_STEP_MAX_TOKENS + 1), ("prefill", 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens,heads,head_dim,window", [
    (1, 8192, 96, 128, False), (2, 300, 3, 128, True), (1, 2, 4, 64, True), (3, 65, 5, 32, False),
    (1, 40, 3, 48, True)])
def test_causal_conv1d_prefill_l2norm_matches_the_reference(batch, tokens, heads, head_dim, window, dtype):
    """The conv with each head's L2 norm in the same tiles (q, k before fla's chunked KDA) against the reference's
    conv + `l2norm_heads`: within one rounding of the dtype (the norm's f32 sum order differs), each head of unit
    norm up to that rounding, the window bit-equal; 48 is no power of two: normalised after the kernel."""
    from kimik3.kernels import conv

    channels = heads * head_dim
    x = (2 * torch.randn(batch, tokens, 2 * channels, device=DEV)).to(dtype)[..., ::2]
    weight = torch.randn(channels, 1, 4, device=DEV) * 0.5
    state = torch.randn(batch, 3, channels, device=DEV).to(dtype).transpose(1, 2) if window else None
    y, new_state = conv.causal_conv1d_prefill(x, weight, state, l2norm_head_dim=head_dim)
    y_ref, state_ref = ops.causal_conv1d(x, weight, state, l2norm_head_dim=head_dim)
    # bf16: two roundings (the conv output, then the normalised value; either may land one ulp off where the f32 sums
    # differ in order); f32: also the GPU's sqrt and division. Absolute slack for outputs whose taps nearly cancel
    # (the sum's order moves them by an f32 ulp of the taps, as in the conv tests above); unit-norm heads: 1e-6
    ulp = 2.0**-6 if dtype == torch.bfloat16 else 2.0**-20
    assert y.dtype == dtype and y.is_contiguous() and torch.equal(new_state, state_ref)
    assert ((y.double() - y_ref.double()).abs() <= ulp * y_ref.double().abs() + 1e-6).all()
    norms = y.double().unflatten(-1, (heads, head_dim)).norm(dim=-1)
    assert ((norms - 1).abs() < 0.02).all()
    plain = ops.causal_conv1d(x, weight, state)[0]
    assert torch.equal(y, ops.l2norm_heads(plain, head_dim)) or max_rel(y, ops.l2norm_heads(plain, head_dim)) < 1e-2
    # the op: the prefill tiles with the norm past the step kernel's few tokens, else the step kernel followed by
    # the reference norm
    y_op, _ = torch.ops.kimik3.causal_conv1d(x, weight, state, head_dim)
    if tokens > conv.CONV_STEP_MAX_TOKENS or state is None:
        assert torch.equal(y_op, y)
    else:
        assert max_rel(y_op, y_ref) < 1e-2
    if window:
        y_step, _ = torch.ops.kimik3.causal_conv1d(x[:, :3], weight, state, head_dim)
        assert max_rel(y_step, ops.causal_conv1d(x[:, :3], weight, state, l2norm_head_dim=head_dim)[0]) < 1e-2


def test_model_prefill_with_qk_normalised_in_the_conv_matches_the_reference(monkeypatch):
    """A bf16 tiny model's prefill with q/k normalised in the conv (fla's chunked KDA then skipping its own pass)
    against the f32 model on the reference ops, as close to it as the same bf16 model with the fold switched off by
    running chunk_kda on its reference (which normalises in f32 itself): the conv's norm adds only bf16 noise."""
    from kimik3.kernels import conv

    seen = []
    prefill = conv.causal_conv1d_prefill
    fast_err, ref_err = tiny_prefill_errors_fast_and_reference_kda(monkeypatch, lambda: monkeypatch.setattr(
        conv, "causal_conv1d_prefill", lambda *a, **k: seen.append(k["l2norm_head_dim"]) or prefill(*a, **k)))
    assert sorted(set(seen)) == [0, 64] and seen.count(64) == 2 * seen.count(0)  # q, k normalised; v not
    assert fast_err < 1.5 * ref_err + 1e-2, (fast_err, ref_err)


# ---------------------------------------------------------------------------------------------------------- gather


@pytest.mark.parametrize("rows,width,picks", [(8192, 3584, 131072), (7, 100, 13), (5, 64, 0), (9, 1030, 40)])
def test_gather_rows_equals_index_select(rows, width, picks):
    from kimik3.kernels import moe

    x = torch.randn(rows, 2 * width, device=DEV).to(torch.bfloat16)[:, ::2]
    index = torch.randint(0, rows, (picks,), device=DEV)
    assert torch.equal(moe.gather_rows(x, index), x.index_select(0, index))


# ---------------------------------------------------------------------------------------------------------- MLA


@pytest.mark.parametrize("batch,s_len,seq_len", [(1, 1, 1), (2, 1, 1000), (3, 1, 4099), (2, 3, 9000)])
def test_mla_decode(batch, s_len, seq_len):
    heads, rank, rope = 96, 512, 64
    q = torch.randn(batch, heads, s_len, rank + rope, device=DEV).to(torch.bfloat16)
    cache = torch.randn(batch, seq_len, rank + rope, device=DEV).to(torch.bfloat16)
    scale = (128 + 64) ** -0.5
    # a static buffer's mask (the unfilled tail hidden), one sequence with every key hidden (uniform weights)
    keep = torch.ones(batch, 1, s_len, seq_len, dtype=torch.bool, device=DEV)
    keep[..., seq_len - seq_len // 3:] = False
    keep[-1] = False
    fast = load_fast("mla_decode")
    for mask in (None, keep, keep.expand(batch, heads, s_len, seq_len)):
        out, probs = fast(q, cache, scale, rank, mask)
        assert out.shape == (batch, heads, s_len, rank) and out.dtype == q.dtype and probs is None
        # the reference rounds at the same points (bf16 scores, scaled scores, probabilities): a bf16 ulp or two
        want = ops.mla_decode(q, cache, scale, rank, mask)[0]
        assert rel_err(out, want) < 2e-3 and max_rel(out, want) < 2e-2
        # and the f32 computation on the same bf16 values is near (bf16 probabilities: about 1e-2 off)
        assert rel_err(out, ops.mla_decode(q.float(), cache.float(), scale, rank, mask)[0]) < 3e-2
    if batch > 1 and seq_len > 1:  # the mask is applied
        unmasked = fast(q, cache, scale, rank)[0]
        assert rel_err(fast(q, cache, scale, rank, keep)[0][:-1], unmasked[:-1]) > 0.1


def test_mla_decode_op_in_a_compiled_cuda_graph():
    """The op as the static-cache step runs it: compiled with mode reduce-overhead (a CUDA graph), one node."""
    q = torch.randn(2, 96, 1, 576, device=DEV).to(torch.bfloat16)
    cache = torch.randn(2, 3000, 576, device=DEV).to(torch.bfloat16)
    keep = torch.arange(3000, device=DEV) < torch.tensor([3000, 1200], device=DEV)[:, None]
    fast = load_fast("mla_decode")
    step = torch.compile(lambda q, c, m: fast(q, c, 0.07, 512, m[:, None, None, :])[0], mode="reduce-overhead",
                         fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            got = step(q, cache, keep)
        want = ops.mla_decode(q, cache, 0.07, 512, keep[:, None, None, :])[0]
    assert rel_err(got, want) < 2e-3


# ---------------------------------------------------------------------------------------------------------- dispatch


def test_dispatch_on_cuda():
    x = torch.randn(4, 8, device=DEV)
    available = kernels.available_ops()
    for name in ("situ_glu", "block_attn_res_mix", "attn_res_mix_norm", "moe_experts", "mla_decode", "mxfp4_dequant",
                 "router_logits"):
        assert available[name] is True, (name, available[name])
    for name in ("situ_glu", "block_attn_res_mix", "mla_decode", "mxfp4_dequant"):
        assert dispatch.fast_or_reference(name, x) is kernels.load(name), name
    assert dispatch.fast_or_reference("moe_experts", x) is ops.moe_experts  # f32: half-only
    assert dispatch.fast_or_reference("moe_experts", x.bfloat16()) is kernels.load("moe_experts")
    assert dispatch.fast_or_reference("router_logits", x) is ops.router_logits  # f32 activations: nothing to upcast
    assert dispatch.fast_or_reference("router_logits", x.bfloat16()) is kernels.load("router_logits")
    assert dispatch.fast_or_reference("situ_glu", x, torch.randn(4, 8)) is ops.situ_glu  # one CPU tensor: reference
    with reference_only():
        assert dispatch.fast_or_reference("situ_glu", x) is ops.situ_glu
    assert dispatch.fast_or_reference("situ_glu", x) is kernels.load("situ_glu")
