"""Launched as 2 nodes of one rank each, or on one node, with --max-restarts 5 by tests/fastai2/test_checkpoint.py: a
3-epoch one-cycle fit checkpointed every 6 batches too. With `kill`, rank 1 (node 1's) kills itself (SIGKILL) in the
first attempt after batch 13 of epoch 1, 4 batches after the checkpoint of batch 9, and torch elastic restarts the
ranks of both nodes. Saves each rank's weights, recorder and restart count in OUT/rank{r}.pt."""
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from ddipp.core.resume import restart_count  # noqa: E402
from fastai.callback.core import Callback  # noqa: E402
from fit_story import digits_dls, digits_learner, history, params  # noqa: E402

out, kill = Path(sys.argv[1]), sys.argv[2] == "kill"


class KillRank1(Callback):
    def after_batch(self):
        if kill and restart_count() == 0 and (self.epoch, self.iter) == (1, 13) and ddipp.rank() == 1 \
                and self.training:
            os.kill(os.getpid(), signal.SIGKILL)


learn = digits_learner(digits_dls(bs=16, shuffle=True), out / "work").to_ddp()
learn.fit_one_cycle(3, 1e-2, cbs=[ddipp.Checkpoint(every_steps=6), KillRank1()])
torch.save(dict(params=params(learn), history=history(learn), restarts=restart_count()), out / f"rank{ddipp.rank()}.pt")
