"""split_batches on fastai v1: the story (scenario.py) and what else counts steps or samples, with the training
loader's batch kept as the global batch; played in one process (the reference), launched and in notebook mode."""
from functools import partial

from fastai.basic_train import Learner, LearnerCallback
from fastai.callbacks import EarlyStoppingCallback
from fastai.train import AccumulateScheduler
import torch
from torch import nn

import ddipp
from scenario import digits_data, digits_learner, history, params, story

# (batch size, drop_last): 1438 training items; the 2 launched ranks play 15, split 8 + 7, its short last batch
# dropped; the 3 notebook processes play 16, split 6 + 5 + 5, and its last batch of 14 (5 + 5 + 4)
SETTINGS = [(16, False), (15, True)]


def batchnorm_learner(data) -> Learner:
    """An MLP with a BatchNorm layer, trained with SGD (Adam would turn SyncBatchNorm's float noise into steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    return Learner(data, model, loss_func=nn.CrossEntropyLoss(), opt_func=partial(torch.optim.SGD, momentum=0.9))


def state(learn) -> list:
    """The parameters and the buffers (BatchNorm's running statistics)."""
    return [t.detach().clone().float() for t in learn.model.state_dict().values()]


class StopAfter2(LearnerCallback):
    """Ends the fit after its second epoch, as a crash would (the Checkpoint of that epoch written)."""
    _order = 10  # after Checkpoint wrote

    def on_epoch_end(self, epoch, **kwargs):
        return {"stop_training": epoch == 1}


def split_story(make, path, settings=SETTINGS) -> dict:
    """The story (lr_find included), a fit resumed from its Checkpoint and the same uninterrupted, then a fit with
    AccumulateScheduler (a summed loss, as it needs; SGD), one that
    EarlyStoppingCallback stops and one of a model with BatchNorm (sync_bn), each on a new learner from
    `make(learner, **options)` (to_ddp, or nothing for the reference), for each of `settings`."""
    res = {}
    for bs, drop_last in settings:
        def learner():
            return make(digits_learner(digits_data(path, bs=bs, drop_last=drop_last)))
        key = f"bs{bs}"
        res[key] = story(learner())
        learn = learner()
        learn.fit_one_cycle(3, 1e-2, callbacks=[ddipp.Checkpoint(learn, name=f"cut{bs}"), StopAfter2(learn)])
        learn = learner()
        learn.fit_one_cycle(3, 1e-2, start_epoch=2, callbacks=[ddipp.Checkpoint(learn, name=f"cut{bs}")])
        res[key]["resumed"] = params(learn)
        learn = learner()
        learn.fit_one_cycle(3, 1e-2)
        res[key]["uninterrupted"] = params(learn)
        learn = make(batchnorm_learner(digits_data(path, bs=bs, drop_last=drop_last)), sync_bn=True)
        learn.fit(2, 1e-2)
        res[key]["batchnorm"] = dict(state=state(learn), history=history(learn))
        learn = learner()
        learn.loss_func = nn.CrossEntropyLoss(reduction="sum")
        learn.opt_func = partial(torch.optim.SGD, momentum=0.9)  # Adam would turn gloo's float noise into steps
        # n_step=5 divides both settings' steps (90, 95): under ddipp the step AccumulateScheduler takes at an
        # epoch's end on a remainder of batches is off in either mode (3e-2 per process, 5e-5 split), another matter
        learn.fit(1, 1e-2, callbacks=[AccumulateScheduler(learn, n_step=5)])
        res[key]["accumulated"] = dict(params=params(learn), history=history(learn))
        learn = learner()
        learn.callback_fns.append(partial(EarlyStoppingCallback, monitor="valid_loss", min_delta=0.05, patience=1))
        learn.fit(12, 1e-2)
        res[key]["early_stop"] = dict(params=params(learn), history=history(learn))
    return res
