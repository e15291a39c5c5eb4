"""A second ddipp.core.parallel.Strategy, not DDP, for the tests of the seam: put it in DDP's place with
`parallel.strategy = HandAveraged` (or `lambda options: HandAveraged(options)`)."""
from contextlib import ExitStack
from typing import Any

import torch.distributed as dist
from torch import nn

from ddipp.core.options import Options
from ddipp.core.state import full_state, load_full_state


class HandAveraged:
    """The model itself, rank 0's parameters and buffers copied to every rank, each gradient all-reduced and averaged
    by a hook as backward accumulates it (hooks removed by `undo`); its whole state a local read, as DDP's. Unlike
    DDP it leaves BatchNorm's running statistics each rank's own, and fails on a parameter some rank leaves out."""
    shards = False  # every rank holds the whole model

    def __init__(self, options: Options):
        self.options = options

    def wrap(self, model: nn.Module, optimizer: Any, undo: ExitStack) -> nn.Module:
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, 0)
        world = dist.get_world_size()

        def average(param: nn.Parameter) -> None:
            dist.all_reduce(param.grad)
            param.grad /= world
        for param in model.parameters():
            if param.requires_grad:
                undo.callback(param.register_post_accumulate_grad_hook(average).remove)
        return model

    def full_state(self, model: nn.Module, optimizer: Any) -> dict:
        return full_state(model, optimizer)

    def load_full_state(self, model: nn.Module, optimizer: Any, state: dict) -> None:
        load_full_state(model, optimizer, state)
