"""Checkpoint: a fit that can be resumed where it stopped, with the same result as if it had not stopped."""
from pathlib import Path

import torch
from fastai.basic_train import Learner, LearnerCallback
from fastai.torch_core import get_model

from ..core import dist as ddist
from ..core.files import save_atomic
from ..core.rng import every_rank, rng_state, set_rng_state, this_rank
from .callbacks import distributed_fit


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
            save_atomic(dict(model=get_model(self.learn.model).state_dict(), opt=self.learn.opt.opt.state_dict(),
                             epoch=epoch + 1, iteration=iteration, rngs=rngs, shuffle_seed=self._sampler_seed()),
                        self.path)

    def jump_to_epoch(self, epoch: int) -> None:
        ddist.barrier()  # the file rank 0 wrote last is complete
        if not self.path.exists():
            raise FileNotFoundError(f"start_epoch={epoch}: no checkpoint at {self.path}; fit from the start "
                                    "(no start_epoch) or give Checkpoint the name the interrupted fit used")
        state = torch.load(self.path, map_location="cpu", weights_only=True)  # tensors and lists only: runs no code
        if state["epoch"] != epoch:
            raise ValueError(f"start_epoch={epoch}, but {self.path} holds the state after epoch {state['epoch']}; "
                             f"pass start_epoch={state['epoch']}")
        get_model(self.learn.model).load_state_dict(state["model"])
        self.learn.opt.opt.load_state_dict(state["opt"])
        rngs = this_rank(state["rngs"], self.path)
        if rngs is not None:
            set_rng_state(rngs)
        if state["shuffle_seed"] is not None and self._sampler_seed() is not None:
            distributed_fit(self.learn).train_sampler.seed = state["shuffle_seed"]

    def _sampler_seed(self):
        """The seed ddipp shuffles this fit's training order with, when the fit is distributed."""
        ddp = distributed_fit(self.learn)
        return ddp.train_sampler.seed if ddp is not None else None
