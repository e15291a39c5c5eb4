"""One notebook fit, both halves: the call the notebook sends, the fit a worker runs, the results that come back.

The notebook's learner travels with everything but its data (which the workers already keep); the fit runs
with ddipp's callbacks as in a launched script; rank 0 sends back what a local fit would have changed on the
learner: weights, optimizer state, and the callbacks it attached (the recorder among them).
"""
import random
from typing import Any, Callable, Optional

import numpy as np
import torch
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner
from fastai.callback import Callback

from .progress import ProgressRelay, relayed_output
from .shipping import (data_objects, dumps, learner_objects, loaders, loads, move_optimizer_state,
                       unpicklable_path)


def fit_call(learn: Learner, epochs: int, lr: Any, wd: Any, callbacks: list) -> bytes:
    """The notebook's half: `learn.fit(epochs, lr, wd, callbacks)` as bytes, the learner's data as a reference.

    It carries a seed drawn from the notebook's torch generator: a notebook that seeds torch gets the same
    shuffles, dropout and augmentations on the workers run after run, as a local fit would."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    call = dict(learn=learn, epochs=epochs, lr=lr, wd=wd, callbacks=callbacks, seed=seed)
    try:
        return dumps(call, objects=data_objects(learn.data), learner=learn)
    except Exception as e:
        path = unpicklable_path(dict(learn=learn, callbacks=callbacks), {**data_objects(learn.data), "learn": learn})
        raise TypeError(f"ddipp sends the learner to its worker processes, and {path} cannot be pickled ({e}); "
                        f"set it to None or delete it before the fit, or make its class picklable") from e


def place_data(data: DataBunch, device: torch.device) -> DataBunch:
    """Make `data` deliver its batches on `device` (the notebook's may be another GPU, or none)."""
    data.device = device
    for dl in loaders(data).values():
        dl.device = device
    return data


def run_fit(data: DataBunch, call: bytes, options: dict, device: torch.device,
            send: Optional[Callable[[tuple], None]]) -> Optional[bytes]:
    """A worker's half: run the call under DDP; on rank 0 (the one given `send`) relay progress, return results."""
    request = loads(call, data_objects(data), device)
    _seed(request["seed"])  # every rank alike, as a launched script that seeds does
    learn = request["learn"]
    learn.model.to(device)
    move_optimizer_state(learn)
    learn.to_ddp(**options)
    callbacks = request["callbacks"] + ([ProgressRelay(send)] if send else [])
    with relayed_output(send):
        learn.fit(request["epochs"], request["lr"], wd=request["wd"], callbacks=callbacks)
    if send is None:
        return None
    return dumps(dict(state=learn.model.state_dict(), opt=learn.opt, callbacks=learn.callbacks,
                      attrs=_attached_callbacks(learn)), objects=learner_objects(learn))


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _attached_callbacks(learn: Learner) -> dict:
    """The callbacks a fit left as attributes of the learner (learn.recorder, ...), ddipp's own excepted."""
    return {name: value for name, value in vars(learn).items()
            if isinstance(value, Callback) and not type(value).__module__.startswith("ddipp.")}


def apply_results(learn: Learner, results: bytes, bar: Any) -> None:
    """The notebook's half again: leave `learn` as the fit on rank 0 left its copy."""
    got = loads(results, {**learner_objects(learn), "bar": bar}, learn.data.device)
    learn.model.load_state_dict(got["state"])
    learn.opt, learn.callbacks = got["opt"], got["callbacks"]
    move_optimizer_state(learn)
    for name, callback in got["attrs"].items():
        setattr(learn, name, callback)
