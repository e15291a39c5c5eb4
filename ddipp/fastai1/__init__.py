"""The fastai v1 (1.0.61) adapter: fastai's fixes for the pinned stack, the callbacks, Learner.to_ddp, notebook mode."""
from . import compat

compat.apply()

from fastai.torch_core import defaults  # noqa: E402 (after compat.apply: fastai imports quietly)

from ..core import dist as ddist  # noqa: E402
from . import batch_size  # noqa: E402,F401 (adds Learner.bs_find)
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback  # noqa: E402
from .checkpoint import Checkpoint  # noqa: E402
from .learner import from_ddp, to_ddp  # noqa: E402 (also adds Learner.to_ddp / Learner.from_ddp)
from .losses import GlobalBatchLoss  # noqa: E402
from .metrics import SumMetric  # noqa: E402
from .recompute import Recompute  # noqa: E402
from .throughput import Throughput  # noqa: E402

if ddist.launched():
    defaults.device = ddist.bind_device()  # data and models built next land on this rank's device

__all__ = ["Checkpoint", "DistributedCallback", "GCCallback", "GlobalBatchLoss", "LRFinderBypassCallback", "Recompute",
           "SumMetric",
           "Throughput", "from_ddp", "to_ddp"]
