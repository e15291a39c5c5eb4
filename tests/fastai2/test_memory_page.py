"""docs/memory.md's CPU script (shard=True, split_batches, sync_bn, Recompute, bs_find) as written: on 2 launched ranks
(workers/extras_worker.py) it finds the size one process finds and trains to one process's weights."""
import pytest

from compare import max_diff
from memory_page import run_page

PAGE_TOL = 1e-6  # the page's fit on 2 ranks against one process (sharded, split, SyncBatchNorm: sums in another order)


@pytest.mark.slow
def test_the_pages_script_finds_one_processs_size_and_trains_to_its_weights(extras_ranks):
    (r0, r1), out = extras_ranks
    one = run_page()
    assert r0["memory_page"]["bs"] == r1["memory_page"]["bs"] == one["bs"] == 128  # max_bs: nothing runs out on CPU
    assert max_diff(r0["memory_page"]["state"], r1["memory_page"]["state"]) == 0
    assert max_diff(r0["memory_page"]["state"], one["state"]) <= PAGE_TOL
    assert one["values"][-1][-1] > 0.9  # the digits' accuracy after 4 epochs: it trains
    said = (out / "stdout0.txt").read_text()
    assert "bs_find: global batch 128 (64 + 64 over 2 processes, split_batches)" in said
