"""Launched on 2 CPU ranks by tests/core/test_batch_size.py: ddipp.core.batch_size's search when the ranks' ceilings
differ (a trial raises out of memory above its rank's ceiling), what each rank saw and what the group agreed."""
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from ddipp.core import dist  # noqa: E402
from ddipp.core.batch_size import CPU_OOM, CUDA_OOM, find_batch_size  # noqa: E402
from batch_size_story import CEILINGS, ceiling_trial  # noqa: E402

out = Path(sys.argv[1])
assert dist.init()
rank, seen = dist.rank(), {}


def run(name, trial, start=2, max_bs=1000):
    """The search's outcome (found, trials) or the error it raised, under `name`."""
    try:
        seen[name] = find_batch_size(trial, start, max_bs)
    except Exception as error:
        seen[name] = (type(error).__name__, str(error))


local = []  # this rank's own verdicts, before the group's
run("ceilings", ceiling_trial(CEILINGS[rank], local))
seen["local"] = local
run("start_fails", ceiling_trial((400, 1)[rank], []))
run("runtime_texts", ceiling_trial((300, 100)[rank], [], RuntimeError((f"{CPU_OOM}: 4 GB", f"{CUDA_OOM}.")[rank])))
run("other_error", ceiling_trial((400, 7)[rank], [], ValueError("not a memory error")))
run("after_error", ceiling_trial(CEILINGS[rank], []))  # the group still agrees after a trial failed otherwise
torch.save(seen, out / f"rank{rank}.pt")
