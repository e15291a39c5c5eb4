"""One notebook fit, both halves: the call the notebook sends, the fit a worker runs, the results that come back.

The notebook's learner travels with everything but its data (which the workers already keep); the fit runs with
ddipp's callbacks as in a launched script; rank 0 sends back what a local fit would have changed: the weights and the
optimizer's state, the learner's attributes (final_record, epoch, ...), the state of every callback of the fit (the
recorder's losses and values, SaveModelCallback's best, CSVLogger's file name, the progress bar) and of every metric,
each put back on the notebook's own objects (its optimizer too), so a callback the user holds sees what the fit did
to it.
"""
import sys
from contextlib import ExitStack
from typing import AbstractSet, Any, Callable, List, Optional, Tuple

import torch
from fastai.callback.progress import ProgressCallback
from fastai.data.core import DataLoaders
from fastai.learner import Learner

from ...core.options import Options
from ...core.group.fitting import fit_and_keep, received_fit
from ...core.group.wire import (HeldTensors, dumps, fit_request, grad_from_spec, grad_spec, loads, travelling_state,
                                without_unpicklable)
from ...core.state import full_state, kept_tensors, load_full_state
from ..learner import distribute
from ..state import optimizer
from .progress import ProgressRelay
from .shipping import data_objects, fit_callbacks, learner_objects

_HELD = ("dls", "model", "opt", "cbs")  # the learner's attributes that come back otherwise (or are the same objects)


def fit_call(learn: Learner, held: AbstractSet[str], n_epoch: int, lr: Any, wd: Any, cbs: Any, reset_opt: bool,
             start_epoch: int) -> bytes:
    """The notebook's half: `learn.fit(...)` as bytes, the learner's data as a reference, the tensors the workers
    `held` as digests."""
    return fit_request(data_objects(learn.dls), learn, held, learn=learn, n_epoch=n_epoch, lr=lr, wd=wd, cbs=cbs,
                       reset_opt=reset_opt, start_epoch=start_epoch)


def place_data(dls: DataLoaders, device: torch.device) -> DataLoaders:
    """Make `dls` deliver its batches on `device` (the notebook's may be another GPU, or none): fastai's loaders move
    them there, the learner a PyTorch loader's (`dls.device` says where)."""
    for dl in dls.loaders:
        if hasattr(dl, "to"):
            dl.to(device)
    dls._device = device
    return dls


def run_fit(dls: DataLoaders, call: bytes, options: Options, device: torch.device,
            send: Optional[Callable[[tuple], None]],
            held: HeldTensors) -> Tuple[Optional[List[bytes]], List[str]]:
    """A worker's half (`ddipp.core.group.adapter.Fitting.run_fit`): the call under DDP, rank 0 relaying progress in
    place of the learner's ProgressCallback."""
    request = received_fit(call, data_objects(dls), device, held, optimizer)
    learn = request["learn"]
    callbacks = fit_callbacks(learn, request["cbs"])
    distribute(learn, options)
    relay = []  # the ProgressRelay that stood for the learner's ProgressCallback during the fit, if it had one

    def fit() -> None:
        with ExitStack() as stack:
            if send is not None:
                relay.append(_relayed_progress(learn, send, stack))
            learn.fit(request["n_epoch"], request["lr"], wd=request["wd"], cbs=request["cbs"],
                      reset_opt=request["reset_opt"], start_epoch=request["start_epoch"])
    return fit_and_keep(fit, lambda: full_state(learn.model, optimizer(learn)),
                        lambda state: results(learn, callbacks, relay[0] if relay else None, state), send, held,
                        lambda: kept_tensors(learn.model, optimizer(learn)), keeps_trained=not options.shard)


def _relayed_progress(learn: Learner, send: Callable[[tuple], None], stack: ExitStack) -> Optional[ProgressRelay]:
    """The learner's ProgressCallback (if it has one) replaced by a relay for the `stack`'s span, at its place in
    learn.cbs: fastai runs the callbacks of one order in list order (CSVLogger chains the logger set before it)."""
    progress = [cb for cb in learn.cbs if type(cb) is ProgressCallback]
    if not progress:
        return None
    place = learn.cbs.index(progress[0])
    stack.enter_context(learn.removed_cbs(progress))
    relay = ProgressRelay(send)
    stack.enter_context(learn.added_cbs([relay]))
    learn.cbs.insert(place, learn.cbs.pop())
    relay.stands_for = progress[0]
    return relay


def _ours(value: Any) -> bool:
    return type(value).__module__.startswith("ddipp.")


