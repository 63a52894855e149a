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

# pytest rewrites each test module's asserts and caches the result as bytecode beside it, unless bytecode writing is
# off (PYTHONDONTWRITEBYTECODE, set on some CI images): then every worker rewrote every module on every run, about 5
# of a worker's 15 s of collection on a 2-core machine. The suite writes its own bytecode whatever the environment
# says; this process only, so the fresh interpreters the tests start keep the environment as given.
sys.dont_write_bytecode = False

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def _rank_entry(rank: int, world_size: int, port: int, worker: str, argv: list[str]) -> None:
    """One rank of a gloo launch (`two_rank_runs`, `four_rank_runs`), in a process forked from the test worker:
    torchrun's environment, then the worker module's own `main`, as
    `torchrun --standalone --nproc-per-node N tests/<worker>.py ...` would run it."""
    import importlib
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
    # a forked rank cannot use the parent's OpenMP thread pool (test_quantile_balancing.py's forked ranks hung)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    importlib.import_module(worker).main(argv)


def _launch_ranks(worker: str, world_size: int, argv: list[str]) -> None:
    """Forks `world_size` gloo ranks running `worker`'s `main(argv)` and waits for them; a rank that raised fails the
    calling fixture with its traceback. The ranks are forked from this process, not started by torchrun: fresh
    interpreters importing torch and transformers (and the launcher's own) were most of a launch's time; the GPU tests
    launch the same workers with torchrun."""
    import importlib
    import socket
    import time

    import torch.multiprocessing as mp

    importlib.import_module(worker)  # imported once here, before the fork, not in each rank
    with socket.socket() as probe:  # a free port for rank 0's rendezvous store, as torchrun --standalone picks one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = mp.start_processes(_rank_entry, args=(world_size, port, worker, argv), nprocs=world_size, join=False,
                               start_method="fork")
    deadline = time.monotonic() + 300
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {world_size} ranks of {worker} did not finish within 300 s")


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory):
    """One launch of 2 gloo ranks for test_parallel.py and test_context_parallel.py (tests/two_rank_worker.py):
    the tiny model folder the parallel plans load, and the two output folders the workers wrote."""
    from kimik3.tiny import write_tiny_folder
    from parallel_worker import MODES

    root = tmp_path_factory.mktemp("two_rank")
    tiny_dir, parallel_out, context_parallel_out = root / "tiny", root / "parallel", root / "context_parallel"
    write_tiny_folder(tiny_dir)
    parallel_out.mkdir()
    context_parallel_out.mkdir()
    _launch_ranks("two_rank_worker", 2, [str(tiny_dir), str(parallel_out), str(context_parallel_out), *MODES])
    return {"tiny_dir": tiny_dir, "parallel": parallel_out, "context_parallel": context_parallel_out}


@pytest.fixture(scope="session")
def four_rank_runs(two_rank_runs, tmp_path_factory):
    """One launch of 4 gloo ranks for test_parallel.py (tests/four_rank_worker.py) on the packed tiny model the
    two-rank launch wrote: its output folder."""
    from packed_parallel_worker import PACKED_OUT

    out_dir = tmp_path_factory.mktemp("four_rank")
    _launch_ranks("four_rank_worker", 4, [str(two_rank_runs["parallel"] / PACKED_OUT / "model"), str(out_dir)])
    return out_dir


FRESH_SERVER = r"""
import contextlib, io, json, sys, traceback
sys.modules["kimik3"] = None  # never imported here: the folders' flat files must be enough
for line in sys.stdin:
    code, argv = json.loads(line)
    sys.argv, out = ["-c", *argv], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<fresh>", "exec"), {"__name__": "__main__"})
        reply = {"rc": 0, "stdout": out.getvalue(), "error": ""}
    except SystemExit as exit:  # sys.exit(code) as in a process of its own
        code = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
        reply = {"rc": code, "stdout": out.getvalue(), "error": "" if code == 0 else str(exit.code)}
    except BaseException:
        reply = {"rc": 1, "stdout": out.getvalue(), "error": traceback.format_exc()}
    sys.__stdout__.write("\x00" + json.dumps(reply) + "\n")
    sys.__stdout__.flush()
"""


