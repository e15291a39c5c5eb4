"""fastai v1 callbacks that make a fit distributed: DistributedCallback, LRFinderBypassCallback, GCCallback.

fastai 1.0.61 reads WORLD_SIZE/RANK itself, and ddipp relies on that where it is right: `save`/`export`
write a file on rank 0 only (a buffer on every rank: ddipp.fastai1.learner), `load`/`load_data`/`load_learner`
wait at a barrier first (so every rank reads what
rank 0 wrote). It neutralises the rest: validation sees the whole batch on every rank (so fastai's
per-batch metric all-reduce averages equal values), lr_find is stopped by LRFinderBypassCallback (fastai
lets it run to the epoch's end under DDP), and Learner.validate(), which calls on_train_begin without
on_train_end, is recognised (it has no progress bar) and left undistributed (under to_ddp() it averages its
metrics on each rank alone: the `validate` of ddipp.fastai1.learner).
"""
import math
from contextlib import ExitStack
from functools import partial
from typing import Optional

import fastprogress.fastprogress
import numpy as np
import torch.distributed as dist
from fastai.basic_train import Learner, LearnerCallback
from fastai.callback import SmoothenValue
from fastai.callbacks import CSVLogger, OverSamplingCallback
from fastai.train import AccumulateScheduler
from torch import nn

from ..core import dist as ddist
from ..core.sharding import pad_to_longest, shared_seed, unshard
from ..core import parallel
from ..core.options import LR_FIND_MODES, Options, check_split
from ..core.files import UnnamedFile
from ..core.fit import DistributedFit, LossAndStop, meet_at_end, split_weight
from ..core.memory import release_memory
from ..core.syncbn import has_batchnorm
from .loaders import repeat_passes, shard_eval_loader, shard_train_loader, split_train_loader, text_if_imported
from .state import hypers, optimizer, set_hypers


