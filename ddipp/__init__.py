"""ddipp: train a fastai Learner (v1 or v2) with DistributedDataParallel on every GPU of a host.

`ddipp.core` is written once and never imports fastai; `ddipp.fastai1` and `ddipp.fastai2` adapt it to each fastai
major version. Importing ddipp picks the adapter of the installed fastai; the public names are the same in both.
"""
import sys
from importlib.metadata import version

__version__ = version("ddipp")  # one number: pyproject.toml's, read from the installed package's metadata

# `python -m ddipp.launch` imports this package first (sys.argv[0] is "-m" while Python locates the
# module): the launcher needs neither fastai nor its fixes, so it starts in a second, not in ten.
if sys.argv[:1] != ["-m"]:
    FASTAI_MAJOR = int(version("fastai").split(".")[0])
    from .core.group import forkserver
    if forkserver.in_a_kernel():  # to_ddp's workers are forked from a process that imported what they need
        forkserver.start(forkserver.worker_modules(f"ddipp.fastai{FASTAI_MAJOR}.notebook.fitting"))
    from .core.collectives import all_gather, reduce_sum
    from .core.dist import barrier, device, is_rank0, rank, world_size
    from .core.group.group import shutdown

    if FASTAI_MAJOR == 1:
        from .fastai1 import (Checkpoint, DistributedCallback, GCCallback, GlobalBatchLoss, LRFinderBypassCallback,
                              Recompute, SumMetric, Throughput, from_ddp, to_ddp)
    else:
        from .fastai2 import (Checkpoint, DistributedCallback, GCCallback, GlobalBatchLoss, LRFinderBypassCallback,
                              Recompute, SumMetric, Throughput, from_ddp, to_ddp)

__all__ = ["__version__", "rank", "world_size", "is_rank0", "device", "barrier", "to_ddp", "from_ddp", "shutdown",
           "DistributedCallback", "LRFinderBypassCallback", "GCCallback",
           "all_gather", "reduce_sum", "GlobalBatchLoss", "SumMetric", "Checkpoint", "Throughput", "Recompute"]
