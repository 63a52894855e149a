"""Small helpers shared by the CPU tests."""


def cache_of(output):
    """The cache of a model output on transformers 5.17 (`past_key_values`) and 5.24+ (`cache`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def peak_rss_resettable() -> bool:
    """Whether this kernel lets a process reset its peak RSS (VmHWM) through /proc/self/clear_refs, which the
    peak-memory tests measure with."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False
