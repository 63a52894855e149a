"""Small helpers shared by the tests (CPU, and the GPU tests in tests/gpu/)."""

from torch.utils._python_dispatch import TorchDispatchMode


class TopLevelOps(TorchDispatchMode):
    """Records the names of the ops called at the top level (not the ops inside them: the mode is off while one
    runs), e.g. which matmul a dispatch chose."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def cache_of(output):
    """The cache of a model output on transformers 5.17 (`past_key_values`) and 5.24+ (`cache`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values