@pytest.fixture(scope="session")
def fresh_python(tmp_path_factory):
    """`fresh_python(code, *argv)` runs a script as `python -c code *argv` would, in ONE Python process per test
    session started for it (torch and transformers imported once for test_remote_code.py and test_hub_card.py), where
    the installed kimik3 package is never imported and cannot be. Returns (returncode, stdout, error text)."""
    import json
    import select
    import subprocess

    log = tmp_path_factory.mktemp("fresh_python") / "stderr.txt"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", FRESH_SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)

    def run(code: str, *argv: str, timeout: float = 300):
        process.stdin.write(json.dumps([code, list(argv)]) + "\n")
        process.stdin.flush()
        while True:
            if not select.select([process.stdout], [], [], timeout)[0]:
                return 124, "", f"no answer in {timeout} s\n" + log.read_text()[-3000:]
            line = process.stdout.readline()
            if not line:
                return process.wait(), "", log.read_text()[-3000:]
            if "\x00" in line:  # the reply; output written past sys.stdout (C code, fd 1) came before it
                reply = json.loads(line.split("\x00", 1)[1])
                error = reply["error"] + log.read_text()[-3000:] if reply["rc"] else ""
                return reply["rc"], reply["stdout"], error

    yield run
    process.stdin.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# Files that share a session fixture run on one pytest-xdist worker, so the fixture runs once: the two files of the
# one launch of two ranks (`two_rank_runs`), the files of the one fresh interpreter (`fresh_python`: starting it
# imports torch and transformers, ~8 s of CPU on a 2-core machine). Every other file is a group of its own.
SHARED_GROUPS = {"test_parallel": "two_rank_launch", "test_context_parallel": "two_rank_launch",
                 "test_serve_parallel": "two_rank_launch",
                 "test_remote_code": "fresh_interpreter", "test_hub_card": "fresh_interpreter",
                 "test_adopt": "fresh_interpreter", "test_release_loading": "fresh_interpreter"}
# The groups that take longest, handed out first (longest first), so the two workers end together rather than one
# starting a long group while the other has finished; the rest go in xdist's order (most tests first). Seconds summed
# from `--durations=0` of a two-worker run on a 2-core machine (only the order matters). No file is near
# half the suite, so the file groups stay whole: the longest bounds the wall time only when it is.
GROUP_SECONDS = {"test_readme": 21, "fresh_interpreter": 18, "two_rank_launch": 25, "test_training_recipes": 17,
                 "test_serve": 16,
                 "test_training": 11, "test_peft_paths": 10, "test_quantile_balancing_model": 10,
                 "test_static_cache": 9, "test_speculative_static": 7, "test_decode_loop": 6, "test_prefix_reuse": 6,
                 "test_convert_roundtrip": 5, "test_convert_memory": 5, "test_training_lora_packed": 5,
                 "test_training_lora": 5, "test_auto_classes": 4, "test_bad_inputs_runs": 4, "test_offload": 4,
                 "test_kernels_dispatch": 3, "test_vision": 3}


def xdist_group_of(nodeid: str) -> str:
    stem = Path(nodeid.split("::", 1)[0]).stem
    return SHARED_GROUPS.get(stem, stem)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (pytest.ini) with the groups taken from the test ids: every file's tests stay on one worker,
    so a module-scoped fixture (a tiny folder, a fresh process, a fine-tune) runs once. xdist's own loadgroup reads
    `xdist_group` marks through a node id suffix that pytest 9 no longer carries: each test was a group of its own, and
    a module's fixtures ran on both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(OrderedDict):
        def popitem(self, last=True):
            if last or not self:
                return super().popitem(last)
            scope = max(self, key=lambda s: GROUP_SECONDS.get(s, 0))  # the first of the longest, else queue order
            return scope, self.pop(scope)

    class FileGroupScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = LongestFirst()

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return FileGroupScheduling(config, log)
