"""Launched on 2 ranks by tests/fastai1/test_shard.py as `shard_worker.py OUT`: plays shard_story.py with batch 16 a
rank under to_ddp(shard=True) and saves what each rank saw in OUT/rank{r}.pt."""
import contextlib
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from shard_story import shard_story  # noqa: E402

out, rank = Path(sys.argv[1]), ddipp.rank()
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = shard_story(lambda learn, **options: ddipp.to_ddp(learn, shard=True, **options), out / "work", 16)
torch.save(res, out / f"rank{rank}.pt")
