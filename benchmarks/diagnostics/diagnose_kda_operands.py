"""What fla's chunk_kda costs with each operand setting for bf16 inputs (`kernels.kda.KDA_CHUNK_OPERANDS`), a
diagnostic, not a test: the fast twin alone at the benchmark model's KDA shapes (96 heads x 128, the model's unit
q and k, the gate in the kernel), its median time in CUDA events, and the profiler's GPU time per kernel name, so
that the wrapper's casts and fla's own kernels are told apart.

    python benchmarks/diagnostics/diagnose_kda_operands.py --tokens 8192 --out kda_operands.json
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for _k3bench_utils
from _k3bench_utils import KDA_OPERANDS, with_setting  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--settings", nargs="+", choices=list(KDA_OPERANDS), default=list(KDA_OPERANDS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from kimik3.kernels import kda

    fast = kda.chunk_kda  # the fast twin itself (fla imported at its first call)
    dev, H, K, T = "cuda", args.heads, 128, args.tokens
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, H, K, device=dev).bfloat16()
    raw = torch.randn(1, T, H, K, device=dev).bfloat16()
    beta = torch.sigmoid(torch.randn(1, T, H, device=dev))
    gate = dict(use_gate_in_kernel=True, A_log=torch.randn(H, device=dev) * 0.5,
                dt_bias=torch.randn(H * K, device=dev) * 0.5, lower_bound=-5.0)

    def call():
        return fast(q, k, v, raw, beta, output_final_state=True, use_qk_l2norm_in_kernel=False, **gate)

    out = args.out or os.path.join(os.environ.get("OUT", "."), "diagnose_kda_operands.json")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": T, "heads": H,
              "settings": {}}

    def measure():
        with torch.no_grad():
            for _ in range(3):  # autotuning and compilation
                call()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        return times, prof

    for name in args.settings:
        times, prof = with_setting(kda, "KDA_CHUNK_OPERANDS", KDA_OPERANDS[name], measure)
        kernels = {}
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.key[:90]] = round(event.device_time_total / 1000, 4)
        row = {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4),
               "kernels_ms": round(sum(kernels.values()), 4),
               "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}
        result["settings"][name] = row
        print(name, json.dumps(row), flush=True)
        with open(out, "w") as f:  # after every setting: the first fp16/f32 call autotunes fla's kernels anew
            json.dump(result, f, indent=1)

if __name__ == "__main__":
    main()
