"""The fastai v2 (2.8.x) adapter: the callbacks and Learner.to_ddp / from_ddp in fastai v2's idioms (launched mode)."""
from fastai.torch_core import defaults

from ..core import dist as ddist
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback
from .learner import from_ddp, to_ddp  # also adds Learner.to_ddp / Learner.from_ddp

if ddist.launched():
    defaults.device = ddist.bind_device()  # data and models built next land on this rank's device

__all__ = ["DistributedCallback", "GCCallback", "LRFinderBypassCallback", "from_ddp", "to_ddp"]
