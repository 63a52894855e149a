"""generate(cache_implementation="static") on CUDA: generate() compiles the decode step by itself (torch.compile,
mode="reduce-overhead", so CUDA graphs); the compiled steps must reproduce an eager forward over the same tokens."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from gpu_helpers import rel_err  # noqa: E402


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
    decoded = torch.stack(out.logits, dim=1).float()  # [B, 10, V]: the prefill's last logits, then 9 compiled steps
    with torch.no_grad():  # teacher-forced over the generated tokens, no cache
        eager = model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
        gold = gold_model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
    if dtype == torch.float32:
        assert rel_err(decoded, eager) < 5e-3
    else:
        # the compiler keeps fused intermediates in f32, so bf16 rounding differs from eager's: measure both against
        # the f32 model and ask the compiled steps to be as close to it as eager bf16 is
        assert rel_err(decoded, gold) < 1.5 * rel_err(eager, gold) + 5e-3
    torch._dynamo.reset()


@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_static_decode_keeps_packed_mxfp4_experts_on_the_triton_kernel(batch, monkeypatch):
    """Packed experts in the compiled decode step: one graph, no break, a CUDA graph, the Triton packed kernels
    (kimik3 custom ops: GEMV or tiles) and never the dequantising reference, and the decode of the uncompiled
    packed model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gpu_helpers import load_fast
    from kimik3.kernels import triton_ops
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
        monkeypatch.setattr(triton_ops, name, spy_triton(getattr(triton_ops, name)))
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

    decoded = torch.stack(out.logits, dim=1).float()
    with torch.no_grad():  # the uncompiled packed model over the same tokens (Triton kernel too), and the f32 gold
        eager = model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
        gold = gold_model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
    # as in the bf16 case above: the compiler's fused f32 intermediates round differently from eager bf16
    assert rel_err(decoded, gold) < 1.5 * rel_err(eager, gold) + 5e-3
    assert rel_err(decoded, eager) < 2 * rel_err(eager, gold) + 5e-3
    torch._dynamo.reset()
