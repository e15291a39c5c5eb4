"""GlobalBatchLoss: the learner's loss, written as for one process, sees the global batch while training under DDP."""
from fastai.basic_train import LearnerCallback

from ..core.collectives import all_gather
from .callbacks import distributed_fit


class GlobalBatchLoss(LearnerCallback):
    """While a DDP fit trains, the loss gets every rank's outputs and targets, gathered in rank order with autograd.

    For losses that need the whole batch (pairwise distances, contrastive losses): each rank computes the loss on
    the global batch and, after DDP's averaging, the gradients are those of one process on that batch. Validation
    needs nothing: DistributedCallback already gives the loss the whole batch there."""

    def _gathering(self, train: bool) -> bool:
        return train and distributed_fit(self.learn) is not None

    def on_batch_begin(self, last_target, train: bool, **kwargs):
        if self._gathering(train):
            return {"last_target": _map(all_gather, last_target)}

    def on_loss_begin(self, last_output, train: bool, **kwargs):
        if self._gathering(train):
            return {"last_output": _map(all_gather, last_output)}


def _map(f, x):
    """`f` applied to the tensor `x`, or to each tensor of the list/tuple `x`."""
    return type(x)(f(o) for o in x) if isinstance(x, (list, tuple)) else f(x)
