"""What to_ddp does the same for every fastai: check its options against the launch or choose a notebook's devices,
and wrap a model in DDP (ModelDDP: what callbacks ask of the model reaches it)."""
import os
from contextlib import ExitStack
from typing import Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import dist as ddist
from .dist import check_gpus
from .group import forkserver
from .sharding import part_sizes
from .syncbn import convert_sync_bn

LR_FIND_MODES = ("solo", "distributed")
# the memory a notebook's CPU worker holds of its own before its first fit, measured with fastai v1 on torch 2.11:
# forked from the kernel's fork server (its imports shared with it), and started as a fresh interpreter
WORKER_MEMORY = {True: 20 << 20, False: 380 << 20}


def check_options(lr_find_mode: str, timeout: float, split_batches: bool = False, restarts: int = 0) -> None:
    """ValueError naming a bad `lr_find_mode`, `timeout`, `split_batches` or `restarts` of to_ddp, and what to give
    instead."""
    if lr_find_mode not in LR_FIND_MODES:
        raise ValueError(f"to_ddp(lr_find_mode={lr_find_mode!r}): use 'solo' (rank 0 sweeps alone) or "
                         "'distributed' (all ranks sweep with the global batch)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"to_ddp(timeout={timeout!r}): timeout is the seconds a rank may wait for the others, "
                         "a number > 0 (default 600)")
    if not isinstance(split_batches, bool):
        raise ValueError(f"to_ddp(split_batches={split_batches!r}): True (the loader's batch is the global batch, "
                         "split over the processes) or False (each process takes a whole batch; the default)")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"to_ddp(restarts={restarts!r}): restarts is how many times a notebook fit whose worker died "
                         "starts a new group and resumes from its Checkpoint, a whole number >= 0 (default 0)")


def check_split(bs: int, world_size: int, smallest_part: int, batchnorm: bool, sync_bn: bool) -> None:
    """ValueError, before a split_batches fit's first step, for a batch size its processes cannot share: `smallest_part`
    is the fewest items a process gets in a step, `batchnorm` whether the model has BatchNorm layers."""
    if bs < world_size:
        raise ValueError(f"split_batches=True splits each batch of bs={bs} over {world_size} processes, which leaves "
                         f"a process no item: use bs >= {world_size}, or leave split_batches out (each process then "
                         "takes bs items a step)")
    if batchnorm and smallest_part == 0:
        raise ValueError(f"split_batches=True: the training set's last batch has fewer items than the {world_size} "
                         f"processes, and a process with no item cannot train the model's BatchNorm layers: give the "
                         "training loader drop_last=True")
    if batchnorm and smallest_part == 1 and not sync_bn:
        raise ValueError(f"split_batches=True: a batch of bs={bs} over {world_size} processes gives one of them a "
                         f"single item in some step, and BatchNorm cannot train on one item: use bs >= "
                         f"{2 * world_size} with drop_last=True, or to_ddp(..., sync_bn=True)")


def check_matches_launch(gpus: Optional[Sequence[int]], nprocs: Optional[int], restarts: int = 0) -> None:
    """ValueError if to_ddp's `gpus` or `nprocs`, in a launched process, differ from what the launcher started, or
    it asks for notebook restarts (`restarts`), which the launcher does there."""
    if restarts:
        raise ValueError(f"to_ddp(restarts={restarts}) restarts a notebook's workers; the launcher restarts a launched "
                         f"script: python -m ddipp.launch --max-restarts {restarts} ..., and leave restarts out")
    launched_devices = os.environ.get(ddist.DEVICES_ENV, "")
    if gpus is not None and [int(g) for g in gpus] != [int(g) for g in launched_devices.split(",") if g.isdigit()]:
        raise ValueError(f"to_ddp(gpus={list(gpus)}) but the launcher started this group on "
                         f"{launched_devices or 'its default devices'}; pass the same gpus or leave gpus out")
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", ddist.world_size()))
    if nprocs is not None and nprocs != local_procs:
        raise ValueError(f"to_ddp(nprocs={nprocs}) but the launcher started {local_procs} processes on this host; "
                         "pass the same number or leave nprocs out")


