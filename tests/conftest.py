import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def cache_of(output):
    """The cache of a model output on transformers 5.17 (`past_key_values`) and 5.24+ (`cache`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
