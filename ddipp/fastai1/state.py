"""Where fastai v1 keeps a learner's optimizer: the torch optimizer inside its OptimWrapper (the state is
ddipp.core.state's), and the hyper-parameters the OptimWrapper keeps beside it."""
from typing import Optional

import torch
from fastai.basic_train import Learner


def optimizer(learn: Learner) -> Optional[torch.optim.Optimizer]:
    """The learner's torch optimizer, None before it has one (its first fit makes it)."""
    opt = getattr(learn, "opt", None)
    return opt.opt if opt else None


_HYPERS = ("_lr", "_mom", "_beta", "_wd")  # per layer group; fastai writes them into the torch optimizer's groups


def hypers(learn: Learner) -> dict:
    """The OptimWrapper's hyper-parameters, as its load_with_state_and_layer_group sets them."""
    return {name: getattr(learn.opt, name) for name in _HYPERS}


def set_hypers(learn: Learner, values: dict) -> None:
    vars(learn.opt).update(values)
