"""Checkpoint: a fit that can be resumed where it stopped, with the same result as if it had not stopped."""
import copy
import random
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.learner import SkipToEpoch
from fastcore.foundation import L

from ..core import dist as ddist
from ..core import resume
from ..core.checkpoint import (FromBatch, Saved, check_every_steps, check_keep, fit_checkpoint, read_checkpoint,
                               restart_state, save_checkpoint)
from ..core.rng import every_rank, rng_state, set_rng_state, this_rank
from ..core.state import full_state, load_full_state
from .callbacks import distributed_fit, imported
from .state import optimizer


class Checkpoint(Callback):
    """After every epoch (and every `every_steps` training batches) rank 0 writes `{path}/{model_dir}/{name}.pth`
    atomically; a fit with `start_epoch` reads it.

    The file holds the model, the optimizer state, the epoch (and batch) reached, the training iteration and smoothed
    loss, the recorder, every rank's random generator states (the training loader's own included) and ddipp's shuffle
    seed. Resume with fastai's own argument: `learn.fit_one_cycle(4, lr, start_epoch=2)` skips epochs 0 and 1
    (fastai's SkipToEpoch), loads the state written after those 2 epochs as epoch 2 begins (or after batch k of epoch 2:
    it goes on at batch k, the batches before it read and dropped), and runs the rest of the same schedule. In a
    launched script that torch elastic restarted (`--max-restarts`), each fit resumes by itself (ddipp.core.resume):
    the fits the run finished are skipped, the one the restart cut resumes where its file left it."""
    order = SkipToEpoch.order + 1  # its before_epoch runs only for the epochs SkipToEpoch lets run
    run_valid = False  # its batch events are the training's: fastai then asks it for none while validating

    def __init__(self, name: str = "checkpoint", keep: int = 1, every_steps: int = None):
        self.file_name, self.keep = f"{name}.pth", check_keep(keep)  # keep: the files that stay (name.1.pth, ...)
        self.every_steps = check_every_steps(every_steps)
        self.skipping = None  # the SkipToEpoch a restarted fit added, until its end
        self.from_batch, self.from_pct, self.start_rngs, self.step_rngs = 0, None, None, None  # a mid-epoch file's

    @property
    def file(self) -> Path:
        return self.file_of(self.learn)

    def file_of(self, learn) -> Path:
        return Path(learn.path) / learn.model_dir / self.file_name

    def before_fit(self):
        # not in validate() and get_preds() (they run before_fit too, under fastai's no_mbar), nor in lr_find's sweep
        self.run = self.learn.create_mbar and not hasattr(self.learn, "lr_finder")
        self.after_fit()  # a SkipToEpoch a fit that raised left
        self.resuming = any(isinstance(cb, SkipToEpoch) for cb in self.learn.cbs)  # fit(..., start_epoch=k), k > 0
        self.epoch_ran, self.saved, self.due, self.from_batch = False, None, False, 0
        self.identity = dict(resume.next_fit(), lrs=_lrs(self.learn)) if self.run else None
        if self.run and self.every_steps and self.learn.recorder.train_metrics:
            raise ValueError(f"Checkpoint(every_steps={self.every_steps}) cannot resume the training metrics of "
                             "Recorder(train_metrics=True) in the middle of an epoch: drop every_steps, or "
                             "train_metrics")
        if self.run and not self.resuming and resume.restarted():
            self._resume_by_itself()

    def _resume_by_itself(self):
        """After an elastic restart: skip this fit, resume it after the epochs its file holds, or run it (Plan), from
        the newest kept file that reads back."""
        self.saved, file, damaged = restart_state(self.file, self.keep)
        plan = resume.plan(self.saved, self.identity, self.learn.n_epoch, len(self.learn.dls.train), file)
        line = resume.say(plan, self.identity["fit"], file, damaged)
        if line and ddist.is_rank0():
            print(line, flush=True)
        if plan.action == "skip":
            raise CancelFitException()
        if plan.action == "finished":  # its end state, no epoch to run; the epoch it ended in, as its fit left it
            self._load(self.saved)
            self.learn.epoch = self.learn.n_epoch - 1
            raise CancelFitException()
        if plan.action == "resume":
            self.skipping = SkipToEpoch(plan.epoch)
            self.learn.add_cb(self.skipping)
            self.resuming = True

    def before_epoch(self):
        self.epoch_ran = True
        if self.resuming:
            self.resuming = False
            self._load(self.saved)

    def before_train(self):
        if self.from_batch:  # a mid-epoch file's epoch starts as it started; its batches before the file's are dropped
            self._set_rngs(self.start_rngs)
            self.learn.pct_train = self.from_pct
            self.learn.dl = FromBatch(self.learn.dl, self.from_batch, lambda: self._set_rngs(self.step_rngs))
        self.epoch_rngs = [rng_state(), _loader_rng(self.learn)]  # what a file written in this epoch starts it with

    def _set_rngs(self, rngs) -> None:
        """This rank's generators and the training loader's as `rngs` ([rng_state(), _loader_rng()]) has them."""
        if rngs is not None:
            set_rng_state(rngs[0])
            _set_loader_rng(self.learn, rngs[1])

    def before_batch(self):
        if self.from_batch:  # fastai calls it for training batches only (run_valid)
            self.learn.iter += self.from_batch  # fastai counts from 0 in the batches FromBatch yields

    def after_batch(self):
        if not self.every_steps:  # fastai calls it for training batches only (run_valid)
            return
        self.due = self.due or self.learn.train_iter % self.every_steps == 0
        if self.due and self.iter + 1 < self.n_iter and not _accumulating(self.learn):  # the epoch's end writes anyway
            self._write(self.epoch, self.iter + 1)

    def after_train(self):
        self.from_batch, self.step_rngs = 0, None

    def after_fit(self):
        if self.skipping is not None:
            self.learn.remove_cb(self.skipping)
            self.skipping = None

    def after_epoch(self):
        if not self.epoch_ran:  # skipped by SkipToEpoch: the model is not that of this epoch's end
            return
        self._write(self.epoch + 1, 0)

    def _write(self, epoch: int, step: int) -> None:
        """The state after `epoch` epochs and `step` batches of the next (with that epoch's starting generators)."""
        self.due = False
        # collectives: every rank takes part (its generators, the state the strategy reads), rank 0 writes
        rngs = every_rank([rng_state(), _loader_rng(self.learn), self.epoch_rngs if step else None])
        fit = distributed_fit(self.learn)
        state = full_state(self.learn.model, optimizer(self.learn), fit.strategy if fit else None)
        save_checkpoint(Saved(_plain(state), epoch, step, rngs, fit.shuffle_seed if fit else None, self.identity,
                              self.learn.n_epoch, len(self.learn.dls.train), fastai=self._fastai_state()),
                        self.file, self.keep)

    def _fastai_state(self) -> dict:
        """What fastai v2 needs besides the model and optimizer to go on: the training iteration and its place in the
        fit (pct_train), the smoothed loss, the recorder's lists."""
        learn, recorder = self.learn, self.learn.recorder
        return _plain(dict(train_iter=learn.train_iter, pct_train=learn.pct_train,
                           smooth_loss=[recorder.smooth_loss.count, recorder.smooth_loss.val],
                           recorder=dict(values=recorder.values, losses=recorder.losses, lrs=recorder.lrs,
                                         iters=recorder.iters)))

    def _load(self, state=None):
        """The state the file holds (or `state`, read already) into the learner, its optimizer, generators, recorder."""
        state = read_checkpoint(self.file, self.epoch) if state is None else state
        _put_trained(self.learn, state)
        rngs = this_rank(state["rngs"], self.file)
        if state.get("step"):  # written mid-epoch: the epoch starts as it started, and goes on at its batch `step`
            self.from_batch, self.from_pct, self.step_rngs = state["step"], state["pct_train"], rngs
            self.start_rngs = None if rngs is None else rngs[2]
        else:
            self._set_rngs(rngs)
        fit = distributed_fit(self.learn)
        if fit is not None and state["shuffle_seed"] is not None:
            fit.shuffle_seed = state["shuffle_seed"]


