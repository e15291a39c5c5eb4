"""Started by tests/test_launch.py under ddipp.launch --max-restarts 2: the ranks join through ddipp and all_reduce.
Attempt 0: rank 1 then kills itself (as the kernel or a user ends a process). Attempt 1: rank 1 never joins, so rank 0's
join fails after the launch's --timeout (it prints how long it waited). Attempt 2 joins, all_reduces and ends."""
import os
import signal
import time

import torch
import torch.distributed as tdist

from ddipp.core import dist

torch.set_num_threads(1)
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], int(os.environ["RANK"])
if attempt == "1" and rank == 1:
    signal.pause()  # stuck before it joins, until the launcher stops it
start = time.monotonic()
try:
    dist.init()
finally:
    print(f"attempt {attempt}: rank {rank} waited {time.monotonic() - start:.1f} s to join", flush=True)
total = torch.tensor([rank + 1])
tdist.all_reduce(total)
print(f"attempt {attempt}: rank {rank} of {tdist.get_world_size()} sums {int(total)}", flush=True)
if attempt == "0":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    tdist.all_reduce(total)  # fails once rank 1 is gone; the launcher restarts both
