"""fastai v2 callbacks that make a fit distributed: DistributedCallback, LRFinderBypassCallback, GCCallback.

fastai 2.8 reads WORLD_SIZE/RANK itself, and ddipp relies on that where it is right: `save`/`export` write on rank 0
only, `load`/`load_learner` wait at a barrier first (so every rank reads what rank 0 wrote). It takes over where
fastai is wrong: validation is split exactly (fastai's own DistributedDL pads by wrapping around and averages per
rank), lr_find sweeps once (fastai's LRFinder reloads its weights on rank 0 only, behind a barrier the other ranks never
reach), and where it waits for nothing: each step's loss is already the global batch's on every rank, so the Recorder
smooths it without gathering it again.
"""
import copy
import os
import sys
from contextlib import ExitStack, contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from fastai.callback.core import Callback, CancelFitException
from fastai.data.load import DataLoader
from fastai.learner import AvgSmoothLoss
from fastai.torch_core import to_detach
from torch.utils.data import DataLoader as TorchDataLoader

from ..core import dist as ddist
from ..core.sharding import shared_seed, unshard
from ..core import parallel
from ..core.options import LR_FIND_MODES, Options, check_split
from ..core.files import UnnamedFile
from ..core.fit import DistributedFit, LossAndStop, meet_at_end, split_weight
from ..core.memory import release_memory
from ..core.syncbn import has_batchnorm
from ..core.state import full_state, load_full_state
from .loaders import ShardedEvalDL, ShardedTrainDL, SplitTrainDL, WholeEvalDL, fastai_loader, splittable
from .state import optimizer


