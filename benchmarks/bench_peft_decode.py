# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The cost of an unmerged PEFT LoRA adapter in cached decode (CPU), side by side in one run: the model alone, with an
unmerged "all-linear" adapter (MLA's absorbed decode adds the adapter's delta to `kv_b_proj`'s weight every step;
every other wrapped projection runs PEFT's own forward), and the same adapter merged. A small model with MLA's head
dimensions (nope 128, rope 64, v 128, latent 512) and 3 KDA + 1 MLA layers; fp32.

    python benchmarks/bench_peft_decode.py [--prompt 512] [--steps 32] [--threads 2] [--out FILE]
"""

import argparse
import copy
import json
import platform
import statistics
import time

import torch


def build(seed: int = 0):
    from kimik3.configuration import tiny_text_config_dict
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    raw = tiny_text_config_dict(num_hidden_layers=4)
    raw.update(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8,
               q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               moe_intermediate_size=256, routed_expert_hidden_size=256, vocab_size=4096,
               linear_attn_config={**raw["linear_attn_config"], "num_heads": 8, "head_dim": 128})
    torch.manual_seed(seed)
    return KimiK3ForCausalLM(KimiK3TextConfig(**raw)).eval()


def step_times(model, prompt: torch.Tensor, steps: int) -> list[float]:
    times = []
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            token = out.logits[:, -1:].argmax(-1)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model

    base = build()
    adapted = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules="all-linear", r=args.rank))
    with torch.no_grad():
        for name, tensor in adapted.named_parameters():
            if "lora_B" in name:
                tensor.normal_(0.0, 0.02)
    adapted.eval()
    merged = copy.deepcopy(adapted).merge_and_unload().eval()
    prompt = torch.randint(0, 4000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    variants = {"base": base, "lora_unmerged": adapted, "lora_merged": merged}
    results = {name: [] for name in variants}
    for _ in range(3):  # interleaved rounds: a slow spell of the machine falls on every variant
        for name, model in variants.items():
            results[name] += step_times(model, prompt, args.steps)
    report = {
        "what": "cached decode step, batch 1, fp32, after a prompt",
        "prompt_tokens": args.prompt, "steps_per_round": args.steps, "rounds": 3, "lora_rank": args.rank,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "torch": torch.__version__,
        "median_ms": {name: round(1000 * statistics.median(t), 3) for name, t in results.items()},
    }
    report["unmerged_over_merged"] = round(report["median_ms"]["lora_unmerged"] / report["median_ms"]["lora_merged"], 3)
    import peft
    import transformers

    report["versions"] = {"transformers": transformers.__version__, "peft": peft.__version__}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
