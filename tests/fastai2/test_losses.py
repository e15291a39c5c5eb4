"""GlobalBatchLoss (fastai v2): a pairwise loss trained on 2 ranks (the `extras_ranks` run) against one process."""

import pytest

import ddipp
from extras import collapsed_loss, pairs_dls, pairs_fit, pairs_learner
from compare import TOL, close, max_diff


@pytest.fixture(scope="module")
def single():
    """The pairwise-regression fit in one process with batch 32, the global batch of 2 ranks of 16."""
    return pairs_fit(pairs_learner(pairs_dls(bs=32)))


@pytest.mark.slow
def test_pairwise_regression_trains_on_2_ranks_as_one_process_with_the_global_batch(extras_ranks, single):
    (r0, r1), _ = extras_ranks
    assert max_diff(r0["pairs"]["params"], r1["pairs"]["params"]) == 0
    assert max_diff(r0["pairs"]["params"], single["params"]) <= TOL
    assert close(r0["pairs"]["values"], single["values"])  # the smoothed train loss and the valid loss, per epoch
    assert close(r0["pairs"]["losses"], single["losses"])  # the recorded train loss is the global-batch loss


@pytest.mark.slow
def test_it_learns_the_distances_instead_of_collapsing(extras_ranks):
    (r0, _), _ = extras_ranks
    assert r0["pairs"]["values"][-1][1] < 0.2 * collapsed_loss()


@pytest.mark.slow
def test_without_it_each_rank_sees_only_its_own_pairs(extras_ranks, single):
    (r0, _), _ = extras_ranks
    assert max_diff(r0["pairs_local"]["params"], single["params"]) > 1e-3


def test_in_one_process_it_changes_nothing(single):
    learn = pairs_learner(pairs_dls(bs=32)).add_cb(ddipp.GlobalBatchLoss())
    assert max_diff(pairs_fit(learn)["params"], single["params"]) == 0