class DistributedCallback(LearnerCallback):
    """Trains on every rank with DDP: shards the loaders' own order, validates exactly, records global numbers.

    On a group of one rank a fit trains as one process, as plain fastai (a notebook's interrupt still stops it).
    At on_train_begin it wraps the model and shards the loaders, before the other callbacks' on_train_begin
    (schedules count the sharded batches); at on_train_end it puts the plain model and the original
    loaders back, also when the fit raised: then every rank leaves the process group before the other callbacks'
    on_train_end (fastai's load waits at a barrier), so that the collectives of ranks still training fail at once
    instead of at the timeout; the next fit joins a new group."""
    _order = -20  # before Recorder (-10): it must record the global loss, and stay silent on rank > 0

    def __init__(self, learn: Learner, sync_bn: bool = False, find_unused_parameters: bool = None,
                 split_batches: bool = False, shard: bool = False, shard_units=None):
        super().__init__(learn)
        self.options = Options(sync_bn=sync_bn, find_unused_parameters=find_unused_parameters,
                               split_batches=split_batches, shard=shard, shard_units=shard_units)
        self.strategy = parallel.strategy(self.options)  # how the fit holds the model (DDP, or sharded)
        self.distributed = False  # between a fit's on_train_begin and the undoing of what it changed
        self.fitting = False  # from a distributed fit's on_train_begin to its on_train_end
        self.alone = False  # from a fit's on_train_begin on a group of one rank to its on_train_end
        self.stopping = False  # an interrupt reached every rank: stop before the next batch
        self.undo = ExitStack()  # every change to the learner a distributed fit makes, undone in reverse
        self.unmute = ExitStack()  # rank > 0's CSV loggers, put back after the fit's last callback ran
        self.rank, self.world_size = 0, 1
        self.train_sampler = None  # the ShardedSampler or SplitBatchSampler of this fit's training shard (set_epoch)
        self.train_batch = 0  # which training batch of the epoch (or of its passes) is running
        self.lm_streams = None  # set_epoch of a language model's sharded streams
        self.padding = None  # (pad_idx, pad_first) of padded text batches, else None
        self.eval_batches = None  # the ShardedEvalBatchSampler of the validation loader
        self.valid_batch = 0  # which validation batch of the epoch is running
        self.smoother = SmoothenValue(0.98)
        self.summed_loss = False  # the loss function sums over the batch (else it averages)
        self.global_loss = None  # the loss of the global batch at the current step
        self.step_loss = None  # the LossAndStop of the training step running, until its result is taken
        self.losses_recorded = 0  # the recorder's losses before the training step running

    def on_train_begin(self, pbar, n_epochs: int, **kwargs) -> None:
        if pbar is None or not ddist.init():  # Learner.validate() (no bar, no on_train_end), or not launched
            return
        if dist.get_world_size() < 2:
            self.alone = True
            return
        self.fitting = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        learn, data = self.learn, self.learn.data
        if self.options.split_batches:
            sharded = split_train_loader(data.train_dl, self.rank, self.world_size, shared_seed())
            check_split(data.train_dl.dl.batch_sampler.batch_size, self.world_size,
                        sharded.dl.batch_sampler.smallest_part(), has_batchnorm(learn.model), self.options.sync_bn)
        else:
            sharded = shard_train_loader(data.train_dl, self.rank, self.world_size, shared_seed())
        if len(sharded) == 0:  # refused before anything changes
            raise ValueError(_no_batch(data.train_dl, self.world_size))
        _check_callbacks(learn)
        if self.rank != 0:
            learn.recorder.silent = True
            hide_progress_bars()
            self.unmute.callback(_csv_loggers_aside(learn))
        self.smoother = SmoothenValue(0.98)
        self.summed_loss = getattr(learn.loss_func, "reduction", "mean") == "sum"
        model, train_dl, valid_dl = learn.model, data.train_dl, data.valid_dl
        self.undo.callback(_restore, learn, model, train_dl, valid_dl)
        learn.model = self.strategy.wrap(model, optimizer(learn), self.undo)
        data.train_dl = sharded
        batches = sharded.dl.batch_sampler
        self.train_sampler = batches if self.options.split_batches else batches.sampler
        self.undo.callback(_rescale_schedule(learn, len(train_dl) * n_epochs, len(sharded) * n_epochs))
        self.lm_streams = getattr(sharded.dl.dataset, "set_epoch", None)  # language-model streams
        self.padding = _padding(train_dl)
        self.eval_batches = None
        if valid_dl is not None:
            data.valid_dl = shard_eval_loader(valid_dl, self.rank, self.world_size)
            self.eval_batches = data.valid_dl.dl.batch_sampler
        self.distributed = True

    def smoothed_state(self) -> list:
        """The smoothed training loss of this fit so far ([steps, moving average]): a Checkpoint keeps it."""
        return [self.smoother.n, float(self.smoother.mov_avg)]

    def load_smoothed_state(self, state: list) -> None:
        """The smoothed training loss goes on from `state` (smoothed_state's), as it was when it was kept."""
        self.smoother.n, self.smoother.mov_avg = state
        self.smoother.smooth = self.smoother.mov_avg / (1 - self.smoother.beta ** self.smoother.n)

    def resume_at_batch(self, batch: int) -> None:
        """This epoch goes on at its training batch `batch` (a mid-epoch Checkpoint's): a split batch's parts follow."""
        self.train_batch = batch

    def undistribute(self, error: Optional[BaseException] = None) -> None:
        """Put back the plain model and the original loaders; the rest of the fit runs as one process. After the
        `error` the fit raised, without a collective (a peer may be gone)."""
        if error is None:
            self.undo.close()
        else:
            self.undo.__exit__(type(error), error, error.__traceback__)
        self.distributed, self.step_loss = False, None

    def read_passes(self, passes: int) -> None:
        """Each epoch of this fit reads the shard `passes` times, each pass in a new order (`RepeatedBatches`)."""
        self.learn.data.train_dl = repeat_passes(self.learn.data.train_dl, passes)

    def on_epoch_begin(self, epoch: int, **kwargs) -> None:
        if self.distributed:
            self.train_sampler.set_epoch(epoch)
            if self.lm_streams:
                self.lm_streams(epoch)
            self.valid_batch = self.train_batch = 0

    def _validating(self, train: bool) -> bool:
        return self.distributed and not train and self.eval_batches is not None

    def on_batch_begin(self, last_input, last_target, train: bool, **kwargs):
        if self.stopping or (self.alone and ddist.stop_requested()):  # alone, a notebook's interrupt needs no peer
            raise ddist.StopRequested("ddipp: the fit was interrupted; every rank stopped after the same step")
        changes = {}
        if self.distributed and self.padding:  # padded text: as long as the global batch, as one process pads it
            changes["last_input"] = pad_to_longest(last_input, *self.padding)
        if self._validating(train):
            changes["last_target"] = unshard(last_target, self.eval_batches.sizes(self.valid_batch))
        return changes or None

    def on_loss_begin(self, last_output, train: bool, **kwargs):
        if self._validating(train):
            return {"last_output": unshard(last_output, self.eval_batches.sizes(self.valid_batch))}

    def on_backward_begin(self, last_loss, last_input, **kwargs):
        """Starts the all-reduce of the global batch's loss, and any rank's stop, which runs while backward and the
        optimizer step do (`take_step_loss`). Under split_batches this rank's loss is weighted by its share of the
        batch before backward, and AccumulateScheduler counts the whole batch's items."""
        if not self.distributed:
            return
        sizes = self.train_sampler.sizes(self.train_batch) if self.options.split_batches else None
        self.step_loss = LossAndStop(last_loss, self.summed_loss, self.world_size, sizes)
        self.losses_recorded = len(self.learn.recorder.losses)  # Recorder adds this step's next
        if sizes is None:
            return
        accumulating = getattr(self.learn, "accumulate_scheduler", None)  # set when made, given to fit() or learn
        if isinstance(accumulating, AccumulateScheduler):  # its on_batch_begin counted this rank's items
            accumulating.acc_samples += sum(sizes) - last_input.shape[0]
        return {"last_loss": last_loss * split_weight(sizes, self.summed_loss)}

    def on_step_end(self, **kwargs):
        return self.take_step_loss()

    def take_step_loss(self):
        """The global batch's loss, once the all-reduce on_backward_begin started ended: smoothed, it replaces what
        Recorder recorded (and its bar shows) at on_backward_begin, this rank's own, and becomes the state's
        smooth_loss, so what callbacks decide on (LRFinder's divergence, TerminateOnNaN) agrees everywhere."""
        if self.step_loss is None:
            return None
        step_loss, self.step_loss = self.step_loss, None
        loss, stopping = step_loss.result()
        self.global_loss, self.stopping = loss.cpu(), self.stopping or stopping
        self.smoother.add_value(self.global_loss)
        recorder = self.learn.recorder
        recorder.losses[-1] = self.smoother.smooth
        if recorder.pbar is not None and hasattr(recorder.pbar, "child"):
            recorder.pbar.child.comment = f"{self.smoother.smooth:.4f}"
        return {"smooth_loss": self.smoother.smooth}

    def _drop_cut_step(self) -> None:
        """A fit that failed inside a training step (its loss's all-reduce started, not taken: a peer failed during
        backward) keeps what its last completed step left: no recorded loss of this step, zero gradients, not this
        step's partial ones."""
        del self.learn.recorder.losses[self.losses_recorded:]
        self.learn.opt.zero_grad()

    def on_batch_end(self, train: bool, last_loss, **kwargs):
        if self._validating(train):
            self.valid_batch += 1
        elif self.distributed and train:  # the loss of the global batch: decisions on it (TerminateOnNaN) agree
            self.train_batch += 1
            taken = self.take_step_loss() or {}  # taken at on_step_end unless the step had none
            return {**taken, "last_loss": self.global_loss.to(last_loss.device, last_loss.dtype)}

    def on_train_end(self, exception, **kwargs) -> None:
        if exception and self.step_loss is not None:
            self._drop_cut_step()
        healthy = not exception or isinstance(exception, ddist.StopRequested)  # an interrupt stopped every rank alike
        try:
            self.undistribute(None if healthy else exception)  # gathers a sharded model, every rank at once
        except BaseException as e:  # a peer gone by now: the fit failed after all
            self.unmute.close()
            self.fitting = self.alone = False
            ddist.leave_after(e)
            raise
        self.unmute.close()
        fitting, self.fitting, self.alone = self.fitting, False, False
        if not (fitting and dist.is_initialized()):
            return
        if exception:  # before any other callback's collective could wait for a peer
            ddist.leave_after(exception)
        else:  # SaveModelCallback's on_train_end looks for what rank 0 wrote
            meet_at_end()


