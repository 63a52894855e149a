#!/usr/bin/env python3
"""Where the device_map (pipeline) prefill of bench_parallel.py spends its time: the 128-expert benchmark model
loaded twice with from_pretrained, once over cuda:0/cuda:1 and once on cuda:0 alone, each decoder layer's 8K-token
prefill timed with synchronising forward hooks, plus the top CUDA kernels of the pipeline run.

    python benchmarks/diagnostics/diagnose_pipeline_prefill.py --workdir /tmp/k3_128 --out /tmp/pipeline_diag.json
"""

import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent  # benchmarks/, for bench_parallel
sys.path.insert(0, str(HERE))

import bench_parallel  # noqa: E402


def layer_times(model, ids) -> list[float]:
    times, starts, handles = [], {}, []
    for index, layer in enumerate(model.model.layers):
        def pre(module, args, kwargs, index=index):
            bench_parallel.sync("cuda")
            starts[index] = time.perf_counter()

        def post(module, args, kwargs, output, index=index):
            bench_parallel.sync("cuda")
            times.append(round(time.perf_counter() - starts[index], 4))

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    with torch.no_grad():
        for _ in range(2):
            times.clear()
            model(input_ids=ids, cache=bench_parallel.new_cache(model), use_cache=True, logits_to_keep=1)
    for handle in handles:
        handle.remove()
    return times


def main() -> None:
    from transformers import AutoModelForCausalLM

    args = bench_parallel.parse_args(sys.argv[1:])
    workdir = bench_parallel.save_expert_model(args)
    result = {}
    device_maps = {"one_gpu": {"": "cuda:0"}}
    device_maps["pipeline"] = {"model.embed_tokens": 0, "model.norm": 1, "lm_head": 1,
                               "model.output_attn_res_norm": 1, "model.output_attn_res_proj": 1}
    device_maps["pipeline"] |= {f"model.layers.{i}": i // 4 for i in range(8)}
    for name, device_map in device_maps.items():
        model = AutoModelForCausalLM.from_pretrained(workdir, trust_remote_code=True, dtype=torch.bfloat16,
                                                     device_map=device_map).eval()
        ids = bench_parallel.random_ids(model, 1, args.prefill_tokens, "cuda:0")
        result[name] = {"layer_s": layer_times(model, ids),
                        "layer_types": list(model.config.layer_types),
                        "hooks": sum(hasattr(m, "_hf_hook") for m in model.modules())}
        if name == "pipeline":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
                model(input_ids=ids, cache=bench_parallel.new_cache(model), use_cache=True, logits_to_keep=1)
                bench_parallel.sync("cuda")
            result[name]["top"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18)
            result[name]["top_cpu"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        print(json.dumps({name: {k: v for k, v in result[name].items() if not k.startswith("top")}}), flush=True)
        del model
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(result["pipeline"]["top"])
    print(result["pipeline"]["top_cpu"])


if __name__ == "__main__":
    main()
