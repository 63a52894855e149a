"""GPU tests (helpers in gpu_helpers.py, imported by the modules). Every test module in this folder skips at
module level when CUDA is unavailable, so CPU CI collects and skips them cleanly."""

import os

import pytest
import torch

# cuBLAS reads its workspace setting when a handle is made: set before any test runs, so a test may turn on torch's
# deterministic algorithms (test_offload_gpu.py) whatever ran before it
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
