"""Launched on 2 ranks with --max-restarts 5 by tests/fastai1/test_checkpoint.py: four fits with a Checkpoint (2
epochs; a 4-epoch one-cycle fit; 1 epoch; a 3-epoch one-cycle fit checkpointed every 6 batches too). With `kill`, rank 1
kills itself (SIGKILL) in each of the first 5 attempts (KILLS: before the first checkpoint, in the middle of fit 2, in
fit 3 after fit 2 ended, in fit 4 4 batches after a mid-epoch checkpoint in its epoch 1, once rank 0 truncated that
checkpoint: fit 4's Checkpoint keeps the one before it) but the fourth, where rank 0 dies writing fit 4's checkpoint of
batch 17 of epoch 0, and torch elastic restarts the group each time. Saves each rank's weights, recorder and restart
count in OUT/rank{r}.pt."""
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from ddipp.core.resume import restart_count  # noqa: E402
from fastai.basic_train import LearnerCallback  # noqa: E402
from dying_write import die_writing  # noqa: E402
from scenario import digits_data, digits_learner, history, params  # noqa: E402

out, kill = Path(sys.argv[1]), sys.argv[2] == "kill"
# attempt (elastic's restart count) -> (fit, epoch, batch) rank 1 dies after; fit 4 writes every 6 batches: after batch
# 11 of epoch 0 (its 12th batch), and after batch 9 of epoch 1 (its 54th)
KILLS = {0: (1, 0, 3), 1: (2, 2, 3), 2: (3, 0, 3), 4: (4, 1, 13)}
# (attempt, fit, epoch, batch) after which rank 0 cuts fit 4's newest file (after batch 9 of epoch 1) to its first half,
# as a copy or a full disk would: the restart resumes from the one before it (after batch 3)
TRUNCATE = (4, 4, 1, 12)
fit, histories = 0, {}  # the fit running; each fit's recorder after it


class KillRank1(LearnerCallback):
    def on_batch_end(self, train, epoch, num_batch, **kwargs):
        at = (fit, epoch, num_batch)
        if kill and KILLS.get(restart_count()) == at and ddipp.rank() == 1 and train:
            os.kill(os.getpid(), signal.SIGKILL)
        if kill and (restart_count(), *at) == TRUNCATE and ddipp.rank() == 0 and train:
            newest = Path(self.learn.path) / self.learn.model_dir / "steps.pth"
            newest.write_bytes(newest.read_bytes()[:newest.stat().st_size // 2])


if kill:
    die_writing(epoch=0, step=18, attempt=3)  # the checkpoint after batch 17 of fit 4's epoch 0
learn = digits_learner(digits_data(out / "work", bs=16, shuffle=True)).to_ddp()
for fit, (run, checkpoint) in enumerate([
        (lambda cbs: learn.fit(2, 1e-2, callbacks=cbs), ddipp.Checkpoint(learn)),
        (lambda cbs: learn.fit_one_cycle(4, 1e-2, callbacks=cbs), ddipp.Checkpoint(learn)),
        (lambda cbs: learn.fit(1, 1e-3, callbacks=cbs), ddipp.Checkpoint(learn)),
        (lambda cbs: learn.fit_one_cycle(3, 1e-2, callbacks=cbs),
         ddipp.Checkpoint(learn, "steps", keep=2, every_steps=6))],
        start=1):
    run([checkpoint, KillRank1(learn)])
    histories[fit] = history(learn)
torch.save(dict(params=params(learn), histories=histories, restarts=restart_count()), out / f"rank{ddipp.rank()}.pt")
