"""The steps of a distributed fit that both adapters' DistributedCallbacks take alike."""
import torch
import torch.distributed as dist

from . import dist as ddist


def global_loss_and_stop(loss: torch.Tensor, summed: bool, world_size: int) -> tuple[torch.Tensor, bool]:
    """The loss of the global batch from this rank's `loss` (float32; a summed loss adds up, a mean averages), and
    whether any rank asked to stop: one all-reduce, so every rank stops after this same step."""
    loss_and_stop = torch.stack([loss.detach().float(), loss.new_tensor(ddist.stop_requested()).float()])
    dist.all_reduce(loss_and_stop)
    total, stop = loss_and_stop
    return (total if summed else total / world_size), bool(stop)


def meet_at_end() -> None:
    """Every rank ends the fit together, so what rank 0 wrote during it exists for all; when a rank failed at the very
    end, this one leaves the group before the error goes on."""
    try:
        dist.barrier()
    except Exception as e:
        if ddist.peer_failure(e):
            ddist.leave()
        raise
