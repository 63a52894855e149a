"""The packed MXFP4 kernels' inline PTX word decodes, run on the CPU by a small interpreter of the PTX they use (the
GPU tests run them on the GPU; CI has none): every E2M1 code at every nibble of a word, and for the bf16 pairs every
E8M0 scale byte, against the format's table (ops_kimi_k3.dequantize_mxfp4's values). A wrong shift, mask, register
or output order in the PTX text fails here."""

import re

import numpy as np
import pytest
import torch

from kimik3.kernels import mxfp4
from kimik3.modeling import ops_kimi_k3 as ops


def _e2m1_values():
    # code c -> its value: the reference dequantisation of bytes whose low nibble is c (scale byte 127: 2^0)
    packed = torch.arange(16, dtype=torch.uint8).reshape(1, 16)  # 16 bytes: low nibble c, high nibble 0
    values = ops.dequantize_mxfp4(packed, torch.full((1, 1), 127, dtype=torch.uint8), torch.float64)
    return values.reshape(16, 2)[:, 0].numpy()  # element 2i is byte i's low nibble


def _text(constant):
    return getattr(constant, "value", constant)


def _halves_to(bits16, dtype):
    return torch.from_numpy(bits16.astype(np.int16)).view(dtype)


def _run_ptx(text, inputs, n_out):
    """Interpret the PTX subset the decodes use over numpy uint32 lanes. inputs: operand number -> uint32 array;
    returns the outputs $0..$(n_out-1) as uint32 lanes (16-bit outputs in the low half)."""
    regs = {f"${i}": v.astype(np.uint32) for i, v in inputs.items()}
    ops_seen = set()

    def val(token):
        token = token.strip()
        if token.startswith("0x"):
            return np.uint32(int(token, 16))
        if token.isdigit():
            return np.uint32(int(token))
        return regs[token]

    def halves(x):
        x = np.asarray(x, dtype=np.uint32)
        return (x & 0xFFFF).astype(np.uint16), (x >> 16).astype(np.uint16)

    def pair(lo, hi):
        return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)

    def mul16(a, b, dtype):
        (alo, ahi), (blo, bhi) = halves(a), halves(b)
        out = []
        for x, y in ((alo, blo), (ahi, bhi)):
            prod = _halves_to(x, dtype).double() * _halves_to(y, dtype).double()  # exact here, rounded below
            out.append(prod.to(dtype).view(torch.int16).numpy().astype(np.uint16))
        return pair(*out)

    body = text.strip().strip("{}")
    for line in body.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        ops_seen.add(op)
        if op == "mov.b32" and rest.startswith("{"):  # unpack a register into two 16-bit halves
            names, src = re.match(r"\{([^}]*)\},(.*)", rest.replace(" ", "")).groups()
            lo_name, hi_name = names.split(",")
            lo, hi = halves(val(src))
            regs[lo_name], regs[hi_name] = lo.astype(np.uint32), hi.astype(np.uint32)
            continue
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            regs[args[0]] = np.broadcast_to(val(args[1]), next(iter(inputs.values())).shape).astype(np.uint32)
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]).astype(np.uint64) << int(args[2])).astype(np.uint32)
        elif op == "shr.b32":
            regs[args[0]] = val(args[1]) >> np.uint32(int(args[2]))
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            regs[args[0]] = val(args[1]) | val(args[2])
        elif op == "mul.rn.bf16x2":
            regs[args[0]] = mul16(val(args[1]), val(args[2]), torch.bfloat16)
        elif op == "mul.rn.f16x2":
            regs[args[0]] = mul16(val(args[1]), val(args[2]), torch.float16)
        elif op == "cvt.f32.f16":
            f16 = _halves_to((val(args[1]) & 0xFFFF).astype(np.uint16), torch.float16)
            regs[args[0]] = f16.float().view(torch.int32).numpy().astype(np.uint32)
        else:
            raise AssertionError(f"the PTX uses {op!r}, which this interpreter does not know: extend it")
    return [regs[f"${i}"] for i in range(n_out)], ops_seen


def _words_with_every_code():
    # words whose nibble i runs over all 16 codes (the other nibbles random), for each of the 8 nibbles
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(8, 16), dtype=np.uint64).astype(np.uint32)
    for i in range(8):
        words[i] = (words[i] & ~np.uint32(0xF << (4 * i))) | (np.arange(16, dtype=np.uint32) << np.uint32(4 * i))
    return words.reshape(-1)


def _codes(words, i):
    return ((words >> np.uint32(4 * i)) & 15).astype(np.int64)


@pytest.mark.parametrize("name,scale", [("_E2M1_F16_PAIRS_PTX", 2.0 ** -14), ("_E2M1_F16_PAIRS_EXACT_PTX", 1.0)])
def test_f16_pair_decodes_give_every_code_at_every_nibble(name, scale):
    # the GEMV's decode (2^-14 times each value) and the word tiles' f32 decode (the values): output i is nibble i
    values = _e2m1_values()
    words = _words_with_every_code()
    outs, seen = _run_ptx(_text(getattr(mxfp4, name)), {8: words}, 8)
    assert "cvt.f32.f16" in seen
    for i, out in enumerate(outs):
        got = out.view(np.float32).astype(np.float64)
        want = values[_codes(words, i)] * scale
        assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want)), i


def test_bf16_pair_decode_gives_every_code_times_every_scale_byte():
    # the word tiles' bf16 decode: output i is nibble i times the group's scale 2^(s - 127), as bf16, for every
    # E8M0 byte but the NaN one (255), the pair built as `_e8m0_bf16_pair` builds it (its denormal byte 0 included);
    # 253 and 254 overflow to infinity for the larger codes, as the format's value does in bf16
    values = _e2m1_values()
    words = _words_with_every_code()
    text = _text(mxfp4._E2M1_BF16_PAIRS_SCALED_PTX)
    for s in range(255):
        half = 0x0040 if s == 0 else s << 7
        scale_pair = np.full(words.shape, half | (half << 16), dtype=np.uint32)
        outs, seen = _run_ptx(text, {8: words, 9: scale_pair}, 8)
        assert "mul.rn.bf16x2" in seen
        for i, out in enumerate(outs):
            got = _halves_to((out & 0xFFFF).astype(np.uint16), torch.bfloat16).double().numpy()
            want = torch.from_numpy(values[_codes(words, i)] * 2.0 ** (s - 127)).to(torch.bfloat16).double().numpy()
            assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want)), (s, i)
            if s <= 252:
                assert np.isfinite(got).all() and np.array_equal(got, values[_codes(words, i)] * 2.0 ** (s - 127))
