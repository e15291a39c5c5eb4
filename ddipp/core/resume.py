"""Resuming a launched script by itself after torch elastic restarted its group: which fit of the script a
Checkpoint's file belongs to, and what each fit of the restarted script does with it.

A Checkpoint's file names the launch (its id, agreed through the launcher's store: the same on every node and across
torch elastic's restarts), the script and the fit:
the n-th fit with a Checkpoint this process started. After a restart the script runs again from its top; its fits
before the file's are skipped (the file's fit loads the state they led to), the file's fit resumes after the epoch
the file holds, and the later fits run. In a notebook's worker group that replaced one whose worker died, only the fit
the notebook sent again is a restarted fit: the fits after it run as usual."""
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import dist as ddist

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
_fit_numbers = itertools.count(1)  # the fits with a Checkpoint this process started
_sent = None  # in a notebook's worker: the number the notebook gave the fit that runs
_first_sent = None  # in a notebook's worker: the number of the first fit it ran (a restarted group's: the one resent)


def restart_count() -> int:
    """How many times torch elastic restarted this process's group (0: the first start, or not launched)."""
    return int(os.environ.get(RESTART_ENV, 0))


def restarted() -> bool:
    """True when the fit with a Checkpoint that starts now runs after a restart: any fit of a launched script torch
    elastic restarted (the script runs again from its top); in a notebook's restarted group, its first fit only."""
    return restart_count() > 0 and (_sent is None or _sent == _first_sent)


def run_id() -> Optional[str]:
    """The launch's id, the same on every node and across its restarts (ddipp.core.dist.launch_id); None outside a
    launch."""
    return ddist.launch_id()


def next_fit() -> dict:
    """The identity of the fit with a Checkpoint that starts now: the launch, the script, its number in the script (in
    a notebook's worker, the number the notebook gave it: `fit_sent`)."""
    number = next(_fit_numbers) if _sent is None else _sent
    return dict(run_id=run_id(), script=str(Path(sys.argv[0]).resolve()), fit=number)


def fit_sent(number: int) -> None:
    """In a notebook's worker: the fit that runs now is the notebook's fit `number` on this run of groups (a group
    that replaces one whose worker died gets the same number for the fit it resumes)."""
    global _sent, _first_sent
    _sent = number
    _first_sent = number if _first_sent is None else _first_sent


@dataclass(frozen=True)
class Plan:
    """What a fit of a restarted script does: "run" it from the start (a fit after the file's), "fresh" likewise (no
    file of this launch: nothing to resume), "skip" it (a fit the run finished: the state it led to is loaded later),
    "finished" (the file's fit, which had ended: its `epoch` epochs are skipped and the state it ended with loaded), or
    "resume" after `epoch` epochs (the fit the restart cut), and `step` batches of the next when the file was written
    mid-epoch (every_steps)."""
    action: str
    epoch: int = 0
    step: int = 0


def plan(saved: Optional[dict], fit: dict, n_epochs: int, size: int, file: Path) -> Plan:
    """The Plan of the fit `fit` (next_fit, with the adapter's `lrs`: the learning rates its schedule runs at) of
    `n_epochs` epochs over a training set of `size` (the adapter's measure: batches or items), given `saved`, the
    identity a Checkpoint's file holds (None if there is none). ValueError when the file is this launch's but not this
    fit's."""
    if saved is None or saved.get("run_id") is None or saved["run_id"] != fit["run_id"]:
        return Plan("fresh")
    if saved["script"] != fit["script"]:
        raise ValueError(f"{file} was written by {saved['script']} in this launch, and {fit['script']} reads it: give "
                         "each script's Checkpoint its own name")
    if fit["fit"] < saved["fit"]:
        return Plan("skip")
    if fit["fit"] > saved["fit"]:
        return Plan("run")
    if (saved["n_epochs"], saved["size"], saved.get("lrs")) != (n_epochs, size, fit.get("lrs")):
        raise ValueError(f"{file} holds fit {fit['fit']} of this launch, {saved['n_epochs']} epochs over a training "
                         f"set of size {saved['size']} at learning rates {saved.get('lrs')}, and the restarted "
                         f"script's fit {fit['fit']} has {n_epochs} over {size} at {fit.get('lrs')}: a restarted "
                         "script must run the same fits (are its data, epochs or learning rates drawn at random?)")
    if saved["epoch"] >= n_epochs:
        return Plan("finished", saved["epoch"])
    return Plan("resume", saved["epoch"], saved.get("step", 0))


def say(plan: Plan, fit: int, file: Path, damaged: Optional[str] = None) -> Optional[str]:
    """The line a restarted script's rank 0 prints for a fit's Plan from `file` (checkpoint.restart_state's: the
    newest kept file that reads back) and `damaged` (what was wrong with the newer ones); None for a fit that simply
    runs."""
    head = f"ddipp: restart {restart_count()}: fit {fit}"
    why = f" ({damaged})" if damaged else ""
    if plan.action == "run":
        return f"{head} runs from its start: {file}, the newest file that reads back, is an earlier fit's{why}" \
            if damaged else None
    if plan.action == "skip":
        return f"{head} finished before the restart: skipped (a later fit loads what it trained)"
    if plan.action == "finished":
        return f"{head} had ended before the restart: the state it ended with loaded from {file}{why}"
    if plan.action == "resume":
        return f"{head} resumed after {progress(plan.epoch, plan.step)} from {file}{why}"
    if damaged:
        return f"{head} starts from scratch ({damaged}; no earlier kept file reads back: Checkpoint(keep=N) keeps " \
            "the N - 1 before the last)"
    return f"{head} starts from scratch (no checkpoint of this launch in {file})"


def progress(epoch: int, step: int) -> str:
    """How far a checkpoint's fit went: `epoch` epochs and `step` batches of the next, in words."""
    return f"epoch {epoch}" + (f" and {step} batches of epoch {epoch + 1}" if step else "")
