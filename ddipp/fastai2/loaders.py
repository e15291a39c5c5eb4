"""fastai v2 loaders across ranks: a training loader's own order sharded by position, validation batches split in parts.

Built on ddipp.core.sharding: ShardedSampler shards the order `get_idxs()` gives, ShardedEvalBatchSampler splits the
batches of a validation loader; these classes only read fastai's DataLoader through its own methods (`get_idxs`,
`do_item`, `do_batch`, `after_batch`, ...), so a loader's transforms, collation and order are its own. A PyTorch
DataLoader is read through them as a fastai DataLoader of its sampler's order and its collate_fn (`TorchDL`).
"""
import random
from typing import Optional, Union

import torch
from fastai.data.load import DataLoader
from fastcore.basics import defaults
from fastai.text.data import LMDataLoader, SortedDL
from fastai.torch_core import apply, to_detach

from ..core.dist import loader_workers
from ..core.sharding import (LoaderView, ShardedEvalBatchSampler, ShardedSampler, SplitBatchSampler,
                              global_batches, global_rngs_seeded)


class TorchDL(DataLoader):
    """The PyTorch DataLoader `dl` as a fastai DataLoader of the same batches: its sampler's order (`get_idxs`), its
    dataset's items and its `collate_fn` in batches of its `batch_size` (its `drop_last`), on as many worker processes;
    its batches stay where `collate_fn` leaves them (the learner moves them to the model, as fastai does `dl`'s)."""

    def __init__(self, dl: torch.utils.data.DataLoader):
        self.torch_dl = dl
        super().__init__(dl.dataset, bs=dl.batch_size, drop_last=dl.drop_last, n=len(dl.sampler),
                         num_workers=dl.num_workers, pin_memory=dl.pin_memory, timeout=dl.timeout,
                         persistent_workers=dl.persistent_workers, pin_memory_device=dl.pin_memory_device)

    def get_idxs(self):
        """The sampler's order; a sampler with a generator of its own (`shuffle` with `generator=`) draws as one
        without: from torch's global generator, which ddipp seeds alike on every rank while it draws an order."""
        sampler = self.torch_dl.sampler
        own = getattr(sampler, "generator", None)
        if own is None:
            return list(sampler)
        sampler.generator = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_()))
        try:
            return list(sampler)
        finally:
            sampler.generator = own

    def do_batch(self, b):
        return self.torch_dl.collate_fn(b)


def fastai_loader(dl):
    """`dl`, or a PyTorch DataLoader of a map-style dataset in batches of `batch_size` as the fastai DataLoader of the
    same batches (`TorchDL`); any other loader as it is."""
    if (isinstance(dl, torch.utils.data.DataLoader) and dl.batch_size is not None
            and not isinstance(dl.dataset, torch.utils.data.IterableDataset)):
        return TorchDL(dl)
    return dl


def batch_size(dl: Union[DataLoader, torch.utils.data.DataLoader]) -> Optional[int]:
    """A fastai loader's `bs` or a PyTorch loader's `batch_size` (None for one with a batch_sampler of its own)."""
    return dl.batch_size if isinstance(dl, torch.utils.data.DataLoader) else dl.bs


class LoaderOrder:
    """The order `dl.get_idxs()` gives, drawn as one process with the global batch `global_bs` draws it: a sampler.

    fastai shuffles with the loader's own generator (`dl.rng`), and some loaders with the global ones (SortedDL with
    numpy's, LMDataLoader with python's): ShardedSampler seeds the global generators while it draws the order, and the
    loader's generator is seeded from them, so every rank draws the same order. Meanwhile `dl.bs` reads `global_bs`, so
    an order made of batches (SortedDL's length buckets) is made of global batches. The loader is left as it was."""

    def __init__(self, dl: DataLoader, global_bs: int):
        self.dl, self.global_bs = dl, global_bs

    def __iter__(self):
        dl = self.dl
        rng, bs = dl.rng, dl.bs
        dl.rng, dl.bs = random.Random(random.getrandbits(64)), self.global_bs
        try:
            return iter(list(dl.get_idxs()))
        finally:
            dl.rng, dl.bs = rng, bs

    def __len__(self) -> int:
        return self.dl.n


