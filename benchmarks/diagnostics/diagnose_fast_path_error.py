"""Where the error of the fast path enters (a diagnostic, not a test): a tiny K3 (4 layers, every mechanism on) in
bf16 (or f32, `--dtype float32`), its prefill logits against the same weights in f32 on the pure-PyTorch
references, over several model seeds and prompts, once per variant, where a variant is a value of
KIMIK3_REFERENCE_ONLY:

  ""          every fast path (what a bf16 user runs)
  "1"         every op on its reference (the reference path of that dtype: the bf16 fast path's bound is 1.2x its
              distance to f32, the f32 fast path's 2e-4 of it)
  "op"        the fast path with that one op on its reference (the error it removes)
  "only:op"   every op on its reference except that one (the error it adds alone)
  "chunk_kda_bf16", "chunk_kda_f16", "chunk_kda_f32"
              every fast path, fla's chunk_kda handed bf16 (as given), fp16 or f32 operands for bf16 inputs
              (kernels.kda.KDA_CHUNK_OPERANDS)

For each variant: the mean |logit - f32 logit| over positions and vocabulary (mean over runs, and min/max over
runs), the largest |logit - f32 logit|, top-1 agreement with the f32 model over all positions, and the ratio to
the reference path's mean.

    python benchmarks/diagnostics/diagnose_fast_path_error.py --seeds 0 1 2 3 --lengths 40 300 --out drift.json
    python benchmarks/diagnostics/diagnose_fast_path_error.py --dtype float32 --variants "" 1 chunk_kda kda_gate

Runs on CUDA (on CPU every variant is the reference path).
"""

import argparse
import copy
import importlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import KDA_OPERANDS, with_setting  # noqa: E402
from kimik3.tiny import build_tiny_model, packed_mxfp4_copy  # noqa: E402

ENV = "KIMIK3_REFERENCE_ONLY"
# variants that are the fast path with one kernel setting changed: name -> (kernels module, setting, value)
SETTINGS = {f"chunk_kda_{tag}": ("kda", "KDA_CHUNK_OPERANDS", dtype) for tag, dtype in KDA_OPERANDS.items()}


def run_variant(model, ids, variant, names, use_cache=False):
    if variant in SETTINGS:
        module_name, setting, value = SETTINGS[variant]
        module = importlib.import_module(f"kimik3.kernels.{module_name}")
        return with_setting(module, setting, value, lambda: run_variant(model, ids, "", names, use_cache))
    if variant.startswith("only:"):
        value = ",".join(n for n in names if n != variant[5:])
    else:
        value = variant
    if value:
        os.environ[ENV] = value
    else:
        os.environ.pop(ENV, None)
    try:
        with torch.no_grad():
            return model(ids, use_cache=use_cache).logits.float()
    finally:
        os.environ.pop(ENV, None)


def paired_top1(only_this: int, only_reference: int, positions: int) -> dict:
    """Top-1 agreement of a variant against the reference path's on the same positions: the difference, its 95%
    interval (normal approximation of the paired difference) and McNemar's exact two-sided p-value (the binomial
    test of the discordant positions: under no difference each goes either way with probability 1/2)."""
    discordant = only_this + only_reference
    diff = (only_this - only_reference) / positions
    half = 1.96 * math.sqrt(max(discordant - (only_this - only_reference) ** 2 / positions, 0.0)) / positions
    tail = sum(math.comb(discordant, i) for i in range(min(only_this, only_reference) + 1)) / 2 ** discordant \
        if discordant else 1.0
    return {"difference": round(diff, 5), "interval_95": [round(diff - half, 5), round(diff + half, 5)],
            "only_this": only_this, "only_reference": only_reference, "mcnemar_p": round(min(1.0, 2 * tail), 4)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 300])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--experts", choices=("dense", "mxfp4"), default="dense")
    parser.add_argument("--use-cache", action="store_true", help="the prefill writes a cache (as generate's does)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--variants", nargs="*", default=None, help="default: '', '1' and each op")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from kimik3.modeling import dispatch_kimi_k3 as dispatch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = sorted(dispatch.FAST_OPS)
    variants = args.variants if args.variants is not None else ["", "1", *names]
    # "only_this" / "only_reference": positions whose top-1 this variant gets right and the reference path wrong,
    # and the other way round (the discordant pairs of a paired comparison of top-1 agreement)
    per_variant = {v: {"mean_abs": [], "max_abs": 0.0, "agree": 0, "positions": 0, "only_this": 0,
                       "only_reference": 0} for v in variants}
    for seed in args.seeds:
        gold_model = build_tiny_model(seed=seed, num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64)
        if args.experts == "mxfp4":
            gold_model = packed_mxfp4_copy(gold_model)
        gold_model = gold_model.to(device).eval()
        model = copy.deepcopy(gold_model).to(getattr(torch, args.dtype))
        for length in args.lengths:
            torch.manual_seed(1000 * seed + length)
            ids = torch.randint(3, gold_model.config.vocab_size, (args.batch, length), device=device)
            gold = run_variant(gold_model, ids, "1", names)
            top = gold.argmax(-1)
            agrees = {}
            for v in variants:
                start = time.perf_counter()
                logits = run_variant(model, ids, v, names, args.use_cache)
                assert bool(torch.isfinite(logits).all()), f"variant {v!r}: non-finite logits"
                row = per_variant[v]
                error = (logits - gold).abs()
                row["mean_abs"].append(error.mean().item())
                row["max_abs"] = max(row["max_abs"], error.max().item())
                agrees[v] = logits.argmax(-1) == top
                row["agree"] += int(agrees[v].sum())
                row["positions"] += top.numel()
                print(f"seed {seed} length {length} variant {v!r}: mean {row['mean_abs'][-1]:.3g} "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)
            if "1" in agrees:
                for v, agree in agrees.items():
                    per_variant[v]["only_this"] += int((agree & ~agrees["1"]).sum())
                    per_variant[v]["only_reference"] += int((~agree & agrees["1"]).sum())
    reference = statistics.mean(per_variant["1"]["mean_abs"]) if "1" in per_variant else None
    table = []
    for v, row in per_variant.items():
        mean = statistics.mean(row["mean_abs"])
        table.append({"variant": v or "(fast)", "mean_abs_logit_err": round(mean, 5),
                      "min_max_over_runs": [round(min(row["mean_abs"]), 5), round(max(row["mean_abs"]), 5)],
                      "max_abs_logit_err": float(f"{row['max_abs']:.3g}"),
                      "top1_agreement": round(row["agree"] / row["positions"], 4),
                      "x_reference": round(mean / reference, 3) if reference else None})
        if reference:
            table[-1]["top1_vs_reference"] = paired_top1(row["only_this"], row["only_reference"], row["positions"])
        print(json.dumps(table[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": args.dtype, "use_cache": args.use_cache, "experts": args.experts, "seeds": args.seeds, "lengths": args.lengths, "batch": args.batch,
              "runs": len(args.seeds) * len(args.lengths), "variants": table}
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"diagnose_fast_path_error_{args.dtype}_{args.experts}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
