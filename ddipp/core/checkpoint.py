"""What both adapters' Checkpoint callbacks do alike: write a state keeping the files before it if asked, read back the
state rank 0 wrote, checked against the fit's `start_epoch`, and go on from a batch in the middle of an epoch."""
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from . import dist as ddist
from .files import save_atomic
from .resume import progress
from .sharding import LoaderView


def check_keep(keep: int) -> int:
    """`keep` of a Checkpoint, or ValueError naming it and what to give."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"Checkpoint(keep={keep!r}): keep is how many checkpoint files stay, a whole number >= 1 "
                         "(1, the default: the last only)")
    return keep


def check_every_steps(every_steps: Optional[int]) -> Optional[int]:
    """`every_steps` of a Checkpoint, or ValueError naming it and what to give."""
    if every_steps is not None and (isinstance(every_steps, bool) or not isinstance(every_steps, int)
                                    or every_steps < 1):
        raise ValueError(f"Checkpoint(every_steps={every_steps!r}): every_steps is how many training batches go "
                         "between two checkpoints in an epoch, a whole number >= 1, or None (the default: after each "
                         "epoch only)")
    return every_steps


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
        raise ValueError(f"start_epoch={start_epoch}, but {path} holds the state after "
                         f"{progress(state['epoch'], state.get('step', 0))}; pass start_epoch={state['epoch']}")
    return state


class FromBatch(LoaderView):
    """The loader `dl` from its batch `start` on, for the epoch a mid-epoch checkpoint resumes: the batches before it
    are read and dropped (the loader's order, workers and augmentation draws go as they went), then `at_start()` runs
    (it puts back the generators of that moment), then the rest is yielded. Its length and attributes are `dl`'s."""

    def __init__(self, dl, start: int, at_start: Callable[[], None]):
        super().__init__(dl)
        self.start, self.at_start = start, at_start

    def __iter__(self):
        batches = iter(self.dl)
        for _ in range(self.start):
            next(batches)
        self.at_start()
        yield from batches
