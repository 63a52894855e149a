"""fp32 on CUDA is fp32: the fast path of an fp32 model within 2e-4 of the same model on the pure-PyTorch references
on the same GPU, for the chunked prefill, eager decode steps over the cache, compiled static-cache decode, and packed
MXFP4 experts; greedy tokens and the routers' expert choices identical on prompts with no router tie closer than
f32 rounding (MIN_ROUTER_MARGIN). fla's chunk kernel multiplies in TF32, so at
PyTorch's default fp32 matmul precision chunk_kda keeps its reference for fp32 (dispatch_kimi_k3, FastOp.tf32_dots);
with TF32 allowed it runs again."""

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from gpu_helpers import reference_only  # noqa: E402

BOUND = 2e-4


def _model(packed):
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64)
    return (packed_mxfp4_copy(model) if packed else model).cuda().eval()


def _routes(model):
    """Hooks on every MoE gate: the chosen experts of each token, and each token's margin between the k-th and the
    (k+1)-th biased score (how far it is from routing elsewhere)."""
    chosen, margins = [], []

    def hook(gate, args, out):
        logits, _, indices = out
        biased = torch.sigmoid(logits.float()) + gate.e_score_correction_bias.float()
        top = biased.topk(gate.top_k + 1, dim=-1).values
        margins.append((top[..., -2] - top[..., -1]).min().item())
        chosen.append(indices.sort(-1).values.cpu())

    gates = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    return chosen, margins, [gate.register_forward_hook(hook) for gate in gates]


def _prefill_and_decode(model, ids, steps=6):
    chosen, margins, handles = _routes(model)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits, past, tokens = [out.logits.float()], out.past_key_values, []
        for _ in range(steps):
            token = logits[-1][:, -1:].argmax(-1)
            tokens.append(token)
            out = model(token, past_key_values=past, use_cache=True)
            logits.append(out.logits.float())
            past = out.past_key_values
    for handle in handles:
        handle.remove()
    return logits, torch.cat(tokens, 1), chosen, min(margins)


# A router score tie closer than the f32 rounding a layer stack accumulates (about 1e-6 on a score here) routes the
# token by whichever sum came out ahead: two exact f32 implementations of different summation order disagree there,
# and that token's logits by the experts' difference (0.0068 on a prompt with a 4e-6 tie). So the prompts are ones
# whose every routing decision is at least this far from a tie; 2 x 300 random tokens on this model have a closest
# tie between 2e-6 and 3e-5 (measured on 12 prompts), so a few of 20 qualify.
MIN_ROUTER_MARGIN = 2e-5


def _prompt_without_router_ties(model, shape):
    for seed in range(20):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        ids = torch.randint(3, 128, shape, device="cuda", generator=generator)
        with reference_only():
            reference = _prefill_and_decode(model, ids)
        if reference[-1] > MIN_ROUTER_MARGIN:
            return ids, reference
    raise AssertionError(f"no prompt of 20 routes every token {MIN_ROUTER_MARGIN} away from a tie")


@pytest.mark.parametrize("packed", [False, True], ids=["bf16-experts-format-dense", "packed-mxfp4"])
def test_fp32_fast_path_prefill_and_decode_within_2e4_of_the_references(packed):
    model = _model(packed)
    # several KDA chunks, a prompt of no chunk multiple
    ids, (ref_logits, ref_tokens, ref_routes, _) = _prompt_without_router_ties(model, (2, 300))
    fast_logits, fast_tokens, fast_routes, _ = _prefill_and_decode(model, ids)
    for step, (a, b) in enumerate(zip(fast_logits, ref_logits)):
        assert (a - b).abs().max().item() < BOUND, (step, (a - b).abs().max().item())
    assert torch.equal(fast_tokens, ref_tokens)
    assert all(torch.equal(a, b) for a, b in zip(fast_routes, ref_routes))


def test_fp32_compiled_static_decode_within_2e4_and_greedy_identical():
    model = _model(False)
    ids = torch.randint(3, 128, (1, 200), device="cuda")
    kwargs = {"max_new_tokens": 12, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        compiled = model.generate(ids, cache_implementation="static", **kwargs)
        with reference_only():
            torch._dynamo.reset()
            reference = copy.deepcopy(model).generate(ids, disable_compile=True, **kwargs)
    torch._dynamo.reset()
    assert torch.equal(compiled.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(compiled.logits, reference.logits)):
        assert (a.float() - b.float()).abs().max().item() < BOUND, step


def test_tf32_allowed_puts_fla_chunk_kda_back():
    from kimik3.modeling import dispatch_kimi_k3 as dispatch

    x = torch.randn(2, 3, device="cuda")
    assert dispatch.fast_or_reference("chunk_kda", x) is dispatch.FAST_OPS["chunk_kda"].reference
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert dispatch.fast_or_reference("chunk_kda", x) is not dispatch.FAST_OPS["chunk_kda"].reference
    finally:
        torch.set_float32_matmul_precision(previous)
