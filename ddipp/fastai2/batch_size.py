"""`Learner.bs_find` for fastai v2 (fastcore @patch): the largest batch size whose training step fits on every rank,
found by ddipp.core.batch_size in one fit that a callback cancels once its trials are done (as lr_find runs in a fit:
launched and notebook mode alike); the learner is left as it was."""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.rnn import RNNCallback
from fastai.learner import Learner
from fastcore.basics import first, patch

from ..core import dist as ddist
from ..core.batch_size import STEPS, Kept, check_sizes, check_start, find_batch_size, report
from ..core.rng import rng_state, set_rng_state
from ..core.sharding import part_sizes
from ..core.syncbn import has_batchnorm
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback
from .loaders import fastai_loader
from .state import optimizer

_KEPT = (DistributedCallback, LRFinderBypassCallback, GCCallback)  # to_ddp's: their fit needs no before_fit


@patch
def bs_find(self: Learner, start: Optional[int] = None, max_bs: Optional[int] = None) -> int:
    """The largest batch size from `start` (2 items a process) up to `max_bs` (the training set's items, a rank's share
    of them without split_batches) whose training steps run out of memory on no rank; under split_batches the global
    batch. It shows the trials; the learner (weights, optimizer, loaders, attributes, generators) is left as it was."""
    generators = rng_state()  # before a PyTorch loader read as fastai's draws
    options, processes = _distribution(self)
    split = options is not None and options.split_batches
    start = (2 * processes if split else 2) if start is None else start
    items = fastai_loader(self.dls.train).n
    items = items if split else items // processes  # without split_batches a rank takes its share's batches
    check_sizes(start, max_bs, items)
    check_start(start, processes if split else 1, has_batchnorm(self.model))
    finder = BatchSizeFinder(start, items if max_bs is None else max_bs, fresh_opt=self.opt is None,
                             rnn=any(isinstance(cb, RNNCallback) for cb in self.cbs))
    before, hypers, cbs = dict(vars(self)), _hypers(self), list(self.cbs)
    later = [cb for cb in cbs if cb.order > finder.order and not isinstance(cb, _KEPT)]
    self.remove_cbs(later)  # fastai's own (CSVLogger, SaveModelCallback...) fail in a fit cancelled before they began
    try:
        self.fit(1, cbs=finder)
    finally:
        self.add_cbs(later)
        self.cbs.clear()
        self.cbs.extend(cbs)  # in their order: callbacks of one order run in list order
        for name in set(vars(self)) - set(before):
            delattr(self, name)
        vars(self).update(before)
        if hypers is not None:
            for now, then in zip(self.opt.hypers, hypers):
                now.clear()
                now.update(then)
        set_rng_state(generators)
    if finder.error is not None:
        raise finder.error
    if ddist.is_rank0():
        print(report(finder.trials, finder.found, options is not None and options.split_batches,
                     options is not None and options.shard, processes), flush=True)
    return finder.found


class BatchSizeFinder(Callback):
    """bs_find's fit: in before_fit, the trials (STEPS training steps of the plain model on real batches of the
    training set at each size, each rank alone, verdicts agreed across ranks), then everything put back and the fit
    cancelled. Holds the size found and the trials, or their error (they come back to a notebook's callback)."""
    order = -6  # after TrainEvalCallback (-10) put the model on its device and Recompute (-7) made its blocks
    # recompute; before DistributedCallback (-5) wraps it: the trials run on the plain model, no collective inside

    def __init__(self, start: int, max_bs: int, fresh_opt: bool, rnn: bool):
        self.start, self.max_bs, self.fresh_opt = start, max_bs, fresh_opt
        self.rnn = rnn  # the learner's RNNCallback (which sits the fit out) gives the loss the model's first output
        self.found: Optional[int] = None
        self.trials: List[Tuple[int, bool, float]] = []
        self.error: Optional[Exception] = None  # what the trials raised (out of memory at the start, ...)

    def before_fit(self) -> None:
        learn = self.learn
        options, _ = _distribution(learn)
        processes = dist.get_world_size() if options is not None and ddist.init() else 1
        split = options is not None and options.split_batches
        items = (lambda size: part_sizes(size, processes)[0]) if split else (lambda size: size)
        kept = Kept(learn.model, optimizer(learn))
        try:
            for p in learn.model.parameters():
                p.grad = None  # held on CPU; after a DDP fit they are views of its buckets, which fastai cannot zero
            learn.model.train()
            self.found, self.trials = find_batch_size(lambda size: _trial(learn, items(size), self.rnn), self.start,
                                                      self.max_bs)
        except Exception as error:  # raised by bs_find after the fit, whose callbacks then end it as usual
            self.error = error
        finally:
            kept.put_back(learn.model, optimizer(learn))
            if self.fresh_opt:
                learn.opt = None
        raise CancelFitException()


def _trial(learn: Learner, size: int, rnn: bool) -> None:
    """STEPS training steps (forward, loss, backward, the learner's optimizer step, zero_grad) on the training set's
    first `size` items."""
    xb, yb = _first_batch(learn, size)
    for _ in range(STEPS):
        pred = learn.model(*xb)
        loss = learn.loss_func(pred[0] if rnn else pred, *yb)  # fastai's RNNs: (output, raw outputs, outputs)
        loss.backward()
        learn.opt.step()
        learn.opt.zero_grad()


def _first_batch(learn: Learner, size: int) -> tuple:
    """The training set's first batch of `size` items on the model's device, as inputs and targets."""
    dl = learn.dls.train
    if isinstance(dl, torch.utils.data.DataLoader):  # a PyTorch loader's items with its collate_fn
        dl = torch.utils.data.DataLoader(dl.dataset, batch_size=size, collate_fn=dl.collate_fn)
    else:
        dl = dl.new(bs=size, shuffle=False, num_workers=0)
    b = learn._set_device(first(dl))
    n_inp = getattr(learn.dls, "n_inp", 1 if len(b) == 1 else len(b) - 1)  # as fastai's Learner._split
    return b[:n_inp], b[n_inp:]


def _hypers(learn: Learner) -> Optional[list]:
    """The optimizer's hyper-parameters (fit sets its lr and wd), or None without an optimizer."""
    return None if learn.opt is None else [dict(h) for h in learn.opt.hypers]


def _distribution(learn: Learner) -> tuple:
    """The to_ddp options of a learner's fits (None in a plain process) and their processes."""
    binding = vars(learn).get("ddp")  # a notebook's learner bound to a worker group
    if binding is not None:
        return binding.options, len(binding.devices)
    for cb in learn.cbs:
        if isinstance(cb, DistributedCallback):
            return cb.options, ddist.world_size()
    return None, 1
