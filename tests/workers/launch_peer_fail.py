"""Started by tests/test_launch.py under ddipp.launch: rank 1 raises once both ranks joined, and rank 0's collective
fails with it; each leaves the group as ddipp's fit callbacks do and lets its error end the script. With the argument
`stuck-exiting`, rank 1 never ends its exit (rank 0 ends first, and the launcher stops rank 1)."""
import atexit
import sys
import threading

import torch
import torch.distributed as tdist

from ddipp.core import dist

torch.set_num_threads(1)
dist.init()
try:
    tdist.all_reduce(torch.ones(1))  # both ranks are in the group
    if tdist.get_rank() == 1:
        if sys.argv[1:] == ["stuck-exiting"]:
            atexit.register(threading.Event().wait)  # after Python printed the traceback
        raise ValueError("rank 1 fails on purpose")
    while True:
        tdist.all_reduce(torch.ones(1))
except Exception as e:
    dist.leave_after(e)
    raise
