"""Conversion throughput next to the plain disk speed of the same files.

Writes a synthetic release-layout checkpoint (MXFP4 experts, a few GB), then measures, each after evicting the files
from the page cache (posix_fadvise DONTNEED, so reads come from the disk, not RAM):
  * plain read of the source shards (64 MiB positioned reads, what the converter's reader does),
  * plain copy of the source shards (read + write + fsync: the floor for any conversion that writes its output),
  * `convert --experts-dtype mxfp4` (a re-layout: the output is as large as the input),
  * `convert --experts-dtype bf16` (dequantises: the expert output is ~3.8x the packed input).
Reported as MB/s of source read and of output written, with the peak RSS growth of each conversion.

With `--compare-value-check` each conversion also runs with the always-on NaN/Inf/E8M0 check of the reader
switched off (here only), to measure what the check costs.

    python benchmarks/convert_throughput.py [--layers 12] [--workdir DIR] [--threads 1] [--markdown]
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kimik3.convert as kc
from kimik3.convert import fixture, safetensors_io

# experts dominate the bytes, as in the release (93% of it); sizes multiples of the MXFP4 group of 32
WIDE = {"hidden_size": 2048, "moe_intermediate_size": 1024, "routed_expert_hidden_size": 1024,
        "intermediate_size": 4096, "vocab_size": 8192}


def evict(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped by DONTNEED; write them back first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def shard_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def plain_read(folder: Path) -> tuple[int, float]:
    buffer = bytearray(64 * 2**20)
    total, start = 0, time.perf_counter()
    for path in shard_paths(folder):
        with open(path, "rb", buffering=0) as handle:
            while True:
                got = handle.readinto(buffer)
                if not got:
                    break
                total += got
    return total, time.perf_counter() - start


def plain_copy(folder: Path, dst: Path) -> tuple[int, float]:
    dst.mkdir(parents=True, exist_ok=True)
    total, start = 0, time.perf_counter()
    for path in shard_paths(folder):
        shutil.copyfile(path, dst / path.name)
        with open(dst / path.name, "rb+") as handle:
            os.fsync(handle.fileno())
        total += path.stat().st_size
    return total, time.perf_counter() - start


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def timed_convert(src: Path, dst: Path, experts: str, threads: int | None, value_check: bool = True) -> dict:
    real_check = safetensors_io.check_values
    if not value_check:
        safetensors_io.check_values = lambda *args, **kwargs: None
    try:
        return _timed_convert(src, dst, experts, threads) | {"value_check": value_check}
    finally:
        safetensors_io.check_values = real_check


def _timed_convert(src: Path, dst: Path, experts: str, threads: int | None) -> dict:
    evict(src)
    can_reset = reset_peak()
    base = status_bytes("VmRSS:")
    start = time.perf_counter()
    summary = kc.convert(src, dst, experts_dtype=experts, progress=False, threads=threads)
    seconds = time.perf_counter() - start
    growth = status_bytes("VmHWM:") - base if can_reset else None
    read = sum(src.joinpath(s).stat().st_size for s in summary["source_shards_read"])
    return {"experts": experts, "seconds": seconds, "read_bytes": read, "written_bytes": summary["bytes"],
            "peak_rss_growth": growth}


def machine_info(workdir: Path) -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    disk = shutil.disk_usage(workdir)
    try:
        device = subprocess.run(["df", "--output=source,fstype", str(workdir)], capture_output=True, text=True,
                                timeout=10).stdout.split("\n")[1].split()
    except Exception:
        device = ["?", "?"]
    cpu = "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except Exception:
        pass
    import safetensors
    import transformers

    return {
        "cpu": cpu, "nproc": os.cpu_count(), "torch_threads": torch.get_num_threads(), "ram_gb": mem / 1e9,
        "disk": f"{device[0]} ({device[1]}), {disk.total / 1e9:.0f} GB, {disk.free / 1e9:.0f} GB free",
        "python": platform.python_version(), "torch": torch.__version__, "safetensors": safetensors.__version__,
        "transformers": transformers.__version__, "kernel": platform.release(),
        "load_average": os.getloadavg(),
    }


def markdown(info: dict, source: dict, read: tuple, copy: tuple, runs: list[dict]) -> str:
    def rate(n, s):
        return f"{n / s / 1e6:,.0f}"

    lines = [
        f"Machine: {info['cpu']}, {info['nproc']} CPUs (torch threads {info['torch_threads']}), "
        f"{info['ram_gb']:.0f} GB RAM, disk {info['disk']}; Python {info['python']}, torch {info['torch']}, "
        f"safetensors {info['safetensors']}, transformers {info['transformers']}, Linux {info['kernel']}; "
        f"load average at start {info['load_average'][0]:.1f}.",
        "",
        f"Synthetic release-layout checkpoint: {source['layers']} layers, {source['experts']} experts of "
        f"{WIDE['moe_intermediate_size']}x{WIDE['routed_expert_hidden_size']} (MXFP4), hidden {WIDE['hidden_size']}; "
        f"{source['bytes'] / 1e9:.2f} GB in {source['shards']} shards. Page cache evicted before each run.",
        "",
        "| run | seconds | source read MB/s | output written MB/s | output GB | peak RSS growth |",
        "|---|---:|---:|---:|---:|---:|",
        f"| plain read (64 MiB readinto) | {read[1]:.1f} | {rate(*read)} | – | – | – |",
        f"| plain copy (read + write + fsync) | {copy[1]:.1f} | {rate(*copy)} | {rate(*copy)} | "
        f"{copy[0] / 1e9:.2f} | – |",
    ]
    for run in runs:
        growth = "n/a" if run["peak_rss_growth"] is None else f"{run['peak_rss_growth'] / 2**20:.0f} MiB"
        lines.append(
            f"| convert --experts-dtype {run['experts']}{'' if run['value_check'] else ' (no value check)'} | "
            f"{run['seconds']:.1f} | "
            f"{rate(run['read_bytes'], run['seconds'])} | {rate(run['written_bytes'], run['seconds'])} | "
            f"{run['written_bytes'] / 1e9:.2f} | {growth} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--workdir", help="where to write (default: a temporary folder, removed afterwards)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for dequantisation (0: torch's)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for docs/benchmarks.md)")
    parser.add_argument("--compare-value-check", action="store_true",
                        help="also run each conversion without the reader's NaN/Inf check (its cost)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kimik3-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        info = machine_info(workdir)
        start = time.perf_counter()
        release = fixture.write_release_checkpoint(workdir / "release", num_layers=args.layers,
                                                   num_experts=args.experts, config_overrides=WIDE, vision=False,
                                                   return_dense=False)
        source = {"layers": args.layers, "experts": args.experts, "shards": len(release.shards),
                  "bytes": sum(p.stat().st_size for p in shard_paths(release.path))}
        print(f"wrote {source['bytes'] / 1e9:.2f} GB synthetic checkpoint in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
        evict(release.path)
        read = plain_read(release.path)
        evict(release.path)
        copy = plain_copy(release.path, workdir / "copy")
        shutil.rmtree(workdir / "copy")
        runs = []
        for experts in ("mxfp4", "bf16"):
            for check in (True, False) if args.compare_value_check else (True,):
                runs.append(timed_convert(release.path, workdir / f"out-{experts}", experts, args.threads or None,
                                          check))
                shutil.rmtree(workdir / f"out-{experts}")
                print(json.dumps(runs[-1]), file=sys.stderr)
        result = {"machine": info, "source": source, "plain_read": read, "plain_copy": copy, "runs": runs}
        print(markdown(info, source, read, copy, runs) if args.markdown else json.dumps(result, indent=2))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
