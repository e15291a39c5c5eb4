"""Sharding an index order across ranks, for training and for exact evaluation, and gathering the evaluated parts.

Convention (DESIGN.md): a rank's shard is every N-th position of the loader's order, starting at its
rank, so global step k of N ranks with batch b covers the items of step k of one process with batch N*b.
Written once over index orders and tensors; each fastai adapter builds its loaders on it.
"""
import random
from contextlib import contextmanager
from typing import Any, List, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, Sampler


@contextmanager
def global_rngs_seeded(seed: int):
    """Seed python's, numpy's and torch's CPU generators for the block, then put their states back."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)  # CPU only: GPU generators (dropout) stay per rank
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class ShardedSampler(Sampler):
    """Rank `rank`'s share of `sampler`'s order: positions rank, rank+N, rank+2N, ...

    Every rank draws the same order: the global generators are seeded with `seed + epoch` while the
    order is drawn (then restored), so a shuffled sampler shuffles alike on all ranks and differently
    each epoch (call `set_epoch`); a sequential one stays sequential. The last len % N positions are
    dropped so that every rank has the same number of items (each item is used at most once per epoch)."""

    def __init__(self, sampler: Sampler, rank: int, world_size: int, seed: int):
        self.sampler, self.rank, self.world_size, self.seed, self.epoch = sampler, rank, world_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(self.shard(self.global_order()))

    def global_order(self) -> list:
        """This epoch's order of every rank's items, the same on every rank (the positions the ranks share)."""
        with global_rngs_seeded(self.seed + self.epoch):
            order = list(self.sampler)
        return order[:len(order) // self.world_size * self.world_size]

    def shard(self, order: list) -> list:
        """This rank's positions of `order` (a `global_order`)."""
        return order[self.rank::self.world_size]

    def __len__(self) -> int:
        return len(self.sampler) // self.world_size


class LoaderView:
    """The loader `dl` seen through another object: its batches, its length and its attributes, for a subclass to
    change one of them."""

    def __init__(self, dl):
        self.dl = dl

    def __iter__(self):
        return iter(self.dl)

    def __len__(self) -> int:
        return len(self.dl)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "dl":
            raise AttributeError(name)
        return getattr(self.dl, name)


def global_batches(order: Sequence[int], bs: int, world_size: int) -> List[List[int]]:
    """The global batches of `order` (a ShardedSampler's global order) when each rank reads its shard in batches of
    `bs`: global batch k holds batch k of every rank, the items one process with batch N x bs reads at its step k."""
    step = bs * world_size
    return [list(order[i:i + step]) for i in range(0, len(order), step)]


class RepeatedBatches(Sampler):
    """The batches of `batches`, over a ShardedSampler, `passes` times back to back, each pass in a new order.

    Epoch e of a fit reads the shard's epochs e*passes, ..., e*passes + passes - 1 (the ShardedSampler's epoch, set
    for epoch e, is moved along pass by pass), so the batches follow one another as one process's epochs do."""

    def __init__(self, batches: BatchSampler, passes: int):
        self.batches, self.passes = batches, passes

    def __iter__(self):
        sampler = self.batches.sampler
        first = sampler.epoch * self.passes
        for p in range(self.passes):
            sampler.set_epoch(first + p)
            yield from self.batches

    def __len__(self) -> int:
        return self.passes * len(self.batches)


class ShardedEvalBatchSampler(Sampler):
    """Rank `rank`'s part of each of the loader's batches: items rank, rank+N, ... of batch k.

    Each item is evaluated exactly once across ranks (no padding duplicates), and `unshard` of the
    ranks' outputs rebuilds batch k of the single-process loader, in its order. A rank whose part of a
    batch is empty (a batch of fewer than N items) gets the batch's first item as a placeholder, which
    `unshard` drops, so that every rank runs the same number of batches."""

    def __init__(self, batches: Sequence[Sequence[int]], rank: int, world_size: int):
        self.batches, self.rank, self.world_size = [list(b) for b in batches], rank, world_size

    def __iter__(self):
        for batch in self.batches:
            yield batch[self.rank::self.world_size] or batch[:1]

    def __len__(self) -> int:
        return len(self.batches)

    def sizes(self, k: int) -> List[int]:
        """How many real items each rank holds of batch k."""
        return part_sizes(len(self.batches[k]), self.world_size)


