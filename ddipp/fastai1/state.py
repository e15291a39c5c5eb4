"""Where fastai v1 keeps a learner's optimizer: the torch optimizer inside its OptimWrapper (the state is
ddipp.core.state's)."""
from typing import Optional

import torch
from fastai.basic_train import Learner


def optimizer(learn: Learner) -> Optional[torch.optim.Optimizer]:
    """The learner's torch optimizer, None before it has one (its first fit makes it)."""
    opt = getattr(learn, "opt", None)
    return opt.opt if opt else None
