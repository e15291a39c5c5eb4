"""The sharding invariants of ddipp.fastai2.loaders, checked by building every rank's loader in one process (fastai's
loaders and PyTorch's); then a Learner on PyTorch DataLoaders trained on a notebook's 3 processes against one process
(on 2 launched ranks: test_callbacks.py's launched run)."""
import random

import numpy as np
import pytest
import torch
from fastai.data.load import DataLoader
from fastai.text.data import LMDataLoader, SortedDL
from torch.utils.data import DataLoader as TorchDataLoader

from ddipp.fastai2.loaders import ShardedEvalDL, ShardedTrainDL, TorchDL, batch_size, fastai_loader, splittable
from torch_loaders import check_torch_orders, check_torch_story, torch_story


def _shards(dl, world_size, seed=7, epoch=0):
    """Every rank's ShardedTrainDL of `dl`, each built after the global generators and `dl.rng` were set differently
    (ranks' own generators differ: the order must not depend on them)."""
    shards = []
    for r in range(world_size):
        random.seed(100 + r)
        np.random.seed(100 + r)
        torch.manual_seed(100 + r)
        dl.rng = random.Random(100 + r)
        shard = ShardedTrainDL(dl, r, world_size, seed)
        shard.set_epoch(epoch)
        shards.append(shard)
    return shards


def _orders(dl, world_size, **kwargs):
    return [s.get_idxs() for s in _shards(dl, world_size, **kwargs)]


def _batches(dl):
    return [b for b in dl]


