"""Started by tests/core/test_dist.py under ddipp.launch: rank 1 fails and leaves (and ends without a word, as a rank
stopped before its traceback is printed); rank 0's collective fails with it. Each writes OUT/rank{r}.json."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from ddipp.core import dist

dist.init()
out, rank = Path(sys.argv[1]), tdist.get_rank()
try:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    while True:
        tdist.all_reduce(torch.ones(1))
except Exception as e:
    dist.leave_after(e)
    result = dict(peer_failure=dist.peer_failure(e), notes=getattr(e, "__notes__", []),
                  world_size_after=dist.world_size(), initialized_after=tdist.is_initialized())
(out / f"rank{rank}.json").write_text(json.dumps(result))