class DistributedCallback(Callback):
    """Trains on every rank with DDP: shards the training loader's own order, validates exactly, records global numbers.

    In each fit (launched, 2 or more ranks) its before_fit wraps the model in DDP and shards the training loader
    before the callbacks that read them (Recorder, the bars, the schedules); every change goes on one undo stack,
    closed when the fit ends, after every callback's after_fit, or at once when the fit raises (fastai then calls no
    after_fit): added to a learner, the callback guards `learn.fit` for that. A fit that raises makes this rank leave
    the process group (the next fit joins a new one); the other ranks' collectives fail when its process ends (on
    gloo, leaving alone does not close their connections: a script that catches the error keeps them waiting until
    the timeout). Each validation batch is split across ranks and gathered whole on every rank (`ShardedEvalDL`), so the
    loss and every metric are one process's; outside a fit (validate, get_preds) every rank evaluates alone."""
    order = -5  # after TrainEvalCallback (-10) put the model on its device; before Recorder (50) and the bars (60)

    def __init__(self, sync_bn: bool = False, find_unused_parameters: bool = None, split_batches: bool = False,
                 shard: bool = False, shard_units=None):
        self.options = Options(sync_bn=sync_bn, find_unused_parameters=find_unused_parameters,
                               split_batches=split_batches, shard=shard, shard_units=shard_units)
        self.strategy = parallel.strategy(self.options)  # how the fit holds the model (DDP, or sharded)
        self.undo = ExitStack()  # every change a distributed fit made, undone in reverse when it ends
        self.in_fit = False  # inside learn.fit (before_fit also starts validate() and get_preds(), which stay local)
        self.joined = False  # this fit began on a group of 2 or more ranks: at its end they meet, or this rank leaves
        self.alone = False  # this fit began on a group of one rank: it trains as one process, and stops when asked
        self.running = False  # the model is wrapped and the training loader sharded (until undistribute)
        self.rank, self.world_size = 0, 1
        self.shard = None  # this fit's ShardedTrainDL or SplitTrainDL (its set_epoch)
        self.parts = None  # the ShardedEvalDL of the validation running, when it is split across ranks
        self.summed_loss = False  # the loss function sums over the batch (else it averages)
        self.stopping = False  # an interrupt reached every rank: stop before the next batch
        self.step_loss = None  # the LossAndStop of the training step running, until its result is taken

    _learn, _guard = None, None  # the learner it is on, and the guard of that learner's fit

    @property
    def learn(self):
        return self._learn

    @learn.setter
    def learn(self, learn) -> None:
        """fastai sets this when the callback is added (the learner) and removed (None): the fit guard follows it."""
        if self._guard is not None:
            self._guard.remove()
        object.__setattr__(self, "_learn", learn)
        object.__setattr__(self, "_guard", None if learn is None else _FitGuard(learn, self))

    @contextmanager
    def fitting(self):
        """The span of one `learn.fit`: its distributed changes are undone when it ends, however it ends."""
        if self.in_fit:  # a fit started inside a fit runs as fastai runs it
            yield
            return
        self.in_fit = True
        try:
            yield
            self.undistribute()  # gathers a sharded model, every rank at once: a peer gone by now fails the fit
        except ddist.StopRequested:  # a notebook's interrupt: every rank stopped after the same step, and stays
            self.undistribute()
            self._meet_at_end()
            raise
        except BaseException as e:
            self._drop_cut_step()
            self.undistribute(e)
            self._leave_after(e)
            raise
        else:
            self._meet_at_end()
        finally:
            self.in_fit = self.joined = self.alone = False
            self.undistribute()

    def _drop_cut_step(self) -> None:
        """A fit that failed inside a training step (its loss's all-reduce started, not taken: a peer failed during
        backward) keeps the gradients its last completed step left, zero, not this step's partial ones."""
        if self.step_loss is not None and self.learn.opt is not None:
            self.learn.opt.zero_grad()

    def _leave_after(self, error: BaseException) -> None:
        if not (self.joined and dist.is_initialized()):
            return
        ddist.leave_after(error)

    def _meet_at_end(self) -> None:
        if self.joined and dist.is_initialized():
            meet_at_end()

    def before_fit(self) -> None:
        if not self.in_fit or not ddist.init():
            return
        if dist.get_world_size() < 2:
            self.alone = True
            return
        learn, rank, world_size = self.learn, dist.get_rank(), dist.get_world_size()
        self.joined, self.rank, self.world_size = True, rank, world_size
        train = fastai_loader(learn.dls.train)
        if not isinstance(train, DataLoader) or train.bs is None or not train.indexed:
            raise TypeError(_not_shardable(learn.dls.train))
        if self.options.split_batches:
            shard = SplitTrainDL(train, rank, world_size, shared_seed())
            check_split(train.bs, world_size, shard.parts.smallest_part(), has_batchnorm(learn.model),
                        self.options.sync_bn)
        else:
            shard = ShardedTrainDL(train, rank, world_size, shared_seed())
        if len(shard) == 0:  # refused before anything changes
            raise ValueError(_no_batch(train, world_size))
        self.summed_loss = getattr(learn.loss_func, "reduction", "mean") == "sum"
        if rank != 0:
            self._quiet()
        else:
            _say_float32(learn)
        model = learn.model
        self.undo.callback(setattr, learn, "model", model)
        learn.model = self.strategy.wrap(model, optimizer(learn), self.undo)
        self.undo.callback(_set_train, learn.dls, learn.dls.train)
        learn.dls.train, self.shard = shard, shard
        self._accumulate_global_samples()
        self._smooth_global_loss()
        self.running = True

    def _quiet(self) -> None:
        """No bars, no results table and no CSV file on this rank during the fit (rank 0 shows and writes them)."""
        learn = self.learn
        self.undo.enter_context(learn.no_logging())
        bars = imported("fastai.callback.progress", "ProgressCallback", "ShowGraphCallback")  # the graph: on a bar
        loggers = imported("fastai.callback.progress", "CSVLogger")
        for cb in learn.cbs:
            if isinstance(cb, bars):
                self.undo.callback(setattr, cb, "run", cb.run)
                cb.run = False
            elif isinstance(cb, loggers):
                self.undo.callback(setattr, cb, "fname", cb.fname)
                cb.fname = UnnamedFile()

    def _accumulate_global_samples(self) -> None:
        """fastai's GradientAccumulation steps once it counted n_acc samples, and a rank sees 1/N of each global batch:
        for this fit it counts to n_acc/N, so the weights step after n_acc samples across ranks, as in one process.
        (Under split_batches it counts the whole batch: after_loss gathers it.)"""
        if self.options.split_batches:
            return
        accumulation = imported("fastai.callback.training", "GradientAccumulation")
        for cb in self.learn.cbs:
            if isinstance(cb, accumulation):
                self.undo.callback(setattr, cb, "n_acc", cb.n_acc)
                cb.n_acc = cb.n_acc / self.world_size

    def _smooth_global_loss(self) -> None:
        """fastai's Recorder averages each step's loss over the ranks to smooth it (an all-gather every rank waits on);
        after_step already made it the global batch's on every rank: for this fit it is smoothed as it is."""
        recorder = getattr(self.learn, "recorder", None)
        if recorder is None or type(recorder.smooth_loss) is not AvgSmoothLoss:  # a smoother of the user's own
            return
        smooth = GlobalSmoothLoss(recorder.smooth_loss)
        _set_quietly(recorder, "smooth_loss", smooth)
        self.undo.callback(smooth.hand_back, recorder)

    def undistribute(self, error: Optional[BaseException] = None) -> None:
        """Put back the plain model and the original loaders (and whatever else this fit changed); after the `error`
        the fit raised, without a collective (a peer may be gone)."""
        if error is None:
            self.undo.close()
        else:
            self.undo.__exit__(type(error), error, error.__traceback__)
        self.running, self.shard, self.parts, self.step_loss = False, None, None, None

    def hide_group_from_fastai(self) -> None:
        """For the rest of this fit fastai reads WORLD_SIZE=1: it neither gathers values across ranks nor waits at
        barriers (ddipp's own collectives are unaffected)."""
        self.undo.callback(os.environ.__setitem__, "WORLD_SIZE", os.environ["WORLD_SIZE"])
        os.environ["WORLD_SIZE"] = "1"

    def before_epoch(self) -> None:
        if self.running:
            self.shard.set_epoch(self.learn.epoch)

    def before_batch(self) -> None:
        self.take_step_loss()  # a step cancelled before after_step and after_batch (CancelEpochException)
        if self.stopping or (self.alone and ddist.stop_requested()):  # alone, a notebook's interrupt needs no peer
            self.stopping = False
            raise ddist.StopRequested("ddipp: the fit was interrupted; every rank stopped after the same step")

    def after_loss(self) -> None:
        """A training step's loss is summed over ranks while backward and the optimizer step run: from after_step (or
        after_cancel_batch, when GradientAccumulation skips the step) it is the global batch's on every rank, so what
        Recorder smooths and callbacks decide on (TerminateOnNaN) agrees everywhere; DDP's backward works on this
        rank's own loss. A stop asked on any rank (a notebook's interrupt) travels with it, so every rank stops after
        this same step. Under split_batches this rank's loss is weighted by its share of the batch before backward,
        and the callbacks after this one see the whole batch's predictions and targets (GradientAccumulation counts
        its items)."""
        learn = self.learn
        if not (self.running and learn.training):
            return
        sizes = self.shard.sizes(learn.iter) if self.options.split_batches else None
        self.step_loss = LossAndStop(learn.loss, self.summed_loss, self.world_size, sizes)
        if sizes is not None:
            learn.loss_grad = learn.loss_grad * split_weight(sizes, self.summed_loss)
            learn.pred = unshard(to_detach(learn.pred, cpu=False, gather=False), sizes)
            learn.yb = unshard(learn.yb, sizes)

    def take_step_loss(self) -> None:
        """The training step's loss becomes the global batch's, and a stop any rank asked is noted, once the
        all-reduce after_loss started ended."""
        if self.step_loss is None:
            return
        step_loss, self.step_loss = self.step_loss, None
        loss, stopping = step_loss.result()
        self.learn.loss, self.stopping = loss.to(self.learn.loss.dtype), self.stopping or stopping

    def after_step(self) -> None:
        self.take_step_loss()

    def after_cancel_batch(self) -> None:
        self.take_step_loss()

    def after_batch(self) -> None:
        self.take_step_loss()  # a batch without targets skips the step

    def before_validate(self) -> None:
        learn, dl = self.learn, fastai_loader(self.learn.dl)
        if self.running and splittable(dl):
            learn.dl = self.parts = ShardedEvalDL(dl, self.rank, self.world_size)
        else:
            self.parts = None
            learn.dl = WholeEvalDL(learn.dl)

    def after_pred(self) -> None:
        """The predictions and targets of the whole validation batch, on every rank, before the loss and metrics."""
        learn = self.learn
        if learn.training or self.parts is None or learn.dl is not self.parts:
            return
        sizes = self.parts.sizes(learn.iter)
        learn.pred, learn.yb = unshard(learn.pred, sizes), unshard(learn.yb, sizes)


