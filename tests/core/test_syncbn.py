"""to_ddp(sync_bn=True): a BatchNorm model trained on 2 ranks (the `beyond_ranks` run) against one process."""
import pytest
import torch
from torch import nn

from beyond import bn_fit, bn_learner
from ddipp.core.syncbn import CPUSyncBatchNorm, convert_sync_bn
from scenario import TOL, close, digits_data, max_diff


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


def test_conversion_shares_parameters_and_buffers_and_undo_restores_the_mode():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    bn = model[1]
    undo = convert_sync_bn(model)
    sync = model[1]
    assert type(sync) is CPUSyncBatchNorm and sync.weight is bn.weight and sync.bias is bn.bias
    assert sync.running_mean is bn.running_mean and sync.num_batches_tracked is bn.num_batches_tracked
    model.eval()
    undo()
    assert model[1] is bn and not bn.training
    x = torch.randn(5, 3)
    assert torch.equal(sync.eval()(x), bn(x))  # eval, no group: plain BatchNorm with the running statistics
