"""to_ddp(sync_bn=True) in fastai v1: a BatchNorm learner fitted on 2 ranks (the `beyond_ranks` run) against one
process; the layer is synced during the fit only, sharing the optimizer's parameters."""
import pytest

from beyond import bn_fit, bn_learner
from compare import TOL, close, max_diff
from scenario import digits_data

pytestmark = pytest.mark.slow  # the `beyond_ranks` launch


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The fit in one process with batch 32 (sequential data), the global batch of 2 ranks of 16."""
    return bn_fit(bn_learner(digits_data(tmp_path_factory.mktemp("bn"), bs=32)))


def test_running_statistics_and_parameters_equal_one_process_on_the_global_batch(beyond_ranks, single):
    (r0, r1), _ = beyond_ranks
    for rank in (r0, r1):
        got, want = rank["bn"], single
        assert max_diff([got["running_mean"], got["running_var"]], [want["running_mean"], want["running_var"]]) <= TOL
        assert got["batches_tracked"] == want["batches_tracked"] == 88
        assert max_diff(got["params"], want["params"]) <= TOL
        assert close(got["val_losses"], want["val_losses"]) and close(got["metrics"], want["metrics"])


def test_without_sync_bn_the_statistics_are_one_rank_s(beyond_ranks, single):
    (r0, _), _ = beyond_ranks
    assert max_diff([r0["bn_unsynced"]["running_var"]], [single["running_var"]]) > 1e-3


def test_synced_during_the_fit_plain_batchnorm_with_the_optimizer_s_parameters_after(beyond_ranks):
    (r0, r1), _ = beyond_ranks
    for rank in (r0, r1):
        assert [s["type"] for s in rank["bn"]["during"]] == ["CPUSyncBatchNorm"] * 2
        assert all(s["shares"] for s in rank["bn"]["during"])
        assert rank["bn"]["plain_after"] and rank["bn"]["same_params_after"]
    assert [s["eval_ok"] for s in r0["bn"]["during"]] == [True, True]  # rank 0 alone, eval mode: no collective

