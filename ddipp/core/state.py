"""The one door to a model's and an optimizer's state: the whole state read and loaded on every rank (a distributed
fit's Strategy reads it, a local read otherwise), what a worker keeps of it between notebook fits, and the wrappers
(DDP's, torch.compile's) seen through. The adapters say only where their fastai keeps its optimizer."""
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

if TYPE_CHECKING:
    from .fit import DistributedFit
    from .parallel import Strategy


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside its DDP (or DataParallel) wrapper and torch.compile's, or `model` itself."""
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif _compiled(model):
            model = model._orig_mod
        else:
            return model


def _compiled(model: nn.Module) -> bool:
    """Whether `model` is torch.compile's wrapper (no model is, before torch._dynamo is imported: 2 s not paid here)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def full_state(model: nn.Module, optimizer: Any, strategy: Optional["Strategy"] = None) -> Optional[dict]:
    """Every rank calls it: {"model": the model's state dict (its keys without the wrappers' `module.` and
    `_orig_mod.`), "opt": the optimizer's (None without one)} on rank 0, read by `strategy` while a distributed fit
    holds the model (it may gather, and leave other ranks None), else locally."""
    if strategy is not None:
        return strategy.full_state(model, optimizer)
    return dict(model=unwrapped(model).state_dict(), opt=None if optimizer is None else optimizer.state_dict())


def load_full_state(model: nn.Module, optimizer: Any, state: dict, strategy: Optional["Strategy"] = None) -> None:
    """Every rank calls it: `state` (as full_state gives it) into the model and, when both have one, the optimizer;
    through `strategy` while a distributed fit holds the model."""
    if strategy is not None:
        return strategy.load_full_state(model, optimizer, state)
    unwrapped(model).load_state_dict(state["model"])
    if optimizer is not None and state.get("opt") is not None:
        optimizer.load_state_dict(state["opt"])


@contextmanager
def plain_model(learn: Any):
    """The learner's model without its wrappers (DDP's, torch.compile's) for the block, then back: what fastai's own
    save writes of it then loads into the plain model."""
    model = learn.model
    learn.model = unwrapped(model)
    try:
        yield
    finally:
        learn.model = model


@contextmanager
def savable(learn: Any, optimizer: Any, fit: Optional["DistributedFit"], file: Any, to_file: bool,
            opt_form=lambda state: state):
    """The learner as fastai's save of `file` (`to_file`: a path, not a buffer) reads it (`learn.model`, `learn.opt`)
    for the block, then back: its plain model, or, while the distributed `fit` shards it, stand-ins holding its whole
    state (every rank calls; rank 0 holds it), the optimizer's in the form fastai writes (`opt_form`); a buffer is then
    refused (rank 0 alone would hold what it gets)."""
    strategy = fit.strategy if fit else None
    if strategy is None or not strategy.shards:
        with plain_model(learn):
            yield
        return
    if not to_file:
        raise ValueError(f"learn.save({file!r}) during a fit with to_ddp(shard=True): rank 0 alone holds the whole "
                         "state; save to a file name (rank 0 writes it)")
    state = full_state(learn.model, optimizer, strategy) or dict(model=None, opt=None)
    model, opt = learn.model, learn.opt
    learn.model = _Read(state["model"])
    learn.opt = None if state["opt"] is None else _Read(opt_form(state["opt"]))
    try:
        yield
    finally:
        learn.model, learn.opt = model, opt


class _Read:
    """A state read once, standing in for its model or optimizer where fastai calls state_dict()."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def move_optimizer_state(optimizer: Any) -> None:
    """Put the optimizer's per-parameter state tensors (not its scalar steps) on the device of their parameter."""
    for param, state in ({} if optimizer is None else optimizer.state).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != param.device:
                state[key] = value.to(param.device)


def kept_tensors(model: nn.Module, optimizer: Any) -> Iterator[torch.Tensor]:
    """The tensors of this rank's model and optimizer state: what a worker keeps between a notebook's fits."""
    yield from unwrapped(model).state_dict().values()
    for state in ({} if optimizer is None else optimizer.state).values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
