"""Where fastai v2 keeps a learner's optimizer: fastai's own Optimizer, seen as ddipp.core.state reads a torch one."""
from typing import Optional

from fastai.learner import Learner
from fastai.torch_core import to_device
from fastcore.foundation import L


def optimizer(learn: Learner) -> Optional["FastaiOptimizer"]:
    """The learner's optimizer as ddipp.core.state takes it, None before it has one (its first fit makes it)."""
    opt = getattr(learn, "opt", None)
    return None if opt is None else FastaiOptimizer(opt)


class FastaiOptimizer:
    """fastai's Optimizer `opt` with a torch optimizer's `state` (parameter -> its state), and a `state_dict` of plain
    values (hypers as a list of dicts: what a weights-only load reads) that `load_state_dict` puts back as fastai
    keeps it (hypers in fastcore's L, the state on the parameters' device). An OptimWrapper's state dict is its torch
    optimizer's, without hypers: it passes as it is."""

    def __init__(self, opt):
        self.opt = opt

    @property
    def state(self) -> dict:
        return self.opt.state

    @property
    def param_groups(self) -> list:
        """fastai's parameter lists as a torch optimizer's groups: {"params": the list itself}, changed in place."""
        return [{"params": params} for params in self.opt.param_lists]

    def state_dict(self) -> dict:
        state = self.opt.state_dict()
        return dict(state, hypers=[dict(h) for h in state["hypers"]]) if "hypers" in state else state

    def load_state_dict(self, state: dict) -> None:
        state = to_device(state, self.opt.param_lists[0][0].device)
        self.opt.load_state_dict(dict(state, hypers=L(state["hypers"])) if "hypers" in state else state)
