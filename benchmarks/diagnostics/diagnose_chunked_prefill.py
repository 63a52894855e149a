"""Which fast path makes a chunked prefill differ from a one-shot prefill on CUDA (a diagnostic, not a test).

For f32 and bf16, the tiny model prefills 300 tokens in one shot and in two chunks (100 + 200, continuing the cache),
first with every fast path off, then with all on, then with each fast op turned off in turn
(`KIMIK3_REFERENCE_ONLY` set to that op's name). It prints, per configuration, the largest logit difference chunked vs one-shot and the
one-shot difference against the all-reference run, and writes them as JSON to $OUT (or the working directory).

    python benchmarks/diagnostics/diagnose_chunked_prefill.py
"""

import json
import os
from pathlib import Path

import torch

from kimik3.tiny import build_tiny_model


OP_GROUPS = ["", "chunk_kda", "causal_conv1d", "block_attn_res_mix", "situ_glu",
             "attention_with_lse", "moe_experts"]


def prefill_both_ways(dtype, disabled):
    os.environ["KIMIK3_REFERENCE_ONLY"] = disabled
    torch.manual_seed(0)
    model = build_tiny_model(num_hidden_layers=4, hidden_size=128, num_heads=4, head_dim=64).cuda().to(dtype)
    model.config.mla_prefill_block_size = 64
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        one_shot = model(ids, use_cache=False).logits.float()
        out = model(ids[:, :100], use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        rest = model(ids[:, 100:], cache=cache).logits
    chunked = torch.cat([out.logits, rest], 1).float()
    diff = (chunked - one_shot).abs()
    return one_shot, {"chunked_vs_one_shot_max": diff.max().item(), "first_chunk_max": diff[:, :100].max().item(),
                      "second_chunk_max": diff[:, 100:].max().item()}


def main():
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference, row = prefill_both_ways(dtype, "all")
        results[f"{dtype} all fast paths off"] = row
        print(dtype, "all off", row, flush=True)
        for disabled in OP_GROUPS:
            try:
                one_shot, row = prefill_both_ways(dtype, disabled)
                row["one_shot_vs_all_off_max"] = (one_shot - reference).abs().max().item()
            except Exception as exc:  # noqa: BLE001 - a diagnostic reports and goes on
                row = {"error": repr(exc)[:300]}
            results[f"{dtype} off: [{disabled}]"] = row
            print(dtype, f"off: [{disabled}]", row, flush=True)
    os.environ.pop("KIMIK3_REFERENCE_ONLY", None)
    out = Path(os.environ.get("OUT", ".")) / "diagnose_chunked_prefill.json"
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
