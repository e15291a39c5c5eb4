"""The one place that knows how a model's and an optimizer's state is read and written (DDP's and torch.compile's
wrappers today; FSDP's gathered state would go here). The adapters say where their fastai keeps the optimizer's
state."""
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel


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


def model_state(model: nn.Module) -> dict:
    """The state dict of `model`, wrapped or not (its keys without the wrappers' `module.` and `_orig_mod.`): a
    compiled model's loads into the plain model and back."""
    return unwrapped(model).state_dict()


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


def load_model_state(model: nn.Module, state: dict) -> None:
    """Load `state` (as model_state gives it) into `model`, wrapped or not."""
    unwrapped(model).load_state_dict(state)


def move_optimizer_state(opt_state: Mapping[torch.Tensor, dict]) -> None:
    """Put an optimizer's per-parameter state tensors (not its scalar steps) on the device of their parameter."""
    for param, state in opt_state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != param.device:
                state[key] = value.to(param.device)


def state_tensors(model: nn.Module, opt_state: Mapping[torch.Tensor, dict]) -> Iterator[torch.Tensor]:
    """The tensors of the model's state and of an optimizer's per-parameter state."""
    yield from model_state(model).values()
    for state in opt_state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