def notebook_devices(gpus: Optional[Sequence[int]], nprocs: Optional[int]) -> Tuple[str, ...]:
    """A notebook's worker devices, rank order: "cuda:i" for each of `gpus`, or "cpu" `nprocs` times."""
    if gpus is not None and nprocs is not None:
        raise ValueError(f"to_ddp(gpus={list(gpus)}, nprocs={nprocs}): give gpus for GPUs or nprocs for CPU "
                         "processes, not both")
    if nprocs is not None:
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"to_ddp(nprocs={nprocs!r}): nprocs is the number of CPU processes, a whole number >= 1")
        forked = forkserver.server() is not None
        available, each = _available_memory(), WORKER_MEMORY[forked]
        most = max(1, available // each)
        if nprocs > most:
            raise ValueError(f"to_ddp(nprocs={nprocs}): this host has memory for at most {most} worker processes "
                             f"({available / 2**30:.1f} GB available, about {each >> 20} MB a worker "
                             f"{'forked from the kernel' if forked else 'started'} before its first fit): use "
                             f"nprocs <= {most}")
        return ("cpu",) * nprocs
    if isinstance(gpus, int) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus) \
            or not gpus:
        raise ValueError(f"to_ddp(gpus={gpus!r}): gpus is a list of GPU indices, e.g. gpus=[0, 1]")
    try:
        check_gpus(list(gpus), torch.cuda.device_count(), "gpus=[0, 1]", "to_ddp(nprocs=N)")
    except ValueError as e:
        raise ValueError(f"to_ddp(gpus={list(gpus)}): {e}") from None
    return tuple(f"cuda:{g}" for g in gpus)


def _available_memory() -> int:
    """The bytes of memory the host can give without swapping (Linux's MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def say_global_batch(bs: Optional[int], processes: int, split_batches: bool) -> None:
    """Print the global batch a notebook's learner now trains with: bs per process, or bs split (split_batches)."""
    if not bs:
        return
    if split_batches:
        parts = " + ".join(map(str, part_sizes(bs, processes)))
        print(f"ddipp: global batch {bs} kept: {parts} over {processes} processes")
    else:
        print(f"ddipp: global batch {bs * processes} = {bs} per process x {processes} (an epoch takes 1/{processes} "
              f"of the steps of one process with bs={bs}); add split_batches=True to keep bs={bs} as the global "
              "batch: one process's training, faster")


class ModelDDP(DistributedDataParallel):
    """DDP whose attributes it lacks are the wrapped model's, read and written through it, as callbacks use
    `learn.model`: fastai's RNN trainers call `reset()`, its tests read `learn.model.tst`, a custom head or a timm
    model its own attributes, callbacks index it (`learn.model[0]`). DDP's own attributes stay its own (a write
    reaches the model only after construction)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._built = True

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module" or "module" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self.module, name)

    def __getitem__(self, index):
        """`learn.model[0]` (a cnn_learner's body, a hook's layer) of an indexable model such as nn.Sequential."""
        module = self.module
        if not hasattr(type(module), "__getitem__"):
            raise TypeError(f"'{type(module).__name__}' object is not subscriptable")
        return module[index]

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_built") and not _has_own(self, name) and hasattr(self.module, name):
            setattr(self.module, name, value)
        else:
            super().__setattr__(name, value)


def _has_own(module: nn.Module, name: str) -> bool:
    """Whether `module` has `name` itself (its class, attributes, parameters, buffers or submodules)."""
    return (hasattr(type(module), name) or name in vars(module)
            or any(name in vars(module)[kind] for kind in ("_parameters", "_buffers", "_modules")))


def wrap(model: nn.Module, undo: ExitStack, sync_bn: bool, find_unused_parameters: Optional[bool]) -> nn.Module:
    """`model` in DDP on this rank's device, its BatchNorms synced first if `sync_bn` (undone by `undo`).

    `find_unused_parameters=None` turns it on for a model with `reset()`: fastai's RNNs (AWD-LSTM) leave some
    parameters out of some steps. Parameters with no element (fastai's TabularModel keeps `BatchNorm1d(0)` when
    it has no continuous column) can never get a gradient: DDP leaves them out of its reduction."""
    if sync_bn:
        undo.callback(convert_sync_bn(model))
    undo.callback(_ignore_empty_parameters(model))
    find_unused = hasattr(model, "reset") if find_unused_parameters is None else find_unused_parameters
    device = ddist.device()
    return ModelDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    find_unused_parameters=find_unused)


def _ignore_empty_parameters(model: nn.Module):
    """Have DDP ignore `model`'s zero-element parameters (besides any it already ignores); returns the undo."""
    before = getattr(model, "_ddp_params_and_buffers_to_ignore", None)
    empty = [name for name, p in model.named_parameters() if p.numel() == 0 and name not in (before or ())]
    if not empty:
        return lambda: None
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [*(before or []), *empty])

    def undo():
        for name, p in model.named_parameters():
            if name in empty:
                del p._ddp_ignored
        if before is None:
            del model._ddp_params_and_buffers_to_ignore
        else:
            model._ddp_params_and_buffers_to_ignore = before
    return undo
