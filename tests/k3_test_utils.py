"""Small helpers shared by the tests (CPU, and the GPU tests in tests/gpu/)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def grouped_product_f64(xs, weight, group_ends):
    """Each group of expert-sorted rows (group e: rows group_ends[e-1]:group_ends[e]) times its expert transposed, in
    float64: the reference of the grouped matmuls."""
    starts = [0, *group_ends.tolist()[:-1]]
    return torch.cat([xs[a:b].double() @ weight[e].double().t() for e, (a, b) in enumerate(zip(starts, group_ends))])


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

