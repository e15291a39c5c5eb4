"""to_ddp's options as one checked value (`Options`: checked once, frozen, sent to a notebook's workers as it is), and
the checks of what to_ddp is given against a launch, a split batch, or a notebook's host."""
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from . import dist as ddist
from .dist import check_gpus
from .group import forkserver

LR_FIND_MODES = ("solo", "distributed")
# the memory a notebook's CPU worker holds of its own before its first fit, measured with fastai v1 on torch 2.11:
# forked from the kernel's fork server (its imports shared with it), and started as a fresh interpreter
WORKER_MEMORY = {True: 20 << 20, False: 380 << 20}


@dataclass(frozen=True)
class Options:
    """What to_ddp was given besides where to run: ddipp's callbacks read it in every fit (`sync_bn`,
    `find_unused_parameters`, `lr_find_mode`, `split_batches`, `shard`, `shard_units`), a notebook's binding the rest
    (`timeout`, `restarts`).
    Made, it is checked: a bad value is a ValueError naming it and what to give instead."""
    sync_bn: bool = False
    find_unused_parameters: Optional[bool] = None
    lr_find_mode: str = "solo"
    split_batches: bool = False
    timeout: float = 600
    restarts: int = 0
    shard: bool = False
    shard_units: Optional[Callable] = None

    def __post_init__(self) -> None:
        lr_find_mode, timeout, split_batches, restarts = (self.lr_find_mode, self.timeout, self.split_batches,
                                                          self.restarts)
        if not isinstance(self.sync_bn, bool):
            raise ValueError(f"to_ddp(sync_bn={self.sync_bn!r}): True (BatchNorm layers sync their statistics over the "
                             "processes while training) or False (the default)")
        if self.find_unused_parameters is not None and not isinstance(self.find_unused_parameters, bool):
            raise ValueError(f"to_ddp(find_unused_parameters={self.find_unused_parameters!r}): True, False, or None "
                             "(the default: on for a model with reset(), such as fastai's RNNs)")
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
            raise ValueError(f"to_ddp(restarts={restarts!r}): restarts is how many times a notebook fit whose worker "
                             "died starts a new group and resumes from its Checkpoint, a whole number >= 0 (default 0)")
        self._check_shard()

    def _check_shard(self) -> None:
        if not isinstance(self.shard, bool):
            raise ValueError(f"to_ddp(shard={self.shard!r}): True (each process holds 1/N of the parameters, "
                             "gradients and optimizer state during a fit) or False (the default: each holds them all)")
        if self.shard_units is not None and not (self.shard and callable(self.shard_units)):
            raise ValueError(f"to_ddp(shard_units={self.shard_units!r}): a function of the model giving the modules "
                             "to shard as units, with shard=True, e.g. shard_units=lambda model: list(model.layers)")
        if not self.shard:
            return
        if self.find_unused_parameters:
            raise ValueError("to_ddp(shard=True, find_unused_parameters=True): a sharded fit has no search for unused "
                             "parameters (FSDP reduces every parameter that has a gradient, and every rank must have "
                             "the same ones): leave find_unused_parameters out, or leave shard out for DDP's search")
        from .shard import fully_shard_api
        fully_shard_api()


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
