"""ddipp.core.sharding's invariants, checked by building every rank's sampler in one process (plain torch samplers)."""
import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler

from ddipp.core.sharding import ShardedEvalBatchSampler, ShardedSampler


def _shards(sampler, world_size, seed=7, epoch=0):
    shards = [ShardedSampler(sampler, r, world_size, seed) for r in range(world_size)]
    for s in shards:
        s.set_epoch(epoch)
    return [list(s) for s in shards]


@pytest.mark.parametrize("n, world_size", [(10, 2), (11, 2), (13, 3), (3, 4)])
def test_a_sequential_order_is_split_every_nth_position(n, world_size):
    shards = _shards(SequentialSampler(range(n)), world_size)
    usable = n // world_size * world_size
    for r, shard in enumerate(shards):
        assert shard == list(range(r, usable, world_size))
        assert len(shard) == len(ShardedSampler(SequentialSampler(range(n)), r, world_size, 0))


def test_a_shuffled_order_is_the_same_on_all_ranks_and_changes_with_the_epoch():
    sampler = RandomSampler(range(101))
    torch.manual_seed(1)
    epoch0 = _shards(sampler, 2, epoch=0)
    torch.manual_seed(2)  # ranks' own generators differ: the order must not depend on them
    again = _shards(sampler, 2, epoch=0)
    epoch1 = _shards(sampler, 2, epoch=1)
    assert epoch0 == again and epoch0 != epoch1
    for shards in (epoch0, epoch1):
        assert not set(shards[0]) & set(shards[1]) and len(set(shards[0]) | set(shards[1])) == 100


def test_drawing_an_order_leaves_the_global_generators_as_they_were():
    torch.manual_seed(3)
    np.random.seed(3)
    expected = torch.rand(1), np.random.rand()
    torch.manual_seed(3)
    np.random.seed(3)
    _shards(RandomSampler(range(10)), 2)
    assert (torch.rand(1), np.random.rand()) == expected


@pytest.mark.parametrize("n, bs, world_size", [(10, 4, 2), (9, 4, 2), (5, 2, 3), (1, 4, 2)])
def test_eval_batches_cover_each_item_once_and_placeholders_fill_empty_parts(n, bs, world_size):
    batches = [list(range(i, min(i + bs, n))) for i in range(0, n, bs)]
    samplers = [ShardedEvalBatchSampler(batches, r, world_size) for r in range(world_size)]
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == len(batches) for p in per_rank)  # every rank runs every batch
    for k, batch in enumerate(batches):
        sizes = samplers[0].sizes(k)
        real = [per_rank[r][k][:sizes[r]] for r in range(world_size)]
        assert sorted(i for part in real for i in part) == batch
        for r in range(world_size):
            assert per_rank[r][k] == (batch[r::world_size] or batch[:1])
