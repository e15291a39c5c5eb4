"""SumMetric: a fastai v2 metric whose state is a set of sums, summed exactly over the ranks."""
from typing import Dict, Optional

import torch
from fastai.learner import Metric

from ..core.collectives import reduce_sum
from .callbacks import distributed_fit


class SumMetric(Metric):
    """A metric computed from sums over the validation set (counts, sums, sums of outer products).

    Subclasses give `sums(output, target)` (a dict of tensors for one batch) and `compute(totals)` (the metric;
    fastai v2 reads it as the `value` property). In a ddipp fit every rank sees each whole validation batch: rank r
    adds the sums of items r, r+N, ... only, and `reduce_sum` adds the ranks' totals once the validation is over,
    so the value is the single-process one and the per-item work is split. As a training metric (fastai's
    `Recorder(train_metrics=True)`) each rank adds the sums of its own batches, which `reduce_sum` adds alike."""

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must define sums(output, target) -> dict of tensors")

    def compute(self, totals: Dict[str, torch.Tensor]):
        raise NotImplementedError(f"{type(self).__name__} must define compute(totals) -> the metric")

    def reset(self) -> None:
        self.totals: Optional[Dict[str, torch.Tensor]] = None
        self.distributed = False  # the totals are this rank's part of a distributed fit's
        self.result = None  # the value, once computed from every rank's totals

    def accumulate(self, learn) -> None:
        fit = distributed_fit(learn)
        self.distributed = fit is not None
        split = self.distributed and not learn.training  # a validation batch is whole on every rank, a training one not
        rank, world_size = (fit.rank, fit.world_size) if split else (0, 1)
        sums = self.sums(learn.pred.detach()[rank::world_size], learn.y[rank::world_size])
        self.totals = sums if self.totals is None else {k: self.totals[k] + v for k, v in sums.items()}

    @property
    def value(self):
        """The metric over every rank's items: the first read after a validation sums the ranks' totals (every rank
        reads it there: fastai's Recorder logs each metric), later reads return it again."""
        if self.totals is None:
            return None
        if self.result is None:
            self.result = self.compute(reduce_sum(self.totals) if self.distributed else self.totals)
        return self.result
