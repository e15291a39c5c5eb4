"""ddipp.core.batch_size: the search in one process against each trial's ceiling, and on a launched 2-rank gloo group
whose ranks' ceilings differ (a trial raises out of memory above its rank's ceiling): one size, the largest that
passes on every rank, on both."""
from pathlib import Path

import pytest
import torch

from batch_size_story import CEILINGS, ceiling_trial
from conftest import launch_2_ranks, rank_files
from ddipp.core.batch_size import CPU_OOM, CUDA_OOM, check_sizes, find_batch_size, out_of_memory, trials_table


def search(ceiling: int, start: int = 2, max_bs: int = 1000):
    """find_batch_size in this process, and the sizes tried."""
    found, trials = find_batch_size(ceiling_trial(ceiling, []), start, max_bs)
    return found, [size for size, _, _ in trials], trials


@pytest.mark.parametrize("ceiling", [2, 5, 168, 999])  # each failed trial collects garbage: 0.1-0.3 s
def test_the_largest_size_under_the_ceiling_is_found_by_doubling_then_bisecting(ceiling):
    found, sizes, trials = search(ceiling)
    assert found == ceiling
    assert all(passed == (size <= ceiling) for size, passed, _ in trials)
    doubling = [min(2 ** k, 1000) for k in range(1, 11) if 2 ** (k - 1) <= ceiling]  # to the first size above it
    assert sizes[:len(doubling)] == doubling and ceiling + 1 in sizes  # the size above was tried: exact
    assert len(sizes) <= len(doubling) + 10  # bisecting halves what is left


def test_max_bs_caps_the_doubling_and_is_found_when_everything_fits():
    found, sizes, _ = search(10 ** 6, max_bs=1000)
    assert (found, sizes) == (1000, [2, 4, 8, 16, 32, 64, 128, 256, 512, 1000])
    assert search(10 ** 6, start=7, max_bs=7)[:2] == (7, [7])
    assert search(300, start=3, max_bs=1000)[:2] == (300, [3, 6, 12, 24, 48, 96, 192, 384, 288, 336, 312, 300, 306,
                                                          303, 301])


def test_out_of_memory_at_start_names_the_size_and_the_ways_to_hold_less():
    with pytest.raises(torch.OutOfMemoryError, match="batch size 4 .*smaller start.*split_batches=True.*shard=True"
                                                     ".*Recompute"):
        find_batch_size(ceiling_trial(3, []), 4, 100)


def test_an_error_other_than_out_of_memory_propagates_and_stops_the_search():
    tried = []
    with pytest.raises(ValueError, match="not a memory error"):
        find_batch_size(ceiling_trial(8, tried, ValueError("not a memory error")), 2, 100)
    assert tried == [(2, True), (4, True), (8, True), (16, False)]


@pytest.mark.parametrize("error, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError(f"{CUDA_OOM}. Tried to allocate 20.00 MiB"), True),
    (RuntimeError(f"[enforce fail at alloc_cpu.cpp:117] . {CPU_OOM}: you tried to allocate 4 GB"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)"), False),
    (ValueError(CUDA_OOM), False), (MemoryError(), False)])
def test_out_of_memory_is_torchs_error_or_a_runtime_error_with_cudas_or_the_cpu_allocators_text(error, expected):
    assert out_of_memory(error) is expected


@pytest.mark.parametrize("start, max_bs, items, message", [
    (0, None, 100, "start=0; a batch holds 1 item or more"),
    (-2, 10, 100, "start=-2; a batch holds 1 item or more"),
    (8, 4, 100, "max_bs=4 is below start=8; give max_bs=8 or more"),
    (8, 200, 100, "max_bs=200 is above the training set's 100 items.*give max_bs=100 or less"),
    (64, None, 50, "the training set holds 50 items, fewer than start=64; give start=50 or less")])
def test_bad_sizes_are_named_with_what_is_allowed(start, max_bs, items, message):
    with pytest.raises(ValueError, match=message):
        check_sizes(start, max_bs, items)
    check_sizes(1, None, 1)
    check_sizes(8, 8, 8)


def test_the_table_shows_each_trial_and_the_verdict():
    lines = trials_table([(2, True, 0.01), (4, False, 1.5), (3, True, 0.25)], 3).splitlines()
    assert lines[0].split() == ["batch", "size", "verdict", "seconds"]
    assert [line.split() for line in lines[1:4]] == [["2", "fits", "0.01"], ["4", "out", "of", "memory", "1.50"],
                                                     ["3", "fits", "0.25"]]
    assert lines[4] == "bs_find: the largest batch size that fits: 3"


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """What each of 2 launched ranks found (tests/core/workers/batch_size_worker.py)."""
    out = tmp_path_factory.mktemp("batch_size")
    launch_2_ranks(Path(__file__).parent / "workers" / "batch_size_worker.py", out)
    return rank_files(out)


@pytest.mark.slow
def test_ranks_of_different_ceilings_agree_on_the_largest_size_every_rank_takes(group):
    alone = [search(ceiling) for ceiling in CEILINGS]
    assert [found for found, _, _ in alone] == [400, 168]  # each rank alone would pick its own
    together = search(min(CEILINGS))
    for rank in group:
        found, trials = rank["ceilings"]
        assert found == 168 and [(s, p) for s, p, _ in trials] == [(s, p) for s, p, _ in together[2]]
    assert (256, True) in group[0]["local"]  # rank 0's own step took 256; the group's verdict was rank 1's
    assert group[0]["after_error"][0] == group[1]["after_error"][0] == 168


@pytest.mark.slow
def test_every_rank_raises_when_one_fails_at_start_or_otherwise(group):
    for rank in group:
        name, message = rank["start_fails"]
        assert name == "OutOfMemoryError" and "batch size 2" in message
        assert rank["runtime_texts"][0] == 100  # the CPU allocator's and CUDA's texts count as out of memory
    assert group[1]["other_error"] == ("ValueError", "not a memory error")
    name, message = group[0]["other_error"]
    assert name == "RuntimeError" and "another rank's training step at batch size 8 failed" in message
