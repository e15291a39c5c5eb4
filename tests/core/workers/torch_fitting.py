"""A fitting module (ddipp.core.group.adapter.Fitting) in plain torch, for testing the notebook's worker group without
fastai: a "fit" is a cloudpickled function of (data, device), run on every rank in the group's gloo process group."""
import cloudpickle

from ddipp.core import dist


def place_data(data, device):
    """The data as sent: plain tensors on CPU."""
    return data


def run_fit(data, call, options, device, send, held):
    """Run `call(data, device)` in the process group (joined again after a failed fit); rank 0 (given `send`) returns
    its result, pickled; no rank keeps tensors for the next fit."""
    dist.init()
    result = cloudpickle.loads(call)(data, device)
    return ([cloudpickle.dumps(result)] if send is not None else None), []
