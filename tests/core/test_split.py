"""split_batches written once: each rank's part of one process's batches (SplitBatchSampler, built for every rank in
one process), the checks before a split fit's first step, and the global-batch line a notebook prints."""
import pytest
import torch
from torch.utils.data import RandomSampler, SequentialSampler

from ddipp.core.group.binding import say_global_batch
from ddipp.core.options import check_split
from ddipp.core.sharding import SplitBatchSampler


def _parts(sampler, bs, drop_last, world_size, epoch=0):
    samplers = [SplitBatchSampler(sampler, bs, drop_last, r, world_size, seed=7) for r in range(world_size)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@pytest.mark.parametrize("n, bs, drop_last, world_size", [(40, 16, False, 2), (40, 16, True, 3), (47, 15, False, 3),
                                                          (33, 8, False, 3)])
def test_step_k_of_the_ranks_is_batch_k_of_one_process(n, bs, drop_last, world_size):
    samplers, parts = _parts(SequentialSampler(range(n)), bs, drop_last, world_size)
    one_process = list(torch.utils.data.BatchSampler(SequentialSampler(range(n)), bs, drop_last))
    assert all(len(p) == len(s) == len(one_process) for p, s in zip(parts, samplers))
    for k, batch in enumerate(one_process):
        sizes = samplers[0].sizes(k)
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(batch)
        assert sorted(i for r in range(world_size) for i in parts[r][k][:sizes[r]]) == batch
        assert all(parts[r][k] == (batch[r::world_size] or batch[:1]) for r in range(world_size))


def test_a_shuffled_order_is_the_same_on_all_ranks_and_changes_with_the_epoch():
    sampler = RandomSampler(range(50))
    torch.manual_seed(1)
    samplers, epoch0 = _parts(sampler, 16, False, 3)
    torch.manual_seed(2)  # ranks' own generators differ: the order must not depend on them
    again = _parts(sampler, 16, False, 3)[1]
    epoch1 = _parts(sampler, 16, False, 3, epoch=1)[1]
    assert epoch0 == again and epoch0 != epoch1
    items = [i for k in range(len(samplers[0])) for r in range(3) for i in epoch0[r][k][:samplers[0].sizes(k)[r]]]
    assert sorted(items) == list(range(50))


def test_the_smallest_part_counts_the_last_short_batch():
    assert SplitBatchSampler(SequentialSampler(range(64)), 64, False, 0, 3, 0).smallest_part() == 21
    assert SplitBatchSampler(SequentialSampler(range(66)), 64, False, 0, 3, 0).smallest_part() == 0  # 2 left
    assert SplitBatchSampler(SequentialSampler(range(66)), 64, True, 0, 3, 0).smallest_part() == 21


@pytest.mark.parametrize("args, message", [
    ((2, 3, 0, False, False), "split_batches=True splits each batch of bs=2 over 3 processes, which leaves a process "
                              "no item: use bs >= 3, or leave split_batches out"),
    ((64, 3, 0, True, True), "the training set's last batch has fewer items than the 3 processes, and a process with "
                             "no item cannot train the model's BatchNorm layers: give the training loader "
                             "drop_last=True"),
    ((4, 3, 1, True, False), "a batch of bs=4 over 3 processes gives one of them a single item in some step, and "
                             "BatchNorm cannot train on one item: use bs >= 6 with drop_last=True, or "
                             "to_ddp(..., sync_bn=True)")])
def test_a_batch_the_processes_cannot_share_is_refused_with_the_fix(args, message):
    with pytest.raises(ValueError) as e:
        check_split(*args)
    assert message in str(e.value)


def test_split_fits_that_can_train_pass_the_checks():
    check_split(64, 3, 21, True, False)
    check_split(4, 3, 1, True, True)  # SyncBatchNorm's statistics are over the whole batch
    check_split(4, 3, 0, False, False)  # no BatchNorm: an empty part trains nothing (its loss weighs 0)


def test_the_global_batch_line_names_the_option_or_the_split(capsys):
    say_global_batch(64, 3, False)
    say_global_batch(64, 3, True)
    off, on = capsys.readouterr().out.splitlines()
    assert off.startswith("ddipp: global batch 192 = 64 per process x 3 (an epoch takes 1/3 of the steps")
    assert off.endswith("add split_batches=True to keep bs=64 as the global batch: one process's training, faster")
    assert on == "ddipp: global batch 64 kept: 22 + 21 + 21 over 3 processes"
