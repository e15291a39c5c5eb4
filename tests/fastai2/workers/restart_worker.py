"""Launched on 2 ranks with --max-restarts 5 by tests/fastai2/test_checkpoint.py: four fits with a Checkpoint (2
epochs; a 4-epoch one-cycle fit; 1 epoch; a 3-epoch one-cycle fit checkpointed every 6 batches too). With `kill`, rank 1
kills itself (SIGKILL) in each of the first 5 attempts (KILLS: before the first checkpoint, in the middle of fit 2, in
fit 3 after fit 2 ended, in fit 4 2 and 4 batches after a mid-epoch checkpoint in its epochs 0 and 1; before the last,
rank 0 truncates fit 4's newest file, whose Checkpoint keeps the one before it), and torch elastic restarts the group
each time. MODE `kill-shard` / `whole-shard`: the same under to_ddp(shard=True). Saves each rank's weights, recorder and
restart count in OUT/rank{r}.pt."""
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

out, kill, shard = Path(sys.argv[1]), sys.argv[2].startswith("kill"), sys.argv[2].endswith("-shard")
# attempt (elastic's restart count) -> (fit, epoch, batch) it dies after; fit 4 wrote after batch 11 of epoch 0 (its
# 12th batch) and after batch 9 of epoch 1 (its 30th)
KILLS = {0: (1, 0, 3), 1: (2, 2, 3), 2: (3, 0, 3), 3: (4, 0, 13), 4: (4, 1, 13)}
# (attempt, fit, epoch, batch) after which rank 0 cuts fit 4's newest file (after batch 9 of epoch 1) to its first half,
# as a copy or a full disk would: the restart resumes from the one before it (after batch 3)
TRUNCATE = (4, 4, 1, 12)
fit, histories = 0, {}  # the fit running; each fit's recorder after it


class KillRank1(Callback):
    def after_batch(self):
        at = (fit, self.epoch, self.iter)
        if kill and KILLS.get(restart_count()) == at and ddipp.rank() == 1 and self.training:
            os.kill(os.getpid(), signal.SIGKILL)
        if kill and (restart_count(), *at) == TRUNCATE and ddipp.rank() == 0 and self.training:
            newest = Path(self.learn.path) / self.learn.model_dir / "steps.pth"
            newest.write_bytes(newest.read_bytes()[:newest.stat().st_size // 2])


learn = digits_learner(digits_dls(bs=16, shuffle=True), out / "work").to_ddp(shard=shard)
for fit, (run, checkpoint) in enumerate([
        (lambda cbs: learn.fit(2, 1e-2, cbs=cbs), ddipp.Checkpoint()),
        (lambda cbs: learn.fit_one_cycle(4, 1e-2, cbs=cbs), ddipp.Checkpoint()),
        (lambda cbs: learn.fit(1, 1e-3, cbs=cbs), ddipp.Checkpoint()),
        (lambda cbs: learn.fit_one_cycle(3, 1e-2, cbs=cbs), ddipp.Checkpoint("steps", keep=2, every_steps=6))],
        start=1):
    run([checkpoint, KillRank1()])
    histories[fit] = history(learn)
torch.save(dict(params=params(learn), histories=histories, restarts=restart_count()), out / f"rank{ddipp.rank()}.pt")
