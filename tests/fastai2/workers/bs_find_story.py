"""bs_find on fastai v2 against a per-rank memory ceiling: a layer of the model raises torch.OutOfMemoryError when
a training batch passes its rank's ceiling (it travels with the model to a notebook's workers). The story: a fit,
bs_find, a fit, against the same two fits without bs_find; the learner compared before and after bs_find."""
import copy

import torch
from fastai.callback.progress import CSVLogger
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from torch import nn
from torch.utils.data import DataLoader as TorchDataLoader

import ddipp
from ddipp.core.rng import rng_state, seed_all
from fit_story import N_TRAIN, digits_dls, two_groups

CEILINGS = (40, 23)  # the largest training batch rank 0 and rank 1 take (a plain process: rank 0's)


class Ceiling(nn.Module):
    """Out of memory, as torch says it, when a training batch passes this rank's entry of `ceilings`."""

    def __init__(self, ceilings=CEILINGS):
        super().__init__()
        self.ceilings = ceilings

    def forward(self, x):
        if self.training and len(x) > self.ceilings[ddipp.rank()]:
            raise torch.OutOfMemoryError(f"simulated: a batch of {len(x)} above rank {ddipp.rank()}'s ceiling "
                                         f"{self.ceilings[ddipp.rank()]}")
        return x


def learner(path, ceilings=CEILINGS) -> Learner:
    """An MLP with BatchNorm (running statistics) and dropout (draws) behind the ceiling; fastai's Adam (its state),
    a CSVLogger (it fails in a fit cancelled before its before_fit). Every generator seeded: the loader draws from
    python's."""
    seed_all(0)
    model = nn.Sequential(nn.Sequential(Ceiling(ceilings), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                        nn.Dropout(0.2)), nn.Identity(), nn.Linear(32, 10))
    return Learner(digits_dls(16, shuffle=True), model, loss_func=nn.CrossEntropyLoss(), splitter=two_groups,
                   path=path, cbs=CSVLogger())


def on_torch_loaders(learn: Learner) -> Learner:
    """The learner on PyTorch DataLoaders of the same items (shuffled by torch's generator)."""
    train, valid = learn.dls.train.dataset, learn.dls.valid.dataset
    learn.dls = DataLoaders(TorchDataLoader(train, batch_size=16, shuffle=True, drop_last=True),
                            TorchDataLoader(valid, batch_size=64), device="cpu")
    return learn


def snapshot(learn: Learner) -> dict:
    """What bs_find must leave as it found it."""
    return dict(model=copy.deepcopy(learn.model.state_dict()),
                grads=[None if p.grad is None else p.grad.clone() for p in learn.model.parameters()],
                opt=None if learn.opt is None else copy.deepcopy(learn.opt.state_dict()),
                attrs=dict(vars(learn)), cbs=list(learn.cbs), train=dict(vars(learn.dls.train)),
                modes=[m.training for m in learn.model.modules()], rng=rng_state())


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def changed(before: dict, after: dict) -> list:
    """The names of what differs: tensors and states by value, the learner's attributes, callbacks and training
    loader's attributes by identity."""
    names = [k for k in ("model", "grads", "opt", "modes", "rng") if not same(before[k], after[k])]
    for k in ("attrs", "train"):
        names += [f"{k}.{name}" for name in before[k].keys() | after[k].keys()
                  if before[k].get(name, before) is not after[k].get(name, after)]
    if len(before["cbs"]) != len(after["cbs"]) or any(a is not b for a, b in zip(before["cbs"], after["cbs"])):
        names.append("cbs")
    return names


def story(make, path, fresh: bool = False, **bs_find) -> dict:
    """A learner `make(learner(path))` fits, finds its batch size, fits again; another, the same without bs_find.
    `fresh`: bs_find on the new learner (no optimizer yet) before its first fit."""
    res, fitted = {}, {}
    for find in (True, False):
        learn = make(learner(path))
        if not fresh:
            learn.fit(1, 1e-2)
        if find:
            before = snapshot(learn)
            res["found"] = learn.bs_find(**bs_find)
            res["changed"] = changed(before, snapshot(learn))
            res["patched"] = [name for name, m in learn.model.named_modules() if "forward" in vars(m)]  # Recompute's
        learn.fit(1, 1e-2)
        fitted[find] = [t.detach().clone() for t in learn.model.state_dict().values()]
        learn.from_ddp()
    res["after"], res["without"] = fitted[True], fitted[False]
    return res
