"""fastai v1's text loaders for ranks: SortishSampler over the global batch, language-model streams sharded by position.
Imported by ddipp.fastai1.loaders only once fastai.text is."""
import numpy as np
from fastai.text.data import LanguageModelPreLoader, SortishSampler, pad_collate

from ..core.sharding import global_rngs_seeded
from .compat import sortish_chunks

__all__ = ["GlobalSortishSampler", "LanguageModelPreLoader", "ShardedLMStreams", "SortishSampler", "pad_collate"]


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
        with global_rngs_seeded(self.seed + self.epoch):
            super().on_epoch_begin()
