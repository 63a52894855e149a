"""What the CPU suite runs in one launch of 2 gloo ranks (one start of two processes instead of one per test file):
the tensor/expert-parallel plans of tests/parallel_worker.py, the same plans with the experts kept packed
(tests/packed_parallel_worker.py), the context-parallel and FSDP2 checks of tests/context_parallel_worker.py, then
`kimik3 serve`'s engine under tensor parallelism (tests/serve_parallel_worker.py, writing PARALLEL_OUT/serve).
The conftest fixture `two_rank_runs` forks the two ranks and calls `main` in each, with torchrun's environment; it
also runs under torchrun, as below, and each worker runs alone (the GPU tests launch them with NCCL).

    torchrun --standalone --nproc-per-node 2 tests/two_rank_worker.py MODEL_DIR PARALLEL_OUT CONTEXT_PARALLEL_OUT MODE...

The packed checks write their model and results under PARALLEL_OUT/packed (packed_parallel_worker.PACKED_OUT).
"""

import sys
from pathlib import Path

import torch.distributed as dist

import context_parallel_worker
import packed_parallel_worker
import parallel_worker
import serve_parallel_worker


def main(argv: list[str]) -> None:
    model_dir, parallel_out, context_parallel_out, *modes = argv
    dist.init_process_group("gloo")
    try:
        parallel_worker.run_modes(model_dir, Path(parallel_out), modes)
        packed_parallel_worker.run_all(model_dir, Path(parallel_out) / packed_parallel_worker.PACKED_OUT)
        context_parallel_worker.run_all(Path(context_parallel_out))
        (Path(parallel_out) / "serve").mkdir(exist_ok=True)
        serve_parallel_worker.run_all(model_dir, Path(parallel_out) / "serve")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