def distributed_fit(learn: Learner) -> Optional[DistributedFit]:
    """The distributed fit the learner runs (its loaders sharded, its model wrapped), else None: how the other
    callbacks learn whether, and how, the fit they are in is distributed."""
    cb = _running_callback(learn)
    if cb is None:
        return None
    sampler = cb.train_sampler
    return DistributedFit(cb.rank, cb.world_size, cb.strategy, sampler, len(sampler.sampler), lambda: list(sampler))


def _running_callback(learn: Learner) -> Optional[DistributedCallback]:
    """The learner's DistributedCallback while a distributed fit runs, else None."""
    ddp = getattr(learn, "distributed_callback", None)
    return ddp if ddp is not None and ddp.distributed else None


def _restore(learn: Learner, model: nn.Module, train_dl, valid_dl) -> None:
    learn.model, learn.data.train_dl, learn.data.valid_dl = model, train_dl, valid_dl


def _check_callbacks(learn: Learner) -> None:
    """ValueError for the fastai callbacks that cannot train as one process does under DDP, saying what to do."""
    def used(cls) -> bool:
        return any(getattr(f, "func", f) is cls for f in learn.callback_fns) or any(
            isinstance(cb, cls) for cb in learn.callbacks)
    reduction = getattr(learn.loss_func, "reduction", "sum")
    if used(AccumulateScheduler) and reduction != "sum":  # it divides the gradients by this rank's samples
        raise ValueError(f"AccumulateScheduler with a loss of reduction={reduction!r} would step with N times one "
                         "process's gradient under DDP: use a loss with reduction='sum', as fastai advises for it")
    if used(OverSamplingCallback):  # it replaces the sharded training loader with a draw of its own on every rank
        raise ValueError("OverSamplingCallback would make every rank draw its own sample of the whole training set: "
                         "give the training DataLoader a WeightedRandomSampler instead, which ddipp shards like any "
                         "sampler (one draw, every rank its part)")