def part_sizes(batch_len: int, world_size: int) -> List[int]:
    """How many items each rank holds of a batch of `batch_len` split into items rank, rank+N, ..."""
    return [len(range(r, batch_len, world_size)) for r in range(world_size)]


class SplitBatchSampler(Sampler):
    """Rank `rank`'s part of each global batch (split_batches): items rank, rank+N, ... of batch k of `bs` items of
    `sampler`'s order, the order drawn alike on every rank from `seed` and the epoch (`set_epoch`) as ShardedSampler
    draws it. Step k of the N ranks covers batch k of one process with batch `bs`, the last short one too unless
    `drop_last`; a rank whose part is empty gets the batch's first item as a placeholder (`sizes` says 0 for it)."""

    def __init__(self, sampler: Sampler, bs: int, drop_last: bool, rank: int, world_size: int, seed: int):
        self.sampler = ShardedSampler(sampler, 0, 1, seed)  # the whole order (its set_epoch: RepeatedBatches)
        self.bs, self.drop_last, self.rank, self.world_size = bs, drop_last, rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def seed(self) -> int:
        """The seed the order is drawn with (a Checkpoint keeps it)."""
        return self.sampler.seed

    @seed.setter
    def seed(self, seed: int) -> None:
        self.sampler.seed = seed

    def global_batches(self) -> List[List[int]]:
        """This epoch's batches of one process, the same on every rank."""
        order = list(self.sampler)
        return [order[i:i + self.bs] for i in range(0, len(self) * self.bs, self.bs)]

    def split(self, batches: List[List[int]]) -> List[List[int]]:
        """This rank's part of each of `batches` (`global_batches`), a placeholder for an empty one."""
        return list(ShardedEvalBatchSampler(batches, self.rank, self.world_size))

    def __iter__(self):
        return iter(self.split(self.global_batches()))

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.bs if self.drop_last else -(-n // self.bs)

    def sizes(self, k: int) -> List[int]:
        """How many real items each rank holds of batch k (of an epoch; past the last, of a later pass)."""
        k %= len(self)
        n = len(self.sampler)
        return part_sizes(min(self.bs, n - k * self.bs), self.world_size)

    def smallest_part(self) -> int:
        """The fewest real items a rank gets in a step of an epoch."""
        return min(min(self.sizes(k)) for k in {0, len(self) - 1})


def unshard(x: Any, sizes: List[int]) -> Any:
    """Gather every rank's part of a batch (tensors in `x`, any nesting) and rebuild the whole batch in order.

    `sizes[r]` is the number of real items rank r holds (see `ShardedEvalBatchSampler.sizes`)."""
    if isinstance(x, (list, tuple)):
        return type(x)(unshard(o, sizes) for o in x)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    world_size, longest = len(sizes), max(sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    mine = sizes[dist.get_rank()]
    padded[:mine] = x[:mine]
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded.contiguous())
    whole = x.new_empty((sum(sizes), *x.shape[1:]))
    for r, part in enumerate(parts):
        whole[r::world_size] = part[:sizes[r]]
    return whole


def pad_to_longest(x: torch.Tensor, pad_idx: int, pad_first: bool) -> torch.Tensor:
    """Token ids `x` (batch × length) padded to the longest of all ranks' parts of the batch, on fastai's side."""
    longest = torch.tensor(x.shape[1], device=x.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    pads = x.new_full((x.shape[0], int(longest) - x.shape[1]), pad_idx)
    return torch.cat([pads, x] if pad_first else [x, pads], dim=1)


def shared_seed() -> int:
    """A seed drawn on rank 0 and sent to every rank (call it on every rank): the seed of an order all ranks shard."""
    seed = [int(torch.randint(0, 2**31 - 1, ()))]
    dist.broadcast_object_list(seed, src=0)
    return seed[0]
