"""`Learner.to_ddp` / `Learner.from_ddp` for fastai v2, added with fastcore's @patch (fastai's own extension idiom)."""
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import cloudpickle
import fastprogress.fastprogress
from fastai.learner import Learner
from fastcore.xtras import join_path_file
from fastai.torch_core import rank_distrib
from fastcore.basics import patch
from fastcore.foundation import L

from ..core import dist as ddist
from ..core.options import Options, check_matches_launch, notebook_devices
from ..core.shard import check_shardable
from ..core.files import replacing, writing_as_rank_0
from ..core.group.wire import BINDING_ATTRS
from ..core.state import savable
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback, distributed_fit
from .state import optimizer
from .loaders import batch_size

_DDIPP_CALLBACKS = (DistributedCallback, LRFinderBypassCallback, GCCallback)

@patch
def to_ddp(self: Learner, gpus: Optional[Sequence[int]] = None, nprocs: Optional[int] = None, sync_bn: bool = False,
           find_unused_parameters: Optional[bool] = None, lr_find_mode: str = "solo", timeout: float = 600,
           split_batches: bool = False, restarts: int = 0, shard: bool = False, shard_units=None) -> Learner:
    """Make every later fit of this learner distributed; a no-op in a plain process given neither `gpus` nor `nprocs`.

    In a process started by `python -m ddipp.launch` it joins the launcher's group (`gpus`/`nprocs`, if given, must
    match it) and adds DistributedCallback (`sync_bn`, `find_unused_parameters`), LRFinderBypassCallback
    (`lr_find_mode`) and GCCallback; `learn.save` and `learn.export` then replace their file only once it is whole.
    Elsewhere (a notebook) it binds the learner to a persistent group of worker processes, one per GPU of `gpus` in
    that order or `nprocs` CPU processes, on which each fit runs; `timeout` is how many seconds a rank may wait for the
    others in a collective before the fit fails instead of hanging. `split_batches=True` keeps the training loader's
    batch as the global batch, each process taking its part (one process's steps and numbers); by default each process
    takes a whole batch. In a notebook, `restarts=N` runs a fit whose worker died again on a new group, up to N times,
    resuming from the fit's Checkpoint. `shard=True` has each process hold 1/N of the parameters, gradients and
    optimizer state during a fit (FSDP2), sharded in units `shard_units(model)` gives (ddipp.core.shard's default
    otherwise); the learner is whole again after it."""
    options = Options(sync_bn, find_unused_parameters, lr_find_mode, split_batches, timeout, restarts, shard,
                      shard_units)
    if not ddist.launched():
        if gpus is None and nprocs is None:
            return self
        from ..core.group.binding import bind
        from .notebook import fitting
        from .notebook.binding import fit_on_group
        devices = notebook_devices(gpus, nprocs)
        if shard:
            check_shardable(self.model, len(devices))
        bind(self, devices, options, fit_on_group, fitting=fitting.__name__)
        self.save, self.export = AtomicSave(self), AtomicExport(self)  # the exported learner is not bound
        self.ddp.say_global_batch(batch_size(self.dls.train))
        return self
    check_matches_launch(gpus, nprocs, restarts)
    if shard:
        check_shardable(self.model, ddist.world_size())
    return distribute(self, options)


def distribute(learn: Learner, options: Options) -> Learner:
    """A launched process's (or a notebook worker's) learner: in the launcher's group, with ddipp's callbacks made
    with `options`, and `save`/`export` that replace their file only once it is whole."""
    ddist.init()
    if not ddist.is_rank0():
        fastprogress.fastprogress.NO_BAR = True  # rank 0 draws the bars, also of validate() and get_preds()
    from_ddp(learn)
    learn.add_cbs([DistributedCallback(options.sync_bn, options.find_unused_parameters, options.split_batches,
                                       options.shard, options.shard_units),
                   LRFinderBypassCallback(mode=options.lr_find_mode), GCCallback()])
    learn.save, learn.export = AtomicSave(learn), AtomicExport(learn)
    return learn


@patch
def from_ddp(self: Learner) -> Learner:
    """Back to plain single-process fastai: removes ddipp's callbacks and its `save`/`export`, or the binding to a
    notebook's workers."""
    self.remove_cbs([cb for cb in self.cbs if isinstance(cb, _DDIPP_CALLBACKS)])
    for name, kind in (("save", AtomicSave), ("export", AtomicExport)):
        if isinstance(vars(self).get(name), kind):
            delattr(self, name)
    if "ddp" in vars(self):
        from ..core.group.binding import unbind
        unbind(self)
    return self


to_ddp, from_ddp = Learner.to_ddp, Learner.from_ddp  # also ddipp.to_ddp(learn, ...) / ddipp.from_ddp(learn)


class AtomicSave:
    """`learn.save` of a learner under ddipp: fastai's own save (rank 0 writes a file; a buffer gets the bytes on every
    rank) of the plain model (a compiled one's keys without torch.compile's `_orig_mod.`: the file loads into the
    uncompiled model; a sharded fit's whole state, gathered), into a file that replaces the target only once it is
    whole (fastai writes in place: a crash mid-write would leave neither the old model nor the new)."""

    def __init__(self, learn: Learner):
        self.learn = weakref.ref(learn)

    def __call__(self, file, **kwargs):
        learn = self.learn()
        with savable(learn, optimizer(learn), distributed_fit(learn), file, isinstance(file, (str, Path)),
                     lambda state: dict(state, hypers=L(state["hypers"]))):
            if not isinstance(file, (str, Path)):  # a buffer is this process's own: it gets the bytes on every rank
                with writing_as_rank_0():
                    return type(learn).save(learn, file, **kwargs)
            if rank_distrib():  # a rank that does not write
                return type(learn).save(learn, file, **kwargs)
            target = join_path_file(file, learn.path / learn.model_dir, ext=".pth")
            with replacing(target) as f:
                type(learn).save(learn, f, **kwargs)
            return target


class AtomicExport:
    """`learn.export` of a learner under ddipp: fastai's own export (rank 0 writes) of the plain learner, without
    ddipp's callbacks (the file loads in any process), into a file that replaces the target only once it is whole."""

    def __init__(self, learn: Learner):
        self.learn = weakref.ref(learn)

    def __call__(self, fname="export.pkl", pickle_module=cloudpickle, pickle_protocol=2):
        learn = self.learn()
        if rank_distrib():
            return
        with _without_ddipp(learn), replacing(learn.path / fname) as f:
            # fastai saves to learn.path/fname: an absolute fname is the temporary file itself (same inode as f)
            type(learn).export(learn, Path(f.name).resolve(), pickle_module, pickle_protocol)


@contextmanager
def _without_ddipp(learn: Learner):
    """The learner as plain fastai for the block: ddipp's callbacks, its save/export and a notebook's binding off,
    then back."""
    cbs = [cb for cb in learn.cbs if isinstance(cb, _DDIPP_CALLBACKS)]
    learn.remove_cbs(cbs)  # DistributedCallback takes its fit guard (learn.fit) with it
    attrs = {k: v for k, v in vars(learn).items() if isinstance(v, (AtomicSave, AtomicExport)) or k in BINDING_ATTRS}
    for name in attrs:
        delattr(learn, name)
    try:
        yield learn
    finally:
        learn.add_cbs(cbs)
        vars(learn).update(attrs)
