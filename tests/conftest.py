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
# Each pytest-xdist worker gets its own transformers module cache: trust_remote_code copies a folder's code files under
# the folder's base name there, and two workers loading folders of the same name would write the same files at once.
if os.environ.get("PYTEST_XDIST_WORKER") and "HF_MODULES_CACHE" not in os.environ:
    import tempfile

    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix=f"kimik3-hf-modules-{os.environ['PYTEST_XDIST_WORKER']}-")

import torch  # noqa: E402

torch.set_num_threads(int(_threads))

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory):
    """One torchrun launch of 2 gloo ranks for test_parallel.py and test_context_parallel.py (tests/two_rank_worker.py):
    the tiny model folder the parallel plans load, and the two output folders the workers wrote."""
    import subprocess

    from kimik3.tiny import write_tiny_folder
    from parallel_worker import MODES

    root = tmp_path_factory.mktemp("two_rank")
    tiny_dir, parallel_out, context_parallel_out = root / "tiny", root / "parallel", root / "context_parallel"
    write_tiny_folder(tiny_dir)
    parallel_out.mkdir()
    context_parallel_out.mkdir()
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(tests / "two_rank_worker.py"), str(tiny_dir), str(parallel_out), str(context_parallel_out), *MODES]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return {"tiny_dir": tiny_dir, "parallel": parallel_out, "context_parallel": context_parallel_out}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`--dist loadgroup`, pytest.ini) every file's tests stay on one worker, so a module-scoped
    fixture (a tiny folder, a fresh process, a fine-tune) runs once; files marked with their own group keep it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
