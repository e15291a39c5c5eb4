"""`Learner.to_ddp` / `Learner.from_ddp`, added the way fastai v1 adds `to_fp16` and `to_distributed`."""
from contextlib import nullcontext
from functools import partial, wraps
from types import MethodType
from typing import Optional, Sequence

import numpy as np

from fastai.basic_train import Learner
from fastai.callback import AverageMetric, Callback
from fastai.core import defaults, ifnone, listify
from fastai.torch_core import is_pathlike, rank_distrib

from ..core import dist as ddist
from ..core.resume import restart_count
from ..core.options import Options, check_matches_launch, notebook_devices
from ..core.files import replacing, writing_as_rank_0
from ..core.shard import check_shardable
from ..core.state import savable
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback, distributed_fit, hide_progress_bars
from .checkpoint import Checkpoint
from .loaders import lm_eval_loader
from .state import optimizer

_DDIPP_CALLBACKS = (DistributedCallback, LRFinderBypassCallback, GCCallback)


def to_ddp(learn: Learner, gpus: Optional[Sequence[int]] = None, nprocs: Optional[int] = None,
           sync_bn: bool = False, find_unused_parameters: Optional[bool] = None,
           lr_find_mode: str = "solo", timeout: float = 600, split_batches: bool = False, restarts: int = 0,
           shard: bool = False, shard_units=None) -> Learner:
    """Make every later fit of `learn` distributed; a no-op in a plain process given neither `gpus` nor `nprocs`.

    In a launched process it joins the launcher's group (`gpus`/`nprocs`, if given, must match it). Elsewhere
    (a notebook) it binds `learn` to a persistent group of worker processes, one per GPU of `gpus` in that
    order or `nprocs` CPU processes, on which each fit runs; `timeout` is how many seconds a rank may wait for
    the others in a collective before the fit fails instead of hanging. `split_batches=True` keeps the training
    loader's batch as the global batch, each process taking its part (one process's steps and numbers); by default
    each process takes a whole batch. In a notebook, `restarts=N` runs a fit whose worker died again on a new group,
    up to N times, resuming from the fit's Checkpoint. `shard=True` has each process hold 1/N of the parameters,
    gradients and optimizer state during a fit (FSDP2), sharded in units `shard_units(model)` gives
    (ddipp.core.shard's default otherwise); the learner is whole again after it."""
    options = Options(sync_bn, find_unused_parameters, lr_find_mode, split_batches, timeout, restarts, shard,
                      shard_units)
    if not ddist.launched():
        if gpus is None and nprocs is None:
            return learn
        from .notebook.binding import bind
        devices = notebook_devices(gpus, nprocs)
        if shard:
            check_shardable(learn.model, len(devices))
        bind(learn, devices, options)  # and says the global batch
        return learn
    check_matches_launch(gpus, nprocs, restarts)
    if shard:
        check_shardable(learn.model, ddist.world_size())
    return distribute(learn, options)


def distribute(learn: Learner, options: Options) -> Learner:
    """A launched process's (or a notebook worker's) learner: in the launcher's group, with ddipp's callbacks made
    with `options`, and the save, export, validate and fit a launched learner needs."""
    ddist.init()
    if not ddist.is_rank0():
        hide_progress_bars()  # also for validate() and get_preds() outside a fit
    from_ddp(learn)
    _lm_eval_loaders(learn.data)
    for name, method in _METHODS.items():  # save, export and validate as a launched learner needs them
        setattr(learn, name, MethodType(method, learn))
    learn.callback_fns += [partial(DistributedCallback, sync_bn=options.sync_bn,
                                   find_unused_parameters=options.find_unused_parameters,
                                   split_batches=options.split_batches, shard=options.shard,
                                   shard_units=options.shard_units),
                           partial(LRFinderBypassCallback, mode=options.lr_find_mode), GCCallback]
    return learn


# The methods to_ddp gives a launched learner, each a bound method with fastai's name, signature and docstring.


