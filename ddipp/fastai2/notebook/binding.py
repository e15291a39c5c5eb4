"""A fastai v2 learner's fit on its worker group: same arguments as `Learner.fit`, and afterwards the learner a local
fit would leave (binding a learner to a group is ddipp.core.group.binding's)."""
import sys
from typing import Any

from fastai.learner import Learner

from ...core.group.binding import group_of
from .fitting import apply_results, fit_call
from .progress import ProgressMirror
from .shipping import fit_callbacks


def fit_on_group(learn: Learner, n_epoch: int, lr: Any = None, wd: Any = None, cbs: Any = None,
                 reset_opt: bool = False, start_epoch: int = 0) -> None:
    """`Learner.fit` on the worker group: same arguments, and afterwards the learner a local fit would leave."""
    learn.ddp.say_global_batch(learn.dls.train.bs)  # again if new learn.dls changed the batch size
    group = group_of(learn)
    callbacks = fit_callbacks(learn, cbs)  # listed before the call is made: both sides list the same
    call = fit_call(learn, group.held, n_epoch, lr, wd, cbs, reset_opt, start_epoch)
    mirror = ProgressMirror()
    try:
        results, interrupted = group.fit(learn.dls, call, learn.ddp.options, mirror)
    except BaseException:
        if group.trained is not None:  # as a local fit that fails: what was trained up to the failure stays
            apply_results(learn, group.trained, mirror.bar, callbacks)
            group.say_kept(len(getattr(learn.recorder, "values", [])), len(getattr(learn.recorder, "losses", [])))
            raise
        print("ddipp: the fit did not complete; the learner here is as it was before it", file=sys.stderr)
        raise
    apply_results(learn, results, mirror.bar, callbacks)
    if interrupted:  # as Ctrl-C in a local fit: it stops, keeps what was trained, and the caller sees the interrupt
        raise KeyboardInterrupt
