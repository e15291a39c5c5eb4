"""ddipp.core's all_gather and reduce_sum in a real 2-rank gloo group (the `core_ranks` run) against one process."""
import pytest
import torch

from compare import TOL, max_diff
from core_story import embedding_net, features, losses_and_grads, mean_cov, moment_sums, pair_batch
from ddipp.core.collectives import all_gather, reduce_sum


@pytest.fixture(scope="module")
def single():
    """Both losses and their gradients in one process on the whole (concatenated) batch."""
    return losses_and_grads(embedding_net(), *pair_batch())


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["pairwise", "info_nce"])
def test_gradients_under_ddp_equal_one_process_on_the_concatenated_batch(core_ranks, single, loss):
    (r0, r1), _ = core_ranks
    value, grads = single[loss]
    for rank in (r0, r1):
        assert abs(rank["grads"][loss][0] - value) <= TOL
        assert max_diff(rank["grads"][loss][1], grads) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["grads_naive", "grads_local"])
@pytest.mark.parametrize("loss", ["pairwise", "info_nce"])
def test_a_gather_without_autograd_or_local_pairs_only_give_other_gradients(core_ranks, single, loss, variant):
    (r0, _), _ = core_ranks
    assert max_diff(r0[variant][loss][1], single[loss][1]) > 1e-3  # the comparison above can fail


@pytest.mark.slow
def test_ranks_of_different_sizes_are_gathered_in_rank_order(core_ranks):
    (r0, r1), _ = core_ranks
    expected = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    assert torch.equal(r0["uneven_gather"], expected) and torch.equal(r1["uneven_gather"], expected)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_reduced_mean_and_covariance_equal_one_process_on_101_items(core_ranks, dtype, tol):
    (r0, r1), _ = core_ranks
    x = features().to(dtype)  # 101 items: rank 0 holds 51, rank 1 holds 50
    mean, cov = x.mean(0), torch.cov(x.T)
    for rank in (r0, r1):
        assert rank[f"inputs_kept_{dtype}"]
        got_mean, got_cov = mean_cov(rank[f"reduced_{dtype}"])
        assert int(rank[f"reduced_{dtype}"]["n"]) == 101
        assert max_diff([got_mean, got_cov], [mean, cov]) <= tol


def test_single_process_values_when_not_launched():
    x = torch.arange(6.0).view(3, 2)
    assert all_gather(x) is x
    state = moment_sums(x)
    reduced = reduce_sum(state)
    assert all(torch.equal(reduced[k], state[k]) and reduced[k] is not state[k] for k in state)


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match=r"0-d tensor; gather t\[None\]"):
        all_gather(torch.tensor(1.0))
    with pytest.raises(TypeError, match="reduce_sum got a list; give a tensor or a dict of tensors"):
        reduce_sum([torch.tensor(1.0)])
