"""Launched on 2 ranks by tests/fastai{1,2}/test_recompute.py as `recompute_worker.py OUT`: the recompute_story.py of
the installed fastai (tests/fastai{N}/workers, on the import path) with batch 16 a rank under to_ddp(),
to_ddp(sync_bn=True) and to_ddp(shard=True); saves what each rank saw in OUT/rank{r}.pt."""
import contextlib
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from recompute_story import recompute_story  # noqa: E402

OPTIONS = dict(ddp={}, sync_bn=dict(sync_bn=True), shard=dict(shard=True))

out, rank = Path(sys.argv[1]), ddipp.rank()
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = {name: recompute_story(lambda learn: learn.to_ddp(**options), out / "work", 16)
           for name, options in OPTIONS.items()}
torch.save(res, out / f"rank{rank}.pt")
