"""Launched on 2 ranks by tests/fastai2/test_apps.py: plays apps.py's applications with half the global batch a rank
(`python -m ddipp.launch --nproc 2 apps_worker.py OUT DIGITS`); rank r writes what it saw to OUT/rank{r}.json and its
stdout (the bars, on rank 0) to OUT/stdout{r}.txt."""
import contextlib
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
import apps  # noqa: E402

out, digits = Path(sys.argv[1]), Path(sys.argv[2])
rank = ddipp.rank()
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    res = apps.play(out, ddipp.world_size(), digits)
(out / f"rank{rank}.json").write_text(json.dumps(res))
