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
"""Kimi K3 over two GPUs: the benchmark model of docs/benchmarks.md (bench_k3.k3_config: K3 widths, 8 layers) with
128 experts split over 2 GPUs, side by side with the same model at 64 experts on one GPU.

  single     1 GPU, 64 experts
  pipeline   device_map: layers 0-3 on cuda:0, 4-7 (+ norm, lm_head) on cuda:1, 128 experts; communication = the
             hidden state and banked AttnRes blocks crossing the boundary
  tp_ep      torchrun, 2 ranks: attention/dense/shared experts tensor parallel by head, routed experts expert
             parallel (64 per GPU, masked local routes + all-reduce on the shared batch), 128 experts;
             communication = the all-reduces (timed in a separate, synchronised pass)

Each: prefill of 8K tokens (tokens/s), decode ms/step at batch 1 and 8 (context 1K), communication ms per decode step.
Random bf16 weights; the 128-expert model is saved once to --workdir (local disk) so the tp_ep ranks load their own
shards with from_pretrained. NCCL_NVLS_ENABLE=0 (NVLink multicast stays off). JSON: --out.

    python benchmarks/bench_parallel.py --out benchmarks/results/h200x2_bench_parallel.json
    python benchmarks/bench_parallel.py --dry-run --out /tmp/dry.json   # tiny model on CPU, seconds
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

MODES = ("single", "pipeline", "tp_ep")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/bench_parallel.json")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--workdir", default="/tmp/k3_bench_parallel", help="where the 128-expert model is saved")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--context", type=int, default=1024, help="decode context")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU (gloo for tp_ep): checks the paths")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a tp_ep rank under torchrun
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.dry_run:
        args.prefill_tokens, args.context, args.steps = min(args.prefill_tokens, 16), min(args.context, 8), 2
    return args


# ------------------------------------------------------------------------------------------------------------
# models


def bench_config(args, num_experts: int):
    if args.dry_run:
        from kimik3.configuration import tiny_text_config_dict
        from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig

        config = KimiK3TextConfig(**tiny_text_config_dict(num_hidden_layers=8, num_experts=num_experts // 8))
    else:
        from bench_k3 import k3_config

        config = k3_config(num_layers=8, num_experts=num_experts)
    config._attn_implementation = "sdpa"
    return config


def random_model(config, device):
    from _k3bench_utils import random_model as build

    return build(config, device, torch.float32 if device == "cpu" else torch.bfloat16)


def model_dtype(args):
    return torch.float32 if args.dry_run else torch.bfloat16


# ------------------------------------------------------------------------------------------------------------
# measurements


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        for index in range(torch.cuda.device_count()):  # a pipeline runs on both
            torch.cuda.synchronize(index)


def new_cache(model):
    # the model's own cache class: a model loaded as remote code has its own copy of the module
    return sys.modules[type(model).__module__].KimiK3Cache(model.config)


def random_ids(model, batch, length, device):
    return torch.randint(0, model.config.vocab_size, (batch, length), device=device)


def measure_prefill(model, args, device) -> dict:
    ids = random_ids(model, 1, args.prefill_tokens, device)
    times = []
    for _ in range(3):  # first one warms up
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, cache=new_cache(model), use_cache=True, logits_to_keep=1)
        sync(device)
        times.append(time.perf_counter() - start)
    best = min(times[1:])
    return {"tokens": args.prefill_tokens, "s": round(best, 4), "tokens_per_s": round(args.prefill_tokens / best, 1)}


def decode_steps(model, args, device, batch, on_step=None) -> float:
    """Mean ms per one-token step after a prefill of `context` tokens (3 warm-up steps)."""
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=random_ids(model, batch, args.context, device), cache=cache, use_cache=True, logits_to_keep=1)
        token = random_ids(model, batch, 1, device)
        for step in range(3 + args.steps):
            if step == 3:
                sync(device)
                start = time.perf_counter()
            if on_step is not None and step >= 3:
                on_step()
            model(input_ids=token, cache=cache, use_cache=True)
        sync(device)
    return (time.perf_counter() - start) * 1000 / args.steps


class CollectiveTimer:
    """Times torch.distributed.all_reduce / all_to_all_single calls, each synchronised (a separate pass)."""

    def __init__(self, device):
        import torch.distributed as dist

        self.device, self.dist, self.total, self.calls = device, dist, 0.0, 0
        self.originals = {name: getattr(dist, name) for name in ("all_reduce", "all_to_all_single")}

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(self.dist, name, self._timed(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(self.dist, name, original)

    def _timed(self, original):
        def call(*args, **kwargs):
            sync(self.device)
            start = time.perf_counter()
            result = original(*args, **kwargs)
            sync(self.device)
            self.total += time.perf_counter() - start
            self.calls += 1
            return result

        return call


def boundary_copy_ms(tensors, target, repeats=10) -> float:
    """Time to move the tensors crossing the pipeline boundary to `target`."""
    sync(target)
    start = time.perf_counter()
    for _ in range(repeats):
        for tensor in tensors:
            tensor.to(target, non_blocking=True)
    sync(target)
    return (time.perf_counter() - start) * 1000 / repeats


def measure_all(model, args, device, comm=None) -> dict:
    result = {"prefill": measure_prefill(model, args, device)}
    for batch in args.batches:
        entry = {"ms_per_step": round(decode_steps(model, args, device, batch), 3)}
        if comm is not None:
            entry["comm_ms_per_step"] = round(comm(batch), 4)
        result[f"decode_b{batch}"] = entry
    return result


# ------------------------------------------------------------------------------------------------------------
# modes


def run_single(args) -> dict:
    device = "cpu" if args.dry_run else "cuda:0"
    model = random_model(bench_config(args, 64), device)
    result = {"experts": 64, "gpus": 1, **measure_all(model, args, device)}
    del model
    return result


def save_expert_model(args) -> Path:
    """The 128-expert model with random weights, saved with its remote code (built on one device)."""
    from kimik3.remote_code import save_with_code

    workdir = Path(args.workdir)
    if (workdir / "config.json").exists():
        return workdir
    model = random_model(bench_config(args, 128), "cpu" if args.dry_run else "cuda:0")
    save_with_code(model, workdir)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return workdir


def run_pipeline(args) -> dict:
    from transformers import AutoModelForCausalLM

    workdir = save_expert_model(args)
    devices = ("cpu", "cpu") if args.dry_run else ("cuda:0", "cuda:1")
    device_map = {"model.embed_tokens": devices[0], "model.norm": devices[1], "lm_head": devices[1],
                  "model.output_attn_res_norm": devices[1], "model.output_attn_res_proj": devices[1]}
    device_map |= {f"model.layers.{i}": devices[i // 4] for i in range(8)}
    model = AutoModelForCausalLM.from_pretrained(workdir, trust_remote_code=True, dtype=model_dtype(args),
                                                 device_map=device_map).eval()
    hidden = model.config.hidden_size
    banked = 1 + 4 // model.config.attn_res_block_size if model.config.attn_res_block_size else 0

    def comm(batch):
        # the running sum and the banked AttnRes blocks cross the boundary once per step
        crossing = [torch.zeros(batch, 1, hidden, dtype=model_dtype(args), device=devices[0])] * (1 + banked)
        return boundary_copy_ms(crossing, devices[1])

    result = {"experts": 128, "gpus": 2, "device_map": device_map, **measure_all(model, args, devices[0], comm)}
    del model
    return result


def run_tp_ep(args) -> dict:
    workdir = save_expert_model(args)
    out = Path(args.workdir) / "tp_ep_rank0.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--worker", "--workdir", str(workdir), "--out", str(out), "--batches", ",".join(map(str, args.batches)),
               "--prefill-tokens", str(args.prefill_tokens), "--context", str(args.context), "--steps", str(args.steps)]
    if args.dry_run:
        command.append("--dry-run")
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    if result.returncode != 0:
        return {"error": (result.stdout[-2000:] + result.stderr[-4000:])}
    return json.loads(out.read_text())


def tp_ep_worker(args) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo" if args.dry_run else "nccl")
    rank = dist.get_rank()
    device = "cpu" if args.dry_run else f"cuda:{rank}"
    if not args.dry_run:
        torch.cuda.set_device(rank)
    fields = getattr(DistributedConfig, "__dataclass_fields__", {})
    if "ep_size" in fields:
        config, mode = DistributedConfig(tp_size=2, ep_size=2), "tp_ep"
    else:  # transformers < 5.21: expert parallel alone (the attention replicated)
        config, mode = DistributedConfig(tp_size=2, enable_expert_parallel=True), "ep"
    model = AutoModelForCausalLM.from_pretrained(args.workdir, trust_remote_code=True, dtype=model_dtype(args),
                                                 distributed_config=config).eval()

    def comm(batch):
        with CollectiveTimer(device) as timer:
            decode_steps(model, args, device, batch)
        return timer.total * 1000 / (3 + args.steps + 1)  # the prefill's collectives spread out: see "note"

    result = {"experts": 128, "gpus": 2, "plan": mode, **measure_all(model, args, device, comm),
              "note": "comm_ms_per_step: synchronised all-reduce/all-to-all time of a decode pass (prefill included) "
                      "divided by its forwards; DTensor redistributions (vocab-parallel embedding) not counted"}
    if rank == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from _k3bench_utils import ensure_kimik3

    ensure_kimik3()
    if args.worker:
        tp_ep_worker(args)
        return {}
    results = {"config": {k: v for k, v in vars(args).items() if k != "worker"},
               "env": {"torch": torch.__version__, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                       "gpus": torch.cuda.device_count()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runners = {"single": run_single, "pipeline": run_pipeline, "tp_ep": run_tp_ep}
    for mode in args.modes:
        start = time.monotonic()
        try:
            results[mode] = runners[mode](args)
        except Exception as error:  # noqa: BLE001 - one failed mode must not lose the others' numbers
            results[mode] = {"error": f"{type(error).__name__}: {error}"}
        results[mode]["wall_s"] = round(time.monotonic() - start, 1)
        out.write_text(json.dumps(results, indent=1, default=str))
        print(json.dumps({mode: results[mode]}, default=str), flush=True)
    return results


if __name__ == "__main__":
    main()
