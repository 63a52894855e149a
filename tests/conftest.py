import os
import sys
from pathlib import Path

import pytest

# One intra-op thread by default: the tiny models of the suite gain nothing from more, and on a shared machine extra
# threads only contend. Set before torch is imported so subprocess tests (fresh-process remote code, the gloo
# two-rank test) inherit it; KIMIK3_TEST_THREADS overrides it.
_threads = os.environ.get("KIMIK3_TEST_THREADS", "1")
if not _threads.isdigit() or int(_threads) < 1:
    raise pytest.UsageError(f"KIMIK3_TEST_THREADS must be a positive integer, got {_threads!r}")
os.environ["OMP_NUM_THREADS"] = _threads

import torch  # noqa: E402

torch.set_num_threads(int(_threads))

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
