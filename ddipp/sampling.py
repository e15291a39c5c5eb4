"""Sharding a loader's own order across ranks: training shards, exact evaluation shards and their undoing.

Convention (DESIGN.md): a rank's shard is every N-th position of the loader's order, starting at its
rank, so global step k of N ranks with batch b covers the items of step k of one process with batch N*b.
"""
import random
from contextlib import contextmanager
from typing import Any, List, Sequence

import numpy as np
import torch
import torch.distributed as dist
from fastai.basic_data import DeviceDataLoader
from fastai.text.data import LanguageModelPreLoader, SortishSampler
from torch.utils.data import BatchSampler, Sampler, SequentialSampler

from .compat import sortish_chunks


@contextmanager
def _global_rngs_seeded(seed: int):
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
        with _global_rngs_seeded(self.seed + self.epoch):
            order = list(self.sampler)
        usable = len(order) // self.world_size * self.world_size
        return iter(order[self.rank:usable:self.world_size])

    def __len__(self) -> int:
        return len(self.sampler) // self.world_size


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
        return [len(self.batches[k][r::self.world_size]) for r in range(self.world_size)]


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


class GlobalSortishSampler(SortishSampler):
    """fastai's SortishSampler with batches of the global batch size N*b, the one short batch last.

    Each global batch is a run of similar lengths, so every rank's batch of b is too; keeping the short
    batch last keeps the later global batches aligned with the ranks' batches."""

    def __iter__(self):
        first, rest = sortish_chunks(self)
        full = [ck for ck in rest if len(ck) == self.bs]
        short = [ck for ck in rest if len(ck) < self.bs]
        full = [full[i] for i in np.random.permutation(len(full))]
        return iter(np.concatenate([first, *full, *short]).astype(np.int64))


class ShardedLMStreams(LanguageModelPreLoader):
    """fastai's language-model streams of `preloader` with one row per item of the global batch (`streams`).

    Sharded by position, rank r trains on rows r, r+N, ...: each its own contiguous stream, the rows of all
    ranks a partition of the corpus. The documents are shuffled alike on every rank, anew each epoch
    (`set_epoch`), with the shared `seed`."""

    def __init__(self, preloader: LanguageModelPreLoader, streams: int, seed: int):
        super().__init__(preloader.dataset, preloader.lengths, streams, preloader.bptt, preloader.backwards,
                         preloader.shuffle)
        self.bs, self.seed, self.epoch = streams, seed, 0  # fastai multiplied bs by WORLD_SIZE: undo that

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def on_epoch_begin(self, **kwargs) -> None:
        if self.idx is None:
            self.allocate_buffers()  # so that fastai shuffles the documents in the first epoch too
        with _global_rngs_seeded(self.seed + self.epoch):
            super().on_epoch_begin()


def _train_sampler(sampler: Sampler, world_size: int) -> Sampler:
    """The order to shard: fastai's SortishSampler buckets over the global batch, so each rank's batch is alike."""
    if isinstance(sampler, SortishSampler):
        return GlobalSortishSampler(sampler.data_source, sampler.key, sampler.bs * world_size)
    return sampler


def shard_train_loader(loader: DeviceDataLoader, rank: int, world_size: int, seed: int) -> DeviceDataLoader:
    """A copy of `loader` that yields rank `rank`'s shard of its order, in batches of the same size.

    A language-model loader gets streams for the global batch (`ShardedLMStreams`), read in order."""
    batches, dataset = loader.dl.batch_sampler, loader.dl.dataset
    sampler = _train_sampler(batches.sampler, world_size)
    if isinstance(dataset, LanguageModelPreLoader):
        dataset = ShardedLMStreams(dataset, batches.batch_size * world_size, seed)
        sampler = SequentialSampler(dataset)
    sampler = ShardedSampler(sampler, rank, world_size, seed)
    return _with(loader, dataset, BatchSampler(sampler, batches.batch_size, batches.drop_last))


def repeat_passes(loader: DeviceDataLoader, passes: int) -> DeviceDataLoader:
    """A copy of the sharded training `loader` whose every epoch reads its shard `passes` times (RepeatedBatches)."""
    return _with(loader, loader.dl.dataset, RepeatedBatches(loader.dl.batch_sampler, passes))


def shard_eval_loader(loader: DeviceDataLoader, rank: int, world_size: int) -> DeviceDataLoader:
    """A copy of `loader` whose batch k is rank `rank`'s part of the loader's batch k.

    A language-model loader's batch k is step k of all its streams (`lm_eval_loader`), whatever batch size the
    loader has: each rank keeps the same rows at every step."""
    loader = lm_eval_loader(loader)
    batches = ShardedEvalBatchSampler(list(loader.dl.batch_sampler), rank, world_size)
    return _with(loader, loader.dl.dataset, batches)


def lm_eval_loader(loader: DeviceDataLoader) -> DeviceDataLoader:
    """`loader`, or for a language model's loader whose batches are smaller than its streams, a copy whose batch k
    is step k of all the streams: the single-process loader with the global batch.

    fastai builds a launched process's preloader with bs·N streams but its loader with batches of bs, so a rank's
    rows would hop between streams from batch to batch (validate() and get_preds() outside a fit)."""
    dataset = loader.dl.dataset
    if not isinstance(dataset, LanguageModelPreLoader) or loader.dl.batch_sampler.batch_size == dataset.bs:
        return loader
    return _with(loader, dataset, BatchSampler(SequentialSampler(dataset), dataset.bs, drop_last=False))


def _with(loader: DeviceDataLoader, dataset, batch_sampler: Sampler) -> DeviceDataLoader:
    """A copy of `loader` reading `dataset` in the batches of `batch_sampler`."""
    kwargs = dict(loader.dl.init_kwargs, batch_sampler=batch_sampler, batch_size=1, shuffle=False, sampler=None,
                  drop_last=False)
    return DeviceDataLoader(loader.dl.__class__(dataset, **kwargs), loader.device, loader.tfms, loader.collate_fn)
