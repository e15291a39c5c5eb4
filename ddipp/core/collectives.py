"""Collectives for the user's own code: a gather that keeps autograd, and an exact sum of metric states.

Both return what a single process would have (the tensor itself, the state itself) when this process is not
part of a group of two or more ranks.
"""
from typing import Dict, Union

import torch
import torch.distributed as dist

from . import dist as ddist

State = Union[torch.Tensor, Dict[str, "State"]]


def _distributed() -> bool:
    """True in a group of two or more ranks (joined now if the launcher made one)."""
    return ddist.world_size() > 1 and ddist.init()


class _Gather(torch.autograd.Function):
    """Equal-sized tensors gathered along dim 0; the backward pass sums the gathered gradient over ranks and keeps
    this rank's part. Public collectives only: torch's own autograd gathers are private (funcol, renamed in 2.14),
    deprecated (torch.distributed.nn) or crash with gloo on CUDA tensors (funcol on torch 2.11, seen on an H200)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        gathered = tensor.new_empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(gathered, tensor.contiguous())
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad.chunk(dist.get_world_size())[dist.get_rank()]


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """The ranks' `tensor`s concatenated along dim 0 in rank order; gradients flow back to every rank's part.

    The backward pass sums, over ranks, the gradient of each rank's loss with respect to this rank's part, so a
    loss computed alike on every rank over the gathered batch gets N times its gradient here, and DDP's average
    over the N ranks brings it back to the single-process gradient. The ranks' dim 0 may differ."""
    if tensor.dim() == 0:
        raise ValueError("all_gather needs a tensor with a batch dimension (dim 0), got a 0-d tensor; gather t[None]")
    if not _distributed():
        return tensor
    sizes = _Gather.apply(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
    longest = max(sizes)
    gathered = _Gather.apply(torch.cat([tensor, tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))]))
    if len(set(sizes)) == 1:
        return gathered
    return torch.cat([gathered[r * longest:r * longest + n] for r, n in enumerate(sizes)])



def all_gather_each(x):
    """`all_gather` of the tensor `x`, or of each tensor of the list or tuple `x` (a fastai batch's parts)."""
    return type(x)(all_gather(o) for o in x) if isinstance(x, (list, tuple)) else all_gather(x)

def reduce_sum(state: State) -> State:
    """`state` (a tensor or a dict of them, nested) summed over all ranks; the inputs are left as they were.

    For metric states that are sums (counts, sums, sums of outer products): the result is the state one process
    would have accumulated over every rank's items. Call it on every rank."""
    if isinstance(state, dict):
        return {k: reduce_sum(v) for k, v in state.items()}
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"reduce_sum got a {type(state).__name__}; give a tensor or a dict of tensors")
    total = state.detach().clone()
    if _distributed():
        dist.all_reduce(total)
    return total
