"""Started by tests/test_launch.py under ddipp.launch: records what the launcher gave this rank, joins the group."""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
out, args = Path(sys.argv[1]), sys.argv[2:]
seen = {name: os.environ.get(name) for name in
        ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DDIPP_DEVICES", "OMP_NUM_THREADS", "MASTER_PORT")}
seen["args"] = args
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)
seen["sum_of_ranks_plus_one"] = int(total)
dist.destroy_process_group()
print(f"stdout of rank {seen['RANK']}: {json.dumps(seen)}")
print(f"stderr of rank {seen['RANK']}", file=sys.stderr)
(out / f"rank{seen['RANK']}.json").write_text(json.dumps(seen))
