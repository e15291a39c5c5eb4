"""What both adapters' Throughput callbacks count and say alike: an epoch's samples over all ranks, and the line that
compares the fit's rate with one process's."""
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from . import dist as ddist
from .collectives import reduce_sum


def global_counts(n_items: int, order: Iterable[int], count: int, elapsed: float) -> tuple[int, int, float]:
    """(samples, distinct items, seconds of the slowest rank) of an epoch's training over all ranks, from this rank's
    `count` samples, the first of its `order` (indices into the `n_items` of the training set), in `elapsed` s."""
    device = ddist.device()  # where the backend's collectives work (NCCL: CUDA tensors only)
    seen = torch.zeros(n_items, dtype=torch.int32, device=device)
    seen[torch.tensor(list(order), dtype=torch.int64, device=device)[:count]] = 1
    totals = reduce_sum(dict(seen=seen, count=torch.tensor(count, device=device)))
    slowest = torch.tensor(elapsed, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return int(totals["count"]), int((totals["seen"] > 0).sum()), float(slowest)


def rank0_rate(time_one_process: Callable[[], float]) -> float:
    """`time_one_process()` run on rank 0 alone, its result given to every rank (the others wait for it)."""
    rate = [time_one_process() if ddist.is_rank0() else None]
    dist.broadcast_object_list(rate, src=0)
    return rate[0]


def say_comparison(rate: int, single_rate: float, batches: int) -> None:
    """On rank 0, one line: the fit's global samples/s against one process's over `batches` batches."""
    if ddist.is_rank0():
        print(f"ddipp throughput: {ddist.world_size()} ranks {rate} samples/s, 1 process {round(single_rate)} "
              f"samples/s (over {batches} batches): {rate / single_rate:.2f}x")
