"""split_batches on fastai v2: the story (fit_story.py) and what else counts steps or samples, with the training
loader's batch kept as the global batch; played in one process (the reference), launched and in notebook mode."""
import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.tracker import EarlyStoppingCallback
from fastai.callback.training import GradientAccumulation
from fastai.learner import Learner
from fastai.optimizer import SGD
from torch import nn

import ddipp
from fit_story import StepLosses, digits_dls, digits_learner, history, params, story, sweep

# (batch size, drop_last): 645 training items; the 2 launched ranks play 15, split 8 + 7, its short last batch
# dropped; the 3 notebook processes play 16, split 6 + 5 + 5, and its last batch of 5 (2 + 2 + 1)
SETTINGS = [(16, False), (15, True)]


def batchnorm_learner(dls, path) -> Learner:
    """An MLP with a BatchNorm layer, trained with SGD (Adam would turn SyncBatchNorm's float noise into steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=SGD, path=path)


def state(learn) -> list:
    """The parameters and the buffers (BatchNorm's running statistics)."""
    return [t.detach().clone().float() for t in learn.model.state_dict().values()]


class StopAfter2(Callback):
    """Ends the fit after its second epoch, as a crash would (the Checkpoint of that epoch written)."""
    order = 80  # after Checkpoint (71) wrote

    def after_epoch(self):
        if self.epoch == 1:
            raise CancelFitException()


def split_story(make, path, settings=SETTINGS) -> dict:
    """The fit story, lr_find, a fit resumed from its Checkpoint and the same uninterrupted, then a fit with
    GradientAccumulation, one that EarlyStoppingCallback stops and one of a
    model with BatchNorm (sync_bn), each on a new learner from `make(learner, **options)` (to_ddp, or nothing for the
    reference), for each of `settings`."""
    res = {}
    for bs, drop_last in settings:
        def learner():
            return make(digits_learner(digits_dls(bs=bs, drop_last=drop_last), path))
        key = f"bs{bs}"
        res[key] = story(learner())
        res[key]["sweep"] = sweep(learner())
        learn = learner()
        learn.fit_one_cycle(3, 1e-2, cbs=[ddipp.Checkpoint(name=f"cut{bs}"), StopAfter2()])
        learn = learner()
        learn.fit_one_cycle(3, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint(name=f"cut{bs}"))
        res[key]["resumed"] = params(learn)
        learn = learner()
        learn.fit_one_cycle(3, 1e-2)
        res[key]["uninterrupted"] = params(learn)
        learn = make(batchnorm_learner(digits_dls(bs=bs, drop_last=drop_last), path), sync_bn=True)
        learn.fit(2, 0.1)
        res[key]["batchnorm"] = dict(state=state(learn), history=history(learn))
        learn, steps = learner(), StepLosses()
        learn.fit(2, 1e-2, cbs=[GradientAccumulation(n_acc=40), steps])
        res[key]["accumulated"] = dict(params=params(learn), history=history(learn), steps=len(steps.losses))
        learn = learner()
        stop = EarlyStoppingCallback(monitor="valid_loss", min_delta=0.05, patience=1)  # after 4 epochs of 12
        learn.fit(12, 1e-2, cbs=stop)
        res[key]["early_stop"] = dict(params=params(learn), history=history(learn))
    return res
