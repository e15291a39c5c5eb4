"""A notebook's learner bound to a worker group: its `learn.fit` runs there, through the adapter's fit function."""
import sys
import weakref
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, List, Optional, Tuple

from ..ddp import say_global_batch
from .group import WorkerGroup, _groups, group_for


@dataclass
class Binding:
    """Where a bound learner's fits run and with which adapter's fitting module, the options of ddipp's callbacks
    there, and the training loader's batch size whose global batch it said last."""
    devices: Tuple[str, ...]
    timeout: float
    options: dict
    fitting: str
    said_bs: Optional[int] = None

    def say_global_batch(self, bs: Optional[int]) -> None:
        """Say the global batch that the loader's `bs` makes, unless it is the one this binding said last."""
        if bs != self.said_bs:
            say_global_batch(bs, len(self.devices), self.options.get("split_batches", False))
            self.said_bs = bs


def bind(learn: Any, devices: Tuple[str, ...], timeout: float, options: dict, fit_on_group: Callable,
         fitting: str) -> None:
    """Run `learn`'s fits on the group on `devices` (started now if not running) with `fit_on_group(learn, ...)`; its
    workers run them with the adapter's module named `fitting` (`adapter.Fitting`)."""
    if "ddp" in vars(learn):
        unbind(learn)
    group_for(devices, timeout, fitting).learners[id(learn)] = learn
    learn.ddp = Binding(devices, timeout, options, fitting)
    learn.fit = FitOnGroup(learn, fit_on_group)  # what fit_one_cycle, lr_find, fine_tune ... call


def unbind(learn: Any) -> bool:
    """Fit `learn` locally again; stop its group if no other learner uses it (True if that stopped it)."""
    binding = vars(learn).pop("ddp")
    for name in [name for name, value in vars(learn).items() if isinstance(value, OfBinding)]:
        delattr(learn, name)
    group = _groups.get(binding.devices)
    if group is None:
        return False
    group.learners.pop(id(learn), None)
    if group.learners:
        return False
    group.stop()
    return True


def group_of(learn: Any) -> WorkerGroup:
    """The running group of a bound learner (a new one if the last fit's failure stopped it)."""
    binding = learn.ddp
    group = group_for(binding.devices, binding.timeout, binding.fitting)
    group.learners[id(learn)] = learn
    return group



def fit_on_group(learn: Any, data: Any, call: Callable[[AbstractSet[str]], bytes], mirror: Any,
                 apply_results: Callable[[List[bytes]], None], kept: Callable[[], Tuple[int, int]],
                 untrained: Callable[[], None] = lambda: None) -> None:
    """Run a bound learner's fit on its group: the `call` made for the tensors the workers hold, its progress shown by
    `mirror`; then `apply_results` puts rank 0's results on the learner, as a local fit would leave it. A failed fit
    keeps what was trained up to the failure (`kept()`: its epoch and step, said) or, if nothing was, leaves the learner
    as it was (`untrained()` then does what a local fit that failed would); an interrupted one raises
    KeyboardInterrupt after keeping what was trained, as Ctrl-C in a local fit."""
    group = group_of(learn)
    try:
        results, interrupted = group.fit(data, call(group.held), learn.ddp.options, mirror)
    except BaseException:
        if group.trained is not None:
            apply_results(group.trained)
            group.say_kept(*kept())
            raise
        print("ddipp: the fit did not complete; the learner here is as it was before it", file=sys.stderr)
        untrained()
        raise
    apply_results(results)
    if interrupted:
        raise KeyboardInterrupt

class OfBinding:
    """A method of a bound learner, set on it as an attribute (fastai calls `self.fit`), that unbind takes away; it
    holds the learner weakly, so an abandoned learner is freed and leaves its group."""

    def __init__(self, learn: Any):
        self.learn = weakref.ref(learn)


class FitOnGroup(OfBinding):
    """`learn.fit` of a bound learner."""

    def __init__(self, learn: Any, fit_on_group: Callable):
        super().__init__(learn)
        self.fit_on_group = fit_on_group

    def __call__(self, *args, **kwargs) -> None:
        self.fit_on_group(self.learn(), *args, **kwargs)
