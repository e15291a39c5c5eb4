"""GlobalBatchLoss: a pairwise loss trained on 2 ranks (the `beyond_ranks` run) against one process."""
import pytest

from beyond import collapsed_loss, pairs_data, pairs_fit, pairs_learner
from compare import TOL, close, max_diff


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The pairwise-regression fit in one process with batch 32, the global batch of 2 ranks of 16."""
    return pairs_fit(pairs_learner(pairs_data(tmp_path_factory.mktemp("pairs"), bs=32)))


@pytest.mark.slow
def test_pairwise_regression_trains_on_2_ranks_as_one_process_with_the_global_batch(beyond_ranks, single):
    (r0, r1), _ = beyond_ranks
    assert max_diff(r0["pairs"]["params"], r1["pairs"]["params"]) == 0
    assert max_diff(r0["pairs"]["params"], single["params"]) <= TOL
    assert close(r0["pairs"]["val_losses"], single["val_losses"])
    assert close(r0["pairs"]["losses"], single["losses"])  # the recorded train loss is the global-batch loss


@pytest.mark.slow
def test_it_learns_the_distances_instead_of_collapsing(beyond_ranks, tmp_path):
    (r0, _), _ = beyond_ranks
    assert r0["pairs"]["val_losses"][-1] < 0.2 * collapsed_loss(pairs_data(tmp_path, bs=32))


@pytest.mark.slow
def test_without_it_each_rank_sees_only_its_own_pairs(beyond_ranks, single):
    (r0, _), _ = beyond_ranks
    assert max_diff(r0["pairs_local"]["params"], single["params"]) > 1e-3
