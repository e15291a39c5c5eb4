"""The steps of a distributed fit that both adapters' DistributedCallbacks take alike."""
from typing import Callable, List, Optional

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


class DistributedFit:
    """What a callback may know of the distributed fit it runs in: each adapter's `distributed_fit(learn)` gives it
    while such a fit runs (its model wrapped, its training loader sharded), else None. `order` is the sampler that
    draws the training order alike on every rank (it holds the seed), `n_items` the items of the whole training set
    it draws from, `epoch_order()` this rank's items of the current epoch (indices into the set), in its order."""

    def __init__(self, rank: int, world_size: int, strategy: Strategy, order, n_items: int,
                 epoch_order: Callable[[], List[int]]):
        self.rank, self.world_size, self.strategy, self.n_items = rank, world_size, strategy, n_items
        self._order, self.epoch_order = order, epoch_order

    @property
    def shuffle_seed(self) -> int:
        """The seed the training order is drawn with, alike on every rank (a Checkpoint restores it)."""
        return self._order.seed

    @shuffle_seed.setter
    def shuffle_seed(self, seed: int) -> None:
        self._order.seed = seed
