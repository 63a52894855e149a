"""Where a compiled static-cache decode departs from the f32 model (a diagnostic, not a test): the scenario of
`tests/gpu/test_compiled_decode.py` (tiny 4-layer model, seed 0, 12 prompt tokens, 10 greedy tokens; bf16 experts
or packed MXFP4), run once per variant, where a variant is a value of KIMIK3_REFERENCE_ONLY ("" = every fast path;
"chunk_kda" = the pure-PyTorch chunked KDA, so neither the decay inside fla's cumsum nor q/k normalised in the conv;
"attn_res_mix_norm", "situ_glu", ... one op on its reference). For each: the relative error against the f32 model of
the decoded logits (prefill + compiled steps) and of the eager forward over the same tokens, per position, and the
test's former bound (decoded < 1.5 x eager + 5e-3), where the f32 model runs the pure-PyTorch reference of
every op, and per position the eager forward's nearest router tie and whether it
routes some token apart from the f32 model; each variant with the static cache (compiled) and the dynamic one
(eager decode).

    python benchmarks/diagnostics/diagnose_compiled_decode_error.py --experts mxfp4 --batch 1 "" chunk_kda attn_res_mix_norm

On CPU (reference ops, compiled by inductor for CPU with --compile-on-cpu) it runs the same steps without CUDA graphs.
Prints and writes JSON (to $OUT or the working directory).
"""

import argparse
import copy
import json
import os
from pathlib import Path

import torch
from transformers import CompileConfig

from kimik3.tiny import build_tiny_model, packed_mxfp4_copy


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def routing(model, sequences, positions):
    """An eager forward over `sequences` with each MoE gate observed: per position (the decoded ones), the smallest
    margin over layers between the k-th and (k+1)-th biased router score (a near tie: another rounding may route
    the token elsewhere), and the top-k index sets per layer."""
    from kimik3.modeling.modeling_kimi_k3 import KimiK3MoEGate

    seen = []

    def hook(module, args, output):
        logits, _, indices = output
        biased = torch.sigmoid(logits.float()) + module.e_score_correction_bias.float()
        top = biased.topk(module.top_k + 1, dim=-1).values
        seen.append((top[:, -2] - top[:, -1], indices.sort(dim=-1).values))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, KimiK3MoEGate)]
    try:
        with torch.no_grad():
            model(sequences, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    batch, length = sequences.shape
    margins = torch.stack([m.view(batch, length)[:, positions] for m, _ in seen])  # [layers, B, P]
    sets = [i.view(batch, length, -1)[:, positions] for _, i in seen]
    return margins.amin(dim=(0, 1)), sets


def run(variant, experts, batch, device, compile_on_cpu, cache_implementation):
    import torch._dynamo

    os.environ.pop("KIMIK3_REFERENCE_ONLY", None)
    if variant:
        os.environ["KIMIK3_REFERENCE_ONLY"] = variant
    torch.manual_seed(0)  # as the GPU tests' autouse fixture: the same model and prompt as the test
    gold_model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).to(device)
    if experts == "mxfp4":
        gold_model = packed_mxfp4_copy(gold_model)
    model = copy.deepcopy(gold_model).to(torch.bfloat16)
    if device == "cpu" and compile_on_cpu:
        config = CompileConfig(fullgraph=True, mode="default")
        config._compile_all_devices = True
        model.generation_config.compile_config = config
    ids = torch.randint(3, 128, (batch, 12), device=device)
    torch._dynamo.reset()
    out = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                         cache_implementation=cache_implementation, return_dict_in_generate=True, output_logits=True)
    decoded = torch.stack(out.logits, dim=1).float()
    positions = torch.arange(11, out.sequences.shape[1] - 1)
    with torch.no_grad():
        eager = model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
        # the f32 model on its fast paths too (fla's kernels take f32 operands at TF32): how far it is from the gold
        fast_f32 = gold_model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
        margins, sets = routing(model, out.sequences, positions)
        os.environ["KIMIK3_REFERENCE_ONLY"] = "1"  # the gold: the f32 model on every op's pure-PyTorch reference
        gold = gold_model(out.sequences, use_cache=False).logits.float()[:, 11:-1]
        _, gold_sets = routing(gold_model, out.sequences, positions)
    routed_apart = torch.stack([(a != b).any(-1) for a, b in zip(sets, gold_sets)]).any(0).any(0)  # [P]
    os.environ.pop("KIMIK3_REFERENCE_ONLY", None)
    d, e = rel_err(decoded, gold), rel_err(eager, gold)
    return {
        "decoded_vs_gold": round(d, 5), "eager_vs_gold": round(e, 5),
        "decoded_vs_eager": round(rel_err(decoded, eager), 5),
        "eager_vs_fast_f32": round(rel_err(eager, fast_f32), 5), "fast_f32_vs_gold": round(rel_err(fast_f32, gold), 5),
        "test_bound": round(1.5 * e + 5e-3, 5), "within_bound": d < 1.5 * e + 5e-3,
        "per_position_decoded_vs_gold": [round(rel_err(decoded[:, i], gold[:, i]), 4) for i in range(decoded.shape[1])],
        "per_position_eager_vs_gold": [round(rel_err(eager[:, i], gold[:, i]), 4) for i in range(eager.shape[1])],
        "same_tokens_as_gold_argmax": bool((gold.argmax(-1) == out.sequences[:, 12:]).all()),
        # the eager bf16 forward's smallest top-k score margin per position, and where it routes a token of some
        # layer to another expert set than the f32 model does
        "per_position_min_router_margin": [float(f"{m:.3g}") for m in margins.tolist()],
        "per_position_eager_routed_apart_from_gold": routed_apart.tolist(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=[""])
    parser.add_argument("--experts", choices=("bf16", "mxfp4"), default="mxfp4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--compile-on-cpu", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "experts": args.experts, "batch": args.batch, "variants": {}}
    for variant in args.variants:
        # static: the compiled step (CUDA graphs); dynamic: the same decode eager, step by step with the fast kernels
        # (separates what compiling changes from what the prefill's state hand-over and the recurrent form change)
        for cache_implementation in ("static", "dynamic"):
            name = f"{variant or 'all fast'} / {cache_implementation}"
            results["variants"][name] = part = run(variant, args.experts, args.batch, device, args.compile_on_cpu,
                                                   cache_implementation)
            print(name, json.dumps(part), flush=True)
    out = Path(os.environ.get("OUT", ".")) / "diagnose_compiled_decode_error.json"
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
