"""SumMetric: a fastai callback metric whose state is a set of sums, summed exactly over the ranks."""
from typing import Dict

import torch
from fastai.callback import Callback
from fastai.torch_core import add_metrics

from ..core import dist as ddist
from ..core.collectives import reduce_sum


class SumMetric(Callback):
    """A metric computed from sums over the validation set (counts, sums, sums of outer products).

    Subclasses give `sums(output, target)` (a dict of tensors for one batch) and `value(totals)`. Under ddipp every
    rank sees each whole validation batch: rank r adds the sums of items r, r+N, ... only, and `reduce_sum` adds
    the ranks' totals at the epoch's end, so the value is the single-process one and the per-item work is split."""

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must define sums(output, target) -> dict of tensors")

    def value(self, totals: Dict[str, torch.Tensor]):
        raise NotImplementedError(f"{type(self).__name__} must define value(totals) -> the metric")

    def on_epoch_begin(self, **kwargs) -> None:
        self.totals = None

    def on_batch_end(self, last_output, last_target, **kwargs) -> None:
        rank, world_size = ddist.rank(), ddist.world_size()
        sums = self.sums(last_output[rank::world_size], last_target[rank::world_size])
        self.totals = sums if self.totals is None else {k: self.totals[k] + v for k, v in sums.items()}

    def on_epoch_end(self, last_metrics, **kwargs):
        self.totals = reduce_sum(self.totals)
        return add_metrics(last_metrics, self.value(self.totals))
