"""GPU tests (helpers in gpu_helpers.py, imported by the modules). Every test module in this folder skips at
module level when CUDA is unavailable, so CPU CI collects and skips them cleanly."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
