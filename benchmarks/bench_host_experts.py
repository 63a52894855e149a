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
"""One MoE layer's routed experts of a decode step computed on the CPU, at K3's widths (latent 3584, expert width
3072, top-16, packed MXFP4, bf16 activations), side by side in one run: the CPU kernel (kimik3.kernels.mxfp4_host,
what `experts_compute="host"` runs), the reference it replaces (a compact copy of the chosen experts, dequantised,
multiplied by torch), and the host's DRAM read rate (a reduction over a buffer larger than the last-level cache).
Random codes (the time does not depend on them) and uniform routing over `--experts` experts of a layer; the stacks
are larger than the last-level cache, so each step reads its experts from memory. No GPU needed.

    python benchmarks/bench_host_experts.py [--experts 128] [--threads N] [--out FILE]
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128, help="experts of the layer (uniform routing over them)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reference-steps", type=int, default=2, help="the reference is ~100x slower: fewer steps")
    parser.add_argument("--threads", type=int, default=None, help="default: every core")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count())
    from kimik3.kernels import mxfp4_host
    from kimik3.modeling.experts_format_kimi_k3 import MXFP4
    from kimik3.modeling.host_experts_kimi_k3 import host_routes

    inter, latent, top_k = 3072, 3584, 16
    betas = (4.0, 25.0)
    stacks = (*MXFP4.empty((args.experts, 2 * inter, latent), torch.bfloat16),
              *MXFP4.empty((args.experts, latent, inter), torch.bfloat16))
    generator = torch.Generator().manual_seed(0)
    for stack in stacks:  # every byte written: the pages are the process's own, as a loaded model's
        stack.random_(0, 256, generator=generator) if stack.shape[-1] > latent // 32 else stack.fill_(120)
    per_expert = sum(t[0].numel() * t.element_size() for t in stacks)

    def run(x, i, w, compact):
        return MXFP4.run(x, i, w, compact, betas)

    def step(batch):
        top = torch.stack([torch.randperm(args.experts, generator=generator)[:top_k] for _ in range(batch)])
        flat = top.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = torch.randn(batch, latent, generator=generator).bfloat16()[order // top_k]
        return rows, flat[order], torch.unique(flat).tolist()

    report = {"what": "one MoE layer's routed experts of a decode step on the CPU, K3 widths, packed MXFP4, bf16",
              "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores",
              "threads": torch.get_num_threads(), "torch": torch.__version__, "kernel": mxfp4_host.isa(),
              "experts_in_layer": args.experts, "bytes_per_expert": per_expert}
    buffer = torch.ones(max(4 << 30, args.experts * per_expert) // 8, dtype=torch.int64)
    buffer.sum()
    reads = []
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        reads.append(time.perf_counter() - start)
    report["dram_read_bytes_per_s"] = round(buffer.numel() * 8 / statistics.median(reads))
    del buffer
    for batch in [int(b) for b in args.batches.split(",")]:
        row = {}
        # the kernel's steps, then the reference's (its dequantised copies would evict the kernel's working set and
        # its allocations fault pages in: alternating them timed the reference's side effects on the kernel)
        for name, situ, steps in (("kernel", betas, args.steps), ("reference", None, args.reference_steps)):
            times, experts_read = [], []
            for index in range(steps + 1):
                rows, sorted_ids, ids = step(batch)
                start = time.perf_counter()
                _, used = host_routes(rows, sorted_ids, ids, stacks, MXFP4, run, situ)
                elapsed = time.perf_counter() - start
                assert used == (name == "kernel"), f"the kernel did not run: {mxfp4_host.unavailable_reason()}"
                if index:  # the first is a warm-up
                    times.append(elapsed)
                    experts_read.append(len(ids))
            seconds = statistics.median(times)
            moved = statistics.mean(experts_read) * per_expert
            row[f"ms_{name}"] = round(seconds * 1e3, 3)
            row[f"{name}_bytes_per_s"] = round(moved / seconds)
            row["distinct_experts"] = statistics.mean(experts_read)
        row["kernel_fraction_of_dram_read"] = round(row["kernel_bytes_per_s"] / report["dram_read_bytes_per_s"], 3)
        row["kernel_over_reference"] = round(row["ms_reference"] / row["ms_kernel"], 1)
        report[f"decode_b{batch}"] = row
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
