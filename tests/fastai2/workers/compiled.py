"""A torch.compile'd model's state on fastai v2: its Checkpoint handed to the uncompiled model and back, its learn.save;
played on 2 launched ranks by extras_worker.py, in one process by tests/fastai2/test_compile.py."""
from pathlib import Path

import torch
from fastai.torch_core import trainable_params

import ddipp
from extras import digits_dls, digits_learner, params


def compiled_story(path: Path, bs: int) -> dict:
    """Epochs 0-1 compiled, epoch 2 uncompiled from the compiled model's Checkpoint, epoch 3 compiled again from the
    uncompiled one's; then learn.save("final"). The weights after each part and the keys of the compiled state."""
    def learner(compiled: bool):
        learn = digits_learner(digits_dls(bs), path=path, splitter=trainable_params)  # compile hides model[i]
        if compiled:
            learn.model = torch.compile(learn.model, backend="eager")  # the wrapper and its keys, without a compiler
        return learn.to_ddp() if ddipp.world_size() > 1 else learn

    res = {}
    learn = learner(compiled=True)
    learn.fit(2, 1e-2, cbs=ddipp.Checkpoint())
    plain = learner(compiled=False)
    plain.fit(3, 1e-2, start_epoch=2, cbs=ddipp.Checkpoint())
    learn.fit(4, 1e-2, start_epoch=3, cbs=ddipp.Checkpoint())
    res["params"], res["keys"] = params(learn), list(learn.model.state_dict())
    learn.save("final")
    return res
