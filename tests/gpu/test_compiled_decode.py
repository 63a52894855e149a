"""generate(cache_implementation="static") on CUDA: generate() compiles the decode step by itself (torch.compile,
mode="reduce-overhead", so CUDA graphs); the compiled steps must reproduce the same decode uncompiled and an eager
forward over the same tokens."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from gpu_helpers import reference_only, rel_err  # noqa: E402


def f32_reference_logits(gold_model, sequences):
    """The f32 model's logits at the decoded positions, on every op's pure-PyTorch reference (the gold of the other
    GPU tests: no fast path's own rounding in it)."""
    with torch.no_grad(), reference_only():
        return gold_model(sequences, use_cache=False).logits.float()[:, 11:-1]


def uncompiled_decode_logits(model, sequences, prompt_length=12):
    """The same decode without compiling, teacher-forced over `sequences`: the prefill, then one eager step per
    generated token on the model's own (dynamic) cache, so the same recurrent step kernels and state hand-over."""
    with torch.no_grad():
        out = model(sequences[:, :prompt_length], use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(prompt_length, sequences.shape[1] - 1):
            out = model(sequences[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1).float()


def assert_compiling_keeps_decode_accuracy(model, gold_model, out):
    """bf16: the compiler keeps fused intermediates in f32, so its roundings differ from eager's; measured against
    the f32 model, the compiled steps must be as close to it as the same decode uncompiled, and within the bf16
    noise of the teacher-forced forward. (The uncompiled decode is the baseline, not that forward: at a sensitive
    position the recurrent step and fla's chunked prefill round apart. On the H200 (docs/benchmarks_history.md,
    session 16) the uncompiled decode, like the pure-PyTorch chunked KDA forward, was 0.050 from the f32 model where
    fla's prefill was 0.024: 0.14-0.15 at one position where fla's was 0.03.)"""
    decoded = torch.stack(out.logits, dim=1).float()  # [B, 10, V]: the prefill's last logits, then 9 compiled steps
    uncompiled = uncompiled_decode_logits(model, out.sequences)
    with torch.no_grad():
        eager = model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
    gold = f32_reference_logits(gold_model, out.sequences)
    assert rel_err(decoded, gold) < 1.5 * rel_err(uncompiled, gold) + 5e-3
    assert rel_err(decoded, eager) < 2 * rel_err(eager, gold) + 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_auto_compiled_static_decode_matches_eager_forward(batch, dtype):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from kimik3.tiny import build_tiny_model

    gold_model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).cuda()
    model = copy.deepcopy(gold_model).to(dtype)
    ids = torch.randint(3, 128, (batch, 12), device="cuda")
    torch._dynamo.reset()
    counters.clear()
    out = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                         cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    assert counters["stats"]["unique_graphs"] >= 1, "generate() did not compile the static decode step"
    assert sum(counters["graph_break"].values()) == 0
    assert counters["inductor"].get("cudagraph_skips", 0) == 0, "the compiled step does not run as a CUDA graph"
    if dtype == torch.float32:
        decoded = torch.stack(out.logits, dim=1).float()  # [B, 10, V]: the prefill's last logits, then 9 steps
        with torch.no_grad():  # teacher-forced over the generated tokens, no cache
            eager = model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
        assert rel_err(decoded, eager) < 5e-3
    else:
        assert_compiling_keeps_decode_accuracy(model, gold_model, out)
    torch._dynamo.reset()


@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_static_decode_keeps_packed_mxfp4_experts_on_the_triton_kernel(batch, monkeypatch):
    """Packed experts in the compiled decode step: one graph, no break, a CUDA graph, the Triton packed kernels
    (kimik3 custom ops: GEMV or tiles) and never the dequantising reference, and the decode of the uncompiled
    packed model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gpu_helpers import load_fast
    from kimik3.kernels import mxfp4
    from kimik3.modeling import ops_kimi_k3 as ops
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    load_fast("moe_experts_mxfp4")  # the twin is there (Triton, grouped_mm), or the reason why not
    dense = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).cuda()
    gold_model = packed_mxfp4_copy(dense)
    model = copy.deepcopy(gold_model).to(torch.bfloat16)
    ids = torch.randint(3, 128, (batch, 12), device="cuda")

    calls = {"triton": 0, "reference": 0}
    reference_dequant = ops.dequantize_mxfp4

    def spy_triton(launcher):  # either packed kernel (GEMV at one routed row per expert, tiles beyond)
        def spy(*args):
            calls["triton"] += 1
            return launcher(*args)
        return spy

    def spy_reference(*args, **kwargs):
        calls["reference"] += 1
        return reference_dequant(*args, **kwargs)

    for name in ("_mxfp4_grouped_matmul_fwd", "_mxfp4_gemv_fwd"):
        monkeypatch.setattr(mxfp4, name, spy_triton(getattr(mxfp4, name)))
    monkeypatch.setattr(ops, "dequantize_mxfp4", spy_reference)
    moe_layers = sum(1 for m in model.modules() if type(m).__name__ == "KimiK3Experts")
    with torch.no_grad():
        model(ids[:, :1])  # one eager token: the Triton kernel, twice per MoE layer
    assert calls == {"triton": 2 * moe_layers, "reference": 0}

    torch._dynamo.reset()
    counters.clear()
    calls.update(triton=0, reference=0)
    out = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                         cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    assert counters["stats"]["unique_graphs"] >= 1, "generate() did not compile the static decode step"
    assert sum(counters["graph_break"].values()) == 0
    assert counters["inductor"].get("cudagraph_skips", 0) == 0, "the compiled step does not run as a CUDA graph"
    # the reference would have been traced into the graph (a call at compile time); the kernel runs in the compiled
    # step's warm-up and CUDA-graph recording besides the eager prefill (which may dequantise the stack instead)
    assert calls["reference"] == 0
    assert calls["triton"] > 2 * moe_layers
    monkeypatch.undo()

    assert_compiling_keeps_decode_accuracy(model, gold_model, out)  # the packed kernels stay inside the graph
    torch._dynamo.reset()
