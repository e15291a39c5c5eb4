"""The fastai v2 (2.8.x) adapter: the callbacks and Learner.to_ddp / from_ddp in fastai v2's idioms (launched mode)."""
from ..core import dist as ddist
from . import batch_size  # noqa: F401 (adds Learner.bs_find)
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback
from .checkpoint import Checkpoint
from .learner import from_ddp, to_ddp  # also adds Learner.to_ddp / Learner.from_ddp
from .losses import GlobalBatchLoss
from .metrics import SumMetric
from .recompute import Recompute
from .throughput import Throughput

if ddist.launched():
    ddist.bind_device()  # fastai's default_device() is torch's current CUDA device: this rank's

__all__ = ["Checkpoint", "DistributedCallback", "GCCallback", "GlobalBatchLoss", "LRFinderBypassCallback", "Recompute",
           "SumMetric",
           "Throughput", "from_ddp", "to_ddp"]
