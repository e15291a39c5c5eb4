"""Launched by tests/test_dist.py under torch's elastic launcher: records what the helpers say on each rank."""
import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddipp  # noqa: E402
from ddipp.core import dist  # noqa: E402
from fastai.torch_core import defaults  # noqa: E402

out = Path(sys.argv[1])
before_init = dict(rank=ddipp.rank(), world_size=ddipp.world_size(), device=str(ddipp.device()))
assert dist.init()
marker = out / "rank1-was-here"
if ddipp.rank() == 1:
    time.sleep(1)  # not synchronisation: gives a broken barrier the time to let rank 0 through first
    marker.write_text("1")
ddipp.barrier()
(out / f"rank{ddipp.rank()}.json").write_text(json.dumps(dict(
    before_init=before_init, rank=ddipp.rank(), world_size=ddipp.world_size(), is_rank0=ddipp.is_rank0(),
    device=str(ddipp.device()), fastai_device=str(defaults.device), backend=torch.distributed.get_backend(),
    marker_seen_after_barrier=marker.exists())))
