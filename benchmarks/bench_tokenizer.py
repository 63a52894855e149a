"""Slow (pure Python, `regex` V1) vs fast (`tokenizers`) K3 tokenizer throughput on CPU, side by side, on the
synthetic ranks file `kimik3 tiny` writes (the release's ranks cannot be downloaded here). Both give identical ids
(checked on the text before timing).

    python benchmarks/bench_tokenizer.py [--ranks 512] [--kib 512] [--repeats 3]
"""

import argparse
import json
import platform
import random
import tempfile
import time


def corpus(kib: int, seed: int = 0) -> list[str]:
    """Lines of mixed English, code, CJK, emoji and whitespace runs, about `kib` KiB of UTF-8 in all."""
    rng = random.Random(seed)
    samples = [
        "The quick brown fox jumps over the lazy dog; it's 21 degrees in Paris today.",
        "def main(argv):\n    return sum(int(x) for x in argv)  # 42\n",
        "你好，世界！今天天气很好。我们去公园散步吧。",
        "Emoji 👍🏽 and family 👨‍👩‍👧 with café, naïve, Zürich.",
        "    indented\n\n\n\t\ttabs   and   spaces      ",
        '{"location": "San Francisco", "unit": "celsius", "days": 3}',
    ]
    lines, size = [], 0
    while size < kib * 1024:
        line = " ".join(rng.choice(samples) for _ in range(rng.randint(1, 4)))
        lines.append(line)
        size += len(line.encode())
    return lines


def throughput(encode, lines, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total = encode(lines)
        best = min(best, time.perf_counter() - start)
    nbytes = sum(len(line.encode()) for line in lines)
    return {"seconds": best, "MB_per_s": nbytes / best / 1e6, "tokens_per_s": total / best, "tokens": total}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--kib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import tokenizers
    import transformers

    from kimik3.modeling.tokenization_kimi_k3 import KimiK3Tokenizer, KimiK3TokenizerFast
    from kimik3.tokenizer_files import write_tokenizer_folder

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_folder(tmp, args.ranks)
        slow = KimiK3Tokenizer.from_pretrained(tmp)
        fast = KimiK3TokenizerFast.from_pretrained(tmp)
    lines = corpus(args.kib)
    sample = lines[:200]
    assert [slow.encode(t, add_special_tokens=False) for t in sample] == \
        [fast.encode(t, add_special_tokens=False) for t in sample], "slow and fast ids differ"

    def slow_encode(batch):
        slow._piece_cache.clear()  # cold cache each repeat: what a fresh process sees
        return sum(len(slow.encode(t, add_special_tokens=False)) for t in batch)

    def fast_one_by_one(batch):
        return sum(len(fast.encode(t, add_special_tokens=False)) for t in batch)

    def fast_batched(batch):
        return sum(len(ids) for ids in fast(batch, add_special_tokens=False)["input_ids"])

    results = {
        "slow (Python, regex V1)": throughput(slow_encode, lines, args.repeats),
        "fast, one text per call": throughput(fast_one_by_one, lines, args.repeats),
        "fast, batched call": throughput(fast_batched, lines, args.repeats),
    }
    print(f"{len(lines)} lines, {sum(len(t.encode()) for t in lines) / 1024:.0f} KiB, {args.ranks} ranks; "
          f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
          f"python {platform.python_version()}, {platform.processor() or platform.machine()}")
    print(f"{'':26s} {'MB/s':>8s} {'tokens/s':>12s} {'s':>7s}")
    for name, row in results.items():
        print(f"{name:26s} {row['MB_per_s']:8.2f} {row['tokens_per_s']:12,.0f} {row['seconds']:7.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
