"""Launched on 2 ranks by tests/fastai2/test_bs_find.py as `bs_find_worker.py OUT`: bs_find_story.py's story under
to_ddp(), to_ddp(split_batches=True) and to_ddp(shard=True), out of memory at the start and bad sizes; saves what each
rank saw in OUT/rank{r}.pt and its output in OUT/stdout{r}.txt."""
import contextlib
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from bs_find_story import changed, learner, snapshot, story  # noqa: E402
from fit_story import N_TRAIN  # noqa: E402

OPTIONS = dict(ddp={}, split=dict(split_batches=True), shard=dict(shard=True))


def refused(learn, **sizes):
    """What bs_find(**sizes) raised, and what it changed of the learner (then a fit trains)."""
    before = snapshot(learn)
    try:
        learn.bs_find(**sizes)
    except Exception as error:
        res = (type(error).__name__, str(error), changed(before, snapshot(learn)))
    learn.fit(1, 1e-2)
    return res


out, rank = Path(sys.argv[1]), ddipp.rank()
(out / "work").mkdir(exist_ok=True)
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {name: story(lambda learn: learn.to_ddp(**options), out / "work") for name, options in OPTIONS.items()}
    res["start_fails"] = refused(learner(out / "work", ceilings=(40, 20)).to_ddp(), start=32)  # its batch is 16
    res["share"] = refused(learner(out / "work").to_ddp(), max_bs=N_TRAIN // 2 + 1)
    res["split_one_item"] = refused(learner(out / "work").to_ddp(split_batches=True), start=3)
torch.save(res, out / f"rank{rank}.pt")
