"""ddipp.Recompute for fastai v1: a fit's blocks recompute their activations in backward, BatchNorm left exact."""
from fastai.basic_train import Learner, LearnerCallback

from ..core.recompute import recompute_names, recomputing


class Recompute(LearnerCallback):
    """For each fit the model's blocks (`modules`, or the blocks of its top-level Sequential children, else those
    children) keep only their inputs and run again in backward: less memory for activations, one more forward. The
    parameters and BatchNorm's running statistics are bitwise those of the same fit without it."""
    _order = -30  # before DistributedCallback (-20) wraps the model, or shards a copy of it whose units hold the
    # recomputing blocks (with sync_bn its swapped BatchNorms are found)

    def __init__(self, learn: Learner, modules=None):
        super().__init__(learn)
        self.modules, self.undo = modules, None

    def on_train_begin(self, **kwargs) -> None:
        model = self.learn.model
        self.undo = recomputing(model, recompute_names(model, self.modules))

    def on_train_end(self, **kwargs) -> None:
        """The model's own forwards again (fastai v1 calls this however the fit ends)."""
        if self.undo is not None:
            self.undo()
            self.undo = None