def _no_batch(loader, world_size: int) -> str:
    """Why a rank's shard of `loader` makes no batch, and the largest batch size that works."""
    batches = loader.dl.batch_sampler
    share = len(batches.sampler) // world_size
    return (f"the per-process batch size {batches.batch_size} is larger than a rank's share of the training set "
            f"({len(batches.sampler)} items / {world_size} ranks = {share}) and drop_last leaves no batch: use "
            f"bs <= {share} (each rank takes bs items a step; the global batch is bs x {world_size})")


def _rescale_schedule(learn: Learner, unsharded: int, sharded: int):
    """Fit the phases of a GeneralScheduler planned for `unsharded` steps to `sharded` steps; returns the undo.

    fastai's FlatCosAnnealScheduler (fit_fc) reads len(train_dl) when it is built, before the fit shards the
    loader: under DDP it plans N times the steps a rank takes, so the lr never leaves its flat phase. Phase ends
    are scaled and rounded down (as fastai rounds them); a schedule of any other total is left alone."""
    sched = getattr(learn, "general_scheduler", None)
    if sched is None or unsharded == sharded or sum(p.length for p in sched.phases) != unsharded:
        return lambda: None
    lengths = [p.length for p in sched.phases]
    ends = [end * sharded // unsharded for end in np.cumsum(lengths)]
    _set_lengths(sched.phases, np.diff(ends, prepend=0))
    return lambda: _set_lengths(sched.phases, lengths)


def _set_lengths(phases, lengths) -> None:
    for phase, length in zip(phases, lengths):
        phase.length = int(length)
        for scheduler in phase.scheds.values():
            scheduler.n_iter = max(1, int(length))  # as fastai's Scheduler clamps it


def _padding(loader):
    """(pad_idx, pad_first) when `loader` pads text with fastai's pad_collate, else None."""
    collate, text = loader.collate_fn, text_if_imported()
    if text is not None and isinstance(collate, partial) and collate.func is text.pad_collate:
        return collate.keywords.get("pad_idx", 1), collate.keywords.get("pad_first", True)
    return None


def _csv_loggers_aside(learn: Learner):
    """Point the learner's CSVLoggers at files without a name (rank 0 alone writes the real file); returns the undo."""
    loggers = [cb for cb in [*vars(learn).values(), *learn.callbacks] if isinstance(cb, CSVLogger)]
    paths = [cb.path for cb in loggers]
    for cb in loggers:
        cb.path = UnnamedFile()

    def undo():
        for cb, path in zip(loggers, paths):
            cb.path = path
    return undo


def hide_progress_bars() -> None:
    """No fastprogress bars in this process (ranks other than 0: rank 0 draws them for everybody)."""
    fastprogress.fastprogress.NO_BAR = True



class LRFinderBypassCallback(LearnerCallback):
    """`lr_find` under DDP: sweeps once and leaves every rank in the same state (weights, optimizer, recorder).

    mode='solo': rank 0 sweeps alone on the whole data (what one GPU would show) while the others wait,
    then the recorder and the optimizer's hyper-parameters are broadcast. mode='distributed': all ranks sweep with
    the global batch, for the sweep's num_it steps as one process with that batch does."""
    _order = 1  # after fastai's LRFinder (0), which it recognises and stops

    def __init__(self, learn: Learner, mode: str = "solo"):
        super().__init__(learn)
        if mode not in LR_FIND_MODES:
            raise ValueError(f"mode={mode!r}: use 'solo' (rank 0 sweeps alone) or 'distributed' (global batch)")
        self.mode, self.sweeping = mode, False

    def on_train_begin(self, pbar, n_epochs: int, **kwargs) -> None:
        # fastai's LRFinder marks its fit's bar clean_on_interrupt in its own on_train_begin, which ran just before
        self.sweeping = getattr(pbar, "clean_on_interrupt", False) and dist.is_initialized()
        if self.sweeping and self.mode == "solo":
            _running_callback(self.learn).undistribute()
        elif self.sweeping:
            self._cover_the_sweep(n_epochs)

    def _cover_the_sweep(self, n_epochs: int) -> None:
        """Give the fit's epochs the sweep's num_it batches: fastai counts them on the unsharded loader (and a notebook
        without WORLD_SIZE), so the shard would run out after about 1/N of the sweep, far below end_lr."""
        steps = self.learn.lr_finder.sched.n_iter
        passes = math.ceil(steps / (n_epochs * len(self.learn.data.train_dl)))
        if passes > 1:
            _running_callback(self.learn).read_passes(passes)

    def _waiting(self) -> bool:
        """True on the ranks that only wait for rank 0's solo sweep."""
        return self.sweeping and self.mode == "solo" and dist.get_rank() != 0

    # A waiting rank runs one forward pass with no backward or step: a fastai fit needs one batch to end.
    def on_backward_begin(self, **kwargs):
        if self._waiting():
            return {"skip_bwd": True}

    def on_backward_end(self, **kwargs):
        if self._waiting():
            return {"skip_step": True}

    def on_step_end(self, **kwargs):
        if self._waiting():
            return {"skip_zero": True}

    def on_batch_end(self, **kwargs):
        # fastai's LRFinder never stops under WORLD_SIZE > 1, so the stop is made here
        if self._waiting() or (self.sweeping and self.learn.lr_finder.stop is not False):
            return {"stop_epoch": True, "stop_training": True}

    def on_train_end(self, **kwargs) -> None:
        # LRFinder.on_train_end already reloaded the pre-sweep weights on every rank (after fastai's load barrier)
        if self.sweeping and self.mode == "solo" and dist.is_initialized():  # not after a failure (left the group)
            state = [_sweep_state(self.learn)]
            dist.broadcast_object_list(state, src=0)
            _set_sweep_state(self.learn, state[0])
        self.sweeping = False


# What a sweep changes besides the weights: the recorder's history, and the optimizer's hyper-parameters (its
# parameter groups were reloaded from the pre-sweep file on every rank; fastai leaves the last scheduled lr in _lr).
_RECORDED = ("lrs", "moms", "losses", "nb_batches", "val_losses", "metrics")


def _sweep_state(learn: Learner) -> dict:
    return dict(recorder={k: getattr(learn.recorder, k) for k in _RECORDED}, opt=hypers(learn))


def _set_sweep_state(learn: Learner, state: dict) -> None:
    vars(learn.recorder).update(state["recorder"])
    set_hypers(learn, state["opt"])


class GCCallback(LearnerCallback):
    """At the end of every fit: `gc.collect()` and, with CUDA, `torch.cuda.empty_cache()`; reports when verbose."""

    def __init__(self, learn: Learner, verbose: bool = False):
        super().__init__(learn)
        self.verbose = verbose

    def on_train_end(self, **kwargs) -> None:
        release_memory(self.verbose)
