"""Throughput: per epoch, how many training samples all ranks processed, how many distinct, and how fast."""
import copy
import itertools
import time

import torch
from fastai.basic_train import Learner, LearnerCallback
from fastai.torch_core import add_metrics

from ..core import dist as ddist
from ..core.state import full_state, load_full_state
from ..core.throughput import global_counts, rank0_rate, say_comparison
from .callbacks import distributed_fit
from .state import optimizer


class Throughput(LearnerCallback):
    """Adds three columns to the results table and `recorder.metrics`: `samples` (training samples processed by all
    ranks in the epoch), `distinct` (how many different items those were) and `samples/s` (global, over the
    training phase of the slowest rank). `samples == distinct ==` the training set size: each item once.

    With `compare_batches=k`, a distributed fit first times k training batches of one process alone (rank 0, the
    same per-process batch, weights and optimizer state put back after) and prints one line after the first epoch
    comparing it with the fit's global rate."""
    _order = -21  # before DistributedCallback (the single-process timing needs the unwrapped model) and Recorder

    def __init__(self, learn: Learner, compare_batches: int = 0):
        super().__init__(learn)
        self.compare_batches, self.single_rate = compare_batches, None

    def on_train_begin(self, pbar, **kwargs) -> None:
        self.learn.recorder.add_metric_names(["samples", "distinct", "samples/s"])
        if self.compare_batches and pbar is not None and ddist.world_size() > 1 and ddist.init():
            self.single_rate = rank0_rate(self._time_one_process)

    def on_epoch_begin(self, **kwargs) -> None:
        self.count, self.start, self.elapsed = 0, time.perf_counter(), 0.0

    def on_batch_begin(self, last_target, train: bool, **kwargs) -> None:
        if train:
            self.count += _batch_size(last_target)

    def on_batch_end(self, train: bool, **kwargs) -> None:
        if train:
            self.elapsed = time.perf_counter() - self.start

    def on_epoch_end(self, epoch: int, last_metrics, **kwargs):
        samples, distinct, elapsed = self._global_counts()
        rate = round(samples / elapsed) if elapsed else None
        if epoch == 0 and self.single_rate:
            say_comparison(rate, self.single_rate, self.compare_batches)
        return add_metrics(last_metrics, [samples, distinct, rate])

    def _global_counts(self):
        """(samples, distinct, seconds) of this epoch's training, over all ranks."""
        fit = distributed_fit(self.learn)
        if fit is None:  # one process: its sampler draws each item at most once per epoch
            return self.count, self.count, self.elapsed
        return global_counts(fit.n_items, fit.epoch_order(), self.count, self.elapsed)

    def _time_one_process(self) -> float:
        """Samples/s of `compare_batches` training steps of this process alone; the model and optimizer are put back."""
        learn = self.learn
        model = learn.model
        state = copy.deepcopy(full_state(model, optimizer(learn)))  # rank 0 alone: the model is not wrapped yet
        count, start = 0, None
        model.train()
        with torch.random.fork_rng(devices=[]):
            for xb, yb in itertools.islice(learn.data.train_dl, self.compare_batches + 1):
                xb, yb = _listed(xb), _listed(yb)
                learn.loss_func(model(*xb), *yb).backward()
                learn.opt.step()
                learn.opt.zero_grad()
                if start is None:  # the first batch warms up, untimed
                    _synchronize()
                    start = time.perf_counter()
                else:
                    count += _batch_size(yb)
            _synchronize()
            elapsed = time.perf_counter() - start
        load_full_state(model, optimizer(learn), state)
        return count / elapsed


def _synchronize() -> None:
    """Wait for this rank's queued GPU work, so that a clock reading covers it."""
    if ddist.device().type == "cuda":
        torch.cuda.synchronize()


def _listed(batch) -> list:
    return list(batch) if isinstance(batch, (list, tuple)) else [batch]


def _batch_size(target) -> int:
    """Items in a batch, from its target (a tensor or a list of them)."""
    return int(target.shape[0]) if isinstance(target, torch.Tensor) else _batch_size(target[0])
