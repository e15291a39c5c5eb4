"""`Learner.to_ddp` / `Learner.from_ddp`, added the way fastai v1 adds `to_fp16` and `to_distributed`."""
import weakref
from functools import partial
from typing import Optional, Sequence

from fastai.basic_train import Learner
from fastai.callback import AverageMetric, Callback
from fastai.core import ifnone, listify
from fastai.torch_core import is_pathlike, rank_distrib

from ..core import dist as ddist
from ..core.ddp import check_matches_launch, check_options, notebook_devices
from ..core.files import replacing
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback, hide_progress_bars
from .loaders import lm_eval_loader

_DDIPP_CALLBACKS = (DistributedCallback, LRFinderBypassCallback, GCCallback)


def to_ddp(learn: Learner, gpus: Optional[Sequence[int]] = None, nprocs: Optional[int] = None,
           sync_bn: bool = False, find_unused_parameters: Optional[bool] = None,
           lr_find_mode: str = "solo", timeout: float = 600) -> Learner:
    """Make every later fit of `learn` distributed; a no-op in a plain process given neither `gpus` nor `nprocs`.

    In a launched process it joins the launcher's group (`gpus`/`nprocs`, if given, must match it). Elsewhere
    (a notebook) it binds `learn` to a persistent group of worker processes, one per GPU of `gpus` in that
    order or `nprocs` CPU processes, on which each fit runs; `timeout` is how many seconds a rank may wait for
    the others in a collective before the fit fails instead of hanging."""
    check_options(lr_find_mode, timeout)
    options = dict(sync_bn=sync_bn, find_unused_parameters=find_unused_parameters, lr_find_mode=lr_find_mode)
    if not ddist.launched():
        if gpus is None and nprocs is None:
            return learn
        from .notebook.binding import bind
        bind(learn, notebook_devices(gpus, nprocs), timeout, options)  # and says the global batch
        return learn
    check_matches_launch(gpus, nprocs)
    ddist.init()
    if not ddist.is_rank0():
        hide_progress_bars()  # also for validate() and get_preds() outside a fit
    from_ddp(learn)
    _lm_eval_loaders(learn.data)
    learn.save = AtomicSave(learn)  # SaveModelCallback's and lr_find's files survive a crash mid-write
    learn.validate = RankValidate(learn)  # `if ddipp.is_rank0(): learn.validate()` works
    learn.callback_fns += [partial(DistributedCallback, sync_bn=sync_bn, find_unused_parameters=find_unused_parameters),
                           partial(LRFinderBypassCallback, mode=lr_find_mode), GCCallback]
    return learn


class AtomicSave:
    """`learn.save` of a learner under ddipp: fastai's own save, into a file that replaces the target only once it
    is whole (fastai writes in place: a crash mid-write would leave neither the old model nor the new)."""

    def __init__(self, learn: Learner):
        self.learn = weakref.ref(learn)

    def __call__(self, file=None, return_path: bool = False, with_opt: bool = True):
        learn = self.learn()
        if not is_pathlike(file) or rank_distrib():  # a stream, or a rank that does not write: fastai's own way
            return type(learn).save(learn, file, return_path, with_opt)
        target = learn.path / learn.model_dir / f"{file}.pth"
        with replacing(target) as f:
            type(learn).save(learn, f, with_opt=with_opt)
        return target if return_path else None


class RankValidate:
    """`learn.validate` of a learner under ddipp: fastai's own, with its metrics averaged on this rank alone.

    Outside a fit every rank validates the whole set, so fastai's per-batch all-reduce of the metrics it wraps in
    AverageMetric (under WORLD_SIZE > 1) adds nothing and makes validate() a collective that waits for the other
    ranks. It wraps them here instead, without the all-reduce (metrics that are callbacks, like FBeta, are kept)."""

    def __init__(self, learn: Learner):
        self.learn = weakref.ref(learn)

    def __call__(self, dl=None, callbacks=None, metrics=None):
        learn = self.learn()
        metrics = [_rank_average(m) for m in listify(ifnone(metrics, learn.metrics))]
        return type(learn).validate(learn, dl, callbacks, metrics)


def _rank_average(metric):
    """`metric` as fastai's CallbackHandler would wrap it, averaged over this rank's batches only."""
    if isinstance(metric, Callback):
        return metric
    average = AverageMetric(metric)
    average.world = 0  # fastai all-reduces when this is the world size
    return average


def _lm_eval_loaders(data) -> None:
    """Language-model validation and test loaders step through all their streams at once, as in one process."""
    for name in ("valid_dl", "test_dl"):
        if getattr(data, name, None) is not None:
            setattr(data, name, lm_eval_loader(getattr(data, name)))


def from_ddp(learn: Learner) -> Learner:
    """Back to plain single-process fastai: removes ddipp's callbacks, or the binding to a notebook's workers."""
    learn.callback_fns = [f for f in learn.callback_fns if getattr(f, "func", f) not in _DDIPP_CALLBACKS]
    for name, kind in (("save", AtomicSave), ("validate", RankValidate)):
        if isinstance(vars(learn).get(name), kind):
            delattr(learn, name)
    if "ddp" in vars(learn):
        from ..core.group.binding import unbind
        unbind(learn)
    return learn


Learner.to_ddp = to_ddp
Learner.from_ddp = from_ddp
