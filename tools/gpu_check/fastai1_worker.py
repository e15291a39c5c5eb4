"""fastai v1 runs of tools/gpu_check.py on cuda:0, as one plain process or under `python -m ddipp.launch`; every rank
saves what it saw to OUT/rank{r}.pt.

    python tools/gpu_check/fastai1_worker.py MODE OUT     # MODE: bn, bn-gloo, gc or steps
"""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[2] / "tests" / "core" / "workers")]

import ddipp  # noqa: E402 (before fastai: it keeps fastai's import quiet)
from ddipp.core import dist as ddist  # noqa: E402
from fastai.basic_data import DataBunch  # noqa: E402
from fastai.basic_train import Learner, LearnerCallback  # noqa: E402
from fastai.metrics import accuracy  # noqa: E402
from gpu_pair import join_gloo_on_cuda0  # noqa: E402
from models import bn_cnn, digits_images, random_images, small_cnn, wide_cnn  # noqa: E402

N_VALID_DIGITS = 359  # the first digits validate (an odd number: 2 ranks split it unevenly)


def data_bunch(x: torch.Tensor, y: torch.Tensor, n_valid: int, bs: int, out: Path) -> DataBunch:
    """The first `n_valid` items validate, the rest train in batches of `bs` (drop_last), on this rank's device."""
    train = DataLoader(TensorDataset(x[n_valid:], y[n_valid:]), bs, drop_last=True)
    valid = DataLoader(TensorDataset(x[:n_valid], y[:n_valid]), 64)
    return DataBunch(train, valid, path=out, device=ddist.device(), no_check=True)


class BatchNormTypes(LearnerCallback):
    """The class names of the model's BatchNorm layers at the fit's first training step."""

    def __init__(self, learn: Learner):
        super().__init__(learn)
        self.seen = None

    def on_batch_end(self, train: bool, **kwargs) -> None:
        if train and self.seen is None:
            self.seen = [type(m).__name__ for m in self.learn.model.modules()
                         if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def count_sync_kernel_calls() -> list[int]:
    """From now on, count the calls of the CUDA kernel with which torch's SyncBatchNorm merges the ranks' batch
    statistics (it runs only in a group of 2 or more ranks); the count is the list's one item."""
    calls, kernel = [0], torch.batch_norm_gather_stats_with_counts

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)
    torch.batch_norm_gather_stats_with_counts = counted
    return calls


def bn(out: Path) -> dict:
    """The BatchNorm CNN on the digits with to_ddp(sync_bn=True), global batch 32: weights, statistics, validation."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    calls = count_sync_kernel_calls()
    x, y = digits_images()
    data = data_bunch(x, y, N_VALID_DIGITS, 32 // ddipp.world_size(), out)
    # plain SGD: fastai's Adam turns the float noise of SyncBatchNorm's merged statistics into whole steps (2 gloo
    # ranks on an H200, 2 epochs: weights 7.2e-3 from one process with Adam, 9.1e-5 with SGD; valid loss 3e-5 both)
    learn = Learner(data, bn_cnn(), opt_func=torch.optim.SGD, loss_func=nn.CrossEntropyLoss(), metrics=[accuracy],
                    callback_fns=[BatchNormTypes])
    learn.to_ddp(sync_bn=True).fit(2, 1e-2)
    rec, norm = learn.recorder, learn.model[1]
    return dict(params=[p.detach().cpu() for p in learn.model.parameters()],
                running=[norm.running_mean.cpu(), norm.running_var.cpu()],
                valid=torch.tensor([[float(v), *map(float, m)] for v, m in zip(rec.val_losses, rec.metrics)]),
                during=learn.batch_norm_types.seen, after=type(norm).__name__, sync_calls=calls[0],
                backend=dist.get_backend() if dist.is_initialized() else "none", world_size=ddipp.world_size(),
                device=str(next(learn.model.parameters()).device))


def bn_gloo(out: Path) -> dict:
    """`bn` on ranks sharing cuda:0 over gloo, then ddipp's collectives on CUDA tensors: rank r gathers and sums r."""
    join_gloo_on_cuda0()
    result = bn(out)
    mine = torch.full((1, 2), float(ddipp.rank()), device=ddipp.device())
    result.update(gathered=ddipp.all_gather(mine).cpu(), summed=float(ddipp.reduce_sum(mine).sum()))
    ddist.teardown()
    return result


class ReservedAtFitEnd(LearnerCallback):
    """torch.cuda.memory_reserved() at the end of the fit, just before GCCallback's on_train_end."""
    _order = -1  # GCCallback's is 0

    def on_train_end(self, **kwargs) -> None:
        self.reserved = torch.cuda.memory_reserved()


def gc(out: Path) -> dict:
    """A fit of wide activations with GCCallback: reserved CUDA memory before its on_train_end and after the fit."""
    x, y = random_images(1280, 64)
    learn = Learner(data_bunch(x, y, 256, 256, out), wide_cnn(), loss_func=nn.CrossEntropyLoss(),
                    callback_fns=[ReservedAtFitEnd, ddipp.GCCallback])
    learn.fit(1, 1e-3)
    return dict(before=learn.reserved_at_fit_end.reserved, after=torch.cuda.memory_reserved(),
                allocated=torch.cuda.memory_allocated())


class StepClock(LearnerCallback):
    """Milliseconds per training step of each epoch, from its first step's end to its last's: the GPU is synchronised
    at those two steps only, so the steps between run as in any fit."""

    def __init__(self, learn: Learner):
        super().__init__(learn)
        self.ms, self.steps, self.since = [], 0, 0.0

    def on_epoch_begin(self, **kwargs) -> None:
        self.steps = 0

    def on_batch_end(self, train: bool, **kwargs) -> None:
        if not train:
            return
        self.steps += 1
        if self.steps in (1, len(self.learn.data.train_dl)):
            torch.cuda.synchronize()
            if self.steps > 1:
                self.ms.append(1000 * (time.perf_counter() - self.since) / (self.steps - 1))
            self.since = time.perf_counter()


def steps(out: Path) -> dict:
    """The small CNN on random 3x32x32 images, batch 128, 4 epochs of 100 steps: ms per step of the last 3."""
    torch.backends.cudnn.benchmark = True
    x, y = random_images(12800 + 256, 32)
    learn = Learner(data_bunch(x, y, 256, 128, out), small_cnn(), loss_func=nn.CrossEntropyLoss(),
                    callback_fns=[StepClock])
    learn.to_ddp().fit(4, 1e-3)
    return dict(ms=learn.step_clock.ms[1:], timed_steps=learn.step_clock.steps - 1,
                backend=dist.get_backend() if dist.is_initialized() else "none")


MODES = {"bn": bn, "bn-gloo": bn_gloo, "gc": gc, "steps": steps}

if __name__ == "__main__":
    seen = MODES[sys.argv[1]](Path(sys.argv[2]))
    torch.save(seen, Path(sys.argv[2]) / f"rank{ddipp.rank()}.pt")
