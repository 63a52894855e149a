"""Reference ops against the spec's formulas and the one piece of real K3 data (an MXFP4 test vector)."""

import math

import pytest
import torch

from kimik3.modeling.ops_kimi_k3 import (
    attention_with_lse,
    attn_res_mix_norm,
    block_attn_res_mix,
    dequantize_mxfp4,
    gated_rms_norm,
    quantize_mxfp4,
    rms_norm,
    situ_glu,
)

# Layer 4, expert 0, w1, row 0, group 0 of model-00005-of-000096.safetensors (k3_checkpoint.md 2.3).
REAL_PACKED = bytes.fromhex("AB4C18652C910439489458339 4B55B30".replace(" ", ""))
REAL_SCALE = 0x79
REAL_BF16_BITS = ("BCC0 BC80 BD00 3D00 8000 3C00 3D40 3D80 BD00 3C80 3C00 BC00 3D00 0000 BC00 3CC0 "
                  "8000 3D00 3D00 BC00 8000 3D40 3CC0 3CC0 3D00 BC00 3D40 BCC0 BCC0 3D40 0000 3CC0").split()


def test_mxfp4_real_k3_vector_low_nibble_first():
    packed = torch.tensor(list(REAL_PACKED), dtype=torch.uint8)[None]
    scale = torch.tensor([[REAL_SCALE]], dtype=torch.uint8)
    bits = [f"{b & 0xFFFF:04X}" for b in dequantize_mxfp4(packed, scale).view(torch.int16)[0].tolist()]
    assert bits == REAL_BF16_BITS
    swapped = ((packed & 0x0F) << 4) | (packed >> 4)
    assert [f"{b & 0xFFFF:04X}" for b in dequantize_mxfp4(swapped, scale).view(torch.int16)[0].tolist()] != bits
    assert torch.equal(quantize_mxfp4(dequantize_mxfp4(packed, scale).float())[0], packed)


def test_mxfp4_round_trip_and_shape_errors():
    packed = torch.randint(0, 256, (3, 8, 32), dtype=torch.uint8)
    scale = torch.randint(100, 140, (3, 8, 2), dtype=torch.uint8)
    dense = dequantize_mxfp4(packed, scale, torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(dense), torch.float32), dense)
    with pytest.raises(ValueError, match="MXFP4 shapes do not match"):
        dequantize_mxfp4(packed, scale[..., :1])


def test_mxfp4_every_scale_byte_is_an_exact_power_of_two():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes.flip(0) << 4)).repeat(256, 2)  # [256, 32]: every code in both nibbles
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 2)
    dense = dequantize_mxfp4(packed, scale, torch.float32)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for byte in (0, 1, 2, 100, 127, 200, 254, 255):
        for k in range(64):
            code = int(packed[byte, k // 2]) >> (4 * (k % 2)) & 15
            magnitude = e2m1[code & 7] * 2.0 ** (byte - 127) if byte < 255 else e2m1[code & 7] * math.inf
            expected = torch.tensor(-magnitude if code & 8 else magnitude, dtype=torch.float64).float()
            assert torch.equal(dense[byte, k], expected) or (expected.isnan() and dense[byte, k].isnan()), (byte, k)


def test_situ_formula_and_bound():
    a, u = torch.randn(1000) * 30, torch.randn(1000) * 300
    expected = (4 * torch.tanh(a / 4) * torch.sigmoid(a)) * (25 * torch.tanh(u / 25))
    torch.testing.assert_close(situ_glu(a, u, 4.0, 25.0), expected)
    assert situ_glu(a, u, 4.0, 25.0).abs().max() <= 100.0
    torch.testing.assert_close(situ_glu(a, u, None, None), torch.tanh(a) * torch.sigmoid(a) * u)


def test_attn_res_mix_uses_normalised_keys_and_raw_values():
    cands = [torch.randn(2, 3, 16) * s for s in (1.0, 10.0, 0.1)]
    gamma, proj = torch.randn(16), torch.randn(1, 16)
    w = gamma * proj[0]
    scores = torch.stack([(c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5) * w).sum(-1) for c in cands])
    expected = (torch.softmax(scores, 0).unsqueeze(-1) * torch.stack(cands)).sum(0)
    torch.testing.assert_close(block_attn_res_mix(cands, gamma, proj, 1e-5), expected)
    uniform = block_attn_res_mix(cands, gamma, torch.zeros(1, 16), 1e-5)
    torch.testing.assert_close(uniform, sum(cands) / 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_blocks", [0, 1, 3, 8])
@pytest.mark.parametrize("given", ["prefix and delta", "prefix", "delta"])
def test_attn_res_mix_norm_is_the_add_the_mix_and_the_norm(given, num_blocks, dtype):
    """The fused op's reference is the layer's three steps, bit for bit: P = prefix + delta (the one given otherwise,
    that tensor itself), the AttnRes mix of [*blocks, P], the RMSNorm of the mix."""
    shape = (2, 5, 48)
    blocks = [(torch.randn(shape) * (1 + i)).to(dtype) for i in range(num_blocks)]
    prefix = (torch.randn(shape) * 3).to(dtype) if "prefix" in given else None
    delta = torch.randn(shape).to(dtype) if "delta" in given else None
    res_w, proj_w = (1 + 0.1 * torch.randn(48)).to(dtype), (0.3 * torch.randn(1, 48)).to(dtype)
    out_w = (1 + 0.3 * torch.randn(48)).to(dtype)
    new_prefix, normed = attn_res_mix_norm(blocks, prefix, delta, res_w, proj_w, 1e-5, out_w, 1e-6)
    expected_prefix = prefix + delta if prefix is not None and delta is not None else prefix if delta is None else delta
    if prefix is None or delta is None:
        assert new_prefix is expected_prefix
    assert torch.equal(new_prefix, expected_prefix) and new_prefix.dtype == dtype
    mix = block_attn_res_mix([*blocks, expected_prefix], res_w, proj_w, 1e-5)
    assert torch.equal(normed, rms_norm(mix, out_w, 1e-6)) and normed.dtype == dtype
    with pytest.raises(ValueError, match="needs a prefix or a delta"):
        attn_res_mix_norm(blocks, None, None, res_w, proj_w, 1e-5, out_w, 1e-6)


def test_gated_rms_norm_is_f32_and_gated_per_channel():
    x, g, w = torch.randn(4, 8).bfloat16(), torch.randn(4, 8), torch.rand(8)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w * torch.sigmoid(g)).bfloat16()
    assert torch.equal(gated_rms_norm(x, g, w, 1e-5), expected)


def test_attention_blocks_merge_by_log_sum_exp():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 4)
    causal_full = torch.ones(5, 12, dtype=torch.bool).tril(7)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~causal_full, float("-inf"))
    expected = torch.softmax(scores, -1) @ v
    o1, l1 = attention_with_lse(q, k[:, :, :7], v[:, :, :7], 0.3, False)
    o2, l2 = attention_with_lse(q, k[:, :, 7:], v[:, :, 7:], 0.3, True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=1e-5)