class GlobalSmoothLoss(AvgSmoothLoss):
    """fastai's smoothed training loss of a loss that is already the same global one on every rank: not gathered."""

    def __init__(self, fastai_own: AvgSmoothLoss):
        super().__init__(fastai_own.beta)
        self.fastai_own = fastai_own

    def accumulate(self, learn) -> None:
        self.count += 1
        self.val = torch.lerp(to_detach(learn.loss.mean(), gather=False), self.val, self.beta)

    def hand_back(self, recorder) -> None:
        """Put fastai's own smoother back on `recorder`, where this one left off."""
        self.fastai_own.count, self.fastai_own.val = self.count, self.val
        _set_quietly(recorder, "smooth_loss", self.fastai_own)


def _set_quietly(cb: Callback, name: str, value) -> None:
    """Set a callback's attribute that the learner has too (Recorder copies smooth_loss to it) without fastai's
    warning of shadowing, which is for a user's callback."""
    object.__setattr__(cb, name, value)


def imported(module: str, *names: str) -> tuple:
    """fastai's classes `names` of `module`, for isinstance, once something imported it; () before, when none can
    exist. ddipp imports neither fastai.callback.progress nor schedule or training, which import it: that import adds
    ProgressCallback to every new Learner's callbacks (fastai's defaults.callbacks), the user's import to make."""
    found = sys.modules.get(module)
    return tuple(getattr(found, name) for name in names) if found else ()


