"""Checkpoint: a fit that can be resumed where it stopped, with the same result as if it had not stopped."""
from pathlib import Path

from fastai.basic_train import Learner, LearnerCallback

from ..core import dist as ddist
from ..core.checkpoint import read_checkpoint
from ..core.files import save_atomic
from ..core.rng import every_rank, rng_state, set_rng_state, this_rank
from ..core.state import load_model_state, model_state
from .callbacks import distributed_fit
from .state import load_opt_state_dict, opt_state_dict


class Checkpoint(LearnerCallback):
    """After every epoch rank 0 writes `{model_dir}/{name}.pth` atomically; a fit started at `start_epoch` reads it.

    The file holds the model, the optimizer state, the epoch and iteration reached, every rank's RNG states and
    ddipp's shuffle seed. Resume with fastai's own argument: `learn.fit_one_cycle(4, lr, start_epoch=2)` loads the
    state written after epoch 2 (fastai's `jump_to_epoch`) and runs epochs 2 and 3 of the same schedule."""
    _order = -1  # its jump_to_epoch loads the optimizer before the schedulers (order 0) jump to their position

    def __init__(self, learn: Learner, name: str = "checkpoint"):
        super().__init__(learn)
        self.path = Path(learn.path) / learn.model_dir / f"{name}.pth"

    def on_epoch_end(self, epoch: int, iteration: int, **kwargs) -> None:
        rngs = every_rank(rng_state())  # a collective: every rank takes part, rank 0 writes
        if ddist.is_rank0():
            save_atomic(dict(model=model_state(self.learn.model), opt=opt_state_dict(self.learn),
                             epoch=epoch + 1, iteration=iteration, rngs=rngs, shuffle_seed=self._sampler_seed()),
                        self.path)

    def jump_to_epoch(self, epoch: int) -> None:
        state = read_checkpoint(self.path, epoch)
        load_model_state(self.learn.model, state["model"])
        load_opt_state_dict(self.learn, state["opt"])
        rngs = this_rank(state["rngs"], self.path)
        if rngs is not None:
            set_rng_state(rngs)
        if state["shuffle_seed"] is not None and self._sampler_seed() is not None:
            distributed_fit(self.learn).train_sampler.seed = state["shuffle_seed"]

    def _sampler_seed(self):
        """The seed ddipp shuffles this fit's training order with, when the fit is distributed."""
        ddp = distributed_fit(self.learn)
        return ddp.train_sampler.seed if ddp is not None else None
