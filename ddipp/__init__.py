"""ddipp: train a fastai v1 Learner with DistributedDataParallel on every GPU of a host."""
from . import compat

compat.apply()

from . import dist  # noqa: E402
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback  # noqa: E402
from .dist import barrier, device, is_rank0, rank, world_size  # noqa: E402
from .learner import from_ddp, to_ddp  # noqa: E402  (also adds Learner.to_ddp / Learner.from_ddp)

if dist.launched():
    dist.bind_device()

__all__ = ["rank", "world_size", "is_rank0", "device", "barrier", "to_ddp", "from_ddp",
           "DistributedCallback", "LRFinderBypassCallback", "GCCallback"]
