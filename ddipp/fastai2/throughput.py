"""Throughput: per epoch, how many training samples all ranks processed, how many distinct, and how fast."""
import copy
import itertools
import time

import torch
from fastai.callback.core import Callback
from fastai.learner import ValueMetric
from fastai.torch_core import find_bs, to_device

from ..core import dist as ddist
from ..core.rng import rng_state, set_rng_state
from ..core.state import full_state, load_full_state
from ..core.throughput import global_counts, rank0_rate, say_comparison
from .callbacks import DistributedCallback, distributed_fit
from .state import optimizer

COLUMNS = ("samples", "distinct", "samples/s")


class Throughput(Callback):
    """Adds three columns to the results table and `recorder.values`: `samples` (training samples processed by all
    ranks in the epoch), `distinct` (how many different items those were) and `samples/s` (global, over the
    training phase of the slowest rank). `samples == distinct ==` the training set size: each item once.

    With `compare_batches=k`, a distributed fit first times k training batches of one process alone (rank 0, the
    same per-process batch, weights, optimizer state and random generators put back after) and prints one line after
    the first epoch comparing it with the fit's global rate."""
    # before DistributedCallback (the one-process timing needs the model unwrapped and the loader unsharded; the model
    # is on its device: TrainEvalCallback is -10), and before the Recorder names the results table's columns
    order = DistributedCallback.order - 1

    def __init__(self, compare_batches: int = 0):
        self.compare_batches, self.single_rate = compare_batches, None
        self.counts = dict.fromkeys(COLUMNS)
        self.columns = [ValueMetric(lambda name=name: self.counts[name], name) for name in COLUMNS]

    def before_fit(self):
        # not in validate() and get_preds() (they run before_fit too, under fastai's no_mbar), nor in lr_find's sweep
        self.run = self.learn.create_mbar and not hasattr(self.learn, "lr_finder")
        if not self.run:
            return
        self.learn.metrics = [m for m in self.learn.metrics if m not in self.columns] + self.columns
        self.single_rate = None
        if self.compare_batches and ddist.world_size() > 1 and ddist.init():
            self.single_rate = rank0_rate(self._time_one_process)

    def before_train(self):
        self.count, self.start, self.elapsed = 0, time.perf_counter(), 0.0

    def before_batch(self):
        if self.training:
            self.count += find_bs(self.yb)

    def after_batch(self):
        if self.training:
            self.elapsed = time.perf_counter() - self.start

    def after_train(self):
        samples, distinct, elapsed = self._global_counts()
        self.counts.update(zip(COLUMNS, (samples, distinct, round(samples / elapsed) if elapsed else None)))

    def after_epoch(self):
        rate = self.counts["samples/s"]
        if self.epoch == 0 and self.single_rate and rate:
            say_comparison(rate, self.single_rate, self.compare_batches)

    def after_fit(self):
        self.learn.metrics = [m for m in self.learn.metrics if m not in self.columns]

    def _global_counts(self):
        """(samples, distinct, seconds) of this epoch's training, over all ranks."""
        fit = distributed_fit(self.learn)
        if fit is None:  # one process: its loader draws each item at most once per epoch
            return self.count, self.count, self.elapsed
        # the order drawn again, alike
        return global_counts(fit.n_items, fit.epoch_order(), self.count, self.elapsed)

    def _time_one_process(self) -> float:
        """Samples/s of `compare_batches` training steps of this process alone; the model, optimizer and random
        generators (global and the loader's) are put back."""
        learn, dl = self.learn, self.learn.dls.train
        model, opt = learn.model, learn.opt
        state = copy.deepcopy(full_state(model, optimizer(learn)))  # rank 0 alone: the model is not wrapped yet
        rngs, loader_rng = rng_state(), copy.deepcopy(getattr(dl, "rng", None))  # the loader's own draws its order
        device = next(model.parameters()).device
        count, start = 0, None
        model.train()
        for b in itertools.islice(dl, self.compare_batches + 1):
            b, n_inp = to_device(b, device), getattr(learn.dls, "n_inp", max(len(b) - 1, 1))  # fastai's split
            learn.loss_func(model(*b[:n_inp]), *b[n_inp:]).backward()
            opt.step()
            opt.zero_grad()
            if start is None:  # the first batch warms up, untimed
                _synchronize(device)
                start = time.perf_counter()
            else:
                count += find_bs(b[n_inp:])
        _synchronize(device)
        elapsed = time.perf_counter() - start
        load_full_state(model, optimizer(learn), state)
        set_rng_state(rngs)
        if loader_rng is not None:
            dl.rng = loader_rng
        return count / elapsed


def _synchronize(device: torch.device) -> None:
    """Wait for this rank's queued GPU work, so that a clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
