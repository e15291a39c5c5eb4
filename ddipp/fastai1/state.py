"""Where fastai v1 keeps a learner's optimizer state (the model's is ddipp.core.state's)."""
from collections.abc import Mapping

from fastai.basic_train import Learner


def opt_state(learn: Learner) -> Mapping:
    """The optimizer's per-parameter state (empty before the learner has an optimizer)."""
    opt = getattr(learn, "opt", None)
    return opt.opt.state if opt else {}


def opt_state_dict(learn: Learner) -> dict:
    return learn.opt.opt.state_dict()


def load_opt_state_dict(learn: Learner, state: dict) -> None:
    learn.opt.opt.load_state_dict(state)
