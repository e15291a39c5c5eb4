"""What both adapters' Checkpoint callbacks do alike: write a state keeping the files before it if asked, read back the
state rank 0 wrote, checked against the fit's `start_epoch`."""
import os
from pathlib import Path

import torch

from . import dist as ddist
from .files import save_atomic


def check_keep(keep: int) -> int:
    """`keep` of a Checkpoint, or ValueError naming it and what to give."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"Checkpoint(keep={keep!r}): keep is how many checkpoint files stay, a whole number >= 1 "
                         "(1, the default: the last only)")
    return keep


def previous(path: Path, k: int) -> Path:
    """The file of the k-th checkpoint before the last (`name.k.pth`); k=0 is `path` itself."""
    return path if k == 0 else path.with_name(f"{path.stem}.{k}{path.suffix}")


def write_checkpoint(state: dict, path: Path, keep: int) -> None:
    """`state` into `path` atomically; with `keep` > 1 the `keep` - 1 before it stay as name.1.pth (the newest), ...
    `path` exists throughout: the last is hard-linked as name.1.pth before the new one replaces it."""
    for k in range(keep - 1, 1, -1):
        if previous(path, k - 1).exists():
            os.replace(previous(path, k - 1), previous(path, k))
    if keep > 1 and path.exists():
        link = path.with_name(f".{path.name}.link")
        link.unlink(missing_ok=True)
        os.link(path, link)
        os.replace(link, previous(path, 1))
    save_atomic(state, path)


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
