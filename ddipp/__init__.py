"""ddipp: train a fastai v1 Learner with DistributedDataParallel on every GPU of a host."""
import sys

# `python -m ddipp.launch` imports this package first (sys.argv[0] is "-m" while Python locates the
# module): the launcher needs neither fastai nor its fixes, so it starts in a second, not in ten.
if sys.argv[:1] != ["-m"]:
    from . import compat

    compat.apply()

    from . import dist
    from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback
    from .checkpoint import Checkpoint
    from .collectives import all_gather, reduce_sum
    from .dist import barrier, device, is_rank0, rank, world_size
    from .interactive.group import shutdown
    from .learner import from_ddp, to_ddp  # also adds Learner.to_ddp / Learner.from_ddp
    from .losses import GlobalBatchLoss
    from .metrics import SumMetric
    from .throughput import Throughput

    if dist.launched():
        dist.bind_device()

__all__ = ["rank", "world_size", "is_rank0", "device", "barrier", "to_ddp", "from_ddp", "shutdown",
           "DistributedCallback", "LRFinderBypassCallback", "GCCallback",
           "all_gather", "reduce_sum", "GlobalBatchLoss", "SumMetric", "Checkpoint", "Throughput"]
