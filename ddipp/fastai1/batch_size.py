"""`Learner.bs_find` for fastai v1: the largest batch size whose training step fits on every rank, found by
ddipp.core.batch_size in one fit of no epoch (as lr_find runs in a fit: launched and notebook mode alike); the learner
is left as it was."""
import copy
from typing import List, Optional, Tuple

from fastai.basic_train import Learner, LearnerCallback, Recorder

from ..core import dist as ddist
from ..core.batch_size import STEPS, Kept, check_sizes, check_start, find_batch_size, report
from ..core.sharding import part_sizes
from ..core.syncbn import has_batchnorm
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback
from .state import hypers, optimizer, set_hypers

_KEPT = (Recorder, DistributedCallback, LRFinderBypassCallback, GCCallback)  # fastai's and to_ddp's: the fit needs them


def bs_find(learn: Learner, start: Optional[int] = None, max_bs: Optional[int] = None) -> int:
    """The largest batch size from `start` (2 items a process) up to `max_bs` (the training set's items, a rank's share
    of them without split_batches) whose training steps run out of memory on no rank; under split_batches the global
    batch. It shows the trials; the learner (weights, optimizer, loaders, attributes, generators) is left as it was."""
    split, shard, processes = _distribution(learn)
    start = (2 * processes if split else 2) if start is None else start
    items = len(learn.data.train_dl.dataset)
    items = items if split else items // processes  # without split_batches a rank takes its share's batches
    check_sizes(start, max_bs, items)
    check_start(start, processes if split else 1, has_batchnorm(learn.model))
    attributes, kept = dict(vars(learn)), _Kept(learn)
    finder = BatchSizeFinder(learn, start, items if max_bs is None else max_bs, processes if split else 1,
                             processes > 1)  # also learn.batch_size_finder, until the attributes are put back
    # the callbacks after the finder but fastai's Recorder and to_ddp's: a fit of no epoch would still run their
    # on_train_begin and on_train_end (CSVLogger would empty its file, SaveModelCallback load its best model)
    learn.callback_fns = [f for f in learn.callback_fns if _runs(getattr(f, "func", f))]
    learn.callbacks = [cb for cb in learn.callbacks if _runs(type(cb))]
    try:
        learn.fit(1, callbacks=[finder])  # a notebook's learn.fit runs on its workers: finder's state comes back
    finally:
        vars(learn).clear()  # the recorder, the optimizer (none if there was none), the callbacks the fit set
        vars(learn).update(attributes)
        kept.put_back(learn)  # fit set the optimizer's lr and wd; a notebook loads what its workers send back
    if finder.error is not None:
        raise finder.error
    if ddist.is_rank0():
        print(report(finder.trials, finder.found, split, shard, processes), flush=True)
    return finder.found


class BatchSizeFinder(LearnerCallback):
    """bs_find's fit: at on_train_begin, the trials (STEPS training steps of the plain model on real batches of the
    training set at each size, each rank alone, verdicts agreed across ranks), then everything put back and the fit
    left without an epoch. Holds the size found, the trials, or the error (they come back to a notebook's callback)."""
    _order = -25  # after Recompute (-30) made the blocks recompute, before DistributedCallback (-20) wraps the model:
    # the trials run on the plain model, no collective inside

    def __init__(self, learn: Learner, start: int, max_bs: int, parts: int, group: bool):
        super().__init__(learn)
        self.start, self.max_bs = start, max_bs
        self.parts, self.group = parts, group  # a batch's parts (split_batches), whether ranks agree on verdicts
        self.found: Optional[int] = None
        self.trials: List[Tuple[int, bool, float]] = []
        self.error: Optional[Exception] = None  # bs_find raises it after the fit: every callback's on_train_end ran

    def on_train_begin(self, pbar, **kwargs) -> None:
        learn = self.learn
        if self.group:
            ddist.init()  # the group a failed fit left, joined again (DistributedCallback joins it after this)
        kept = _Kept(learn)
        try:
            self.found, self.trials = find_batch_size(self._trial, self.start, self.max_bs)
        except Exception as error:
            self.error = error
        finally:
            kept.put_back(learn)
            if hasattr(learn.model, "reset"):  # a recurrent model's hidden state, as LRFinder leaves it
                learn.model.reset()
        learn.recorder.silent = True  # this fit's recorder (bs_find puts the learner's back): no table header
        pbar.main_bar.gen, pbar.main_bar.total = range(0), 0  # no epoch: no batch drawn, no epoch's end

    def _trial(self, size: int) -> None:
        """STEPS training steps (forward, loss, backward, the optimizer's step, zero_grad) on this rank's part of the
        training set's first batch of `size` items."""
        learn = self.learn
        dl = learn.data.train_dl.new(batch_size=part_sizes(size, self.parts)[0], shuffle=False, num_workers=0)
        xb, yb = next(iter(dl))
        xb, yb = (xb if isinstance(xb, (list, tuple)) else [xb]), (yb if isinstance(yb, (list, tuple)) else [yb])
        learn.model.train()
        for _ in range(STEPS):
            out = learn.model(*xb)
            if isinstance(out, tuple):  # fastai's RNNs: (output, raw outputs, outputs); RNNTrainer keeps the first
                out = out[0]
            loss = learn.loss_func(out, *yb)
            loss.backward()
            learn.opt.step()
            learn.opt.zero_grad()


class _Kept:
    """What training steps or a fit change on a learner: core's Kept, and the optimizer's hyper-parameters."""

    def __init__(self, learn: Learner):
        self.trained = Kept(learn.model, optimizer(learn))
        self.hypers = copy.deepcopy(hypers(learn)) if getattr(learn, "opt", None) else None

    def put_back(self, learn: Learner) -> None:
        self.trained.put_back(learn.model, optimizer(learn))
        if self.hypers is not None:
            set_hypers(learn, copy.deepcopy(self.hypers))


def _runs(make) -> bool:
    """Whether the callback `make` makes (its class, or a function of the learner) runs in bs_find's fit."""
    return getattr(make, "_order", 0) < BatchSizeFinder._order or isinstance(make, type) and issubclass(make, _KEPT)


def _distribution(learn: Learner) -> Tuple[bool, bool, int]:
    """split_batches, shard and the processes of the learner's fits: a notebook's bound learner, a launched one that
    to_ddp made distributed, or a plain one (False, False, 1)."""
    binding = vars(learn).get("ddp")
    if binding is not None:
        return binding.options.split_batches, binding.options.shard, len(binding.devices)
    for f in learn.callback_fns:
        if getattr(f, "func", f) is DistributedCallback:
            return f.keywords["split_batches"], f.keywords["shard"], ddist.world_size()
    return False, False, 1


Learner.bs_find = bs_find
