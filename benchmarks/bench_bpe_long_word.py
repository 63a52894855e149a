"""The slow tokenizer's BPE merge on one long piece (text without spaces or punctuation, which the pre-tokenizer
cannot split): the heap-ordered merge of `tokenization_kimi_k3.bpe_parts` against the rescanning loop it replaced
(kept here as the baseline), side by side in one run, on the synthetic 512-rank tokenizer `kimik3 tiny` writes.
Both give identical parts (checked at every size before timing).

    python benchmarks/bench_bpe_long_word.py [--sizes 1000,4000,16000] [--out FILE]
"""

import argparse
import json
import platform
import random
import time

from kimik3.modeling.tokenization_kimi_k3 import bpe_parts
from kimik3.tokenizer_files import train_ranks


def rescanning_bpe_parts(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    """The previous merge loop: after each merge it rescans every adjacent pair for the lowest rank (O(n^2))."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_index, best_rank = -1, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_index, best_rank = i, rank
        if best_rank is None:
            break
        parts[best_index:best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    return parts


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,4000,16000", help="piece lengths in bytes, comma-separated")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    args = parser.parse_args()
    ranks = train_ranks(512)
    rng = random.Random(0)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        piece = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(size)).encode()
        assert bpe_parts(ranks, piece) == rescanning_bpe_parts(ranks, piece), f"parts differ at {size} bytes"
        row = {"bytes": size, "rescanning_s": timed(rescanning_bpe_parts, ranks, piece),
               "heap_s": timed(bpe_parts, ranks, piece)}
        row["speedup"] = row["rescanning_s"] / row["heap_s"]
        rows.append(row)
        print(f"{size:>8} bytes  rescanning {row['rescanning_s']:8.3f} s  heap {row['heap_s']:7.4f} s  "
              f"{row['speedup']:7.1f}x", flush=True)
    result = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "ranks": len(ranks), "rows": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
