"""Launched on 2 ranks with --max-restarts 1 by tests/fastai1/test_checkpoint.py: a fit with a Checkpoint, then a
4-epoch one-cycle fit with one; with `kill`, rank 1 kills itself (SIGKILL) at step 3 of epoch 2 of the second fit in
the first attempt, and torch elastic restarts the group. Saves each rank's weights, recorder and restart count in
OUT/rank{r}.pt."""
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from ddipp.core.resume import restart_count  # noqa: E402
from fastai.basic_train import LearnerCallback  # noqa: E402
from scenario import digits_data, digits_learner, history, params  # noqa: E402

out, kill = Path(sys.argv[1]), sys.argv[2] == "kill"


class KillRank1(LearnerCallback):
    def on_batch_end(self, train, epoch, num_batch, **kwargs):
        if kill and restart_count() == 0 and ddipp.rank() == 1 and train and epoch == 2 and num_batch == 3:
            os.kill(os.getpid(), signal.SIGKILL)


learn = digits_learner(digits_data(out / "work", bs=16, shuffle=True)).to_ddp()
learn.fit(2, 1e-2, callbacks=[ddipp.Checkpoint(learn)])
learn.fit_one_cycle(4, 1e-2, callbacks=[ddipp.Checkpoint(learn), KillRank1(learn)])
torch.save(dict(params=params(learn), history=history(learn), restarts=restart_count()), out / f"rank{ddipp.rank()}.pt")
