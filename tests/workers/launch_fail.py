"""Started by tests/test_launch.py under ddipp.launch: rank 1 raises once rank 0 is waiting for it, forever."""
import os
from datetime import timedelta

from torch.distributed import TCPStore

store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                 timeout=timedelta(hours=1))
waiting = f"rank 0 waits in attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}"  # the store outlives attempts
if os.environ["RANK"] == "1":
    store.wait([waiting])
    raise RuntimeError("rank 1 gives up on purpose")
print("rank 0 waits for rank 1, forever", flush=True)
store.set(waiting, "1")
store.get("a key rank 1 never sets")  # blocks: only the launcher can end this process
