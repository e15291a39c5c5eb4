"""A notebook's learner bound to a worker group: its fits run on the group, their results land on it."""
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Tuple

from fastai.basic_train import Learner
from fastai.core import defaults, listify

from ...core.group.group import _groups, group_for
from .fitting import apply_results, fit_call
from .progress import ProgressMirror


@dataclass
class Binding:
    """Where a bound learner's fits run, and the options of ddipp's callbacks there."""
    devices: Tuple[str, ...]
    timeout: float
    options: dict


def bind(learn: Learner, devices: Tuple[str, ...], timeout: float, options: dict) -> None:
    """Run `learn`'s fits on the group on `devices`, starting it now if it is not running."""
    if "ddp" in vars(learn):
        unbind(learn)
    group_for(devices, timeout).learners[id(learn)] = learn
    learn.ddp = Binding(devices, timeout, options)
    learn.fit = _FitOnGroup(learn)  # what fit_one_cycle, lr_find, ... call


def unbind(learn: Learner) -> None:
    """Fit `learn` locally again; stop its group if no other learner uses it."""
    binding = vars(learn).pop("ddp")
    vars(learn).pop("fit", None)
    group = _groups.get(binding.devices)
    if group is not None:
        group.learners.pop(id(learn), None)
        if not group.learners:
            group.stop()


class _FitOnGroup:
    """`learn.fit` of a bound learner; holds it weakly, so an abandoned learner is freed and leaves its group."""

    def __init__(self, learn: Learner):
        self.learn = weakref.ref(learn)

    def __call__(self, *args, **kwargs) -> None:
        fit_on_group(self.learn(), *args, **kwargs)


def fit_on_group(learn: Learner, epochs: int, lr: Any = defaults.lr, wd: Any = None, callbacks: Any = None) -> None:
    """`Learner.fit` on the worker group: same arguments, and afterwards the learner a local fit would leave."""
    binding = learn.ddp
    group = group_for(binding.devices, binding.timeout)
    group.learners[id(learn)] = learn
    call = fit_call(learn, epochs, lr, wd, listify(callbacks))
    mirror = ProgressMirror()
    try:
        results, interrupted = group.fit(learn.data, call, binding.options, mirror)
    except BaseException:
        print("ddipp: the fit did not complete; the learner here is as it was before it", file=sys.stderr)
        if not hasattr(learn, "recorder"):  # as after a local fit that failed: an empty recorder
            learn.callback_fns[0](learn)
        raise
    apply_results(learn, results, mirror.bar)
    if interrupted:  # as Ctrl-C in a local fit: it stops, keeps what was trained, and the caller sees the interrupt
        raise KeyboardInterrupt
