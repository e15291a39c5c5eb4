"""Launched on 2 CPU ranks by tests/core/test_dist.py: what ddipp.core.dist's helpers say on each rank."""
import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

from ddipp.core import dist  # noqa: E402

out = Path(sys.argv[1])
before_init = dict(rank=dist.rank(), world_size=dist.world_size(), device=str(dist.device()))
assert dist.init()
marker = out / "rank1-was-here"
if dist.rank() == 1:
    time.sleep(1)  # not synchronisation: gives a broken barrier the time to let rank 0 through first
    marker.write_text("1")
dist.barrier()
(out / f"rank{dist.rank()}.json").write_text(json.dumps(dict(
    before_init=before_init, rank=dist.rank(), world_size=dist.world_size(), is_rank0=dist.is_rank0(),
    device=str(dist.device()), backend=torch.distributed.get_backend(),
    marker_seen_after_barrier=marker.exists())))
