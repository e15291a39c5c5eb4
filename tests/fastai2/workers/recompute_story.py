"""Recompute on fastai v2: a convnet with BatchNorm and dropout in its blocks trained through fit_one_cycle, a frozen
phase with its BatchNorms frozen (BnFreeze) and an unfrozen phase with GradientAccumulation, with and without
Recompute; played in one process, launched (DDP, sync_bn, shard) and in notebook mode."""
import torch
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (Learner.fit_one_cycle)
from fastai.callback.training import BnFreeze, GradientAccumulation
from fastai.learner import Learner
from fastai.torch_core import params
from torch import nn

import ddipp
from fit_story import digits_dls


def convnet_learner(dls, path) -> Learner:
    """Two conv blocks (BatchNorm, dropout) over the digits as 1x8x8 images, a linear head; two layer groups."""
    torch.manual_seed(0)
    block = lambda c_in, c_out: nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                                              nn.Dropout(0.1))
    model = nn.Sequential(nn.Sequential(nn.Unflatten(1, (1, 8, 8)), block(1, 8), block(8, 8)),
                          nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)))
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), splitter=lambda m: [params(m[0]), params(m[1])],
                   path=path, train_bn=False)  # frozen, the body's BatchNorms are too: BnFreeze keeps them in eval


PHASES = ("fit", "frozen", "unfrozen")


def state(learn) -> list:
    """Every parameter and buffer (BatchNorm's running statistics and batch counts), as they are."""
    return [t.detach().clone() for t in learn.model.state_dict().values()]


def phases(learn) -> dict:
    res = dict(phases=PHASES)
    learn.fit_one_cycle(1, 1e-2)
    res["fit"] = state(learn)
    learn.freeze()
    learn.fit(1, 1e-2, cbs=BnFreeze())
    res["frozen"] = state(learn)
    learn.unfreeze()
    learn.fit(1, 1e-3, cbs=GradientAccumulation(n_acc=64))
    res["unfrozen"] = state(learn)
    res["patched"] = [name for name, m in learn.model.named_modules() if "forward" in vars(m)]  # after the fits: none
    return res


def recompute_story(make, path, bs: int, modules=None) -> dict:
    """{False: the phases' states without Recompute, True: with it (`modules(learn)`'s blocks if given)} of learners
    `make(learn)` returns, batch `bs`."""
    res = {}
    for recompute in (False, True):
        learn = make(convnet_learner(digits_dls(bs), path))
        if recompute:
            learn.add_cb(ddipp.Recompute(None if modules is None else modules(learn)))
        res[recompute] = phases(learn)
    return res
