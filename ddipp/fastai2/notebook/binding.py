"""A fastai v2 learner's fit on its worker group: same arguments as `Learner.fit`, and afterwards the learner a local
fit would leave (binding a learner to a group is ddipp.core.group.binding's)."""
from typing import Any

from fastai.learner import Learner

from ...core.group import binding
from ..checkpoint import from_checkpoint
from ..loaders import batch_size
from .fitting import apply_results, fit_call
from .progress import ProgressMirror
from .shipping import fit_callbacks


def fit_on_group(learn: Learner, n_epoch: int, lr: Any = None, wd: Any = None, cbs: Any = None,
                 reset_opt: bool = False, start_epoch: int = 0) -> None:
    """`Learner.fit` on the worker group: same arguments, and afterwards the learner a local fit would leave."""
    learn.ddp.say_global_batch(batch_size(learn.dls.train))  # again if new learn.dls changed the batch size
    callbacks, mirror = fit_callbacks(learn, cbs), ProgressMirror()  # listed before the call: both sides list the same
    try:
        binding.fit_on_group(
            learn, "dls", lambda held: fit_call(learn, held, n_epoch, lr, wd, cbs, reset_opt, start_epoch), mirror,
            apply_results=lambda results: apply_results(learn, results, mirror.bar, mirror.child_bar, callbacks),
            kept=lambda: (len(getattr(learn.recorder, "values", [])), len(getattr(learn.recorder, "losses", []))),
            from_checkpoint=lambda fit, after: from_checkpoint(learn, callbacks, fit, after))
    except BaseException:
        _recorder_started(learn)
        raise


def _recorder_started(learn: Learner) -> None:
    """A failed fit leaves the Recorder's lists, as a local fit's does (its before_fit runs before any step can fail);
    one refused on the workers, or whose rank 0 died, before the Recorder started, left a new learner without them."""
    recorder = getattr(learn, "recorder", None)
    if recorder is not None and "values" not in vars(recorder):
        recorder.before_fit()
