"""A model in torch.compile's and DDP's wrappers on fastai v2: what a callback reads of it through the learner, its
Checkpoint handed to the uncompiled model and back, its learn.save; played on 2 launched ranks by extras_worker.py, in
one process by tests/fastai2/test_wrapped_model.py."""
from pathlib import Path

import torch
from fastai.callback.core import Callback
from fastai.torch_core import trainable_params

import ddipp
from extras import digits_dls, digits_learner, params


class ReadsTheModel(Callback):
    """Reads the model's own attribute through the learner each training step (`learn.model` is DDP's wrapper)."""

    def before_fit(self):
        self.seen = []

    def after_batch(self):
        if self.training:
            self.seen.append(self.learn.model.label)


def compiled_story(path: Path, bs: int) -> dict:
    """Epochs 0-1 compiled, epoch 2 uncompiled from the compiled model's Checkpoint (its model's `label` read by a
    callback), epoch 3 compiled again from the uncompiled one's; then learn.save("final"). The final weights, the keys
    of the compiled state, what the callback read."""
    def learner(compiled: bool):
        learn = digits_learner(digits_dls(bs), path=path, splitter=trainable_params)  # compile hides model[i]
        if compiled:
            learn.model = torch.compile(learn.model, backend="eager")  # the wrapper and its keys, without a compiler
        return learn.to_ddp() if ddipp.world_size() > 1 else learn

    res = {}
    learn = learner(compiled=True)
    learn.fit(2, 1e-2, cbs=ddipp.Checkpoint())
    plain, reads = learner(compiled=False), ReadsTheModel()
    plain.model.label = "digits"
    plain.fit(3, 1e-2, start_epoch=2, cbs=[ddipp.Checkpoint(), reads])
    learn.fit(4, 1e-2, start_epoch=3, cbs=ddipp.Checkpoint())
    res["params"], res["keys"], res["read"] = params(learn), list(learn.model.state_dict()), reads.seen
    learn.save("final")
    return res
