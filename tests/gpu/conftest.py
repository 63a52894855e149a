"""Fixtures of the GPU tests. Every test module in this folder skips at module level when CUDA is unavailable, so
CPU CI collects and skips them cleanly."""

import pytest
import torch

from gpu_helpers import load_kernels, load_ops


@pytest.fixture(scope="session")
def kernels():
    return load_kernels()


@pytest.fixture(scope="session")
def ops():
    return load_ops()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
