#!/usr/bin/env python3
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
"""Context parallelism and FSDP2 on two GPUs, on the benchmark model of docs/benchmarks.md (bench_k3.k3_config: K3
widths, random bf16 weights, `--layers` layers, `--experts` experts).

  prefill_1gpu   rank 0 alone: a `--tokens` prefill on one GPU, in `--single-chunk` pieces through the cache (0: one
                 forward), tokens/s and peak memory
  prefill_cp     both ranks: the same prefill split into 2 segments (KDA by state composition, MLA by latent
                 all-gather, context_parallel_kimi_k3.py), tokens/s and peak memory per GPU, bytes exchanged per
                 layer (KDA: fixed, MLA: latents)
  train_fsdp2    both ranks: FSDP2 (kimik3.training.fsdp.shard_model, gradient checkpointing, f32 islands in their own
                 groups) on a `--train-layers` model, `--train-tokens` tokens per rank and step, SGD (no optimizer
                 state), tokens/s over both GPUs and peak memory per GPU

One torchrun launch (2 ranks, NCCL, NVLink multicast off); a section that runs out of memory records the error and
the next one runs. JSON to --out.

    python benchmarks/bench_context_parallel.py --out benchmarks/results/h200x2_context_parallel.json
    python benchmarks/bench_context_parallel.py --quick     # tiny model, 2 CPU processes (gloo), one JSON line
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    parser.add_argument("--tokens", type=int, default=256 * 1024, help="prefill length")
    parser.add_argument("--single-chunk", type=int, default=32 * 1024,
                        help="one-GPU prefill piece (0: the whole prefill in one forward)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the prefill model")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--train-layers", type=int, default=2)
    parser.add_argument("--train-tokens", type=int, default=4096, help="tokens per rank and step")
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny model on 2 CPU processes (gloo): a smoke run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank under torchrun
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)  # where rank 0 writes the results
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.single_chunk, args.train_tokens, args.train_steps = 64, 16, 32, 2
    return args


# ------------------------------------------------------------------------------------------------------------
# models


def build_model(args, num_layers: int, device):
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig

    if args.quick:
        from kimik3.configuration import tiny_text_config_dict

        config = KimiK3TextConfig(**tiny_text_config_dict(num_hidden_layers=num_layers))
    else:
        from bench_k3 import k3_config

        config = k3_config(num_layers=num_layers, num_experts=args.experts)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    from _k3bench_utils import random_model

    return random_model(config, device, torch.float32 if args.quick else torch.bfloat16)


# ------------------------------------------------------------------------------------------------------------
# measurements (run on every rank)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def guarded(fn):
    """A section's result, or its error (an OOM must not end the other sections)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError as exc:
        return {"error": f"CUDA OOM: {str(exc)[:200]}"}
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def prefill_one_gpu(args, device, input_ids) -> dict:
    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache

    model = build_model(args, args.layers, device)
    chunk = args.single_chunk or input_ids.shape[1]
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        cache = KimiK3Cache(model.config)
        for s in range(0, input_ids.shape[1], chunk):
            model(input_ids=input_ids[:, s:s + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    sync(device)
    elapsed = time.perf_counter() - start
    del model, cache
    return {"tokens": input_ids.shape[1], "chunk": chunk, "seconds": round(elapsed, 3),
            "tokens_per_s": round(input_ids.shape[1] / elapsed, 1), "peak_mem_gib": peak_gib(device)}


def prefill_context_parallel(args, device, input_ids) -> dict:
    import torch.distributed as dist

    from kimik3.modeling.cache_kimi_k3 import KimiK3Cache
    from kimik3.modeling.context_parallel_kimi_k3 import ContextParallel, kda_exchange_bytes

    model = build_model(args, args.layers, device)
    cp = ContextParallel.for_sequence(input_ids.shape[1])
    local = cp.shard(input_ids)
    reset_peak(device)
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        cache = KimiK3Cache(model.config)
        model(input_ids=local, cache=cache, use_cache=True, logits_to_keep=1, context_parallel=cp)
    sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    kinds = model.config.layer_types
    sent = cp.exchanged_bytes
    result = {"tokens": input_ids.shape[1], "segments": list(cp.lengths), "seconds": round(elapsed, 3),
              "tokens_per_s": round(input_ids.shape[1] / elapsed, 1), "peak_mem_gib": peak_gib(device),
              "kda_bytes_per_layer": sorted({sent[i] for i, t in enumerate(kinds) if t == "linear_attention"}),
              "kda_bytes_per_layer_analytic": kda_exchange_bytes(model.config, 1, 4 if args.quick else 2),
              "mla_bytes_per_layer": sorted({sent[i] for i, t in enumerate(kinds) if t == "full_attention"})}
    del model, cache
    return result


def train_fsdp2(args, device, rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from kimik3.training.fsdp import shard_model

    model = build_model(args, args.train_layers, device).train()
    shard_model(model, gradient_checkpointing=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    generator = torch.Generator(device=device).manual_seed(rank)
    reset_peak(device)

    def step():
        ids = torch.randint(0, model.config.vocab_size, (1, args.train_tokens), device=device, generator=generator)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.train_steps):
        step()
    sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    tokens = args.train_tokens * args.train_steps * world_size
    del model, optimizer
    return {"layers": args.train_layers, "tokens_per_rank_step": args.train_tokens, "steps": args.train_steps,
            "tokens_per_s": round(tokens / elapsed, 1), "peak_mem_gib": peak_gib(device)}


def worker(args) -> None:
    import torch.distributed as dist

    on_cuda = not args.quick
    dist.init_process_group("nccl" if on_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}" if on_cuda else "cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    input_ids = torch.randint(0, 128 if args.quick else 163840, (1, args.tokens),
                              generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    try:
        if rank == 0:
            results["prefill_1gpu"] = guarded(lambda: prefill_one_gpu(args, device, input_ids))
        dist.barrier()
        results["prefill_cp"] = guarded(lambda: prefill_context_parallel(args, device, input_ids))
        results["train_fsdp2"] = guarded(lambda: train_fsdp2(args, device, rank, world_size))
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, results)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        merged = {"device": torch.cuda.get_device_name(0) if on_cuda else "cpu", "tokens": args.tokens,
                  "layers": args.layers, "prefill_1gpu": per_rank[0]["prefill_1gpu"],
                  "prefill_cp": [r["prefill_cp"] for r in per_rank],
                  "train_fsdp2": [r["train_fsdp2"] for r in per_rank]}
        Path(args.result).write_text(json.dumps(merged))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    result_path = Path(args.out or "/tmp/bench_context_parallel.json").with_suffix(".rank0.json")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONWARNINGS": "ignore"}
    if args.quick:
        env["OMP_NUM_THREADS"] = "1"
    options = ["--tokens", args.tokens, "--single-chunk", args.single_chunk, "--layers", args.layers, "--experts",
               args.experts, "--train-layers", args.train_layers, "--train-tokens", args.train_tokens,
               "--train-steps", args.train_steps]
    passthrough = [str(x) for x in options] + (["--quick"] if args.quick else [])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).resolve()), "--worker", "--result", str(result_path), *passthrough]
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        sys.exit(f"bench_context_parallel: the torchrun ranks failed:\n{completed.stderr[-4000:]}")
    results = json.loads(result_path.read_text())
    result_path.unlink()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
