"""fastai v2 callbacks (being written)."""
from fastai.callback.core import Callback


class DistributedCallback(Callback):
    """Placeholder while the adapter is written."""


class LRFinderBypassCallback(Callback):
    """Placeholder while the adapter is written."""


class GCCallback(Callback):
    """Placeholder while the adapter is written."""
