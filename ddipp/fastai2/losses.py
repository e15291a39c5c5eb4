"""GlobalBatchLoss: the learner's loss, written as for one process, sees the global batch while training under DDP."""
from fastai.callback.core import Callback

from ..core.collectives import all_gather_each
from .callbacks import distributed_fit


class GlobalBatchLoss(Callback):
    """While a DDP fit trains, the loss gets every rank's predictions and targets, gathered in rank order with autograd.

    For losses that need the whole batch (pairwise distances, contrastive losses): each rank computes the loss on
    the global batch and, after DDP's averaging, the gradients are those of one process on that batch. Validation
    needs nothing: DistributedCallback already gives the loss the whole batch there."""
    order = 20  # after the callbacks that shape the prediction the loss sees (RNNCallback 0, MixedPrecision 10)
    run_valid = False

    def after_pred(self):
        if distributed_fit(self.learn) is not None:
            self.learn.pred = all_gather_each(self.pred)
            self.learn.yb = all_gather_each(self.yb)

