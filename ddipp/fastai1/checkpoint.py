"""Checkpoint: a fit that can be resumed where it stopped, with the same result as if it had not stopped."""
from pathlib import Path
from typing import List, Optional, Tuple

from fastai.basic_train import Learner, LearnerCallback, Recorder
from fastai.callback import Callback
from fastai.core import defaults
from fastai.train import AccumulateScheduler

from ..core import dist as ddist
from ..core import resume
from ..core.checkpoint import (FromBatch, Saved, check_every_steps, check_keep, fit_checkpoint, read_checkpoint,
                               restart_state, save_checkpoint)
from ..core.rng import every_rank, rng_state, set_rng_state, this_rank
from ..core.state import full_state, load_full_state
from .callbacks import _running_callback, distributed_fit
from .state import optimizer


class Checkpoint(LearnerCallback):
    """After every epoch (and every `every_steps` training batches) rank 0 writes `{model_dir}/{name}.pth`
    atomically; a fit started at `start_epoch` reads it.

    The file holds the model, the optimizer state, the epoch (and batch) and iteration reached, every rank's RNG states
    and ddipp's shuffle seed. Resume with fastai's own argument: `learn.fit_one_cycle(4, lr, start_epoch=2)` loads the
    state written after epoch 2 (fastai's `jump_to_epoch`) and runs epochs 2 and 3 of the same schedule. In a launched
    script that torch elastic restarted (`--max-restarts`), a fit given a Checkpoint (in `callbacks` or
    `learn.callbacks`) resumes by itself (ddipp.core.resume): a launched learner's `fit` skips the fits the run
    finished, and the one the restart cut resumes where its file left it (a file written after batch k of an epoch
    goes on at batch k: the batches before it are read and dropped, the schedules stepped past them)."""
    _order = -1  # its jump_to_epoch loads the optimizer before the schedulers (order 0) jump to their position

    def __init__(self, learn: Learner, name: str = "checkpoint", keep: int = 1, every_steps: int = None):
        super().__init__(learn)
        self.path = Path(learn.path) / learn.model_dir / f"{name}.pth"
        self.keep = check_keep(keep)  # the files that stay: name.pth, name.1.pth, ...
        self.every_steps = check_every_steps(every_steps)
        self.fit_callbacks = []  # the fit's callbacks, as a launched learner's fit tells them (their schedules jump)
        self.fit_lrs = None  # the fit's learning rates, as a launched learner's fit tells them
        self.from_batch, self.start_rngs, self.step_rngs = 0, None, None  # the epoch a mid-epoch file resumes
        self.epoch_rngs, self.due = None, False
        self.identity = None  # this fit's (ddipp.core.resume.next_fit), from its start to its end
        self.plan = resume.Plan("run")  # what this fit of a restarted script does
        self.saved = None  # the file's state a restarted fit resumes from, read once by skips()
        self.n_epochs = 0

    def skips(self, n_epochs: int) -> bool:
        """Called by a launched learner's fit before fastai's, after an elastic restart: True if this fit is one the
        run finished (the state it ended with loaded when it is the file's fit), else the fit runs as planned."""
        if not resume.restarted():  # a notebook's restarted group, past the fit it ran again
            return False
        self.identity, self.n_epochs = dict(resume.next_fit(), lrs=self.fit_lrs), n_epochs
        self.saved, file, damaged = restart_state(self.path, self.keep)
        self.plan = resume.plan(self.saved, self.identity, n_epochs, len(self.learn.data.train_ds), file)
        line = resume.say(self.plan, self.identity["fit"], file, damaged)
        if line and ddist.is_rank0():
            print(line, flush=True)
        finished = self.plan.action == "finished"
        if self.plan.action != "skip" and not finished:
            return False
        if not hasattr(self.learn, "recorder"):  # the restarted script's first fit: none made one yet, an empty one
            recorder = Recorder(self.learn)
            recorder.losses, recorder.val_losses, recorder.lrs, recorder.moms, recorder.metrics = [], [], [], [], []
            recorder.nb_batches = []
        if finished:  # the state it ended with, into the optimizer the fit would have made
            self._load(self.saved)
        self.on_train_end()
        return True

    def on_train_begin(self, n_epochs: int, pbar, **kwargs):
        if pbar is None:  # Learner.validate()
            return None
        if self.identity is None:
            self.identity, self.n_epochs = dict(resume.next_fit(), lrs=self.fit_lrs), n_epochs
        if self.plan.action != "resume":
            return None
        if self.plan.epoch == 0:  # a file written in the first epoch: fastai jumps to no epoch
            self.jump_to_epoch(0)
        return {"epoch": self.plan.epoch, "iteration": self.saved["iteration"]}  # fastai calls jump_to_epoch

    def on_epoch_begin(self, **kwargs):
        if not self.from_batch:
            self.epoch_rngs = rng_state()  # what a file written in this epoch starts it with
            return None
        # a mid-epoch file's epoch starts as it started; its batches before the file's are read and dropped, the
        # schedules stepped past them (as fastai's jump_to_epoch steps them past whole epochs)
        if self.start_rngs is not None:
            set_rng_state(self.start_rngs)
        self.epoch_rngs = rng_state()
        self.learn.data.train_dl = FromBatch(self.learn.data.train_dl, self.from_batch, self._set_step_rngs)
        for cb in self.fit_callbacks:
            if type(cb).jump_to_epoch is not Callback.jump_to_epoch and cb is not self:
                for _ in range(self.from_batch):
                    cb.on_batch_end(train=True)
        running = _running_callback(self.learn)
        if running is not None:
            running.resume_at_batch(self.from_batch)
        return {"num_batch": self.from_batch}

    def _set_step_rngs(self) -> None:
        if self.step_rngs is not None:
            set_rng_state(self.step_rngs)

    def on_batch_end(self, train: bool, epoch: int, num_batch: int, iteration: int, **kwargs):
        if not (self.every_steps and train and self.identity is not None):
            return
        self.due = self.due or (iteration + 1) % self.every_steps == 0  # fastai counts this batch after its callbacks
        accumulating = getattr(self.learn, "accumulate_scheduler", None)
        if isinstance(accumulating, AccumulateScheduler) and accumulating.acc_batches % accumulating.n_step:
            return  # gradients it has not stepped with: no state to write
        if self.due and num_batch + 1 < len(self.learn.data.train_dl):  # the epoch's end writes anyway
            self._write(epoch, num_batch + 1, iteration + 1)

    def on_epoch_end(self, epoch: int, iteration: int, **kwargs):
        self._end_resumed_epoch()
        self._write(epoch + 1, 0, iteration)
        if self.plan.action == "resume" and epoch + 1 >= self.n_epochs:  # a plain fit has no schedule that stops it
            return {"stop_training": True}
        return None

    def _write(self, epoch: int, step: int, iteration: int) -> None:
        """The state after `epoch` epochs and `step` batches of the next (with that epoch's starting generators)."""
        self.due = False
        # collectives (the generators, the state the strategy reads): every rank takes part, rank 0 writes
        rngs = every_rank([rng_state(), self.epoch_rngs if step else None])
        fit, running = distributed_fit(self.learn), _running_callback(self.learn)
        state = full_state(self.learn.model, optimizer(self.learn), fit.strategy if fit else None)
        fastai = dict(iteration=iteration, recorder=_recorded(self.learn.recorder),
                      smoothed=running.smoothed_state() if running else None)
        save_checkpoint(Saved(state, epoch, step, rngs, fit.shuffle_seed if fit else None, self.identity, self.n_epochs,
                              len(self.learn.data.train_ds), fastai), self.path, self.keep)

    def on_train_end(self, **kwargs) -> None:
        self._end_resumed_epoch()  # a fit that ended in its resumed epoch
        self.identity, self.plan, self.saved = None, resume.Plan("run"), None
        self.fit_callbacks, self.fit_lrs = [], None

    def _end_resumed_epoch(self) -> None:
        """The training loader as it was before a mid-epoch file's epoch wrapped it (FromBatch), once it ended."""
        if isinstance(self.learn.data.train_dl, FromBatch):
            self.learn.data.train_dl = self.learn.data.train_dl.dl
        self.from_batch = 0

    def jump_to_epoch(self, epoch: int) -> None:
        self._load(self.saved if self.plan.action == "resume" else read_checkpoint(self.path, epoch))

    def _load(self, state: dict) -> None:
        """`state`, read from the file, into the model, the optimizer, the generators and the recorder."""
        if state.get("step") and not self.fit_callbacks:
            raise ValueError(f"{self.path} holds the state after {resume.progress(state['epoch'], state['step'])}: a "
                             "learner made with to_ddp() resumes it in the middle of an epoch (its fit steps the "
                             "schedules past the batches before it)")
        _put_trained(self.learn, state)
        rngs = this_rank(state["rngs"], self.path)
        if state.get("step"):  # written mid-epoch: on_epoch_begin starts that epoch as it started, at batch `step`
            self.from_batch = state["step"]
            self.start_rngs, self.step_rngs = (None, None) if rngs is None else (rngs[1], rngs[0])
        elif rngs is not None:
            set_rng_state(rngs[0])
        fit, running = distributed_fit(self.learn), _running_callback(self.learn)
        if fit is not None and state["shuffle_seed"] is not None:
            fit.shuffle_seed = state["shuffle_seed"]
        if running is not None and state.get("smoothed") and state["smoothed"][0]:  # the smoothed loss goes on
            running.load_smoothed_state(state["smoothed"])


