"""Started by tests/test_callbacks.py under ddipp.launch --timeout 60: rank 1 raises mid-fit, in a fit whose
on_train_end loads a file behind fastai's barrier (SaveModelCallback on improvement, or a distributed lr_find).
Usage: fail_fast_worker.py OUT save_model|lr_find. Rank 1 writes OUT/raised (the time it raised)."""
import sys
import time
from functools import partial
from pathlib import Path

import torch

torch.set_num_threads(1)
import ddipp  # noqa: E402
from fastai.basic_train import LearnerCallback  # noqa: E402
from fastai.callbacks import SaveModelCallback  # noqa: E402
from scenario import digits_data, digits_learner  # noqa: E402

out, story = Path(sys.argv[1]), sys.argv[2]


class FailOnRank1(LearnerCallback):
    def on_batch_end(self, iteration, **kwargs):
        if iteration == 5 and ddipp.rank() == 1:
            (out / "raised").write_text(str(time.time()))
            raise ValueError("rank 1 fails on purpose")


learn = digits_learner(digits_data(out, bs=16)).to_ddp(lr_find_mode="distributed")
if story == "save_model":
    learn.callback_fns.append(partial(SaveModelCallback, every="improvement", name="best"))
    learn.fit(1, 1e-2)  # writes models/best.pth, which the failing fit's on_train_end loads
learn.callback_fns.append(FailOnRank1)
if story == "save_model":
    learn.fit(2, 1e-2)
else:
    learn.lr_find(num_it=40)
