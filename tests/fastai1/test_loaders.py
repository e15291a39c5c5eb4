"""ddipp.fastai1.loaders: fastai v1's samplers and loaders sharded, every rank's built in one process (the sampler
invariants of ddipp.core.sharding: tests/core/test_sharding.py)."""
import numpy as np
import torch
from fastai.text.data import SortishSampler

from ddipp.core.sharding import ShardedSampler
from ddipp.fastai1.loaders import _train_sampler, shard_eval_loader, shard_train_loader


def _shards(sampler, world_size, seed=7, epoch=0):
    shards = [ShardedSampler(sampler, r, world_size, seed) for r in range(world_size)]
    for s in shards:
        s.set_epoch(epoch)
    return [list(s) for s in shards]


def test_sortish_order_keeps_length_buckets_within_each_rank_batch():
    lengths = np.random.default_rng(0).integers(5, 500, 2000)
    bs, world_size = 16, 2
    sampler = _train_sampler(SortishSampler(lengths, key=lambda i: lengths[i], bs=bs), world_size)
    spreads = []
    for shard in _shards(sampler, world_size):
        batches = [shard[i:i + bs] for i in range(0, len(shard) - bs + 1, bs)]
        spreads += [lengths[b].max() - lengths[b].min() for b in batches]
    assert np.median(spreads) < 15  # unsorted batches of this data spread over ~450
    assert max(lengths[shard[0]] for shard in _shards(sampler, world_size)) == lengths.max()  # longest first


def test_a_loader_left_at_fastais_default_workers_gets_the_ranks_share_of_the_cores(monkeypatch):
    from fastai.basic_data import DeviceDataLoader
    from fastai.core import defaults
    from torch.utils.data import DataLoader, TensorDataset

    from ddipp.core import dist
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(defaults, "cpus", 8)  # fastai's default num_workers: min(16, the cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    data = TensorDataset(torch.arange(40.0))
    for workers, expected in ((8, 4), (3, 3), (0, 0)):  # a number the user chose stays
        loader = DeviceDataLoader(DataLoader(data, batch_size=4, num_workers=workers), torch.device("cpu"))
        assert shard_train_loader(loader, 0, 2, seed=3).dl.num_workers == expected
        assert shard_eval_loader(loader, 0, 2).dl.num_workers == expected
