"""SumMetric (fastai v2): a metric of sums over the validation set, on 2 ranks (`extras_ranks`) and in one process."""

import pytest
import torch

from extras import OutputMoments, digits_dls, digits_learner, moments_fit
from compare import TOL, close, max_diff


@pytest.mark.slow
def test_mean_and_covariance_of_the_outputs_equal_one_process_on_359_items_and_as_a_training_metric(extras_ranks):
    (r0, r1), _ = extras_ranks
    single = moments_fit(digits_learner(digits_dls(bs=32)))  # 359 validation items, batches of 64
    for rank in (r0, r1):
        assert max_diff([rank["moments"]["mean"], rank["moments"]["cov"]], [single["mean"], single["cov"]]) <= TOL
        assert close(rank["moments"]["recorded"], single["recorded"])  # as a training metric too


def test_in_one_process_it_equals_the_statistics_of_get_preds():
    learn = digits_learner(digits_dls(bs=32), metrics=OutputMoments())
    learn.validate()
    metric = learn.metrics[0]
    preds = learn.get_preds(act=lambda x: x)[0].double()
    assert max_diff([metric.mean, metric.cov], [preds.mean(0), torch.cov(preds.T)]) <= 1e-10
    assert learn.final_record[-1] == pytest.approx(float(torch.cov(preds.T).trace()))  # the value fastai recorded


def test_a_subclass_without_its_two_methods_is_told_what_to_define():
    import ddipp
    learn = digits_learner(digits_dls(bs=32), metrics=type("Incomplete", (ddipp.SumMetric,), {})())
    with pytest.raises(NotImplementedError, match=r"Incomplete must define sums\(output, target\)"):
        learn.validate()
