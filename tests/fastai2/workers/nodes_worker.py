"""Launched as 2 nodes of one rank each, or on one node, with --max-restarts 5 by tests/fastai2/test_checkpoint.py: a
3-epoch one-cycle fit checkpointed every 6 batches too. With `kill`, rank 0 (node 0's) kills itself (SIGKILL) in the
first attempt while it writes the checkpoint of batch 15 of epoch 1 (its temporary file half written), and torch
elastic restarts the ranks of both nodes. Saves each rank's weights, recorder and restart count in OUT/rank{r}.pt."""
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from ddipp.core.resume import restart_count  # noqa: E402
from dying_write import die_writing  # noqa: E402
from fit_story import digits_dls, digits_learner, history, params  # noqa: E402

out, kill = Path(sys.argv[1]), sys.argv[2] == "kill"
if kill:
    die_writing(epoch=1, step=16, attempt=0)
learn = digits_learner(digits_dls(bs=16, shuffle=True), out / "work").to_ddp()
learn.fit_one_cycle(3, 1e-2, cbs=ddipp.Checkpoint(every_steps=6))
torch.save(dict(params=params(learn), history=history(learn), restarts=restart_count()), out / f"rank{ddipp.rank()}.pt")
