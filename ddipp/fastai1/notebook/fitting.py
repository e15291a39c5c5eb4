"""One notebook fit, both halves: the call the notebook sends, the fit a worker runs, the results that come back.

The notebook's learner travels with everything but its data (which the workers already keep); the fit runs
with ddipp's callbacks as in a launched script; rank 0 sends back what a local fit would have changed on the
learner: weights, optimizer state, the callbacks it attached (the recorder among them), and the state of the callbacks
given to the fit, put back on the caller's own objects.
"""
import copy
import sys
from typing import AbstractSet, Any, Callable, List, Optional, Tuple

import torch
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner
from fastai.callback import Callback
from fastai.core import defaults

from ...core.options import Options
from ...core.group.fitting import fit_and_keep, received_fit
from ...core.group.wire import HeldTensors, dumps, fit_request, loads, without_unpicklable
from ...core.state import full_state, kept_tensors, load_full_state
from ..learner import distribute
from ..state import hypers, optimizer, set_hypers
from .progress import ProgressRelay
from .shipping import data_objects, learner_objects, loaders


def fit_call(learn: Learner, held: AbstractSet[str], epochs: int, lr: Any, wd: Any, callbacks: list) -> bytes:
    """The notebook's half: `learn.fit(epochs, lr, wd, callbacks)` as bytes, the learner's data as a reference, the
    tensors the workers `held` as digests."""
    return fit_request(data_objects(learn.data), learn, held, learn=learn, epochs=epochs, lr=lr, wd=wd,
                       callbacks=callbacks)


def place_data(data: DataBunch, device: torch.device) -> DataBunch:
    """Make `data` deliver its batches on `device` (the notebook's may be another GPU, or none)."""
    data.device = device
    for dl in loaders(data).values():
        dl.device = device
    return data


def run_fit(data: DataBunch, call: bytes, options: Options, device: torch.device,
            send: Optional[Callable[[tuple], None]],
            held: HeldTensors) -> Tuple[Optional[List[bytes]], List[str]]:
    """A worker's half (`ddipp.core.group.adapter.Fitting.run_fit`): the call under DDP, rank 0 relaying progress
    through a callback of the fit."""
    request = received_fit(call, data_objects(data), device, held, optimizer)
    learn = request["learn"]
    distribute(learn, options)
    callbacks = request["callbacks"] + ([ProgressRelay(send)] if send else [])
    return fit_and_keep(lambda: learn.fit(request["epochs"], request["lr"], wd=request["wd"], callbacks=callbacks),
                        lambda: full_state(learn.model, optimizer(learn)),
                        lambda state: results(learn, request["callbacks"], state), send, held,
                        lambda: kept_tensors(learn.model, optimizer(learn)), keeps_trained=not options.shard)


def results(learn: Learner, fit_callbacks: list, state: dict) -> List[bytes]:
    """What a fit changed on the learner, in parts that come back one after the other: its whole `state` (full_state:
    the weights and the optimizer's state) and the optimizer's hyper-parameters first, on their own; then the callbacks
    (of the `fit_callbacks`, given to the fit, their state), together, or (if that fails) each alone and without what
    of it cannot be pickled (a lock, a socket): an unpicklable attribute never costs the weights."""
    objects = {**learner_objects(learn), **fit_callback_objects(fit_callbacks)}
    opt = getattr(learn, "opt", None)
    objects["opt"] = opt  # what holds the optimizer (the recorder) gets the notebook's own
    parts = [dumps(dict(state=state, hypers=hypers(learn) if opt else None), objects=objects)]
    callbacks = dict(callbacks=learn.callbacks, attrs=_attached_callbacks(learn),
                     fit=[vars(cb) for cb in fit_callbacks])
    try:
        return parts + [dumps(callbacks, objects=objects)]
    except Exception:
        pass
    notes = []
    for group, items in callbacks.items():
        for key, item in (items.items() if group == "attrs" else enumerate(items)):
            if group == "fit":
                item = _travelling_state(item, f"callbacks[{key}] of the fit", objects, notes)
            else:
                path = f"learn.callbacks[{key}]" if group == "callbacks" else f"learn.{key}"
                item = _travelling(item, path, objects, notes)
            parts.append(dumps((group, key, item), objects=objects))
    return parts + [dumps(("notes", notes))]


def _travelling(callback: Callback, path: str, objects: dict, notes: list) -> Optional[Callback]:
    """`callback`, or a copy without the attributes that cannot be pickled (None there), or None; `notes` says which."""
    try:
        dumps(callback, objects)
        return callback
    except Exception as e:
        error = e
    stripped = copy.copy(callback)
    state, dropped = without_unpicklable(vars(callback), objects)
    vars(stripped).update(state)
    try:
        dumps(stripped, objects)
    except Exception:
        notes.append(f"{path} ({type(callback).__name__}) stayed on the workers: it cannot be pickled ({error})")
        return None
    if dropped:
        notes.append(f"{path} ({type(callback).__name__}) came back with {', '.join(dropped)} set to None: "
                     f"{'it' if len(dropped) == 1 else 'they'} cannot be pickled ({error})")
    return stripped


def _travelling_state(state: dict, path: str, objects: dict, notes: list) -> dict:
    """A callback's `state` with None for what of it cannot be pickled; `notes` says what."""
    state, dropped = without_unpicklable(state, objects)
    if dropped:
        notes.append(f"{path} came back with {', '.join(dropped)} set to None: "
                     f"{'it' if len(dropped) == 1 else 'they'} cannot be pickled")
    return state


def fit_callback_objects(fit_callbacks: list) -> dict:
    """The callbacks given to a fit, by the names both sides use for them: a reference to one comes back as the
    caller's own."""
    return {("fit_callback", i): cb for i, cb in enumerate(fit_callbacks)}


def _attached_callbacks(learn: Learner) -> dict:
    """The callbacks a fit left as attributes of the learner (learn.recorder, ...), ddipp's own excepted."""
    return {name: value for name, value in vars(learn).items()
            if isinstance(value, Callback) and not type(value).__module__.startswith("ddipp.")}


def apply_results(learn: Learner, parts: List[bytes], bar: Any, fit_callbacks: list) -> None:
    """The notebook's half again: leave `learn` and the callbacks given to the fit as the fit on rank 0 left its
    copies."""
    objects = {**learner_objects(learn), **fit_callback_objects(fit_callbacks), "bar": bar}
    got = loads(parts[0], objects, learn.data.device)
    if got["state"]["opt"] is not None and not getattr(learn, "opt", None):  # the fit made the workers' learner one
        learn.create_opt(defaults.lr, learn.wd)
    load_full_state(learn.model, optimizer(learn), got["state"])
    if got["hypers"] is not None:
        set_hypers(learn, got["hypers"])
    objects["opt"] = getattr(learn, "opt", None)
    got = [loads(part, objects, learn.data.device) for part in parts[1:]]
    if len(got) == 1:
        learn.callbacks = got[0]["callbacks"]
        attrs, states = got[0]["attrs"], got[0]["fit"]
    else:
        *each, (_, notes) = got
        learn.callbacks = [cb for group, _, cb in each if group == "callbacks" and cb is not None]
        attrs = {key: cb for group, key, cb in each if group == "attrs" and cb is not None}
        states = [state for group, _, state in each if group == "fit"]
        for note in notes:
            print(f"ddipp: {note}", file=sys.stderr)
    for name, callback in attrs.items():
        setattr(learn, name, callback)
    for callback, state in zip(fit_callbacks, states):
        vars(callback).update(state)