def _put_trained(learn, state: dict) -> None:
    """What a Checkpoint's `state` holds of the training into `learn`: the model, the optimizer (made if the learner
    has none yet: its first fit makes it), the training iteration, the recorder (the epochs before the file's, once
    each)."""
    if learn.opt is None:
        learn.create_opt()
    fit = distributed_fit(learn)
    load_full_state(learn.model, optimizer(learn), dict(model=state["model"], opt=state["opt"]),
                    fit.strategy if fit else None)
    learn.train_iter = state["train_iter"]
    recorder = learn.recorder
    recorder.smooth_loss.count, recorder.smooth_loss.val = state["smooth_loss"]
    for name, recorded in state.get("recorder", {}).items():
        setattr(recorder, name, list(recorded))


def from_checkpoint(learn, callbacks: List[Callback], fit: dict, after_steps: int) -> Optional[Tuple[dict, Path]]:
    """In the notebook, after the fit `fit` failed: the state of its Checkpoint's file (one of `callbacks`) put on
    `learn` if the file holds that fit past `after_steps` steps (ddipp.core.checkpoint.fit_checkpoint), and the file."""
    for cb in callbacks:
        found = isinstance(cb, Checkpoint) and fit_checkpoint(cb.file_of(learn), cb.keep, fit, after_steps)
        if found:
            _put_trained(learn, found[0])
            return found
    return None


def _lrs(learn) -> list:
    """The learning rates a fit runs at (a restarted script's fit must run at the same): its schedules' at the start,
    middle and end, or the optimizer's."""
    scheduler = imported("fastai.callback.schedule", "ParamScheduler")
    schedules = [cb.scheds["lr"] for cb in learn.cbs if isinstance(cb, scheduler) and "lr" in cb.scheds]
    values = [f(pct) for f in schedules for pct in (0.0, 0.5, 1.0)] or [h["lr"] for h in learn.opt.hypers]
    return [float(v) for value in values for v in np.ravel(np.asarray(value, dtype=float))]


def _accumulating(learn) -> bool:
    """True while a GradientAccumulation holds gradients it has not stepped with (no state to write then)."""
    accumulation = imported("fastai.callback.training", "GradientAccumulation")
    return any(isinstance(cb, accumulation) and cb.count for cb in learn.cbs)


def _loader_rng(learn):
    """The training loader's own generator state (it draws the loader's order), as lists; None if it has none."""
    rng = getattr(learn.dls.train, "rng", None)
    if rng is None:
        return None
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def _set_loader_rng(learn, state) -> None:
    if state is not None:
        learn.dls.train.rng = random.Random()
        learn.dls.train.rng.setstate((state[0], tuple(state[1]), state[2]))


def _plain(obj):
    """`obj` with fastcore's L as lists, numpy scalars as Python numbers and fastai's tensor subclasses (TensorBase: the
    smoothed loss of a fastai loss) as plain tensors: what a weights-only load reads. A dict keeps its type (a state
    dict its metadata)."""
    if isinstance(obj, dict):
        plain = copy.copy(obj)
        plain.update((k, _plain(v)) for k, v in obj.items())
        return plain
    if isinstance(obj, (list, tuple, L)):
        return [_plain(o) for o in obj]
    if isinstance(obj, torch.Tensor):
        return obj.as_subclass(torch.Tensor)
    return obj.item() if isinstance(obj, np.generic) else obj
