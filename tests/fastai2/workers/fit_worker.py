"""Launched on 2 ranks by tests/fastai2/test_callbacks.py: plays fit_story.py with batch 16 a rank under ddipp (and
torch_loaders.py's story) and saves what each rank saw in OUT/rank{r}.pt (its stdout goes to OUT/stdout{r}.txt); then
rank 1 raises in the middle of a fit whose after_fit would load a file behind fastai's barrier, and writes OUT/raised
(the time it raised): the launched run must end with that error, long before the collective timeout."""
import contextlib
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from fastai.callback.core import Callback  # noqa: E402
from fastai.callback.tracker import SaveModelCallback  # noqa: E402
from fit_story import (ReversedDL, digits_dls, digits_learner, failed_fit, orders, refused,  # noqa: E402
                       saved_and_exported, story, sweep, tabular_digits_learner, tiny_valid,
                       torch_batches_learner)
from strategy_story import second_strategy  # noqa: E402
from torch_loaders import torch_story  # noqa: E402

out = Path(sys.argv[1])
rank = ddipp.rank()


class FailOnRank1(Callback):
    def after_batch(self):
        if self.training and self.iter == 5 and rank == 1:
            (out / "raised").write_text(str(time.time()))
            raise ValueError("rank 1 fails on purpose")


with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {"story": story(digits_learner(digits_dls(bs=16), out / "story").to_ddp())}
    res["solo_sweep"] = sweep(digits_learner(digits_dls(bs=16), out / "sweep").to_ddp())
    learn = digits_learner(digits_dls(bs=16), out / "sweep").to_ddp(lr_find_mode="distributed")
    res["distributed_sweep"] = sweep(learn)
    res["tiny_valid"] = tiny_valid(digits_learner(digits_dls(bs=16, val_bs=2, n_valid=3), out / "tiny").to_ddp())
    res["one_valid"] = tiny_valid(digits_learner(digits_dls(bs=16, n_valid=1), out / "tiny").to_ddp())
    res["shuffled_orders"] = orders(digits_learner(digits_dls(bs=16, shuffle=True), out / "orders").to_ddp())
    res["own_orders"] = orders(digits_learner(digits_dls(bs=16, dl_type=ReversedDL), out / "orders").to_ddp(), 1)
    res["torch_loaders"] = torch_story(lambda learn, split: learn.to_ddp(split_batches=split), 2)
    res["failed_fit"] = failed_fit(digits_learner(digits_dls(bs=16), out / "failed").to_ddp())
    res["too_large_bs"] = refused(lambda: digits_learner(digits_dls(bs=16, n_train=20), out / "bad").to_ddp())
    res["torch_batches"] = refused(lambda: torch_batches_learner(out / "bad").to_ddp())
    res["saved"] = saved_and_exported(tabular_digits_learner(out / "tabular", bs=16).to_ddp(sync_bn=True))
    res["second_strategy"] = second_strategy(
        lambda: digits_learner(digits_dls(bs=16), out / "strategy").to_ddp(lr_find_mode="distributed"),
        fit=lambda learn: learn.fit_one_cycle(1, 1e-2, cbs=ddipp.Checkpoint("stub")),
        sweep=lambda learn: learn.lr_find(num_it=5, show_plot=False),
        resume=lambda learn: learn.fit(2, 1e-3, cbs=ddipp.Checkpoint("stub"), start_epoch=1))
    torch.save(res, out / f"rank{rank}.pt")
    learn = digits_learner(digits_dls(bs=16), out / "fail").to_ddp()
    learn.fit(1, 1e-2, cbs=SaveModelCallback(fname="best"))  # writes models/best.pth, which the next after_fit loads
    learn.fit(2, 1e-2, cbs=[SaveModelCallback(fname="best"), FailOnRank1()])
