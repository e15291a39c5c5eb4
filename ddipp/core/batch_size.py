"""The largest batch size a training step takes on every rank (bs_find): doubling from a start, then bisecting; each
trial runs on this rank alone and its verdict is agreed across ranks (the minimum) before the next trial."""
import time
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import dist as ddist
from .memory import release_memory
from .rng import rng_state, set_rng_state
from .shard import walk
from .sharding import part_sizes
from .state import full_state, load_full_state

CUDA_OOM = "CUDA out of memory"
CPU_OOM = "DefaultCPUAllocator: can't allocate memory"
FAILED, OUT_OF_MEMORY, PASSED = 0, 1, 2  # a trial's outcome; the group's is the least of its ranks'

Trial = Tuple[int, bool, float]  # size, passed on every rank, seconds
STEPS = 2  # a trial's training steps: the second holds the optimizer's state beside the batch's activations


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is running out of memory: torch's OutOfMemoryError, or a RuntimeError with CUDA's or the CPU
    allocator's text."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and (CUDA_OOM in text or CPU_OOM in text))


def check_sizes(start: int, max_bs: Optional[int], items: int) -> None:
    """Refuse a start below 1, a max_bs below start or above the training set's `items`, a training set below start."""
    if start < 1:
        raise ValueError(f"bs_find: start={start}; a batch holds 1 item or more, e.g. start=2")
    if items < start:
        raise ValueError(f"bs_find: the training set holds {items} items, fewer than start={start}; "
                         f"give start={items} or less")
    if max_bs is not None and max_bs < start:
        raise ValueError(f"bs_find: max_bs={max_bs} is below start={start}; give max_bs={start} or more "
                         f"(at most the training set's {items} items), or max_bs=None for {items}")
    if max_bs is not None and max_bs > items:
        raise ValueError(f"bs_find: max_bs={max_bs} is above the training set's {items} items, the largest batch it "
                         f"has; give max_bs={items} or less, or max_bs=None for {items}")


def check_start(start: int, processes: int, batchnorm: bool) -> None:
    """Refuse a start that gives one of `processes` one item a step when the model has BatchNorm (it cannot train
    on one)."""
    fewest = min(part_sizes(start, processes))
    if batchnorm and fewest < 2:
        raise ValueError(f"bs_find: start={start} gives a process {fewest} item{'s' * (fewest != 1)} a step, and the "
                         f"model's BatchNorm cannot train on fewer than 2: give start={2 * processes} or more")


def find_batch_size(trial: Callable[[int], None], start: int, max_bs: int) -> Tuple[int, List[Trial]]:
    """The largest size in [start, max_bs] whose `trial(size)` passes on every rank (doubling, then bisecting), and
    the trials; `trial` raises on out of memory and holds no collective."""
    trials: List[Trial] = []

    def passes(size: int) -> bool:
        began = time.perf_counter()
        passed = _agree(_outcome(trial, size), size) == PASSED
        trials.append((size, passed, time.perf_counter() - began))
        return passed

    size, good, bad = start, None, None
    while True:
        if not passes(size):
            bad = size
            break
        good = size
        if size == max_bs:
            break
        size = min(2 * size, max_bs)
    if good is None:
        raise torch.OutOfMemoryError(
            f"bs_find: a training step at batch size {start} (start) ran out of memory on at least one rank; give a "
            f"smaller start, or hold less per rank: split_batches=True (a rank takes 1/N of a global batch), "
            f"shard=True (a rank holds 1/N of the model's state) or ddipp.Recompute() (activations recomputed in "
            f"backward)")
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if passes(middle):
            good = middle
        else:
            bad = middle
    return good, trials


def trials_table(trials: List[Trial], found: int) -> str:
    """The trials as a text table (size, fits or out of memory, seconds) and the verdict line."""
    rows = [f"{'batch size':>10}  {'verdict':<13}  {'seconds':>7}"]
    rows += [f"{size:>10}  {'fits' if passed else 'out of memory':<13}  {seconds:>7.2f}"
             for size, passed, seconds in trials]
    return "\n".join(rows + [f"bs_find: the largest batch size that fits: {found}"])


def report(trials: List[Trial], found: int, split: bool, shard: bool, processes: int) -> str:
    """The trials' table and what the size found means for a fit of `processes` (split_batches, shard=True)."""
    lines = [trials_table(trials, found)]
    if shard:
        lines.append("bs_find: shard=True: the trials ran the whole model on each process; a sharded step holds less, "
                     "so a larger batch may fit")
    if processes > 1 and split:
        parts = " + ".join(map(str, part_sizes(found, processes)))
        lines.append(f"bs_find: global batch {found} ({parts} over {processes} processes, split_batches)")
    elif processes > 1:
        lines.append(f"bs_find: bs={found} per process: global batch {found * processes} = {found} x {processes} "
                     "processes")
    return "\n".join(lines)


class Kept:
    """What trials' training steps change, copied to the CPU (a GPU holds no second copy while they run): the model's
    weights and buffers, the optimizer's state, the gradients, the modules' modes, every generator."""

    def __init__(self, model: nn.Module, optimizer: Any):
        self.state = walk(full_state(model, optimizer), lambda t: t.detach().to("cpu", copy=True))
        self.grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
        self.modes = [m.training for m in model.modules()]
        self.rng = rng_state()

    def put_back(self, model: nn.Module, optimizer: Any) -> None:
        load_full_state(model, optimizer, self.state)
        for p, grad in zip(model.parameters(), self.grads):
            p.grad = None if grad is None else grad.to(p.device)
        for m, training in zip(model.modules(), self.modes):
            m.training = training
        set_rng_state(self.rng)



def _outcome(trial: Callable[[int], None], size: int) -> int:
    """PASSED, OUT_OF_MEMORY, or FAILED (another error, kept to raise once the group has heard of it)."""
    try:
        trial(size)
        return PASSED
    except Exception as error:
        if not out_of_memory(error):
            _agree(FAILED, size)
            raise
    release_memory()  # the error's frames are gone: what the failed step held can be freed
    return OUT_OF_MEMORY


def _agree(outcome: int, size: int) -> int:
    """The least outcome over the ranks of the default group (this rank's alone outside a group of 2 or more)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return outcome
    least = torch.tensor([outcome], device=ddist.device())  # where the backend's collectives work
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    if int(least.item()) == FAILED and outcome != FAILED:
        raise RuntimeError(f"bs_find: another rank's training step at batch size {size} failed with an error other "
                           f"than out of memory; that rank's output names it")
    return int(least.item())
