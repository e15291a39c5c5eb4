"""Launched on N ranks by tests/fastai{1,2}/test_split_batches.py as `split_worker.py OUT BS [shard]`: plays the
split_story.py of the installed fastai (tests/fastai{N}/workers, on the import path) with its setting of batch size BS
under to_ddp(split_batches=True) (and shard=True, given `shard`: test_shard.py) and saves what each rank saw in
OUT/rank{r}.pt."""
import contextlib
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from split_story import SETTINGS, split_story  # noqa: E402

out, settings = Path(sys.argv[1]), [s for s in SETTINGS if s[0] == int(sys.argv[2])]
shard = sys.argv[3:] == ["shard"]
rank = ddipp.rank()
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = split_story(lambda learn, **options: learn.to_ddp(split_batches=True, shard=shard, **options), out / "work",
                      settings)
torch.save(res, out / f"rank{rank}.pt")
