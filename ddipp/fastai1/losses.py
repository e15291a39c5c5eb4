"""GlobalBatchLoss: the learner's loss, written as for one process, sees the global batch while training under DDP."""
from fastai.basic_train import LearnerCallback

from ..core.collectives import all_gather_each
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
            return {"last_target": all_gather_each(last_target)}

    def on_loss_begin(self, last_output, train: bool, **kwargs):
        if self._gathering(train):
            return {"last_output": all_gather_each(last_output)}