def _put_trained(learn: Learner, state: dict) -> None:
    """What a Checkpoint's `state` holds of the training into `learn`: the model, the optimizer (made if the learner
    has none yet), the recorder (the epochs before the file's, once each)."""
    if getattr(learn, "opt", None) is None:
        learn.create_opt(defaults.lr, learn.wd)
    fit = distributed_fit(learn)
    load_full_state(learn.model, optimizer(learn), dict(model=state["model"], opt=state["opt"]),
                    fit.strategy if fit else None)
    for name, recorded in state.get("recorder", {}).items():
        setattr(learn.recorder, name, list(recorded))


def from_checkpoint(learn: Learner, callbacks: List[Callback], fit: dict, after_steps: int
                    ) -> Optional[Tuple[dict, Path]]:
    """In the notebook, after the fit `fit` failed: the state of its Checkpoint's file (one of `callbacks`) put on
    `learn` (which has a recorder) if the file holds that fit past `after_steps` steps
    (ddipp.core.checkpoint.fit_checkpoint), and the file."""
    for cb in callbacks:
        found = isinstance(cb, Checkpoint) and fit_checkpoint(cb.path, cb.keep, fit, after_steps)
        if found:
            _put_trained(learn, found[0])
            return found
    return None


def _recorded(recorder) -> dict:
    """What fastai's Recorder recorded so far, as plain numbers (what a weights-only load reads)."""
    def plain(x):
        return None if x is None else float(x)
    return dict(losses=[plain(v) for v in recorder.losses], val_losses=[plain(v) for v in recorder.val_losses],
                metrics=[[plain(v) for v in row] for row in recorder.metrics], lrs=[plain(v) for v in recorder.lrs],
                moms=[plain(v) for v in recorder.moms], nb_batches=[int(n) for n in recorder.nb_batches])
