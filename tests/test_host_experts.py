"""The host experts kernel (kernels/csrc/mxfp4_host_experts.c through kimik3.kernels.mxfp4_host) against the
reference (ops_kimi_k3: dequantize_mxfp4, F.linear, situ_glu, rounded where routed_experts rounds) on odd shapes,
every E8M0 scale byte, f32 and bf16, and its refusals. The machines this suite runs on have a C compiler (gcc): a
build that fails here fails the test, it is not skipped."""

import pytest
import torch
import torch.nn.functional as F

from kimik3.kernels import mxfp4_host
from kimik3.modeling.ops_kimi_k3 import dequantize_mxfp4, situ_glu


def reference(x, offsets, gate_up, down, beta, linear_beta):
    """Each row's expert output before its routing weight, as ops_kimi_k3.routed_experts computes it."""
    outs = []
    for e in range(len(gate_up)):
        rows = x[offsets[e]:offsets[e + 1]]
        if rows.shape[0] == 0:
            continue
        gate, up = F.linear(rows, dequantize_mxfp4(*gate_up[e], x.dtype)).chunk(2, dim=-1)
        outs.append(F.linear(situ_glu(gate, up, beta, linear_beta), dequantize_mxfp4(*down[e], x.dtype)))
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])


def random_experts(counts, k, inter, generator, scale_bytes=(118, 130)):
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)

    def packed(rows, cols):
        return (torch.randint(0, 256, (rows, cols // 2), generator=generator, dtype=torch.uint8),
                torch.randint(*scale_bytes, (rows, cols // 32), generator=generator, dtype=torch.uint8))

    return offsets, [packed(2 * inter, k) for _ in counts], [packed(k, inter) for _ in counts]


def magnitudes(x, offsets, gate_up, down, beta, linear_beta):
    """Each output's sum of its terms' magnitudes, |SiTU-GLU(x W_gu)| |W_down|: what the f32 rounding of a sum in
    another order is proportional to (a term misread moves an output by about its share of this, far more)."""
    outs = []
    for e in range(len(gate_up)):
        rows = x[offsets[e]:offsets[e + 1]].float()
        if rows.shape[0] == 0:
            continue
        gate, up = F.linear(rows, dequantize_mxfp4(*gate_up[e], torch.float32)).chunk(2, dim=-1)
        outs.append(F.linear(situ_glu(gate, up, beta, linear_beta).abs(),
                             dequantize_mxfp4(*down[e], torch.float32).abs()))
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1], dtype=torch.float32)


def close(actual, expected, dtype):
    # f32: the weights are the reference's exactly, only the order of the f32 sums differs (a few ulps of the
    # largest partial sum); bf16: the same f32 sums rounded to bf16 may land one bf16 ulp apart
    scale = expected.float().abs().max().clamp_min(1.0)
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * float(scale))
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-8 * float(scale))


def test_the_kernel_builds_here():
    assert mxfp4_host.unavailable_reason() is None
    assert mxfp4_host.isa() in {"avx512-bf16", "avx512", "avx2", "scalar"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,inter,counts", [(32, 32, [1]), (96, 64, [3, 0, 9]), (160, 96, [8, 1, 17, 2]),
                                            (64, 160, [0, 0, 5])])
