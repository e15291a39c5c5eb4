"""A fitting module (ddipp.core.group.adapter.Fitting) in plain torch, for testing the notebook's worker group without
fastai: a "fit" is a pickled function of (data, device), run on every rank in the group's gloo process group."""
from typing import Any, List, NamedTuple

import cloudpickle
import torch

from ddipp.core import dist
from ddipp.core.group.wire import loads


class Keeping(NamedTuple):
    """What a fit's function returns to keep `tensors` on its rank for the next fit, with its `result`."""
    result: Any
    tensors: List[torch.Tensor]


def place_data(data, device):
    """The data as sent: plain tensors on CPU."""
    return data


def run_fit(data, call, options, device, send, held):
    """Run `call(data, device)` in the process group (joined again after a failed fit), the tensors it names taken from
    `held`; rank 0 (given `send`) returns its result, pickled; a rank keeps in `held` the tensors its function returned
    in a `Keeping` (their digests), else none."""
    dist.init()
    result, kept = loads(call, device=device, held=held)(data, device), []
    if isinstance(result, Keeping):
        result, kept = result.result, held.keep(result.tensors)
    return ([cloudpickle.dumps(result)] if send is not None else None), kept
