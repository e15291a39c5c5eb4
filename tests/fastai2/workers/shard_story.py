"""to_ddp(shard=True) on fastai v2 beyond the split story: what a sharded fit holds on a rank, what it leaves (plain
save, export and SaveModelCallback files, a failed fit's start, BatchNorm statistics), a user's own units; played
launched on 2 ranks (shard_worker.py) and in the tests' own process (the reference)."""
import io

import torch
from fastai.callback.core import Callback
from fastai.callback.tracker import SaveModelCallback
from fastai.callback.training import GradientClip
from fastai.learner import Learner
from fastai.optimizer import SGD
from torch import nn

from stories import held_bytes
from fit_story import RaiseAt, digits_dls, digits_learner, history, params, state, story, sweep, tabular_digits_learner


class HeldBytes(Callback):
    """The bytes of parameters, gradients and optimizer state this rank holds after each training step (a sharded
    tensor's own part), the largest of the fit."""
    order = 60

    def before_fit(self):
        self.most = dict(params=0, grads=0, opt=0)

    def after_step(self):
        model, opt = self.learn.model, self.learn.opt
        held = dict(params=held_bytes(model.parameters()), grads=held_bytes(p.grad for p in model.parameters()),
                    opt=held_bytes(v for p, *_ in opt.all_params() for v in opt.state[p].values()))
        self.most = {k: max(v, held[k]) for k, v in self.most.items()}


class SavesToBuffer(Callback):
    """learn.save to a buffer after the fit's epoch: the error it raises, or None."""
    refused = None

    def after_epoch(self):
        try:
            self.learn.save(io.BytesIO())
        except ValueError as e:
            self.refused = str(e)


def wide_learner(dls, path) -> Learner:
    """An MLP of 64 -> 256 -> 256 -> 10 (85 K parameters), fastai's Adam."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), path=path)


def batchnorm_learner(dls, path) -> Learner:
    """An MLP with a BatchNorm layer, SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=SGD, path=path)


def buffers(learn) -> list:
    return [b.detach().clone().float() for b in learn.model.buffers()]


def shard_story(make, path, bs: int) -> dict:
    """Each part on a new learner from `make(learner, **options)` (to_ddp(shard=True, ...), or nothing for the
    reference), batch `bs`."""
    res = {"story": story(make(digits_learner(digits_dls(bs=bs), path / "story")))}
    learn, held = make(wide_learner(digits_dls(bs=bs), path / "wide")), HeldBytes()
    learn.fit(1, 1e-3, cbs=held)
    res["held"] = dict(held.most, params_after=held_bytes(learn.model.parameters()), model=type(learn.model).__name__)
    learn.save("saved")
    res["saved"] = params(learn)
    (path / "tabular").mkdir(parents=True, exist_ok=True)
    learn = make(tabular_digits_learner(path / "tabular", bs=bs))  # BatchNorm layers; its data can be exported
    learn.fit(1, 1e-2)
    learn.export("exported.pkl")
    res["exported"] = state(learn)
    learn = make(digits_learner(digits_dls(bs=bs), path / "best"))
    learn.fit(4, 3e-2, cbs=SaveModelCallback(fname="best"))  # saves inside the fit, loads the best at its end
    res["best"] = dict(params=params(learn), history=history(learn))
    learn = make(digits_learner(digits_dls(bs=bs), path / "failed"))
    learn.fit(1, 1e-2)
    began, raised = params(learn), None
    try:
        learn.fit(1, 1e-2, cbs=RaiseAt())
    except RuntimeError as e:
        raised = str(e)
    res["failed"] = dict(began=began, after=params(learn), raised=raised)
    learn.fit(1, 1e-2)
    res["failed"]["next"] = params(learn)
    learn = make(batchnorm_learner(digits_dls(bs=bs), path / "bn"))
    learn.fit(2, 0.1)
    res["batchnorm"] = dict(buffers=buffers(learn), params=params(learn))
    # every rank sweeps the sharded model; fastai's LRFinder saves (gathered) and reloads on rank 0
    res["sweep"] = sweep(make(digits_learner(digits_dls(bs=bs), path / "sweep"), lr_find_mode="distributed"))
    learn = make(digits_learner(digits_dls(bs=bs), path / "clip"))
    to_buffer = SavesToBuffer()
    learn.fit(1, 1e-2, cbs=[GradientClip(0.1), to_buffer])  # GradientClip reads the gradients: a rank's shards
    res["clipped"], res["buffer_refused"] = params(learn), to_buffer.refused
    learn = make(digits_learner(digits_dls(bs=bs), path / "units"), shard_units=lambda model: [model[0]])
    learn.fit_one_cycle(1, 1e-2)
    res["units"] = params(learn)
    return res