class _ReadsThrough(DataLoader):
    """A fastai DataLoader of its own order that reads its items through the loader `dl` (its transforms, collation,
    device); any other attribute is `dl`'s. It has `dl`'s worker processes (num_workers), or this rank's share of the
    host's cores if `dl` had fastai's default (one per core)."""
    _default = "dl"

    def __init__(self, dl: DataLoader, bs, n: int, drop_last: bool = False):
        self.dl = dl
        fake = dl.fake_l
        super().__init__(dl.dataset, bs=bs, n=n, drop_last=drop_last, shuffle=False, indexed=dl.indexed,
                         device=dl.device, num_workers=loader_workers(fake.num_workers, min(16, defaults.cpus)),
                         pin_memory=fake.pin_memory,
                         timeout=fake.timeout, persistent_workers=fake.persistent_workers,
                         pin_memory_device=fake.pin_memory_device)

    def randomize(self) -> None:  # the order is drawn by the sharding, not by this loader's generator
        pass

    def before_iter(self) -> None:
        self.dl.before_iter()

    def after_iter(self) -> None:
        self.dl.after_iter()

    def after_batch(self, b):
        return self.dl.after_batch(b)


class _PartsDL(_ReadsThrough):
    """A loader whose each "item" is a rank's part of a batch of `dl`, collated as `dl` collates that part (a SortedDL's
    padded as its whole batch: `pad_to`), whose `to_detach` does not gather across ranks as fastai's does under
    WORLD_SIZE > 1: once unsharded, every rank holds the whole batch."""
    pad_to = None  # a SortedDL's items -> the longest item of their batch

    def create_item(self, part):
        return collate_padded(self.dl, part, self.pad_to)

    def do_batch(self, b):
        return b  # create_item collated the part already

    def to_detach(self, b, cpu: bool = True, gather: bool = True):
        return to_detach(b, cpu, gather=False)


