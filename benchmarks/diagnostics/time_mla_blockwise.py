"""The blockwise MLA prefill over a long cache, taken apart (a diagnostic, not a test): one MLA layer of the benchmark
model (96 heads, latents 512 + 64, head dims 192/128), one prefill chunk of `--chunk` queries continuing a cache of
`--past` tokens, as each chunk of the 1M-token prefill does (docs/benchmarks.md, 1M-token prompt).

For each key block size (the config's rule, `mla_prefill_key_block`, replaced by the size) it times, by CUDA events:

* `attention`: `attention_with_lse`'s fast twin alone over one past block of expanded keys (what cuDNN reaches at
  chunk x block),
* `expand`: `_expand_latents` of one block (kv_b_proj and the key assembly),
* `merge`: one log-sum-exp merge of a block's output into the running one, as the model does it and (`merge_before`)
  as it did before it fused the weighting into one addcmul,
* `blockwise`: the whole `_blockwise_prefill_attention` of the chunk (the past blocks and the causal diagonal one),
  with the model's merge and with the merge before,

and the whole chunk's effective TFLOP/s (useful FLOPs only: 96 heads x 640 FLOP per query-key pair, the diagonal
block's causal half). The outputs of every block size and merge are compared with the 16K-block, merge-before one.
Writes $OUT/time_mla_blockwise.json (or the working directory).

    python3 benchmarks/diagnostics/time_mla_blockwise.py [--chunk 32768] [--past 262144] [--blocks 16384 65536]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils and bench_k3
from _k3bench_utils import event_us  # noqa: E402
from bench_k3 import k3_config  # noqa: E402

from kimik3.modeling import modeling_kimi_k3 as modeling  # noqa: E402
from kimik3.modeling.dispatch_kimi_k3 import fast_or_reference  # noqa: E402

FLOP_PER_PAIR_HEAD = 2 * (192 + 128)


def merge_before(out, lse, block_out, block_lse):
    """The merge as the model wrote it before: each side weighted into a temporary of its own, then summed."""
    merged = torch.logaddexp(lse, block_lse)
    return out * (lse - merged).exp().unsqueeze(-1) + block_out * (block_lse - merged).exp().unsqueeze(-1), merged


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=32768)
    parser.add_argument("--past", type=int, default=262144)
    parser.add_argument("--blocks", nargs="+", type=int, default=[16384, 32768, 65536, 131072])
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = k3_config(num_layers=1, num_experts=16)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        attn = modeling.KimiK3MLAAttention(config, layer_idx=0).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.02)
    heads, chunk, past = config.num_attention_heads, args.chunk, args.past
    query = torch.randn(1, heads, chunk, config.qk_head_dim, device="cuda", dtype=torch.bfloat16)
    latents = torch.randn(1, past + chunk, config.kv_lora_rank + config.qk_rope_head_dim, device="cuda",
                          dtype=torch.bfloat16)
    attend = fast_or_reference("attention_with_lse", query)
    flop = heads * FLOP_PER_PAIR_HEAD * chunk * (past + chunk / 2)
    model_merge, model_block = modeling._merge_attention_blocks, type(config).mla_prefill_key_block
    rows, reference = [], None
    with torch.no_grad():
        for block in args.blocks:
            type(config).mla_prefill_key_block = lambda self, queries, block=block: block
            key, value = attn._expand_latents(latents[:, :block])
            out, lse = attend(query, key, value, attn.scaling, False)
            row = {"block": block,
                   "attention_us": event_us(lambda: attend(query, key, value, attn.scaling, False), args.iters, 1),
                   "expand_us": event_us(lambda: attn._expand_latents(latents[:, :block]), args.iters, 1),
                   "merge_us": event_us(lambda: model_merge(out, lse, out, lse), args.iters, 1),
                   "merge_before_us": event_us(lambda: merge_before(out, lse, out, lse), args.iters, 1)}
            row["attention_tflops"] = round(heads * FLOP_PER_PAIR_HEAD * chunk * block / row["attention_us"] / 1e6, 1)
            del key, value, out, lse
            for name, merge in (("blockwise_merge_before", merge_before), ("blockwise", model_merge)):
                modeling._merge_attention_blocks = merge
                try:
                    result = attn._blockwise_prefill_attention(query, latents)
                    us = event_us(lambda: attn._blockwise_prefill_attention(query, latents), args.iters, 0)
                finally:
                    modeling._merge_attention_blocks = model_merge
                if reference is None:
                    reference = result.float()
                row[f"{name}_ms"] = round(us / 1e3, 2)
                row[f"{name}_tflops"] = round(flop / us / 1e6, 1)
                row[f"{name}_max_abs_diff"] = float((result.float() - reference).abs().max())
                del result
            type(config).mla_prefill_key_block = model_block
            row = {k: round(v, 1) if isinstance(v, float) and k.endswith("_us") else v for k, v in row.items()}
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    machine = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "chunk": chunk, "past": past,
               "model_block": config.mla_prefill_key_block(chunk)}
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "time_mla_blockwise.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
