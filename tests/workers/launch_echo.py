"""Started by tests/test_launch.py under ddipp.launch: records what the launcher gave this rank, joins the group, and
keeps it while OUT/hold exists (the test looks at the running group, then removes that file)."""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
out, args = Path(sys.argv[1]), sys.argv[2:]
seen = {name: os.environ.get(name) for name in
        ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DDIPP_DEVICES", "DDIPP_TIMEOUT", "OMP_NUM_THREADS", "MASTER_ADDR",
         "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
seen["args"] = args
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)
seen["sum_of_ranks_plus_one"] = int(total)
print(f"stdout of rank {seen['RANK']}: {json.dumps(seen)}")
print(f"stderr of rank {seen['RANK']}", file=sys.stderr)
partial = out / f".rank{seen['RANK']}.json"
partial.write_text(json.dumps(seen))
partial.replace(out / f"rank{seen['RANK']}.json")  # whole once it is there
while (out / "hold").exists():
    time.sleep(0.05)
dist.destroy_process_group()
