"""A fastai v2 Learner on PyTorch's own DataLoaders (issue 41 point 1): a regression on a TensorDataset of 160 items in
a sampler's order of its own, fitted with and without split_batches and validated on 160 and 145 items in batches of
16; played in one process (the reference, at the global batch), on 2 launched ranks (fit_worker.py) and on a
notebook's 3 processes (tests/fastai2/test_loaders.py)."""
import torch
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import MSELossFlat
from fastai.test_utils import RegModel
from torch.utils.data import DataLoader, Sampler, TensorDataset

from compare import TOL, close, max_diff
from fit_story import history, orders, params

N_TRAIN, BS = 160, 16
SPLIT_BS = 15  # split_batches: 8 + 7 on 2 ranks, 5 + 5 + 5 on 3; 10 batches and a last of 10 (5 + 5, 4 + 3 + 3) kept
VALID_SIZES = (160, 145)  # 10 batches of 16 (6 + 5 + 5 on 3), or 9 and a last of 1 (the other ranks: a placeholder)


class FixedOrder(Sampler):
    """A sampler with an order of its own: one fixed permutation of range(n)."""

    def __init__(self, n: int):
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def regression(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, 2 * x + 3)


def torch_learner(bs: int, n_valid: int, split: bool = False, shuffle: bool = False) -> Learner:
    """fastai's RegModel on PyTorch DataLoaders: training in FixedOrder (or shuffled) in batches of `bs` (drop_last
    unless `split`), validation in batches of 16; always the same initial weights."""
    order = dict(shuffle=True) if shuffle else dict(sampler=FixedOrder(N_TRAIN))
    train = DataLoader(regression(N_TRAIN, 1), batch_size=bs, drop_last=not split, **order)
    dls = DataLoaders(train, DataLoader(regression(n_valid, 2), batch_size=BS))
    torch.manual_seed(0)
    return Learner(dls, RegModel(), loss_func=MSELossFlat())


def torch_story(to_ddp, world_size: int) -> dict:
    """For split_batches off and on, each validation set: the weights and the recorder after 2 epochs of the learner
    `to_ddp(learner, split_batches)` gives, and validate() after them (one process's, on every rank); under ddipp, the
    shuffled loader's order each epoch. The reference (`to_ddp` None) trains one process at the global batch."""
    res = {}
    for split in (False, True):
        bs = SPLIT_BS if split else BS if to_ddp else BS * world_size
        for n_valid in VALID_SIZES:
            learn = torch_learner(bs, n_valid, split)
            if to_ddp:
                to_ddp(learn, split)
            learn.fit(2, 1e-2)
            res[split, n_valid] = dict(params=params(learn), fit=history(learn),
                                       validate=[float(v) for v in learn.validate()])
    if to_ddp:
        res["orders"] = orders(to_ddp(torch_learner(BS, BS, shuffle=True), False), 2)
    return res


def check_torch_story(run: dict, world_size: int) -> None:
    """A Learner on PyTorch DataLoaders trained on `world_size` processes (`run`, torch_loaders.py) as one process:
    its weights and recorder with and without split_batches, and each validation loss exactly one process's of the
    same weights, over every item (the last batch of 1 too)."""
    reference = torch_story(None, world_size)
    for key, ref in reference.items():
        got = run[key]
        assert max_diff(got["params"], ref["params"]) <= TOL, key
        assert close(got["fit"], ref["fit"], tol=1e-4), key  # steps per epoch, smoothed losses, lrs, epoch values
        assert close([v[1] for v in got["fit"]["values"]], [v[1] for v in ref["fit"]["values"]], tol=1e-6), key
        assert close(got["validate"][0], got["fit"]["values"][-1][1], tol=1e-6), key  # one process, same weights


def check_torch_orders(shards: list, world_size: int) -> None:
    """Each epoch, the shuffled loader's shards of the ranks `shards` (all of them, or rank 0's) are disjoint and
    every rank's share: 160 // N items; a new order each epoch."""
    for epochs in shards:
        assert len(epochs) == 2 and epochs[0] != epochs[1]
        assert all(len(set(order)) == len(order) == 160 // world_size for order in epochs)
    for k in range(2):
        assert len(set().union(*(epochs[k] for epochs in shards))) == len(shards) * (160 // world_size)

