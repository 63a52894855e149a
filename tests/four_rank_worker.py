"""What the CPU suite runs in one launch of 4 gloo ranks, after the two-rank launch (tests/two_rank_worker.py) has
written the packed tiny model: the packed experts under each layout of parallel_worker.FOUR_RANK_MODES (TP 4, EP 4 as
this transformers has it, and with transformers >= 5.21 TP 2 inside each pair of ranks with EP over all 4), every rank
writing OUT/<mode>-rank<r>.json (its packed holdings) and .safetensors (logits and greedy tokens) as
packed_parallel_worker.run does. No backward here: the two-rank launch checks the gradients, and one backward per
layout on 4 ranks of a 2-core machine would double this launch's time. The conftest fixture `four_rank_runs` forks
the ranks and calls `main` with torchrun's environment; it also runs under torchrun:

    torchrun --standalone --nproc-per-node 4 tests/four_rank_worker.py PACKED_DIR OUT_DIR
"""

import sys
from pathlib import Path

import torch.distributed as dist

import packed_parallel_worker
from parallel_worker import FOUR_RANK_MODES


def main(argv: list[str]) -> None:
    packed_dir, out_dir = argv
    dist.init_process_group("gloo")
    try:
        for mode in FOUR_RANK_MODES:
            packed_parallel_worker.run(packed_dir, Path(out_dir), mode, dist.get_rank(), backward=False)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
