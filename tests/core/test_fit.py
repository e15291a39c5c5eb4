"""ddipp.core.fit's LossAndStop in a real 2-rank gloo group (the `core_ranks` run): a training step's global loss and
any rank's stop, summed by an all-reduce that starts without waiting for the other ranks, so that it runs while
backward and the optimizer step do."""
import pytest


@pytest.mark.slow
def test_the_global_loss_and_a_stop_asked_on_one_rank_reach_every_rank_without_blocking_the_step(core_ranks):
    (r0, r1), _ = core_ranks  # rank 1 joins each all-reduce only after rank 0's LossAndStop returned
    assert r0["loss_and_stop"] == r1["loss_and_stop"] == [(1.5, False), (1.5, True)]
