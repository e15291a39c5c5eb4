"""Started by tests/test_launch.py under ddipp.launch: the script makes its own gloo group, joins through ddipp (as
to_ddp() does, finding it), all-reduces, and rank 0 writes the sum to OUT; the group is left to the interpreter's exit.
The last of the exit's handlers writes to OUT.rankN whether the group was left by then."""
import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

out = Path(sys.argv[1])
exited = out.with_name(f"{out.name}.rank{os.environ['RANK']}")
atexit.register(lambda: exited.write_text("in the group" if tdist.is_initialized() else "left"))  # runs last

from ddipp.core import dist  # noqa: E402 (after the handler above, so that it runs after ddipp's)

torch.set_num_threads(1)
tdist.init_process_group("gloo")
dist.init()
total = torch.tensor([tdist.get_rank() + 1])
tdist.all_reduce(total)
if tdist.get_rank() == 0:
    out.write_text(str(int(total)))
