"""Global-batch losses, sum metrics, checkpoints, throughput on fastai v2: the stories the tests run in one process
(the reference) and extras_worker.py runs on 2 ranks."""
import os
import random
import signal
from functools import cache
from pathlib import Path

import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (adds Learner.fit_one_cycle)
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import ddipp
from ddipp.core.resume import restart_count
from core_story import pairwise_loss, sq_distances
from dying_write import die_writing

N_VALID = 359  # digits' validation items: odd, so the ranks' shares differ


def params(learn) -> list:
    return [p.detach().clone() for p in learn.model.parameters()]


def values(learn) -> list:
    """The recorder's rows (train loss, valid loss, metrics) as plain floats; [] for an epoch that was skipped."""
    return [[float(v) for v in row] for row in learn.recorder.values]


@cache
def digits():
    d = load_digits()
    return torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target)


def digits_dls(bs: int, shuffle: bool = False) -> DataLoaders:
    """scikit-learn's digits as 64 features; the first N_VALID validate, in batches of 64."""
    x, y = digits()
    train = DataLoader(TensorDataset(x[N_VALID:], y[N_VALID:]), bs=bs, shuffle=shuffle, drop_last=True)
    return DataLoaders(train, DataLoader(TensorDataset(x[:N_VALID], y[:N_VALID]), bs=64), device=ddipp.device())


def digits_learner(dls, dropout: float = 0.0, seed: int = 0, **kwargs) -> Learner:
    """An MLP, always with the same initial weights for a seed (no BatchNorm)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10))
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), **kwargs)


@cache
def launched(basetemp: Path):
    """What extras_worker.py saw on each of 2 launched ranks (batch 16 a rank), and its folder; the run is made once
    per test session (pass pytest's basetemp), for every test file that reads it."""
    from conftest import launch_2_ranks, rank_files  # tests/conftest.py
    out = basetemp / "extras"
    out.mkdir()
    launch_2_ranks(Path(__file__).parent / "extras_worker.py", out)
    return rank_files(out), out


# 1. Global-batch losses

def pairs_dls(bs: int, n_train: int = 256, n_valid: int = 64) -> DataLoaders:
    """Points in 8-d whose targets are 2-d coordinates, a fixed nonlinear map of them; batches in order."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n_train + n_valid, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 2, generator=g) / 3)
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), bs=bs, drop_last=True)
    return DataLoaders(train, DataLoader(TensorDataset(x[n_train:], y[n_train:]), bs=32), device=ddipp.device())


def pairs_learner(dls) -> Learner:
    torch.manual_seed(0)
    # no last bias: distances ignore it, so its gradient is float noise that Adam would turn into steps
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2, bias=False))
    return Learner(dls, model, loss_func=pairwise_loss)


def pairs_fit(learn) -> dict:
    learn.fit_one_cycle(6, 2e-2)
    return dict(values=values(learn), losses=[float(v) for v in learn.recorder.losses], params=params(learn))


def collapsed_loss() -> float:
    """The validation loss of predictions that collapsed to one point (every predicted distance 0)."""
    _, y = pairs_dls(32).valid.dataset.tensors
    return float(sq_distances(y).pow(2).mean())


# 2. Sum metrics

class OutputMoments(ddipp.SumMetric):
    """Mean and covariance of the model's outputs over the validation set (as for a Fréchet distance)."""

    def sums(self, output, target):
        o = output.double()
        return dict(n=torch.tensor(float(len(o)), dtype=o.dtype), sum=o.sum(0), outer=o.T @ o)

    def compute(self, totals):
        self.mean = totals["sum"] / totals["n"]
        self.cov = (totals["outer"] - totals["n"] * torch.outer(self.mean, self.mean)) / (totals["n"] - 1)
        return float(self.cov.trace())


def moments_fit(learn) -> dict:
    """One epoch with OutputMoments as a training and a validation metric: the validation's mean and covariance, and
    what the recorder holds (train loss, train moments, valid loss, valid moments)."""
    metric = OutputMoments()
    learn.metrics = [metric]
    learn.recorder.train_metrics = True
    learn.fit(1, 1e-2)
    return dict(mean=metric.mean, cov=metric.cov, recorded=values(learn)[-1])


# 3. Checkpoint / resume

class StopAt(Callback):
    """Stops the fit when epoch `at` begins (after the checkpoint of the epoch before was written), or after its
    training batch `batch` (and the Checkpoint's after_batch)."""
    order = 80

    def __init__(self, at: int, batch: int = None):
        self.at, self.batch = at, batch

    def before_epoch(self):
        if self.epoch == self.at and self.batch is None:
            raise CancelFitException

    def after_batch(self):
        if (self.epoch, self.iter) == (self.at, self.batch) and self.training:
            raise CancelFitException


class KillRank1(Callback):
    """Kills rank 1 (SIGKILL) after its training batch `batch` of epoch `epoch`, in a group's first attempt only (a
    notebook's group that replaces it does not die again)."""

    def __init__(self, epoch: int, batch: int):
        self.at = epoch, batch

    def after_batch(self):
        if self.training and (self.epoch, self.iter) == self.at and ddipp.rank() == 1 and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


class DieWriting(Callback):
    """Kills rank 0 (SIGKILL) while it writes the Checkpoint file of the state after `epoch` epochs and `step` batches,
    in a group's attempt `attempt` only (dying_write)."""

    def __init__(self, epoch: int, step: int, attempt: int):
        self.at = dict(epoch=epoch, step=step, attempt=attempt)

    def before_fit(self):
        die_writing(**self.at)


def ckpt_learner(path, seed: int = 0) -> Learner:
    """The digits MLP with dropout (so the restored random generators matter), shuffled batches of 32 / N (so the
    loader's own generator, or ddipp's shuffle seed, matters), under to_ddp (a no-op when not launched)."""
    random.seed(seed)  # a fastai DataLoader seeds its own generator from Python's
    dls = digits_dls(bs=32 // ddipp.world_size(), shuffle=True)
    return digits_learner(dls, dropout=0.2, seed=seed, path=path).to_ddp()


def resume_story(path, name_prefix: str = "") -> dict:
    """Uninterrupted 4-epoch one-cycle fit; the same stopped after epoch 2; a fresh learner resumed from there."""
    res = {}
    learn = ckpt_learner(path)
    learn.fit_one_cycle(4, 1e-2, cbs=ddipp.Checkpoint(name=f"{name_prefix}full"))
    res["full"] = dict(values=values(learn), params=params(learn))
    learn = ckpt_learner(path)
    learn.fit_one_cycle(4, 1e-2, cbs=[ddipp.Checkpoint(name=f"{name_prefix}cut"), StopAt(2)])
    res["saved_epoch"] = torch.load(path / "models" / f"{name_prefix}cut.pth", weights_only=True)["epoch"]
    learn = ckpt_learner(path, seed=1)  # other weights, random draws and loader order than the stopped fit
    learn.fit_one_cycle(4, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint(name=f"{name_prefix}cut"))
    res["resumed"] = dict(values=values(learn), params=params(learn))
    return res


# 4. Throughput

def throughput_fit(learn, compare_batches: int = 0) -> dict:
    learn.fit(2, 1e-2, cbs=ddipp.Throughput(compare_batches=compare_batches))
    return dict(names=list(learn.recorder.metric_names), values=values(learn), params=params(learn),
                metrics_after=len(learn.metrics))