def results(learn: Learner, callbacks: list, relay: Optional[ProgressRelay], state: dict) -> List[bytes]:
    """What the fit changed, in two parts: the learner's whole `state` (full_state: weights and optimizer state) with
    the gradients first, on their own; then the learner's attributes, the state of each of the fit's `callbacks` and
    metrics, the callbacks the fit added, notes on what could not be pickled (None in its place: an unpicklable
    attribute never costs the weights or the recorder). What held the `relay` (learn.logger, CSVLogger's old_logger)
    comes back holding the ProgressCallback it stood for, and that ProgressCallback with the relay's state."""
    objects = learner_objects(learn, callbacks)
    objects["opt"] = learn.opt  # what holds the optimizer (a callback) gets the notebook's own
    if relay is not None:
        objects.update({key: relay for key, cb in list(objects.items()) if cb is relay.stands_for})
    grads = [grad_spec(p.grad) for p in learn.model.parameters()]
    parts = [dumps(dict(state=state, grads=grads), objects=objects)]
    attrs = {k: v for k, v in travelling_state(learn).items()
             if k not in _HELD and not _ours(v) and not any(v is cb for cb in learn.cbs)}
    states = dict(learn=attrs, cbs=[_state(cb, relay) for cb in callbacks], metrics=[vars(m) for m in learn.metrics],
                  added=[cb for cb in learn.cbs if not _ours(cb) and not any(cb is c for c in callbacks)], notes=[])
    try:
        return parts + [dumps(states, objects=objects)]
    except Exception as e:
        error = e
    notes = states["notes"]
    states["learn"] = _picklable(attrs, objects, "learn", error, notes)
    states["cbs"] = [_picklable(state, objects, f"{type(cb).__name__} (learn.{cb.name})", error, notes)
                     for cb, state in zip(callbacks, states["cbs"])]
    kept = []
    for cb in states["added"]:
        try:
            dumps(cb, objects)
            kept.append(cb)
        except Exception as e:
            notes.append(f"{type(cb).__name__}, which the fit added, stayed on the workers: it cannot be pickled ({e})")
    states["added"] = kept
    states["metrics"] = [_picklable(state, objects, type(m).__name__, error, notes) for m, state in
                         zip(learn.metrics, states["metrics"])]
    return parts + [dumps(states, objects=objects)]


def _state(cb: Any, relay: Optional[ProgressRelay]) -> dict:
    """What `cb` holds after the fit: for the ProgressCallback the `relay` stood for, what the relay holds (its last
    bar, the notebook's own once there), as a local fit leaves its ProgressCallback; not its learner, which fastai
    unset when it took the relay off."""
    if relay is None or cb is not relay.stands_for:
        return vars(cb)
    return {k: v for k, v in vars(relay).items() if k not in ("relay", "stands_for", "learn")}


def _picklable(state: dict, objects: dict, what: str, error: Exception, notes: list) -> dict:
    state, lost = without_unpicklable(state, objects)
    if lost:
        notes.append(f"{what} came back with {', '.join(lost)} set to None: "
                     f"{'it' if len(lost) == 1 else 'they'} cannot be pickled ({error})")
    return state


def apply_results(learn: Learner, parts: List[bytes], bar: Any, child_bar: Any, callbacks: list) -> None:
    """The notebook's half again: leave `learn`, its metrics and the fit's `callbacks` as the fit on rank 0 left its
    copies (rank 0's bars are the notebook's master `bar` and last `child_bar`)."""
    objects = {**learner_objects(learn, callbacks), "bar": bar, "child_bar": child_bar}
    device = getattr(learn.dls, "device", None) or torch.device("cpu")  # PyTorch loaders leave it unset
    got = loads(parts[0], objects, device)
    if got["state"]["opt"] is not None and learn.opt is None:  # the fit made the workers' learner one
        learn.create_opt()
    load_full_state(learn.model, optimizer(learn), got["state"])
    for param, grad in zip(learn.model.parameters(), got["grads"]):
        param.grad = grad_from_spec(grad, param)
    objects["opt"] = learn.opt
    got = loads(parts[1], objects, device)
    vars(learn).update(got["learn"])
    for cb, state in zip(callbacks, got["cbs"]):
        vars(cb).update(state)
    for metric, state in zip(learn.metrics, got["metrics"]):
        vars(metric).update(state)
    learn.add_cbs(got["added"])
    for note in got["notes"]:
        print(f"ddipp: {note}", file=sys.stderr)
