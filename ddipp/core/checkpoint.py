"""What both adapters' Checkpoint callbacks do alike: read back the state rank 0 wrote, checked against the fit's
`start_epoch`."""
from pathlib import Path

import torch

from . import dist as ddist


def read_checkpoint(path: Path, start_epoch: int) -> dict:
    """The state at `path` once rank 0's last write is complete on every rank; FileNotFoundError or ValueError saying
    what to pass when there is none, or it holds another epoch's."""
    ddist.barrier()
    if not path.exists():
        raise FileNotFoundError(f"start_epoch={start_epoch}: no checkpoint at {path}; fit from the start "
                                "(no start_epoch) or give Checkpoint the name the interrupted fit used")
    state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and lists only: runs no code
    if state["epoch"] != start_epoch:
        raise ValueError(f"start_epoch={start_epoch}, but {path} holds the state after {state['epoch']} epochs; "
                         f"pass start_epoch={state['epoch']}")
    return state