@pytest.mark.parametrize("n, bs, world_size", [(10, 2, 2), (11, 2, 2), (13, 2, 3), (3, 1, 4)])
def test_a_sequential_order_is_split_every_nth_position_in_batches_of_bs(n, bs, world_size):
    dl = DataLoader(list(range(n)), bs=bs, drop_last=True)
    usable = n // world_size * world_size
    for r, shard in enumerate(_shards(dl, world_size)):
        assert shard.get_idxs() == list(range(r, usable, world_size))
        assert len(shard) == (n // world_size) // bs == len(_batches(shard))
        assert [int(i) for b in _batches(shard) for i in b] == list(range(r, usable, world_size))[:len(shard) * bs]


def test_step_k_of_the_ranks_covers_step_k_of_one_process_with_the_global_batch():
    dl = DataLoader(list(range(40)), bs=4, drop_last=True)
    single = _batches(DataLoader(list(range(40)), bs=8, drop_last=True))
    ranks = [_batches(s) for s in _shards(dl, 2)]
    assert len(ranks[0]) == len(ranks[1]) == len(single) == 5
    for k, batch in enumerate(single):
        assert sorted(torch.cat([ranks[0][k], ranks[1][k]]).tolist()) == batch.tolist()


def test_fastais_worker_processes_read_the_same_shards_and_parts():
    def batches(workers):
        train = ShardedTrainDL(DataLoader(list(range(40)), bs=4, num_workers=workers, shuffle=True, drop_last=True),
                               1, 2, seed=3)
        train.set_epoch(2)
        valid = ShardedEvalDL(DataLoader(list(range(11)), bs=4, num_workers=workers), 1, 2)
        return [b.tolist() for b in train], [b.tolist() for b in valid]
    assert batches(2) == batches(0)  # fastai's DataBlock loaders default to a worker per CPU


def test_a_loader_left_at_fastais_default_workers_gets_the_ranks_share_of_the_cores(monkeypatch):
    from ddipp.core import dist
    from fastcore.basics import defaults
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(defaults, "cpus", 8)  # what fastai's dataloaders() gives a loader: min(16, defaults.cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    items = list(range(40))
    for workers, expected in ((8, 4), (3, 3), (0, 0)):  # a number the user chose stays
        dl = DataLoader(items, bs=4, num_workers=workers, drop_last=True)
        assert ShardedTrainDL(dl, 0, 2, seed=3).fake_l.num_workers == expected
        assert ShardedEvalDL(dl, 0, 2).fake_l.num_workers == expected


def test_a_shuffled_order_is_the_same_on_all_ranks_and_changes_with_the_epoch():
    dl = DataLoader(list(range(101)), bs=5, shuffle=True, drop_last=True)
    epoch0, again, epoch1 = _orders(dl, 2, epoch=0), _orders(dl, 2, epoch=0), _orders(dl, 2, epoch=1)
    assert epoch0 == again and epoch0 != epoch1 and epoch0[0] != list(range(0, 100, 2))
    for shards in (epoch0, epoch1):
        assert not set(shards[0]) & set(shards[1]) and len(set(shards[0]) | set(shards[1])) == 100


def test_drawing_an_order_leaves_the_global_generators_and_the_loaders_own_as_they_were():
    dl = DataLoader(list(range(10)), bs=2, shuffle=True)
    shard = ShardedTrainDL(dl, 0, 2, seed=7)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    dl.rng = random.Random(3)
    expected = random.random(), np.random.rand(), float(torch.rand(1)), dl.rng.random()
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    dl.rng = random.Random(3)
    shard.get_idxs()
    assert (random.random(), np.random.rand(), float(torch.rand(1)), dl.rng.random()) == expected
    assert dl.bs == 2


class ReversedDL(DataLoader):
    def get_idxs(self):
        return list(reversed(super().get_idxs()))


def test_a_loader_with_an_order_of_its_own_is_sharded_in_that_order():
    assert _orders(ReversedDL(list(range(9)), bs=2), 2) == [[8, 6, 4, 2], [7, 5, 3, 1]]


def test_sorted_dl_buckets_lengths_over_the_global_batch():
    lengths = np.random.default_rng(0).integers(5, 500, 2000)
    bs, world_size = 16, 2
    dl = SortedDL(list(range(2000)), res=list(lengths), bs=bs, shuffle=True, drop_last=True)
    orders = _orders(dl, world_size)
    spreads = []
    for k in range(len(orders[0]) // bs):
        rank_batches = [lengths[order[k * bs:(k + 1) * bs]] for order in orders]
        global_batch = np.concatenate(rank_batches)
        spreads += [b.max() - b.min() for b in rank_batches] + [global_batch.max() - global_batch.min()]
    assert np.median(spreads) < 20  # batches of unsorted lengths spread over ~450
    assert lengths[orders[0][0]] == lengths.max()  # SortedDL's longest item first


def test_a_language_model_loader_gives_rank_r_rows_r_r_plus_n_of_the_global_batchs_streams():
    docs = [torch.arange(start, start + length) for start, length in
            zip(np.cumsum([0, 30, 17, 45, 22, 38, 51, 12]), [30, 17, 45, 22, 38, 51, 12, 40])]
    single = _batches(LMDataLoader(docs, bs=8, seq_len=5))
    ranks = [_batches(s) for s in _shards(LMDataLoader(docs, bs=4, seq_len=5), 2)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) > 3
    for k, (x, y) in enumerate(single):
        for r in range(2):
            assert torch.equal(ranks[r][k][0], x[r::2]) and torch.equal(ranks[r][k][1], y[r::2])


def test_a_shuffled_language_model_corpus_is_shuffled_alike_on_every_rank_and_anew_each_epoch():
    docs = [torch.arange(100 * i, 100 * i + 20 + 3 * i) for i in range(12)]
    dl = LMDataLoader(docs, bs=2, seq_len=4, shuffle=True)

    def tokens(epoch):
        return [torch.cat([b[0].flatten() for b in _batches(s)]).tolist() for s in _shards(dl, 2, epoch=epoch)]
    epoch0, epoch1 = tokens(0), tokens(1)
    for ranks in (epoch0, epoch1):
        assert not set(ranks[0]) & set(ranks[1])  # one shuffled corpus, its streams split: no token twice
    assert epoch0 != epoch1


@pytest.mark.parametrize("n, bs, world_size", [(10, 4, 2), (9, 4, 2), (5, 2, 3), (1, 4, 2)])
def test_eval_parts_rebuild_each_batch_of_one_process_and_placeholders_fill_empty_parts(n, bs, world_size):
    dl = DataLoader(list(range(100, 100 + n)), bs=bs)
    single = _batches(dl)
    shards = [ShardedEvalDL(dl, r, world_size) for r in range(world_size)]
    parts = [_batches(s) for s in shards]
    assert all(len(p) == len(single) == len(s) for p, s in zip(parts, shards))  # every rank runs every batch
    for k, batch in enumerate(single):
        sizes = shards[0].sizes(k)
        whole = torch.empty_like(batch)
        for r in range(world_size):
            whole[r::world_size] = parts[r][k][:sizes[r]]
            if sizes[r] == 0:
                assert parts[r][k].tolist() == batch[:1].tolist()  # a placeholder, dropped by unshard
        assert torch.equal(whole, batch)


def test_eval_parts_follow_the_loaders_own_order():
    dl = SortedDL(list(range(7)), res=[3, 9, 1, 7, 5, 8, 2], bs=3)  # sorted by length, longest first
    single = _batches(dl)
    shards = [ShardedEvalDL(dl, r, 2) for r in range(2)]
    assert [b.tolist() for b in single] == [[1, 5, 3], [4, 0, 6], [2]]
    assert [b.tolist() for b in _batches(shards[0])] == [[1, 3], [4, 6], [2]]
    assert [b.tolist() for b in _batches(shards[1])] == [[5], [0], [2]]
    assert shards[1].sizes(2) == [1, 0]


class EveryThird(torch.utils.data.Sampler):
    """A sampler with an order of its own: 0, 3, 6, ..., then 1, 4, ..., then 2, 5, ..."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return (i for start in range(3) for i in range(start, self.n, 3))

    def __len__(self):
        return self.n


def _torch_shards(dl, world_size, epoch=0):
    return _shards(TorchDL(dl), world_size, epoch=epoch)


def test_a_pytorch_loader_is_sharded_every_nth_position_of_its_samplers_order_through_its_collate_fn():
    dl = TorchDataLoader(list(range(20)), batch_size=3, sampler=EveryThird(20), drop_last=True,
                         collate_fn=lambda items: torch.tensor(items) * 10)
    order = list(EveryThird(20))
    for r, shard in enumerate(_torch_shards(dl, 2)):
        assert shard.get_idxs() == order[r::2]
        assert [b.tolist() for b in shard] == [[10 * i for i in order[r::2][k:k + 3]] for k in (0, 3, 6)]


@pytest.mark.parametrize("generator", [None, "per rank"])
def test_a_shuffled_pytorch_loader_is_shuffled_alike_on_every_rank_and_anew_each_epoch(generator):
    def orders(epoch):
        shards = []
        for r in range(2):  # each rank's loader with a generator of its own, seeded differently, if any
            own = None if generator is None else torch.Generator().manual_seed(r)
            dl = TorchDataLoader(list(range(101)), batch_size=5, shuffle=True, drop_last=True, generator=own)
            shards.append(_torch_shards(dl, 2, epoch)[r].get_idxs())
            if own is not None:  # the user's generator is left as it was
                assert torch.equal(own.get_state(), torch.Generator().manual_seed(r).get_state())
        return shards
    epoch0, again, epoch1 = orders(0), orders(0), orders(1)
    assert epoch0 == again and epoch0 != epoch1 and epoch0[0] != list(range(0, 100, 2))
    for shards in (epoch0, epoch1):
        assert not set(shards[0]) & set(shards[1]) and len(set(shards[0]) | set(shards[1])) == 100


def test_eval_parts_of_a_pytorch_loader_rebuild_its_batches():
    dl = TorchDataLoader(list(range(100, 109)), batch_size=4, sampler=EveryThird(9),
                         collate_fn=lambda items: torch.tensor(items) + 0.5)
    single = list(dl)
    shards = [ShardedEvalDL(TorchDL(dl), r, 3) for r in range(3)]
    parts = [list(s) for s in shards]
    assert [len(p) for p in parts] == [3, 3, 3] and splittable(TorchDL(dl))
    for k, batch in enumerate(single):
        sizes = shards[0].sizes(k)
        whole = torch.empty_like(batch)
        for r in range(3):
            whole[r::3] = parts[r][k][:sizes[r]]
        assert torch.equal(whole, batch)
    assert shards[1].sizes(2) == [1, 0, 0] and parts[1][2].tolist() == single[2].tolist()  # a placeholder


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(9))


def test_a_pytorch_loader_that_cannot_be_sharded_stays_as_it_is():
    batches = TorchDataLoader(list(range(9)), batch_sampler=[[0, 1], [2, 3, 4]])
    stream = TorchDataLoader(Stream(), batch_size=2)
    assert fastai_loader(batches) is batches and fastai_loader(stream) is stream
    assert batch_size(batches) is None and batch_size(TorchDataLoader(list(range(9)), batch_size=4)) == 4


@pytest.mark.slow
def test_a_learner_on_pytorch_loaders_trains_in_a_notebook_as_one_process(capsys):
    run = torch_story(lambda learn, split: learn.to_ddp(nprocs=3, split_batches=split), 3)
    check_torch_story(run, 3)
    check_torch_orders([run["orders"]], 3)  # rank 0's, which come back
    assert "ddipp: global batch 48 = 16 per process x 3" in capsys.readouterr().out


@pytest.mark.parametrize("torch_loader", [False, True])
def test_a_shuffled_validation_loader_is_split_in_one_order_on_every_rank(torch_loader):
    items = list(range(100, 121))
    parts = []
    for r in range(2):  # each rank's generators (global and the loader's own) differ
        random.seed(100 + r)
        torch.manual_seed(100 + r)
        dl = (TorchDL(TorchDataLoader(items, batch_size=4, shuffle=True)) if torch_loader
              else DataLoader(items, bs=4, shuffle=True))
        parts.append([int(i) for b in ShardedEvalDL(dl, r, 2) for i in b])
    parts[1] = parts[1][:-1]  # the last batch holds 1 item, rank 0's: rank 1 evaluates a placeholder
    assert sorted(parts[0] + parts[1]) == items
