"""argparse value types shared by the `kimik3` command and `kimik3 convert` (a usage error, exit code 2, names the
bad value), and `kimik3 serve`'s flags."""

import argparse


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a usage error, exit code 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def token_counts(text: str) -> list[int]:
    """argparse type: comma-separated context lengths, each a whole number >= 1."""
    return [positive_int(part.strip()) for part in text.split(",")]


def text_config_file(path: str):
    """argparse type: a config.json (the release's top-level schema or a text config), read into a text config."""
    from kimik3.memory import load_text_config

    try:
        return load_text_config(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def gpu_memory_size(text: str) -> tuple[int, str]:
    """argparse type: (bytes per device, the unit to print in) from '141GB' (10^9) or '141GiB' (2^30)."""
    from kimik3.memory import parse_gpu_memory

    try:
        return parse_gpu_memory(text), "GiB" if "ib" in text.lower() else "GB"
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def context_tokens(text: str) -> int:
    """argparse type: a token count, '131072', '128K' or '1M' (K = 1024)."""
    from kimik3.memory import parse_tokens

    try:
        return parse_tokens(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bandwidth(text: str) -> float:
    """argparse type: bytes per second, '4.8TB/s' (10^12), '4300GB/s' (10^9) or a plain number of bytes/s."""
    import re

    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:([TG])B/s)?", text.strip(), flags=re.IGNORECASE)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a bandwidth: give a number > 0 with TB/s or GB/s, e.g. "
                                         "4.8TB/s (4.8*10^12 bytes/s)")
    scale = {"T": 10**12, "G": 10**9, None: 1}[match.group(2) and match.group(2).upper()]
    return float(match.group(1)) * scale


def milliseconds(text: str) -> float:
    """argparse type: a duration in milliseconds, a finite number >= 0 (e.g. 3.5); returns seconds."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give milliseconds as a number >= 0, e.g. 3.5")
    return value / 1e3


def experts_cache_bytes(text: str):
    """argparse type: a whole number of bytes, or auto."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of bytes or auto")
    return int(text)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`kimik3 serve`'s flags, named as `transformers serve` names those that mean the same thing (--host, --port,
    --dtype, --device, --log-level). Here, not in kimik3.serve, so that building the command's parser imports no
    torch (a usage error or --help answers at once)."""
    parser.add_argument("directory", help="a model folder (kimik3 tiny, convert or adopt)")
    parser.add_argument("--host", default="localhost", help="the address to listen on (default localhost)")
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument("--dtype", default=None, help="the model's dtype, e.g. bfloat16 (default: the folder's)")
    parser.add_argument("--device", default=None, help="where the model runs, e.g. cuda (default: where it loads)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--model-name", default=None, help="the model id clients name (default: the folder's name)")
    parser.add_argument("--max-requests", type=positive_int, default=16,
                        help="sequences running or queued at once (each of a request's n counts); more are refused "
                             "with HTTP 429 (default 16)")
    parser.add_argument("--prefill-chunk", type=positive_int, default=512,
                        help="prompt tokens a request reads a step, between the batch's decode steps (default 512)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="prompt + max_tokens limit (default: the model's max_position_embeddings)")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="max_tokens when a request names none")
    parser.add_argument("--prefix-cache-bytes", type=int, default=1 << 30,
                        help="memory for stored prompts (MLA latents and KDA snapshots at 512-token blocks) that "
                             "later prompts start from; least recently used out; 0 turns it off (default 1 GiB)")
    parser.add_argument("--max-cache-bytes", type=positive_int, default=None,
                        help="a byte budget for the running sequences' caches: the KDA states of --max-requests "
                             "sequences, the rest a fixed pool of MLA latent pages; prompts wait for pages, and a "
                             "decode step that finds none preempts the sequence that arrived last (recomputed later); "
                             "a sequence the pool could never hold at prompt + max_tokens is a 400 (default: none, a "
                             "pool that grows)")
    parser.add_argument("--block-size", type=positive_int, default=64,
                        help="tokens a page of MLA latents holds in the running batch's pool (default 64)")
    parser.add_argument("--decode-step", choices=["auto", "plain", "fixed", "captured", "compiled"], default="auto",
                        help="the batch's decode forward: captured (CUDA graphs replayed, the rows and keys padded to "
                             "buckets), compiled (captured, torch.compile'd first: a compile a bucket), fixed (the "
                             "same shapes, eager), plain (the rows as they are, eager); auto: captured on one CUDA "
                             "device with the routed experts on it, else plain")
    parser.add_argument("--speculative-tokens", type=int, default=0,
                        help="tokens proposed by prompt lookup and verified in one forward (a sampled request "
                             "keeps each with its probability; 0: off, the default; at most 16)")
    parser.add_argument("--experts-offload", choices=["host", "disk"], default=None,
                        help="the load option experts_offload: routed experts kept in host memory or on disk")
    parser.add_argument("--experts-cache-bytes", type=experts_cache_bytes, default=None,
                        help="the load option experts_cache_bytes (with --experts-offload): the device's expert "
                             "cache in bytes, or auto")
    parser.add_argument("--experts-compute", choices=["device", "host", "auto"], default=None,
                        help="the load option experts_compute (with --experts-offload)")
    parser.add_argument("--tp-plan", choices=["auto"], default=None,
                        help="the load option tp_plan: tensor parallel over the ranks of torchrun (torchrun "
                             "--nproc-per-node N -m kimik3.serve DIR --tp-plan auto); rank 0 serves, every rank "
                             "computes")
