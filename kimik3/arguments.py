"""argparse value types shared by the `kimik3` command and `kimik3 convert` (a usage error, exit code 2, names the
bad value)."""

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