@wraps(Learner.save)
def _save(self, file=None, return_path: bool = False, with_opt: bool = True):
    # A file replaces the target only once it is whole (fastai writes in place: a crash mid-write would leave neither
    # the old model nor the new); rank 0 alone writes it. A buffer is this process's own: it gets the bytes anywhere.
    # A compiled model's file holds the plain model's keys (without torch.compile's `_orig_mod.`); a sharded fit's
    # whole state is gathered (every rank calls save).
    with savable(self, optimizer(self), distributed_fit(self), file, is_pathlike(file)):
        if not is_pathlike(file):
            with writing_as_rank_0():
                return type(self).save(self, file, return_path, with_opt)
        if rank_distrib():
            return type(self).save(self, file, return_path, with_opt)  # fastai's own: writes nothing here
        target = self.path / self.model_dir / f"{file}.pth"
        with replacing(target) as f:
            type(self).save(self, f, with_opt=with_opt)
        return target if return_path else None


@wraps(Learner.export)
def _export(self, file="export.pkl", destroy: bool = False):
    # What a plain learner exports: without ddipp's callbacks (the file loads where ddipp is not installed). A file is
    # rank 0's to write, as fastai writes it; a buffer is this process's own: it gets the bytes anywhere.
    callback_fns = self.callback_fns
    self.callback_fns = _plain_callback_fns(callback_fns)
    try:
        with nullcontext() if is_pathlike(file) else writing_as_rank_0():
            type(self).export(self, file, destroy)
    finally:
        if "callback_fns" in vars(self):  # not destroyed
            self.callback_fns = callback_fns


@wraps(Learner.validate)
def _validate(self, dl=None, callbacks=None, metrics=None):
    # Outside a fit every rank validates the whole set, so fastai's per-batch all-reduce of the metrics it wraps in
    # AverageMetric (under WORLD_SIZE > 1) adds nothing and makes validate() a collective that waits for the other
    # ranks. They are wrapped here instead, without the all-reduce (metrics that are callbacks, like FBeta, are kept):
    # `if ddipp.is_rank0(): learn.validate()` works.
    metrics = [_rank_average(m) for m in listify(ifnone(metrics, self.metrics))]
    return type(self).validate(self, dl, callbacks, metrics)


@wraps(Learner.fit)
def _fit(self, epochs, lr=defaults.lr, wd=None, callbacks=None):
    # After torch elastic restarted the group, a fit with a Checkpoint that the run finished is skipped, and its state
    # loaded when the Checkpoint's file is its (ddipp.core.resume); any other fit is fastai's. A Checkpoint is told
    # the fit's callbacks: a file written mid-epoch resumes with their schedules stepped past the batches before it.
    checkpoints = [cb for cb in listify(callbacks) + listify(self.callbacks) if isinstance(cb, Checkpoint)]
    for checkpoint in checkpoints:
        checkpoint.fit_callbacks = listify(callbacks) + listify(self.callbacks)
        checkpoint.fit_lrs = [float(v) for v in np.ravel(self.lr_range(lr))]  # a restarted fit must run at the same
    if checkpoints and restart_count() > 0 and checkpoints[0].skips(epochs):
        return None
    return type(self).fit(self, epochs, lr, wd, callbacks)


_METHODS = {"save": _save, "export": _export, "validate": _validate, "fit": _fit}


def _plain_callback_fns(callback_fns: list) -> list:
    """`callback_fns` without ddipp's callbacks."""
    return [f for f in callback_fns if getattr(f, "func", f) not in _DDIPP_CALLBACKS]


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
    learn.callback_fns = _plain_callback_fns(learn.callback_fns)
    for name, method in _METHODS.items():
        if getattr(vars(learn).get(name), "__func__", None) is method:
            delattr(learn, name)
    if "ddp" in vars(learn):
        from ..core.group.binding import unbind
        unbind(learn)
    return learn


Learner.to_ddp = to_ddp
Learner.from_ddp = from_ddp
