"""Launched on 2 ranks by tests/test_apps.py: trains every application with half the global batch per rank."""
import contextlib
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
import apps  # noqa: E402
from digits import digits_folder  # noqa: E402

out = Path(sys.argv[1])
rank, world = ddipp.rank(), ddipp.world_size()
res = {}
with open(out / f"stdout{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
    for name, run in apps.RUNS.items():
        path = digits_folder(out / "digits") if name == "vision" else out / apps.FOLDERS.get(name, name)
        res[name] = run(path, apps.GLOBAL_BS[name] // world)
(out / f"rank{rank}.json").write_text(json.dumps(res))
