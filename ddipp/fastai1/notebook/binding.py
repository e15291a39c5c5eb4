"""A fastai v1 learner's fit on its worker group: same arguments as `Learner.fit`, and afterwards the learner a local
fit would leave (binding a learner to a group is ddipp.core.group.binding's)."""
import sys
from typing import Any

from fastai.basic_train import Learner
from fastai.core import defaults, listify

from ...core.group.binding import group_of
from .fitting import apply_results, fit_call
from .progress import ProgressMirror


def fit_on_group(learn: Learner, epochs: int, lr: Any = defaults.lr, wd: Any = None, callbacks: Any = None) -> None:
    """`Learner.fit` on the worker group: same arguments, and afterwards the learner a local fit would leave."""
    group = group_of(learn)
    callbacks = listify(callbacks)
    call = fit_call(learn, group.held, epochs, lr, wd, callbacks)
    mirror = ProgressMirror()
    try:
        results, interrupted = group.fit(learn.data, call, learn.ddp.options, mirror)
    except BaseException:
        print("ddipp: the fit did not complete; the learner here is as it was before it", file=sys.stderr)
        if not hasattr(learn, "recorder"):  # as after a local fit that failed: an empty recorder
            learn.callback_fns[0](learn)
        raise
    apply_results(learn, results, mirror.bar, callbacks)
    if interrupted:  # as Ctrl-C in a local fit: it stops, keeps what was trained, and the caller sees the interrupt
        raise KeyboardInterrupt
