"""How a distributed fit holds the model: a `Strategy` wraps it (and owns the optimizer's parameters), reads its whole
state and loads it back, on every rank. `strategy(options)` chooses one: DDP (every rank a whole copy, gradients
averaged), or Shard (ddipp.core.shard: each rank 1/N of it) with `shard=True`. The adapters' DistributedCallbacks
build it once and ask it; they never name DDP or Shard."""
from contextlib import ExitStack
from typing import Any, Optional, Protocol

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import dist as ddist
from .options import Options
from .state import full_state, load_full_state
from .syncbn import convert_sync_bn


class Strategy(Protocol):
    """What a distributed fit asks of the way it holds the model; every rank calls each method. `shards`: whether
    each rank holds only part of it (its state is then gathered to be read)."""
    shards: bool

    def wrap(self, model: nn.Module, optimizer: Any, undo: ExitStack) -> nn.Module:
        """The model as this fit trains it, `optimizer` (the learner's, or None) stepping its parameters; `undo`
        puts back the plain model's when the fit ends."""

    def full_state(self, model: nn.Module, optimizer: Any) -> Optional[dict]:
        """The whole state of the wrapped model and the optimizer on rank 0 (ddipp.core.state.full_state's form)."""

    def load_full_state(self, model: nn.Module, optimizer: Any, state: dict) -> None:
        """`state` (full_state's form, which every rank passes: each reads the checkpoint, or keeps its own copy) into
        the wrapped model and the optimizer."""


def strategy(options: Options) -> Strategy:
    """The Strategy of a fit with `options`."""
    if options.shard:
        from .shard import Shard
        return Shard(options.sync_bn, options.shard_units)
    return DDP(options)


class DDP:
    """Every rank holds the whole model in DDP on its device, gradients averaged in backward; the optimizer keeps the
    same parameters. The whole state is a local read on every rank (they hold the same).

    `find_unused_parameters=None` turns it on for a model with `reset()`: fastai's RNNs (AWD-LSTM) leave some
    parameters out of some steps. Parameters with no element (fastai's TabularModel keeps `BatchNorm1d(0)` when it
    has no continuous column) can never get a gradient: DDP leaves them out of its reduction."""
    shards = False

    def __init__(self, options: Options):
        self.sync_bn, self.find_unused_parameters = options.sync_bn, options.find_unused_parameters

    def wrap(self, model: nn.Module, optimizer: Any, undo: ExitStack) -> nn.Module:
        """`model` in DDP on this rank's device, its BatchNorms synced first if `sync_bn` (undone by `undo`)."""
        if self.sync_bn:
            undo.callback(convert_sync_bn(model))
        undo.callback(_ignore_empty_parameters(model))
        find_unused = hasattr(model, "reset") if self.find_unused_parameters is None else self.find_unused_parameters
        device = ddist.device()
        return ModelDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        find_unused_parameters=find_unused)

    def full_state(self, model: nn.Module, optimizer: Any) -> dict:
        return full_state(model, optimizer)

    def load_full_state(self, model: nn.Module, optimizer: Any, state: dict) -> None:
        load_full_state(model, optimizer, state)


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
