"""Global-batch losses, metric states, SyncBatchNorm, checkpoints, throughput in fastai v1: what the tests run in one
process (the reference) and beyond_worker.py runs on 2 ranks (plain-torch parts: tests/core/workers/core_story.py)."""
import os
import signal

import torch
import torch.nn.functional as F
from fastai.basic_data import DataBunch
from fastai.basic_train import Learner, LearnerCallback
from fastai.metrics import accuracy
from fastai.torch_core import get_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddipp
from ddipp.core.resume import restart_count
from dying_write import die_writing
from core_story import mean_cov, moment_sums, pairwise_loss, sq_distances
from scenario import digits_data, digits_learner, history, params


# 1. Global-batch losses

def pairs_data(path, bs, n_train=256, n_valid=64) -> DataBunch:
    """Points in 8-d whose targets are 2-d coordinates, a fixed nonlinear map of them; sequential batches."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n_train + n_valid, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 2, generator=g) / 3)
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), bs, drop_last=True)
    valid = DataLoader(TensorDataset(x[n_train:], y[n_train:]), 32)
    return DataBunch(train, valid, path=path, device=torch.device("cpu"), no_check=True)


def pairs_learner(data) -> Learner:
    torch.manual_seed(0)
    # no last bias: distances ignore it, so its gradient is float noise that Adam would turn into steps
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2, bias=False))
    return Learner(data, model, loss_func=pairwise_loss)


def pairs_fit(learn):
    learn.fit_one_cycle(6, 2e-2)
    return dict(history(learn), params=params(learn))


def collapsed_loss(data) -> float:
    """The validation loss of predictions that collapsed to one point (every predicted distance 0)."""
    _, y = data.valid_ds.tensors
    return float(sq_distances(y).pow(2).mean())


# 2. Metric states

class OutputMoments(ddipp.SumMetric):
    """Mean and covariance of the model's outputs over the validation set (as for a Fréchet distance)."""

    def sums(self, output, target):
        return moment_sums(output.double())

    def value(self, totals):
        self.mean, self.cov = mean_cov(totals)
        return float(self.cov.trace())


def moments_fit(learn):
    metric = OutputMoments()
    learn.metrics = [metric]
    learn.fit(1, 1e-2)
    return dict(mean=metric.mean, cov=metric.cov, recorded=learn.recorder.metrics[0][0])


# 3. SyncBatchNorm

def bn_learner(data) -> Learner:
    torch.manual_seed(0)
    # no bias before the BatchNorm: it would only remove it, so that gradient is float noise Adam would amplify
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    return Learner(data, model, loss_func=nn.CrossEntropyLoss(), metrics=[accuracy])


class DuringFit(LearnerCallback):
    """At each epoch's end (model in eval mode): the BatchNorm layer's type, whether it holds the optimizer's
    Parameters, and whether rank 0 alone can run it in eval mode with the running statistics."""
    _order = 10

    def on_train_begin(self, **kwargs):
        self.seen = []

    def on_epoch_end(self, **kwargs):
        model = get_model(self.learn.model)
        bn, opt_params = model[1], {id(p) for g in self.learn.opt.opt.param_groups for p in g["params"]}
        eval_ok = None
        if ddipp.is_rank0():  # would hang (and fail on DDIPP_TIMEOUT) if eval mode communicated
            h = model[0](torch.linspace(-1, 1, 64 * 5).view(5, 64))
            expected = F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
            eval_ok = not bn.training and torch.equal(bn(h), expected)
        self.seen.append(dict(type=type(bn).__name__, shares=id(bn.weight) in opt_params and id(bn.bias) in opt_params,
                              eval_ok=eval_ok))


def bn_fit(learn):
    learn.callback_fns.append(DuringFit)
    learn.fit_one_cycle(2, 1e-2)
    model, bn = learn.model, learn.model[1]
    opt_params = {id(p) for g in learn.opt.opt.param_groups for p in g["params"]}
    return dict(history(learn), params=params(learn), running_mean=bn.running_mean.clone(),
                running_var=bn.running_var.clone(), batches_tracked=int(bn.num_batches_tracked),
                plain_after=type(bn) is nn.BatchNorm1d and type(model) is nn.Sequential,
                same_params_after=opt_params == {id(p) for p in model.parameters()},
                during=learn.during_fit.seen)


# 4. Checkpoint / resume

class StopAt(LearnerCallback):
    """Interrupts the fit when epoch `at` begins (after the checkpoint of the epoch before was written)."""

    def __init__(self, learn, at: int):
        super().__init__(learn)
        self.at = at

    def on_epoch_begin(self, epoch, **kwargs):
        if epoch == self.at:
            raise KeyboardInterrupt(f"interrupted at epoch {epoch}")


class KillRank1(LearnerCallback):
    """Kills rank 1 (SIGKILL) after its training batch `batch` of epoch `epoch`, in a group's first attempt only (a
    notebook's group that replaces it does not die again)."""

    def __init__(self, learn, epoch: int, batch: int):
        super().__init__(learn)
        self.at = epoch, batch

    def on_batch_end(self, train, epoch, num_batch, **kwargs):
        if train and (epoch, num_batch) == self.at and ddipp.rank() == 1 and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


class DieWriting(LearnerCallback):
    """Kills rank 0 (SIGKILL) while it writes the Checkpoint file of the state after `epoch` epochs and `step` batches,
    in a group's attempt `attempt` only (dying_write)."""

    def __init__(self, learn, epoch: int, step: int, attempt: int):
        super().__init__(learn)
        self.at = dict(epoch=epoch, step=step, attempt=attempt)

    def on_train_begin(self, **kwargs):
        die_writing(**self.at)


def ckpt_learner(path, seed=0) -> Learner:
    """The digits MLP with dropout (so the restored random generators matter), shuffled batches of 16."""
    learn = digits_learner(digits_data(path, bs=16, shuffle=True))
    torch.manual_seed(seed)
    learn.model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))
    return learn.split([learn.model[3]])


def resume_story(path, name_prefix=""):
    """Uninterrupted 4-epoch one-cycle fit; the same interrupted after epoch 2; a fresh learner resumed from there."""
    from functools import partial
    res = {}
    learn = ckpt_learner(path)
    learn.callback_fns.append(partial(ddipp.Checkpoint, name=f"{name_prefix}full"))
    learn.fit_one_cycle(4, 1e-2)
    res["full"] = dict(history(learn), params=params(learn))
    learn = ckpt_learner(path)
    learn.callback_fns += [partial(ddipp.Checkpoint, name=f"{name_prefix}cut"), partial(StopAt, at=2)]
    try:
        learn.fit_one_cycle(4, 1e-2)
    except KeyboardInterrupt:
        ddipp.barrier()  # rank 0 may still be writing the checkpoint of epoch 2
    res["saved_epoch"] = torch.load(learn.path / learn.model_dir / f"{name_prefix}cut.pth", weights_only=True)["epoch"]
    learn = ckpt_learner(path, seed=1)  # other weights and other random draws than the interrupted fit
    torch.manual_seed(99)
    learn.callback_fns.append(partial(ddipp.Checkpoint, name=f"{name_prefix}cut"))
    learn.fit_one_cycle(4, 1e-2, start_epoch=2)
    res["resumed"] = dict(history(learn), params=params(learn))
    return res


# 5. Throughput

def throughput_fit(learn, compare_batches=0):
    from functools import partial
    learn.callback_fns.append(partial(ddipp.Throughput, compare_batches=compare_batches))
    learn.fit(2, 1e-2)
    return dict(names=learn.recorder.metrics_names, metrics=learn.recorder.metrics, params=params(learn))
