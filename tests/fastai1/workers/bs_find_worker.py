"""Launched on 2 ranks by tests/fastai1/test_bs_find.py as `bs_find_worker.py OUT`: bs_find_story.py under to_ddp(),
to_ddp(split_batches=True) and to_ddp(shard=True), a split start too small for BatchNorm (2: 1 item a rank), a start
that one rank's ceiling refuses and a fit after it; saves what each rank saw in OUT/rank{r}.pt."""
import contextlib
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from bs_find_story import bs_find_story, ceiling_learner  # noqa: E402

OPTIONS = dict(ddp={}, split=dict(split_batches=True), shard=dict(shard=True))

out, rank = Path(sys.argv[1]), ddipp.rank()
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {name: bs_find_story(lambda learn: learn.to_ddp(**options), out / name)
           for name, options in OPTIONS.items()}
    try:
        ceiling_learner(out / "split_start").to_ddp(split_batches=True).bs_find(start=2)
    except ValueError as e:
        res["split_start_refused"] = str(e)
    learn = ceiling_learner(out / "start").to_ddp()
    try:
        learn.bs_find(start=250)  # rank 0 fits 300 items, rank 1 200
    except torch.OutOfMemoryError as e:
        res["start_refused"] = str(e)
    learn.fit(1, 1e-2)  # the group goes on
    res["fit_after_refusal"] = [p.detach().clone() for p in learn.model.parameters()]
torch.save(res, out / f"rank{rank}.pt")