def distributed_fit(learn) -> Optional[DistributedFit]:
    """The distributed fit the learner runs (its model wrapped, its training loader sharded), else None: how other
    callbacks learn whether, and how, the fit they are in is distributed."""
    cb = _running_callback(learn)
    if cb is None:
        return None
    return DistributedFit(cb.rank, cb.world_size, cb.strategy, cb.shard.order, cb.shard.dl.n, cb.shard.get_idxs)


def _running_callback(learn) -> Optional[DistributedCallback]:
    """The learner's DistributedCallback while a distributed fit runs, else None."""
    for cb in getattr(learn, "cbs", ()):
        if isinstance(cb, DistributedCallback) and cb.running:
            return cb
    return None


class _FitGuard:
    """`learn.fit` of a learner with a DistributedCallback: the fit it replaces, run inside the callback's `fitting()`.

    fastai calls after_fit when a fit ends or is cancelled, not when it raises; the guard is where the fit's
    distributed changes are undone in that case too, and the place after every after_fit."""

    def __init__(self, learn, callback: DistributedCallback):
        self.learn, self.callback, self.replaced = learn, callback, vars(learn).get("fit")
        self.fit = learn.fit  # fastai's fit (or the instance's own), bound to the learner
        learn.fit = self

    def __call__(self, *args, **kwargs):
        with self.callback.fitting():
            return self.fit(*args, **kwargs)

    def remove(self) -> None:
        if vars(self.learn).get("fit") is self:
            if self.replaced is None:
                del self.learn.fit
            else:
                self.learn.fit = self.replaced


def _say_float32(learn) -> None:
    """fastai's MixedPrecision builds CUDA's autocast and scaler, which torch disables on CPU (with a warning): a fit on
    a CPU rank trains in float32, and one ddipp line says so."""
    mixed = imported("fastai.callback.fp16", "MixedPrecision")
    if ddist.device().type == "cpu" and any(isinstance(cb, mixed) for cb in learn.cbs):
        print("ddipp: fastai's MixedPrecision (to_bf16/to_fp16) is CUDA-only: this fit on CPU trains in float32",
              flush=True)


def _set_train(dls, loader) -> None:
    dls.train = loader


def _not_shardable(loader) -> str:
    """Why the training loader `loader` cannot be sharded, and what to build instead."""
    kind = f"{type(loader).__module__}.{type(loader).__name__}"
    if isinstance(loader, TorchDataLoader):
        return (f"ddipp shards a PyTorch DataLoader's sampler in batches of batch_size, and the training loader is a "
                f"{kind} of a {type(loader.dataset).__name__} with batch_size={loader.batch_size}: give it a "
                f"map-style dataset (one with __getitem__ and __len__) and batch_size, with a sampler= or shuffle= "
                f"in place of a batch_sampler=")
    return (f"ddipp shards a fastai DataLoader of indexed items in batches of bs, or a PyTorch DataLoader, and the "
            f"training loader is a {kind} (bs={getattr(loader, 'bs', None)}): build the DataLoaders with fastai's "
            f"DataLoader (fastai.data.load.DataLoader), its DataBlock API or PyTorch's DataLoader")


def _no_batch(loader: DataLoader, world_size: int) -> str:
    """Why a rank's shard of `loader` makes no batch, and the largest batch size that works."""
    share = loader.n // world_size
    return (f"the per-process batch size bs={loader.bs} is larger than a rank's share of the training set "
            f"({loader.n} items / {world_size} ranks = {share}) and drop_last leaves no batch: use bs <= {share} "
            f"(each rank takes bs items a step; the global batch is bs x {world_size})")



