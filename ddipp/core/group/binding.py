"""A notebook's learner bound to a worker group: its `learn.fit` runs there, through the adapter's fit function."""
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Tuple

from .group import WorkerGroup, _groups, group_for


@dataclass
class Binding:
    """Where a bound learner's fits run, and the options of ddipp's callbacks there."""
    devices: Tuple[str, ...]
    timeout: float
    options: dict


def bind(learn: Any, devices: Tuple[str, ...], timeout: float, options: dict, fit_on_group: Callable) -> None:
    """Run `learn`'s fits on the group on `devices` (started now if not running) with `fit_on_group(learn, ...)`."""
    if "ddp" in vars(learn):
        unbind(learn)
    group_for(devices, timeout).learners[id(learn)] = learn
    learn.ddp = Binding(devices, timeout, options)
    learn.fit = FitOnGroup(learn, fit_on_group)  # what fit_one_cycle, lr_find, fine_tune ... call


def unbind(learn: Any) -> None:
    """Fit `learn` locally again; stop its group if no other learner uses it."""
    binding = vars(learn).pop("ddp")
    vars(learn).pop("fit", None)
    group = _groups.get(binding.devices)
    if group is not None:
        group.learners.pop(id(learn), None)
        if not group.learners:
            group.stop()


def group_of(learn: Any) -> WorkerGroup:
    """The running group of a bound learner (a new one if the last fit's failure stopped it)."""
    binding = learn.ddp
    group = group_for(binding.devices, binding.timeout)
    group.learners[id(learn)] = learn
    return group


class FitOnGroup:
    """`learn.fit` of a bound learner; holds it weakly, so an abandoned learner is freed and leaves its group."""

    def __init__(self, learn: Any, fit_on_group: Callable):
        self.learn, self.fit_on_group = weakref.ref(learn), fit_on_group

    def __call__(self, *args, **kwargs) -> None:
        self.fit_on_group(self.learn(), *args, **kwargs)
