"""ddipp.Recompute's mechanism: chosen blocks of a model keep only their inputs for backward and run their forward
again there (torch's non-reentrant checkpoint), their BatchNorm layers then updating throwaway copies of their running
statistics, so the statistics are those of the same fit without recomputation (plain checkpointing updates them twice,
pytorch#96136).

A block's `forward` becomes an instance attribute for the fit (its class, submodules and state_dict keys unchanged), so
BatchNorm layers swapped in later (sync_bn) are found when the block runs again, and a sharded copy of the model
(ddipp.core.shard) copies the recomputing forward with its block."""
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable, List, Optional

from torch import nn
from torch.utils.checkpoint import checkpoint

from .shard import default_units, names_in


def recompute_names(model: nn.Module, modules: Optional[Iterable[nn.Module]]) -> List[str]:
    """The names in `model` of the blocks to recompute: `modules`, or ddipp.core.shard's default units (the blocks of
    the model's top-level Sequential children, else its top-level children); a ValueError naming one not in `model`."""
    return names_in(model, default_units(model) if modules is None else list(modules), lambda module: (
        f"Recompute(modules=...) was given a {type(module).__name__} that is not a submodule of the model "
        f"({type(model).__name__}): give modules of learn.model, e.g. Recompute(modules=list(learn.model[0]))"))


def recomputing(model: nn.Module, names: Iterable[str]) -> Callable[[], None]:
    """Make the blocks of `model` called `names` recompute their activations in backward; returns the undo."""
    blocks = [model.get_submodule(name) for name in names]
    for block in blocks:
        block.forward = Recomputed(block)

    def undo() -> None:
        for block in blocks:
            vars(block).pop("forward", None)
    return undo


class Recomputed:
    """A block's forward that saves only its inputs and runs again in backward (its class's forward: a sharded
    unit's hooks stay outside), its BatchNorm layers then updating throwaway statistics."""

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, *args, **kwargs):
        block = self.block
        return checkpoint(type(block).forward, block, *args, use_reentrant=False,
                          context_fn=lambda: (nullcontext(), _throwaway_statistics(block)), **kwargs)


@contextmanager
def _throwaway_statistics(block: nn.Module):
    """For the block's recomputation: each training BatchNorm's running statistics swapped for copies (not written
    back in place: the first forward's batch_norm saved the originals for its backward), then put back."""
    kept = [(bn, bn.running_mean, bn.running_var, bn.num_batches_tracked) for bn in block.modules()
            if isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.training and bn.running_mean is not None]
    for bn, mean, var, count in kept:
        bn.running_mean, bn.running_var, bn.num_batches_tracked = mean.clone(), var.clone(), count.clone()
    try:
        yield
    finally:
        for bn, mean, var, count in kept:
            bn.running_mean, bn.running_var, bn.num_batches_tracked = mean, var, count
