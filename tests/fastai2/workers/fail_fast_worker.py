"""Started by tests/fastai2/test_callbacks.py under ddipp.launch --timeout 60: rank 1 raises mid-fit, in a fit whose
after_fit loads a file behind fastai's barrier (SaveModelCallback), or in a distributed lr_find.
Usage: fail_fast_worker.py OUT fit|lr_find. Rank 1 writes OUT/raised (the time it raised)."""
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

import ddipp  # noqa: E402
from fastai.callback.core import Callback  # noqa: E402
from fastai.callback.tracker import SaveModelCallback  # noqa: E402
from fit_story import digits_dls, digits_learner  # noqa: E402

out, story = Path(sys.argv[1]), sys.argv[2]


class FailOnRank1(Callback):
    def after_batch(self):
        if self.training and self.iter == 5 and ddipp.rank() == 1:
            (out / "raised").write_text(str(time.time()))
            raise ValueError("rank 1 fails on purpose")


learn = digits_learner(digits_dls(bs=16), out).to_ddp(lr_find_mode="distributed")
if story == "fit":
    learn.add_cb(SaveModelCallback(fname="best"))
    learn.fit(1, 1e-2)  # writes models/best.pth, which the failing fit's after_fit would load
    learn.add_cb(FailOnRank1())
    learn.fit(2, 1e-2)
else:
    learn.add_cb(FailOnRank1())
    learn.lr_find(num_it=40, show_plot=False)
