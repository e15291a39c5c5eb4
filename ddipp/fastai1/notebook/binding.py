"""A fastai v1 learner bound to its worker group (ddipp.core.group.binding), through fastai's `purge` and `destroy`
too, and its fit there: same arguments as `Learner.fit`, and afterwards the learner a local fit would leave."""
from functools import update_wrapper
from typing import Any, Optional, Tuple

from fastai.basic_data import DataBunch
from fastai.basic_train import Learner
from fastai.core import defaults, listify

from ...core.group import binding
from ...core.group.binding import OfBinding, unbind
from ...core.options import Options
from ..checkpoint import from_checkpoint
from . import fitting
from .fitting import apply_results, fit_call
from .progress import ProgressMirror


def bind(learn: Learner, devices: Tuple[str, ...], options: Options) -> None:
    """Run `learn`'s fits on the group on `devices` with `options`, also after fastai's purge, and say the global
    batch."""
    binding.bind(learn, devices, options, fit_on_group, fitting=fitting.__name__)
    learn.purge, learn.destroy = Purge(learn), Destroy(learn)
    learn.ddp.say_global_batch(_train_bs(learn.data))


def _train_bs(data: DataBunch) -> Optional[int]:
    dl = data.train_dl.dl
    return dl.batch_size or getattr(dl.batch_sampler, "batch_size", None)


class Purge(OfBinding):
    """`learn.purge` of a bound learner, which `load(purge=True)` calls too: fastai's own, which rebuilds the learner's
    attributes, and the binding kept."""

    def __init__(self, learn: Learner):
        super().__init__(learn)
        update_wrapper(self, Learner.purge)

    def __call__(self, clear_opt: bool = True) -> Learner:
        learn = self.learn()
        kept = {name: value for name, value in vars(learn).items() if name == "ddp" or isinstance(value, OfBinding)}
        type(learn).purge(learn, clear_opt)
        vars(learn).update(kept)
        return learn


class Destroy(OfBinding):
    """`learn.destroy` of a bound learner, which `export(destroy=True)` calls too: the learner leaves its workers
    (they stop if no other learner is bound to them), a line says so, then fastai's own."""

    def __init__(self, learn: Learner):
        super().__init__(learn)
        update_wrapper(self, Learner.destroy)

    def __call__(self) -> None:
        learn = self.learn()
        if "ddp" in vars(learn):  # not on a worker, where the learner is not bound
            stopped = unbind(learn)
            print("ddipp: the destroyed learner left its workers; " + (
                "they stopped: no other learner was bound to them" if stopped else
                "they stay for the other learners bound to them"))
        type(learn).destroy(learn)


def fit_on_group(learn: Learner, epochs: int, lr: Any = defaults.lr, wd: Any = None, callbacks: Any = None) -> None:
    """`Learner.fit` on the worker group: same arguments, and afterwards the learner a local fit would leave."""
    learn.ddp.say_global_batch(_train_bs(learn.data))  # again if a new learn.data changed the batch size
    callbacks, mirror = listify(callbacks), ProgressMirror()

    def empty_recorder() -> None:  # as a local fit that failed leaves it
        if not hasattr(learn, "recorder"):
            learn.callback_fns[0](learn)

    def checkpointed(fit: dict, after_steps: int):
        empty_recorder()  # where the file's recorder goes
        return from_checkpoint(learn, callbacks + list(learn.callbacks), fit, after_steps)
    binding.fit_on_group(
        learn, "data", lambda held: fit_call(learn, held, epochs, lr, wd, callbacks), mirror,
        apply_results=lambda results: apply_results(learn, results, mirror.bar, callbacks),
        kept=lambda: (len(getattr(learn.recorder, "nb_batches", [])), len(getattr(learn.recorder, "losses", []))),
        untrained=empty_recorder, from_checkpoint=checkpointed)
