"""ddipp.Recompute for fastai v2: a fit's blocks recompute their activations in backward, BatchNorm left exact."""
from fastai.callback.core import Callback

from ..core.recompute import recompute_names, recomputing


class Recompute(Callback):
    """For each fit the model's blocks (`modules`, or the blocks of its top-level Sequential children, else those
    children) keep only their inputs and run again in backward: less memory for activations, one more forward. The
    parameters and BatchNorm's running statistics are bitwise those of the same fit without it."""
    order = -7  # after TrainEvalCallback (-10) put the model on its device; before DistributedCallback (-5) wraps it,
    # or shards a copy of it whose units hold the recomputing blocks (with sync_bn its swapped BatchNorms are found)

    def __init__(self, modules=None):
        self.modules, self.undo = modules, None

    @property
    def learn(self):
        return self._learn

    @learn.setter
    def learn(self, learn) -> None:
        """fastai sets None when it removes the callback (a fit's `cbs` after it, even one that raised): undo there."""
        self.restore()
        object.__setattr__(self, "_learn", learn)

    _learn = None

    def before_fit(self) -> None:
        self.restore()  # after a fit that raised on a learner keeping the callback
        model = self.learn.model
        self.undo = recomputing(model, recompute_names(model, self.modules))

    def after_fit(self) -> None:
        self.restore()

    def restore(self) -> None:
        """The model's own forwards again."""
        if self.undo is not None:
            self.undo()
            self.undo = None
