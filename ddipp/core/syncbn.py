"""SyncBatchNorm for a fit: BatchNorm layers swapped for synchronised ones sharing their parameters and buffers.

torch's SyncBatchNorm has CUDA kernels only; on CPU (gloo) ddipp's CPUSyncBatchNorm computes the same global-batch
statistics with two gathers, so `sync_bn=True` works, and is tested, in CPU mode too.
"""
import torch
import torch.distributed as dist
from torch import nn

from . import dist as ddist
from .collectives import all_gather


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """SyncBatchNorm for CPU tensors: in training, batch statistics over every rank's part of the batch.

    In eval mode it normalises with the running statistics and never communicates. (DDP refuses torch's
    SyncBatchNorm class on CPU modules, hence a BatchNorm subclass.)"""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input of 2 or more dimensions (batch, channels, ...), got {x.dim()}-d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        self._check_input_dim(x)
        dims, shape = [0, *range(2, x.dim())], (1, -1) + (1,) * (x.dim() - 2)
        sums = all_gather(torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.shape[1]])])[None]).sum(0)
        count = sums[-1]
        mean = sums[:-1] / count
        var = all_gather(((x - mean.view(shape)) ** 2).sum(dims)[None]).sum(0) / count
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * count / (count - 1))
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape) if self.affine else y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(factor * mean)
        self.running_var.mul_(1 - factor).add_(factor * unbiased_var)


def has_batchnorm(model: nn.Module) -> bool:
    """True if `model` has a BatchNorm layer (which needs 2 or more items a step to train)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def convert_sync_bn(model: nn.Module):
    """Swap the BatchNorm layers of `model` for SyncBatchNorm layers sharing their Parameters and buffers.

    The optimizer keeps the same Parameter objects and the running statistics are updated in place; returns the
    function that puts the original BatchNorm layers back, in the train/eval mode the model is in then."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.modules.batchnorm._BatchNorm)
             and not isinstance(child, (nn.SyncBatchNorm, CPUSyncBatchNorm))]
    synced = CPUSyncBatchNorm if ddist.device().type == "cpu" else nn.SyncBatchNorm
    for parent, name, child in swaps:
        setattr(parent, name, _synced(child, synced))

    def undo():
        for parent, name, child in swaps:
            child.train(getattr(parent, name).training)
            setattr(parent, name, child)
    return undo


def _synced(bn: nn.modules.batchnorm._BatchNorm, synced: type) -> nn.Module:
    """A `synced` BatchNorm holding `bn`'s own Parameters and buffers (not copies)."""
    sync = synced(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    if bn.affine:
        sync.weight, sync.bias = bn.weight, bn.bias
    sync.running_mean, sync.running_var, sync.num_batches_tracked = bn.running_mean, bn.running_var, \
        bn.num_batches_tracked
    return sync.train(bn.training)
