"""What a worker of the notebook's group needs from the adapter of the installed fastai: its notebook fitting module,
named by the adapter when it binds a learner (`binding.bind(..., fitting=...)`) and imported by the worker."""
import importlib
from typing import Any, Callable, List, Optional, Protocol, Tuple

import torch

from ..options import Options
from .wire import HeldTensors


class Fitting(Protocol):
    """An adapter's notebook fitting module (ddipp.fastai1.notebook.fitting, ddipp.fastai2.notebook.fitting)."""

    def place_data(self, data: Any, device: torch.device) -> Any:
        """Make the data the notebook sent deliver its batches on `device`; the data."""

    def run_fit(self, data: Any, call: bytes, options: Options, device: torch.device,
                send: Optional[Callable[[tuple], None]], held: HeldTensors) -> Tuple[Optional[List[bytes]], List[str]]:
        """Run the fit `call` on `data` with ddipp's callbacks (`options`: its Strategy's too), taking the tensors it
        names from `held`; rank 0 (given `send`) relays progress and returns the results; every rank returns the
        digests of the tensors it keeps in `held` for the next fit, its own (a sharding strategy keeps a different part
        on each rank): its next `call` names only those."""


def load_fitting(name: str) -> Fitting:
    """The fitting module `name`; TypeError naming the functions of `Fitting` it lacks."""
    module = importlib.import_module(name)
    missing = [attr for attr in ("place_data", "run_fit") if not callable(getattr(module, attr, None))]
    if missing:
        raise TypeError(f"ddipp: the fitting module {name} an adapter bound with lacks {', '.join(missing)}; bind "
                        f"with a module that has both functions of ddipp.core.group.adapter.Fitting")
    return module
