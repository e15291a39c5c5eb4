"""ddipp.core.syncbn: a BatchNorm model trained with SGD under DDP on 2 ranks (the `core_ranks` run) against one
process on the global batch; the conversion and its undo."""
import pytest
import torch
from torch import nn

from compare import TOL, max_diff
from core_story import BN_EPOCHS, bn_model, bn_train
from ddipp.core.syncbn import CPUSyncBatchNorm, convert_sync_bn

STEPS = 44  # global batches of 32 an epoch: 1438 training digits


@pytest.fixture(scope="module")
def single():
    """The same training in one process with the global batch of 32."""
    return bn_train(bn_model())


@pytest.mark.slow
def test_running_statistics_and_parameters_equal_one_process_on_the_global_batch(core_ranks, single):
    (r0, r1), _ = core_ranks
    for rank in (r0, r1):
        got = rank["bn"]
        assert max_diff([got["running_mean"], got["running_var"]], [single["running_mean"], single["running_var"]]) \
            <= TOL
        assert got["batches_tracked"] == single["batches_tracked"] == BN_EPOCHS * STEPS
        assert max_diff(got["params"], single["params"]) <= TOL
    assert abs(r0["bn"]["valid_loss"] - single["valid_loss"]) <= TOL  # rank 0 alone in eval mode: no collective


@pytest.mark.slow
def test_without_sync_bn_the_statistics_are_one_rank_s(core_ranks, single):
    (r0, _), _ = core_ranks
    assert max_diff([r0["bn_unsynced"]["running_var"]], [single["running_var"]]) > 1e-3


@pytest.mark.slow
def test_synced_while_training_plain_batchnorm_after_the_undo(core_ranks):
    (r0, r1), _ = core_ranks
    for rank in (r0, r1):
        assert rank["bn_type"] == "CPUSyncBatchNorm" and rank["bn_plain_after"]


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