def test_odd_shapes_match_the_reference(dtype, k, inter, counts):
    generator = torch.Generator().manual_seed(k + inter + len(counts))
    offsets, gate_up, down = random_experts(counts, k, inter, generator)
    x = torch.randn(offsets[-1], k, generator=generator).to(dtype)
    for betas in ((4.0, 25.0), (None, None)):
        out = mxfp4_host.host_experts(x, offsets, gate_up, down, *betas)
        assert out.dtype == dtype and out.shape == x.shape
        expected = reference(x, offsets, gate_up, down, *betas)
        if dtype == torch.float32:
            # f32 sums of K then I terms in another order than the BLAS's: a few ulps of each output's magnitudes
            # (an output near cancellation differs by more than a few ulps of the largest output, as on AMD's BLAS)
            allowed = 4 * (k + inter) * 2.0**-24 * magnitudes(x, offsets, gate_up, down, *betas)
            excess = (out - expected).abs() - allowed
            assert excess.max() <= 0, f"{int((excess > 0).sum())} outputs past their rounding bound"
        else:
            close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_scale_byte(dtype):
    """Every E8M0 byte (0: the denormal 2^-127, 255: inf) as the scale of every group of gate_up, then of down (the
    other at byte 127, 2^0). Where no partial sum can reach f32's largest value (6 x 2^(byte-127) x the sum of the
    inputs' magnitudes below it), inf and NaN land exactly where the reference's do and the finite values agree as on
    ordinary scales. Above it (here bytes 241 and up for down, 247 and up for gate_up: scales of 2^114 and more, which
    no trained weight has; the load
    refuses only groups that decode past the dtype's largest value), whether a sum overflows, and whether two
    overflows of opposite sign meet as NaN, depends on the order of its terms, which differs between any two matmul
    implementations (a BLAS's, a GPU's, this kernel's): those bytes are counted, not compared."""
    generator = torch.Generator().manual_seed(1)
    k, inter = 64, 32
    offsets, gate_up, down = random_experts([3], k, inter, generator)
    (gate_up_codes, _), (down_codes, _) = gate_up[0], down[0]
    x = torch.randn(3, k, generator=generator).to(dtype)
    one = 127
    strict = edge = 0
    for byte in range(256):
        for where in ("gate_up", "down"):
            gate_byte, down_byte = (byte, one) if where == "gate_up" else (one, byte)
            stacks = ([(gate_up_codes, torch.full((2 * inter, k // 32), gate_byte, dtype=torch.uint8))],
                      [(down_codes, torch.full((k, inter // 32), down_byte, dtype=torch.uint8))])
            out = mxfp4_host.host_experts(x, offsets, *stacks, 4.0, 25.0)
            expected = reference(x, offsets, *stacks, 4.0, 25.0)
            # the largest sum magnitude below the scale: the inputs' (gate_up), SiTU's cap of 4 x 25 a value (down)
            below = float(x.float().abs().sum(-1).max()) if where == "gate_up" else 100.0 * inter
            if byte < 255 and 6.0 * 2.0 ** (byte - 127) * below < torch.finfo(torch.float32).max:
                strict += 1
                assert torch.equal(out.isnan(), expected.isnan()), (where, byte)
                assert torch.equal(out.isinf(), expected.isinf()), (where, byte)
                finite = expected.isfinite()
                if finite.any():
                    close(out[finite], expected[finite], dtype)
            else:
                edge += 1
    assert strict > 450 and edge < 40  # the order-dependent band is the top of the byte range only


def _refusal_inputs():
    generator = torch.Generator().manual_seed(2)
    offsets, gate_up, down = random_experts([2, 1], 64, 32, generator)
    return torch.randn(3, 64, generator=generator), offsets, gate_up, down


@pytest.mark.parametrize("edit, error, message", [
    (lambda x, o, g, d: (x, [0, 2, 2], g, d), ValueError, r"offsets \[0, 2, 2\] do not split 3 rows among 2 experts"),
    (lambda x, o, g, d: (x.half(), o, g, d), ValueError, "f32 or bf16 CPU tensor, got torch.float16"),
    (lambda x, o, g, d: (x, o, [g[0], (g[1][0].float(), g[1][1])], d), TypeError,
     "gate_up of expert 1: MXFP4 codes and scales are uint8"),
    (lambda x, o, g, d: (x, o, g, [(d[0][0][:, :8].contiguous(), d[0][1]), d[1]]), ValueError,
     r"down of expert 0: codes \(64, 8\) and scales \(64, 1\) do not make a packed \[64, 32\] matrix"),
    (lambda x, o, g, d: (x, o, [(g[0][0].t().contiguous().t(), g[0][1]), g[1]], d), ValueError,
     "contiguous CPU tensors"),
], ids=["host-kernel-offsets", "host-kernel-dtype", "host-kernel-codes-dtype", "host-kernel-shape",
        "host-kernel-not-contiguous"])
def test_refusals_name_what_is_wrong(edit, error, message):
    with pytest.raises(error, match=message):
        mxfp4_host.host_experts(*edit(*_refusal_inputs()), None, None)


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    """No compiler: the library is None and the reason names it; the op refuses by name (the callers run the
    reference, tests/test_offload_host_compute.py)."""
    monkeypatch.setattr(mxfp4_host, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KIMIK3_KERNEL_CACHE", str(tmp_path / "cache"))
    assert mxfp4_host.library() is None
    assert "no-such-cc" in mxfp4_host.unavailable_reason()
    with pytest.raises(RuntimeError, match="host experts kernel is not available: .*no-such-cc"):
        mxfp4_host.host_experts(torch.zeros(1, 32), [0, 1], [], [], None, None)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("value", ["0", "two", "-3"], ids=["host-threads-zero", "host-threads-not-a-number",
                                                          "host-threads-negative"])
def test_the_thread_count_from_the_environment_is_checked(monkeypatch, value):
    monkeypatch.setenv("KIMIK3_HOST_THREADS", value)
    with pytest.raises(ValueError, match=f"KIMIK3_HOST_THREADS='{value}': give a whole number of threads"):
        mxfp4_host.thread_count(4)


def test_the_thread_count_is_the_callers_or_the_environments(monkeypatch):
    monkeypatch.delenv("KIMIK3_HOST_THREADS", raising=False)
    assert mxfp4_host.thread_count(None) == torch.get_num_threads()
    assert mxfp4_host.thread_count(3) == 3
    # the kernel runs on the count it is given: one thread and two give the same values (each row's sums are one
    # thread's, whichever thread takes the row)
    generator = torch.Generator().manual_seed(9)
    offsets, gate_up, down = random_experts([3, 2], 64, 64, generator)
    x = torch.randn(5, 64, generator=generator)
    one = mxfp4_host.host_experts(x, offsets, gate_up, down, 4.0, 25.0, threads=1)
    assert torch.equal(mxfp4_host.host_experts(x, offsets, gate_up, down, 4.0, 25.0, threads=2), one)
    monkeypatch.setenv("KIMIK3_HOST_THREADS", "2")
    assert mxfp4_host.thread_count(3) == 2  # the environment wins: a measurement's knob


# ---------------------------------------------------------------------------------------------------------------
# The host step (`HostRouteStep`: one layer's routes in a CUDA stream's order; run at once on the CPU here)


def _stacks(num_experts, k, inter, generator):
    def packed(rows, cols):
        return (torch.randint(0, 256, (num_experts, rows, cols // 2), generator=generator, dtype=torch.uint8),
                torch.randint(118, 130, (num_experts, rows, cols // 32), generator=generator, dtype=torch.uint8))

    return packed(2 * inter, k), packed(k, inter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,k,inter,tokens,top_k,held", [
    (7, 96, 64, 3, 4, []), (7, 96, 64, 3, 4, [2, 5]), (5, 32, 160, 1, 5, [0, 1, 2, 3, 4]), (9, 160, 32, 6, 2, [8]),
    (5, 32, 96, 2, 5, [])])  # the last: every expert chosen, none held (the step's offsets fill its E + 1 places)
def test_the_host_step_gives_each_route_in_the_references_order(dtype, num_experts, k, inter, tokens, top_k, held):
    """Each route's expert output at its place in the order routed_experts takes the routes (by expert, stable), the
    routes the device holds (sent as -1 - expert) left zero, every route counted for its expert."""
    generator = torch.Generator().manual_seed(num_experts * k + tokens)
    gate_up, down = _stacks(num_experts, k, inter, generator)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    table = mxfp4_host.ExpertTable(gate_up, down, counts)
    step = mxfp4_host.HostRouteStep(table, tokens, top_k, dtype, 4.0, 25.0, torch.device("cpu"))
    x = torch.randn(tokens, k, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    sent = torch.where(torch.isin(ids, torch.tensor(held, dtype=ids.dtype)), -1 - ids, ids)  # held: -1 - expert
    got = mxfp4_host.host_routes_in_stream(x, sent, mxfp4_host.register_step(step))
    order = torch.argsort(ids.reshape(-1), stable=True)
    for place, route in enumerate(order.tolist()):
        expert, token = int(ids.reshape(-1)[route]), route // top_k
        if expert in held:
            assert not got[place].any()
        else:
            want = reference(x[token:token + 1], [0, 1], [(gate_up[0][expert], gate_up[1][expert])],
                             [(down[0][expert], down[1][expert])], 4.0, 25.0)
            close(got[place:place + 1], want, dtype)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=num_experts))


def _apart(codes, scales, inter):
    """An expert's gate_up as the release stores it: w1 and w3 in tensors of their own (new memory, not views)."""
    return (codes[:inter].clone(), codes[inter:].clone()), (scales[:inter].clone(), scales[inter:].clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_and_up_apart_give_the_fused_stacks_bits(dtype):
    """The kernel reads an expert's gate and up through pointers of their own: with w1 and w3 in separate tensors
    (the release's parts, (w2,) for down) the op and the stream's step give exactly the fused stacks' outputs. A
    kernel that took up's rows at gate's address + I rows would read past w1 here and differ."""
    generator = torch.Generator().manual_seed(21)
    num_experts, k, inter, tokens, top_k = 5, 96, 64, 3, 3
    (gu_codes, gu_scales), (dn_codes, dn_scales) = _stacks(num_experts, k, inter, generator)
    parts_gate_up = [_apart(gu_codes[e], gu_scales[e], inter) for e in range(num_experts)]
    parts_down = [((dn_codes[e].clone(),), (dn_scales[e].clone(),)) for e in range(num_experts)]
    x = torch.randn(7, k, generator=generator).to(dtype)
    offsets, chosen = [0, 2, 2, 7], [4, 0, 2]
    fused = mxfp4_host.host_experts(x, offsets, [(gu_codes[e], gu_scales[e]) for e in chosen],
                                    [(dn_codes[e], dn_scales[e]) for e in chosen], 4.0, 25.0)
    apart = mxfp4_host.host_experts(x, offsets, [parts_gate_up[e] for e in chosen], [parts_down[e] for e in chosen],
                                    4.0, 25.0)
    assert torch.equal(apart, fused)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    rows = torch.randn(tokens, k, generator=generator).to(dtype)
    outs = []
    for gate_up, down in (((gu_codes, gu_scales), (dn_codes, dn_scales)),
                          (([c for c, _ in parts_gate_up], [s for _, s in parts_gate_up]),
                           ([c for c, _ in parts_down], [s for _, s in parts_down]))):
        table = mxfp4_host.ExpertTable(gate_up, down, torch.zeros(num_experts, dtype=torch.int64))
        step = mxfp4_host.HostRouteStep(table, tokens, top_k, dtype, 4.0, 25.0, torch.device("cpu"))
        outs.append(mxfp4_host.host_routes_in_stream(rows, ids, mxfp4_host.register_step(step)))
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


@pytest.mark.parametrize("edit, message", [
    (lambda g: [((g[0][0][0],), g[0][1]), g[1]], "gate_up of expert 0: gate and up apart are two codes and two scales"),
    (lambda g: [g[0], ((g[1][0][0], g[1][0][1][:, :8].contiguous()), g[1][1])],
     r"gate_up of expert 1 \(up\): codes \(32, 8\)"),
], ids=["host-kernel-apart-one-part", "host-kernel-apart-up-shape"])
def test_gate_and_up_apart_are_checked_by_name(edit, message):
    x, offsets, gate_up, down = _refusal_inputs()
    apart = [_apart(codes, scales, 32) for codes, scales in gate_up]
    with pytest.raises(ValueError, match=message):
        mxfp4_host.host_experts(x, offsets, edit(apart), down, None, None)


def test_the_host_step_refuses_a_bad_route_and_other_shapes():
    generator = torch.Generator().manual_seed(3)
    gate_up, down = _stacks(4, 64, 32, generator)
    table = mxfp4_host.ExpertTable(gate_up, down, torch.zeros(4, dtype=torch.int64))
    step = mxfp4_host.HostRouteStep(table, 2, 2, torch.float32, 4.0, None, torch.device("cpu"))
    x = torch.randn(2, 64, generator=generator)
    for bad in ([[0, 4], [1, 2]], [[0, -5], [1, 2]]):  # past the experts, as a route or marked held
        with pytest.raises(RuntimeError, match="status -3: a route's expert id is out of range"):
            step.run(x, torch.tensor(bad))
    assert not step.out.any()  # nothing half computed is left as an output
    assert torch.equal(step.run(x, torch.tensor([[0, 3], [1, 2]])) != 0, torch.ones(4, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"built for x \(2, 64\) torch.float32 and routes \(2, 2\), given \(3, 64\)"):
        step.run(torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"routes' counts must be a contiguous int64 CPU tensor of 4 values"):
        mxfp4_host.ExpertTable(gate_up, down, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="the model's dtype must be f32 or bf16, got torch.float16"):
        mxfp4_host.HostRouteStep(table, 2, 2, torch.float16, 4.0, None, torch.device("cpu"))


def test_steps_of_one_shape_share_their_buffers_and_a_freed_step_is_named():
    """Every layer's step of one shape on one device shares one set of pinned buffers and workspace (their host
    functions run one after another in the stream's order); the registry holds steps weakly, so a freed model's steps
    go with it and the op names a step that is gone."""
    import gc

    generator = torch.Generator().manual_seed(5)
    tables = [mxfp4_host.ExpertTable(*_stacks(4, 64, 32, generator), torch.zeros(4, dtype=torch.int64))
              for _ in range(2)]
    first, second = (mxfp4_host.HostRouteStep(t, 2, 2, torch.float32, 4.0, None, torch.device("cpu")) for t in tables)
    other = mxfp4_host.HostRouteStep(tables[0], 3, 2, torch.float32, 4.0, None, torch.device("cpu"))
    assert first.buffers is second.buffers and other.buffers is not first.buffers
    x, ids = torch.randn(2, 64, generator=generator), torch.tensor([[0, 3], [1, 2]])
    number = mxfp4_host.register_step(second)
    want = second.run(x, ids)
    assert not torch.equal(first.run(x, ids), want)  # its own layer's experts, through the shared buffers
    assert torch.equal(mxfp4_host.host_routes_in_stream(x, ids, number), want)
    del second
    gc.collect()
    with pytest.raises(RuntimeError, match=f"host route step {number} is gone"):
        mxfp4_host.host_routes_in_stream(x, ids, number)



def test_the_host_step_carries_non_finite_rows_as_the_kernel_does():
    """Rows holding inf and NaN (a model gone wrong upstream) reach the step's outputs exactly as the kernel gives
    them for the same rows grouped by expert: the step neither hides them nor spreads them to other tokens' routes."""
    generator = torch.Generator().manual_seed(8)
    gate_up, down = _stacks(6, 64, 32, generator)
    table = mxfp4_host.ExpertTable(gate_up, down, torch.zeros(6, dtype=torch.int64))
    step = mxfp4_host.HostRouteStep(table, 3, 2, torch.float32, 4.0, 25.0, torch.device("cpu"))
    x = torch.randn(3, 64, generator=generator)
    x[0, 5], x[2, 7] = float("inf"), float("nan")
    ids = torch.tensor([[1, 4], [4, 0], [2, 1]])
    got = step.run(x, ids)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    want = mxfp4_host.host_experts(x[order // 2], offsets, [(gate_up[0][e], gate_up[1][e]) for e in experts],
                                   [(down[0][e], down[1][e]) for e in experts], 4.0, 25.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    token_one = (order // 2 == 1).nonzero().squeeze(1)  # token 1's routes: finite
    assert got[token_one].isfinite().all() and not got.isfinite().all()
