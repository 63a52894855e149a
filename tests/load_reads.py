"""What one from_pretrained reads from the safetensors files, and the peak of its process's memory, for the parallel
workers (tests/packed_parallel_worker.py): the checks of docs/design.md, Parallelism ("Bytes each rank reads").

`counting_reads` counts, per checkpoint tensor, the bytes transformers' loader takes out of the files: it opens every
weights file through `transformers.modeling_utils.safe_open` and reads each tensor by indexing the slice object
`get_slice` returns (whole, `tensor[...]`, or the rank's part, shard-on-read), the lowest level transformers uses;
the files are mmap-ed, so a tensor's bytes enter the process only when such an index copies them out. The count is
the bytes of what the index returns (the file's dtype, before any cast): the logical read; the kernel's page-sized
readahead around it is not counted. `peak_rss_growth` resets the process's peak resident size (Linux:
/proc/self/clear_refs), so the peak seen after the load is the load's own, above what the process held before it.
"""

import contextlib
import threading

import transformers.modeling_utils as modeling_utils


class _CountedSlice:
    def __init__(self, inner, name: str, count):
        self._inner, self._name, self._count = inner, name, count

    def __getitem__(self, index):
        tensor = self._inner[index]
        self._count(self._name, tensor.numel() * tensor.element_size())
        return tensor

    def __getattr__(self, attribute):  # get_shape, get_dtype
        return getattr(self._inner, attribute)


class _CountedFile:
    def __init__(self, inner, count):
        self._inner, self._count = inner, count

    def get_slice(self, name):
        return _CountedSlice(self._inner.get_slice(name), name, self._count)

    def get_tensor(self, name):
        tensor = self._inner.get_tensor(name)
        self._count(name, tensor.numel() * tensor.element_size())
        return tensor

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __getattr__(self, attribute):  # keys, metadata, offset_keys
        return getattr(self._inner, attribute)


@contextlib.contextmanager
def counting_reads():
    """Yields {checkpoint tensor name: bytes read from the files} for the loads inside the block (the loader's
    thread pool included)."""
    reads, lock, original = {}, threading.Lock(), modeling_utils.safe_open

    def count(name: str, nbytes: int) -> None:
        with lock:
            reads[name] = reads.get(name, 0) + nbytes

    modeling_utils.safe_open = lambda *args, **kwargs: _CountedFile(original(*args, **kwargs), count)
    try:
        yield reads
    finally:
        modeling_utils.safe_open = original


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


@contextlib.contextmanager
def peak_rss_growth():
    """Yields a dict that gets `bytes`: the peak resident size during the block minus the resident size before it
    (resource.getrusage's ru_maxrss cannot be reset, and a rank that loaded a model before would hide this load's
    peak behind the earlier one)."""
    result = {}
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident size (VmHWM) starts again from the current one
    before = _status_kb("VmRSS")
    try:
        yield result
    finally:
        result["bytes"] = (_status_kb("VmHWM") - before) * 1024
