"""Where fastai v2 keeps a learner's optimizer state (the model's is ddipp.core.state's)."""
from collections.abc import Mapping

from fastai.learner import Learner


def opt_state(learn: Learner) -> Mapping:
    """The optimizer's per-parameter state (empty before the learner has an optimizer)."""
    opt = getattr(learn, "opt", None)
    return opt.state if opt is not None else {}


def opt_state_dict(learn: Learner) -> dict:
    return learn.opt.state_dict()


def load_opt_state_dict(learn: Learner, state: dict) -> None:
    learn.opt.load_state_dict(state)
