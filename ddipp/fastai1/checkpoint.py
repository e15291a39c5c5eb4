"""Checkpoint: a fit that can be resumed where it stopped, with the same result as if it had not stopped."""
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from fastai.basic_train import Learner, LearnerCallback
from fastai.torch_core import get_model

from ..core import dist as ddist
from ..core.files import save_atomic


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
        rngs = _every_rank(_rng_states())  # a collective: every rank takes part, rank 0 writes
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
        self._restore_rngs(state["rngs"])
        if state["shuffle_seed"] is not None and self._sampler_seed() is not None:
            self.learn.distributed_callback.train_sampler.seed = state["shuffle_seed"]

    def _sampler_seed(self):
        """The seed ddipp shuffles this fit's training order with, when the fit is distributed."""
        ddp = getattr(self.learn, "distributed_callback", None)
        return ddp.train_sampler.seed if ddp is not None and ddp.distributed else None

    def _restore_rngs(self, rngs: list) -> None:
        if len(rngs) != ddist.world_size():
            warnings.warn(f"{self.path} was written by {len(rngs)} ranks, this group has {ddist.world_size()}: "
                          "random number generators are not restored (dropout and augmentation draws will differ)")
            return
        python, (key, *numpy), torch_cpu, cuda = rngs[ddist.rank()]
        random.setstate((python[0], tuple(python[1]), python[2]))
        np.random.set_state(("MT19937", key.numpy().astype(np.uint32), *numpy))
        torch.set_rng_state(torch_cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def _rng_states() -> list:
    """This process's python, numpy, torch CPU and (if in use) current CUDA generator states, as tensors and lists
    (what a weights-only load reads)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    version, python, gauss = random.getstate()
    _, key, pos, has_gauss, cached = np.random.get_state()
    return [[version, list(python), gauss], [torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss),
                                            float(cached)], torch.get_rng_state(), cuda]


def _every_rank(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...]: one entry in a plain process."""
    if ddist.world_size() == 1 or not ddist.init():
        return [obj]
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs
