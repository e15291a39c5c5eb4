"""The steps of a distributed fit that both adapters' DistributedCallbacks take alike."""
from typing import List, Optional, Protocol

import torch
import torch.distributed as dist

from . import dist as ddist
from .parallel import Strategy


class LossAndStop:
    """The loss of the global batch from this rank's `loss` (float32; a summed loss adds up, a mean averages), and
    whether any rank asked to stop, in one all-reduce started now (after a step's loss) and read by `result()` (after
    its optimizer step), so that it runs while backward and the step do; every rank stops after this same step. Under
    split_batches (`split_sizes`: each rank's items of the global batch) each rank's mean loss counts by its share."""

    def __init__(self, loss: torch.Tensor, summed: bool, world_size: int, split_sizes: Optional[List[int]] = None):
        if split_sizes is None:
            mine = loss.detach().float() / (1 if summed else world_size)
        else:
            mine = loss.detach().float() * split_weight(split_sizes, summed) / world_size
        self.loss_and_stop = torch.stack([mine, loss.new_tensor(ddist.stop_requested()).float()])
        self.work = dist.all_reduce(self.loss_and_stop, async_op=True)

    def result(self) -> tuple[torch.Tensor, bool]:
        """The global batch's loss and whether to stop, once the all-reduce ended."""
        self.work.wait()
        total, stop = self.loss_and_stop
        return total, bool(stop)


def split_weight(sizes: List[int], summed: bool) -> float:
    """This rank's loss factor before backward under split_batches (`sizes`: each rank's items of the global batch), so
    that DDP's average of the ranks' gradients is one process's on the whole batch: N x the rank's share for a mean
    loss, N for a summed one, 0 for a placeholder (a rank with no item of a short last batch)."""
    mine, world_size = sizes[dist.get_rank()], len(sizes)
    if mine == 0:
        return 0.0
    return float(world_size) if summed else world_size * mine / sum(sizes)


def meet_at_end() -> None:
    """Every rank ends the fit together, so what rank 0 wrote during it exists for all; when a rank failed at the very
    end, this one leaves the group before the error goes on."""
    try:
        dist.barrier()
    except Exception as e:
        if ddist.peer_failure(e):
            ddist.leave()
        raise


class DistributedFit(Protocol):
    """What a callback may know of the distributed fit it runs in: each adapter's `distributed_fit(learn)` gives it
    while such a fit runs (its model wrapped, its training loader sharded), else None."""
    rank: int
    world_size: int
    strategy: Strategy  # how the fit holds the model: read and load its whole state through it
    shuffle_seed: int  # the seed the training order is drawn with, alike on every rank (a Checkpoint restores it)
    n_items: int  # the items of the whole training set the order is drawn from

    def epoch_order(self) -> List[int]:
        """This rank's items of the current epoch (indices into the training set), in the order it takes them."""
