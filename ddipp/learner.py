"""`Learner.to_ddp` / `Learner.from_ddp`, added the way fastai v1 adds `to_fp16` and `to_distributed`."""
import os
from functools import partial
from typing import Optional, Sequence

from fastai.basic_train import Learner

from . import dist
from .callbacks import DistributedCallback, GCCallback, LRFinderBypassCallback, hide_progress_bars

_DDIPP_CALLBACKS = (DistributedCallback, LRFinderBypassCallback, GCCallback)


def to_ddp(learn: Learner, gpus: Optional[Sequence[int]] = None, nprocs: Optional[int] = None,
           sync_bn: bool = False, find_unused_parameters: Optional[bool] = None,
           lr_find_mode: str = "solo") -> Learner:
    """Make every later fit of `learn` distributed over the launcher's group; a no-op in a plain process.

    In a launched process `gpus`/`nprocs` may be left out; given, they must match what the launcher started."""
    if not dist.launched():
        if gpus is None and nprocs is None:
            return learn
        raise NotImplementedError(f"to_ddp(gpus={gpus}, nprocs={nprocs}) outside a launcher (notebook mode) is not "
                                  "built yet; start the script with python -m ddipp.launch")
    _check_matches_launch(gpus, nprocs)
    dist.init()
    if not dist.is_rank0():
        hide_progress_bars()  # also for validate() and get_preds() outside a fit
    from_ddp(learn)
    learn.callback_fns += [partial(DistributedCallback, sync_bn=sync_bn, find_unused_parameters=find_unused_parameters),
                           partial(LRFinderBypassCallback, mode=lr_find_mode), GCCallback]
    return learn


def from_ddp(learn: Learner) -> Learner:
    """Back to plain single-process fastai: removes ddipp's callbacks."""
    learn.callback_fns = [f for f in learn.callback_fns if getattr(f, "func", f) not in _DDIPP_CALLBACKS]
    return learn


def _check_matches_launch(gpus, nprocs) -> None:
    launched_devices = os.environ.get(dist.DEVICES_ENV, "")
    if gpus is not None and [int(g) for g in gpus] != [int(g) for g in launched_devices.split(",") if g.isdigit()]:
        raise ValueError(f"to_ddp(gpus={list(gpus)}) but the launcher started this group on "
                         f"{launched_devices or 'its default devices'}; pass the same gpus or leave gpus out")
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size()))
    if nprocs is not None and nprocs != local_procs:
        raise ValueError(f"to_ddp(nprocs={nprocs}) but the launcher started {local_procs} processes on this host; "
                         "pass the same number or leave nprocs out")


Learner.to_ddp = to_ddp
Learner.from_ddp = from_ddp
