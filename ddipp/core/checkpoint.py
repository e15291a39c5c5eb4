"""What both adapters' Checkpoint callbacks do alike: write a state keeping the files before it if asked, read back the
state rank 0 wrote (checked against the fit's `start_epoch`; after a restart, the newest kept file that reads back;
after a notebook's fit failed, the file of that fit), and go on from a batch in the middle of an epoch."""
import os
import re
import zipfile
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

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


@dataclass
class Saved:
    """What every Checkpoint file holds, whatever the fastai: the whole model and optimizer state (`state`, as
    ddipp.core.state.full_state gives it), the epochs and batches trained (`epoch`, `step`), every rank's generators,
    ddipp's shuffle seed (None in one process), the fit's identity (ddipp.core.resume.next_fit's, with its learning
    rates), its epochs and training set size; and `fastai`, the adapter's own part (its recorder, with a loss a step,
    and what its fastai needs to go on), whose keys are the file's too."""
    state: Optional[dict]
    epoch: int
    step: int
    rngs: list
    shuffle_seed: Optional[int]
    identity: dict
    n_epochs: int
    size: int
    fastai: dict


def save_checkpoint(saved: Saved, path: Path, keep: int) -> None:
    """Every rank calls it after reading the state (a collective); rank 0 writes `saved` into `path` (write_checkpoint),
    the others nothing."""
    if ddist.is_rank0():
        write_checkpoint(dict(saved.state, epoch=saved.epoch, step=saved.step, rngs=saved.rngs,
                              shuffle_seed=saved.shuffle_seed, **saved.identity, n_epochs=saved.n_epochs,
                              size=saved.size, **saved.fastai), path, keep)


class DamagedCheckpoint(ValueError):
    """A checkpoint file that does not read back as one: the message names the file and what is wrong with it."""


def load_checkpoint(path: Path) -> dict:
    """The state ddipp wrote at `path`, read weights-only (tensors, numbers and lists: it runs no code), or
    DamagedCheckpoint naming the file and what is wrong with it (empty, truncated, not a checkpoint ddipp wrote)."""
    size = path.stat().st_size
    if size == 0:
        raise DamagedCheckpoint(f"{path} is empty (0 bytes)")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; its directory is at the end
        with open(path, "rb") as f:
            truncated = f.read(4) == b"PK\x03\x04"
        raise DamagedCheckpoint(f"{path} is truncated: a zip archive of {size} bytes without its end" if truncated
                                else f"{path} is not a checkpoint: {size} bytes that are not the zip archive "
                                     "torch.save writes")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DamagedCheckpoint(f"{path} is not a checkpoint ddipp wrote: {_unreadable(e)}") from None
    if not isinstance(state, dict) or not {"model", "opt", "epoch"} <= state.keys():
        raise DamagedCheckpoint(f"{path} is not a checkpoint ddipp wrote: a {type(state).__name__} without the "
                                "model, opt and epoch a Checkpoint writes (learn.save's files load with learn.load)")
    return state


def _unreadable(error: Exception) -> str:
    """Why torch could not read a file weights-only, in words that never suggest reading it otherwise."""
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if refused:
        return (f"it holds {refused[1]}, which a weights-only load refuses (ddipp writes tensors, numbers and lists, "
                "and reads nothing that could run code)")
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return "its content is damaged" + (f" ({detail})" if detail and "weights_only" not in str(error) else "")


def restart_state(path: Path, keep: int) -> Tuple[Optional[dict], Path, Optional[str]]:
    """After a restart: the state of the newest of `path` and the `keep` - 1 files kept before it that reads back,
    the file it is from, and what was wrong with the newer ones (None when `path` read back); (None, `path`, None)
    when there is no file, (None, `path`, what was wrong) when none reads back."""
    damaged: List[str] = []
    for k in range(keep):
        if not previous(path, k).exists():
            break
        try:
            return load_checkpoint(previous(path, k)), previous(path, k), "; ".join(damaged) or None
        except DamagedCheckpoint as e:
            damaged.append(str(e))
    return None, path, "; ".join(damaged) or None


def fit_checkpoint(path: Path, keep: int, fit: dict, after_steps: int) -> Optional[Tuple[dict, Path]]:
    """After a notebook's fit failed: the state of the newest of `path` and the files kept before it that reads back,
    and its file, if it holds the fit `fit` (next_fit's run_id and fit number) past `after_steps` training steps."""
    state, file, _ = restart_state(path, keep)
    if state is None or (state.get("run_id"), state.get("fit")) != (fit["run_id"], fit["fit"]):
        return None
    return (state, file) if steps(state) > after_steps else None


def steps(state: dict) -> int:
    """The training steps of its fit that a Checkpoint's state holds (its recorder's losses: one a step)."""
    return len(state.get("recorder", {}).get("losses", []))


def read_checkpoint(path: Path, start_epoch: int) -> dict:
    """The state at `path` once rank 0's last write is complete on every rank; FileNotFoundError, DamagedCheckpoint or
    ValueError saying what to pass when there is none, it does not read back, or it holds another epoch's."""
    ddist.barrier()
    if not path.exists():
        raise FileNotFoundError(f"start_epoch={start_epoch}: no checkpoint at {path}; fit from the start "
                                "(no start_epoch) or give Checkpoint the name the interrupted fit used")
    try:
        state = load_checkpoint(path)
    except DamagedCheckpoint as e:
        raise DamagedCheckpoint(f"start_epoch={start_epoch}: {e}; put an earlier kept file ({previous(path, 1).name}, "
                                "with Checkpoint(keep=2) or more) in its place, or fit from the start (no start_epoch)"
                                ) from None
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
