"""SumMetric: a callback metric of sums over the validation set, on 2 ranks (`beyond_ranks`) and in one process."""
import pytest
import torch
from fastai.basic_data import DatasetType

from beyond import OutputMoments, moments_fit
from compare import TOL, max_diff
from scenario import digits_data, digits_learner


@pytest.mark.slow
def test_mean_and_covariance_of_the_outputs_equal_one_process_on_359_items(beyond_ranks, tmp_path):
    (r0, r1), _ = beyond_ranks
    single = moments_fit(digits_learner(digits_data(tmp_path, bs=32)))  # 359 validation items, batches of 64
    for rank in (r0, r1):
        assert max_diff([rank["moments"]["mean"], rank["moments"]["cov"]], [single["mean"], single["cov"]]) <= TOL
        assert abs(rank["moments"]["recorded"] - single["recorded"]) <= TOL


def test_in_one_process_it_equals_the_statistics_of_get_preds(tmp_path):
    learn = digits_learner(digits_data(tmp_path, bs=32))
    metric = OutputMoments()
    learn.validate(metrics=[metric])
    preds = learn.get_preds(DatasetType.Valid, activ=lambda x: x)[0].double()
    assert max_diff([metric.mean, metric.cov], [preds.mean(0), torch.cov(preds.T)]) <= 1e-10