class ShardedTrainDL(_ReadsThrough):
    """Rank `rank`'s shard of the training loader `dl`: positions rank, rank+N, rank+2N, ... of `dl`'s own order.

    The order is `dl.get_idxs()` (a user's override included) drawn alike on every rank from `seed` and the epoch
    (`set_epoch`): a new order each epoch, every item at most once per epoch across ranks; the last len % N positions
    are dropped so every rank has as many batches. Batches are `dl.bs` items (the global batch is N x bs), so step k
    of the N ranks covers the items of step k of one process with batch N x bs. A language-model loader is read as
    one with N x bs streams (`global_batch_loader`): rank r trains on rows r, r+N, ... of them. A SortedDL's batch is
    padded as the whole global batch is (`collate_padded`)."""

    def __init__(self, dl: DataLoader, rank: int, world_size: int, seed: int):
        source = global_batch_loader(dl, world_size)
        self.order = ShardedSampler(LoaderOrder(source, dl.bs * world_size), rank, world_size, seed)
        self.pad_to = None  # a SortedDL's items -> the longest item of their global batch, this epoch
        super().__init__(source, bs=dl.bs, n=len(self.order), drop_last=dl.drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def get_idxs(self):
        if not isinstance(self.dl, SortedDL):
            return list(self.order)
        order = self.order.global_order()
        self.pad_to = longest_of_batches(self.dl, global_batches(order, self.bs, self.order.world_size))
        return self.order.shard(order)

    def create_batches(self, samps):
        if self.pad_to is None:
            return super().create_batches(samps)
        return (collate_padded(self.dl, list(chunk), self.pad_to) for chunk in self.chunkify(samps))

    def do_item(self, s):
        return self.dl.do_item(s)

    def do_batch(self, b):
        return self.dl.do_batch(b)


class SplitTrainDL(_PartsDL):
    """Rank `rank`'s part of each batch of the training loader `dl` (split_batches): items rank, rank+N, ... of batch k
    of `dl`'s own order, drawn alike on every rank from `seed` and the epoch (`set_epoch`), in batches of `dl.bs` as one
    process reads them (its drop_last too): the N ranks' step k is one process's step k. `sizes(k)` says how many
    items each rank holds of batch k (a rank with none evaluates a placeholder, as ShardedEvalDL's do)."""

    def __init__(self, dl: DataLoader, rank: int, world_size: int, seed: int):
        self.parts = SplitBatchSampler(LoaderOrder(dl, dl.bs), dl.bs, dl.drop_last, rank, world_size, seed)
        self.order = self.parts.sampler  # the order's seed, as ShardedTrainDL's (a Checkpoint keeps it)
        super().__init__(dl, bs=None, n=len(self.parts))

    def set_epoch(self, epoch: int) -> None:
        self.parts.set_epoch(epoch)

    def sizes(self, k: int):
        return self.parts.sizes(k)

    def get_idxs(self):
        batches = self.parts.global_batches()
        self.pad_to = longest_of_batches(self.dl, batches)
        return self.parts.split(batches)


def global_batch_loader(dl: DataLoader, world_size: int) -> DataLoader:
    """The loader whose order and items the ranks share: `dl`, or for a language model `dl` with N x bs streams.

    fastai's LMDataLoader cuts its corpus into `bs` streams when it is made; one process with the global batch reads
    N x bs of them, one row each."""
    if isinstance(dl, LMDataLoader) and world_size > 1:
        return dl.new(bs=dl.bs * world_size)
    return dl


class ShardedEvalDL(_PartsDL):
    """Rank `rank`'s part of each batch of the evaluation loader `dl`: items rank, rank+N, ... of its batch k.

    Batch k is what `dl` yields as batch k in one process (its `get_idxs()` order in batches of `dl.bs`; a shuffled
    order drawn alike on every rank); every item is evaluated once across ranks, and `unshard(x, sizes(k))` rebuilds
    the whole batch on every rank (a rank whose part is empty evaluates a placeholder item, which unshard drops)."""

    def __init__(self, dl: DataLoader, rank: int, world_size: int):
        with global_rngs_seeded(0):
            idxs = list(LoaderOrder(dl, dl.bs))
        usable = len(idxs) // dl.bs * dl.bs if dl.drop_last else len(idxs)
        batches = [idxs[i:i + dl.bs] for i in range(0, usable, dl.bs)]
        self.parts = ShardedEvalBatchSampler(batches, rank, world_size)
        self.pad_to = longest_of_batches(dl, batches)
        super().__init__(dl, bs=None, n=len(self.parts))  # each "item" is a rank's part of a batch

    def sizes(self, k: int):
        return self.parts.sizes(k)

    def get_idxs(self):
        return list(self.parts)


def longest_of_batches(dl: DataLoader, batches) -> Optional[dict]:
    """For a SortedDL, each item of `batches` -> the longest item of its batch by the loader's lengths (`dl.res`);
    None for another loader."""
    if not isinstance(dl, SortedDL) or len(dl.res) == 0:
        return None
    pad_to = {}
    for batch in batches:
        pad_to.update(dict.fromkeys(batch, max(batch, key=dl.res.__getitem__, default=None)))
    return pad_to


def collate_padded(dl: DataLoader, part: list, pad_to: Optional[dict]):
    """`dl`'s batch of the items `part` of a larger batch, padded as `dl` pads that whole batch.

    fastai pads a SortedDL's batch (Pad_Chunk, pad_input_chunk) to its longest item, by chunks: a rank padding its
    part to the part's longest would give its rows other padding than one process, so the whole batch's longest item
    (`pad_to`) is collated with the part, then its row is dropped."""
    items = [item for item in map(dl.do_item, part) if item is not None]
    longest = pad_to[part[0]] if pad_to and part else None
    if longest is None or max(dl.res[i] for i in part) >= dl.res[longest]:
        return dl.do_batch(items)
    return apply(lambda x: x[:-1], dl.do_batch(items + [dl.do_item(longest)]))


def splittable(dl) -> bool:
    """True for a loader ShardedEvalDL can split: a fastai DataLoader of indexed items in batches of `bs`."""
    return isinstance(dl, DataLoader) and dl.bs is not None and dl.indexed and dl.n is not None


class WholeEvalDL(LoaderView):
    """The loader `dl` as it is, evaluated whole on this rank, with a `to_detach` that does not gather across ranks.

    fastai gathers every metric's values across ranks when WORLD_SIZE > 1; a rank that evaluates the whole set alone
    (outside a fit, or a loader that cannot be split) must not wait for the others, nor count their copies."""

    def to_detach(self, b, cpu: bool = True, gather: bool = True):
        return to_detach(b, cpu, gather=False)
