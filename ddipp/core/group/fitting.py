"""The steps of a notebook fit on a worker that every adapter's fitting module (`adapter.Fitting`) takes alike, around
its fastai's own: the learner the call carries made ready, then the fit run and what it trained kept."""
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, List, Optional, Tuple

import torch

from .. import dist as ddist
from ..rng import seed_all
from ..state import move_optimizer_state
from .messages import TRAINED
from .output import relayed_output
from .wire import HeldTensors, loads


def received_fit(call: bytes, objects: Mapping[Hashable, Any], device: torch.device, held: HeldTensors,
                 optimizer: Callable[[Any], Any]) -> dict:
    """The fit request `call` (its references resolved to `objects`, its tensors taken from `held`), every rank seeded
    alike as a launched script that seeds, its learner's model and optimizer (`optimizer(learn)`) on `device`."""
    request = loads(call, objects, device, held=held)
    seed_all(request["seed"])
    learn = request["learn"]
    learn.model.to(device)
    move_optimizer_state(optimizer(learn))
    return request


def fit_and_keep(fit: Callable[[], None], state: Callable[[], Optional[dict]],
                 results: Callable[[Optional[dict]], List[bytes]], send: Optional[Callable[[tuple], None]],
                 held: HeldTensors, tensors: Callable[[], Iterable[torch.Tensor]], keeps_trained: bool = True
                 ) -> Tuple[Optional[List[bytes]], List[str]]:
    """Run `fit()`, rank 0's output relayed (the rank given `send`); then, on every rank, the learner's whole `state()`
    (ddipp.core.state.full_state: a collective where the strategy gathers), rank 0's `results(state)`, and the digests
    of the `tensors()` this rank keeps in `held` for the next fit. A stop the notebook asked for (its interrupt) ends
    the fit after the same step on every rank, as Ctrl-C ends a local fit, and what was trained comes back; so it does
    from a fit that fails, sent by rank 0 ahead of the error from its own state, when it `keeps_trained` (a sharded
    fit's rank 0 holds only its part: its learner went back to the fit's start, and nothing is sent)."""
    try:
        with relayed_output(send):
            fit()
    except ddist.StopRequested:
        pass
    except BaseException:
        if send is not None and keeps_trained:
            send((TRAINED, results(state())))
        raise
    whole = state()
    return (None if send is None else results(whole)), held.keep(tensors())