class LRFinderBypassCallback(Callback):
    """`lr_find` under DDP: sweeps once, and leaves every rank in the same state (weights, optimizer, recorder).

    mode='solo': rank 0 sweeps alone on the whole data with its own batch (what one GPU would show) while the others
    wait; then its recorder is broadcast. mode='distributed': all ranks sweep with the global batch for the sweep's
    num_it steps, as one process with that batch does (fastai plans the epochs on the unsharded loader). Either way
    fastai reads WORLD_SIZE=1 during the sweep, so its LRFinder saves and reloads the weights on rank 0 without a
    barrier the others would have to meet, and every rank puts back the state it had before the sweep."""
    order = DistributedCallback.order + 1  # after the fit was distributed; before Recorder, the bars and LRFinder
    run_train = run_valid = False  # no batch event: fastai then asks this callback for none (each ask costs)

    def __init__(self, mode: str = "solo"):
        if mode not in LR_FIND_MODES:
            raise ValueError(f"mode={mode!r}: use 'solo' (rank 0 sweeps alone) or 'distributed' (global batch)")
        self.mode = mode
        self.sweeping = False  # a distributed fit's lr_find sweep runs
        self.before_sweep = None  # the weights and optimizer state when it began (a sharded fit's: rank 0's alone)

    def before_fit(self) -> None:
        running = _running_callback(self.learn)
        if running is None or not isinstance(getattr(self.learn, "lr_finder", None),
                                            imported("fastai.callback.schedule", "LRFinder")):
            return
        self.sweeping = True
        if self.mode == "solo":  # every rank puts the plain model back (a sharded one is gathered: all take part)
            running.undistribute()
            self.before_sweep = copy.deepcopy(full_state(self.learn.model, optimizer(self.learn)))
            if running.rank == 0:
                running.hide_group_from_fastai()
        else:
            self.before_sweep = copy.deepcopy(full_state(self.learn.model, optimizer(self.learn), running.strategy))
            running.hide_group_from_fastai()  # fastai's LRFinder saves and reloads on rank 0 alone
            steps = self.learn.lr_finder.num_it  # LRFinder stops there; fastai counted epochs on the unsharded loader
            self.learn.n_epoch = max(self.learn.n_epoch, steps // len(self.learn.dls.train) + 1)

    def _waiting(self) -> bool:
        """True on the ranks that only wait for rank 0's solo sweep."""
        return self.sweeping and self.mode == "solo" and dist.get_rank() != 0

    def before_epoch(self) -> None:
        if self._waiting():  # after fastai's LRFinder.before_fit, so its after_fit finds what it expects
            raise CancelFitException()

    def after_fit(self) -> None:
        if not self.sweeping:
            return
        learn, state, self.before_sweep, self.sweeping = self.learn, self.before_sweep, None, False
        fit = distributed_fit(learn)  # None on the rank that swept alone
        load_full_state(learn.model, optimizer(learn), state, fit.strategy if fit else None)  # as LRFinder on rank 0
        finder = learn.lr_finder
        if dist.get_rank() != 0 and hasattr(finder, "tmp_d"):
            finder.tmp_d.cleanup()  # its folder stays empty here: fastai saves on rank 0 only
        if self.mode == "solo":
            record = [_record(learn)]
            dist.broadcast_object_list(record, src=0)
            _set_record(learn, record[0])


_RECORDED = ("lrs", "iters", "losses", "values")


def _record(learn) -> dict:
    """What a sweep leaves in the recorder (and the learner's last record), as plain Python values."""
    return dict(recorder={k: copy.deepcopy(getattr(learn.recorder, k)) for k in _RECORDED},
                final_record=copy.deepcopy(getattr(learn, "final_record", None)))


def _set_record(learn, record: dict) -> None:
    for k, v in record["recorder"].items():
        setattr(learn.recorder, k, v)
    if record["final_record"] is not None:
        learn.final_record = record["final_record"]


class GCCallback(Callback):
    """At the end of every fit: `gc.collect()` and, with CUDA, `torch.cuda.empty_cache()`; reports when verbose."""
    order = 100  # after the other callbacks let go of what the fit held
    run_train = run_valid = False  # no batch event: fastai then asks this callback for none (each ask costs)

    def __init__(self, verbose: bool = False):
        self.verbose = verbose

    def after_fit(self) -> None:
        release_memory(self.verbose)
